"""The portable read path against the fast one, from the page cache, on this machine.

    python benchmarks/experiments/portable_read.py [--gib 1] [--repeats 5] [--device cpu]
        [--portable-arms MIBxCOUNTxTHREADS,...]

Writes one safetensors file of ``--gib`` GiB of bf16 tensors, reads it once to warm the
page cache, then loads every tensor into fresh destinations through ``read_into``,
alternating the fast path (``os.preadv``; reading processes for CUDA) and
``ONDECK_READ_PATH=portable`` (threads, ``readinto``), ``--repeats`` times each. Prints
the median GB/s of each and their ratio; writes portable_read.json to $OUT.
``--portable-arms 16x16x8,32x8x16`` adds portable arms with the threads' ring buffers of
that many MiB, that many buffers, and that many threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch
    from safetensors.torch import save_file

    from ondeck.loading.chunks import ReadJob
    from ondeck.loading.reads import read_into
    from ondeck.loading.safetensors_format import read_header

    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--portable-arms", default="")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    path = folder / "weights.safetensors"
    count = max(1, int(args.gib * 2**30 / (64 * 2**20)))
    save_file({f"t{i}": torch.randn(32 * 2**20).bfloat16() for i in range(count)}, str(path))
    path.read_bytes()  # into the page cache
    header = read_header(path).tensors
    nbytes = sum(info.nbytes for info in header.values())
    arms: dict[str, dict] = {"fast": {}, "portable": {}}
    for text in filter(None, args.portable_arms.split(",")):
        mib, count, threads = (int(part) for part in text.split("x"))
        arms[f"portable {text}"] = dict(
            buffer_bytes=mib * 2**20, buffer_count=count, threads=threads
        )
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name in seconds:
            if name.startswith("portable"):
                os.environ["ONDECK_READ_PATH"] = "portable"
            else:
                os.environ.pop("ONDECK_READ_PATH", None)
            targets = [
                torch.empty(info.shape, dtype=info.dtype, device=args.device)
                for info in header.values()
            ]
            jobs = [ReadJob(info, t) for info, t in zip(header.values(), targets, strict=True)]
            started = time.perf_counter()
            read_into(jobs, progress=False, **arms[name])
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - started)
            del targets, jobs
    rates = {name: nbytes / statistics.median(values) / 1e9 for name, values in seconds.items()}
    result = {
        "bytes": nbytes,
        "device": args.device,
        "cpus": os.cpu_count(),
        "seconds": seconds,
        "gb_per_s": rates,
        "ratio": rates["portable"] / rates["fast"],
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/experiments/portable_read.py " + " ".join(sys.argv[1:]),
    }
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "portable_read.json").write_text(json.dumps(result, indent=2))
    path.unlink()
    print(f"{'path':<22} {'GB/s (median)':>14} {'/ fast':>7}")
    for name, rate in rates.items():
        print(f"{name:<22} {rate:>14.2f} {rate / rates['fast']:>7.2f}")
    print(f"portable / fast: {result['ratio']:.2f}")


if __name__ == "__main__":
    main()
