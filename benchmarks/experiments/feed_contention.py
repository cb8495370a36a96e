"""The reader beside a busy thread: how much of its rate a load keeps while another thread
of the process runs, as a pipelined load runs beside the model's forward.

    python benchmarks/feed_contention.py [--device cpu|cuda] [--mib 768]

One safetensors file (``--mib`` of float32) is written to a temp folder and read into
tensors on ``--device`` by the reading processes, three times per row, the best kept:

- alone;
- beside a thread issuing small torch ops with a little Python between them (on the
  device: what a forward pass does);
- beside a thread running pure Python, which gives up the GIL only when the interpreter
  asks it to (every ``sys.getswitchinterval()``, 5 ms by default);
- the same with the switch interval at 0.5 ms for the read (set back after it).

Each at 4 MiB x 24 ring slots (the default) and 16 MiB x 6. The copying thread that
feeds the processes and issues the copies needs the GIL for every chunk, several times;
each time it gives it up (a socket call, a torch op), a busy thread can keep it for up to
the switch interval. Writes feed_contention.json to $OUT and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import out_dir  # noqa: E402

RINGS = ((4 << 20, 24), (16 << 20, 6))


def busy_torch(device: str, stop: threading.Event) -> None:
    import torch

    a = torch.ones(256, device=device)
    b = torch.ones(256, device=device)
    while not stop.is_set():
        for _ in range(20):
            a.add_(b)
        sum(range(50))  # the Python between a module's ops
        if device == "cuda":
            torch.cuda.synchronize()  # keep the queue short, as a forward's waits do


def busy_python(device: str, stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--mib", type=int, default=768)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    from ondeck.loading import ReadJob, read_header, read_into

    folder = Path(tempfile.mkdtemp(prefix="feed-contention-"))
    path = folder / "weights.safetensors"
    pieces = max(1, args.mib // 64)
    save_file({f"w{i}": torch.randn(64 * 2**20 // 4) for i in range(pieces)}, str(path))
    infos = list(read_header(path).tensors.values())
    nbytes = sum(info.nbytes for info in infos)
    destinations = {info.name: torch.empty(info.shape, device=args.device) for info in infos}

    def load(slot_bytes: int, slots: int) -> float:
        jobs = [ReadJob(info, destinations[info.name]) for info in infos]
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        read_into(
            jobs,
            progress=False,
            processes=True,
            buffer_bytes=slot_bytes,
            buffer_count=slots,
        )
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    load(*RINGS[0])  # starts the processes, warms the page cache
    rows = []
    cases = [
        ("alone", None, None),
        ("torch ops", busy_torch, None),
        ("pure Python", busy_python, None),
        ("pure Python, switch 0.5 ms", busy_python, 0.0005),
    ]
    default_interval = sys.getswitchinterval()
    for beside, work, interval in cases:
        for slot_bytes, slots in RINGS:
            sys.setswitchinterval(interval or default_interval)
            stop = threading.Event()
            thread = None
            if work is not None:
                thread = threading.Thread(target=work, args=(args.device, stop), daemon=True)
                thread.start()
            try:
                best = min(load(slot_bytes, slots) for _ in range(3))
            finally:
                stop.set()
                if thread is not None:
                    thread.join()
                sys.setswitchinterval(default_interval)
            rows.append(
                {
                    "beside": beside,
                    "slot_bytes": slot_bytes,
                    "slots": slots,
                    "seconds": best,
                    "gb_per_second": nbytes / best / 1e9,
                }
            )
            print(f"{beside} {slot_bytes >> 20} MiB x {slots}: {nbytes / best / 1e9:.2f} GB/s")
    for row in rows:
        alone = next(
            r for r in rows if r["beside"] == "alone" and r["slot_bytes"] == row["slot_bytes"]
        )
        row["of_alone"] = row["gb_per_second"] / alone["gb_per_second"]
    document = {
        "device": args.device,
        "bytes": nbytes,
        "cpu_count": os.cpu_count(),
        "switch_interval_s": default_interval,
        "rows": rows,
    }
    (out_dir() / "feed_contention.json").write_text(json.dumps(document, indent=1))
    path.unlink()
    folder.rmdir()
    print(f"\n{'beside':<27} {'ring':>10} {'GB/s':>6} {'of alone':>8}")
    for row in rows:
        ring = f"{row['slot_bytes'] >> 20} MiB x {row['slots']}"
        print(
            f"{row['beside']:<27} {ring:>10} {row['gb_per_second']:>6.2f} {row['of_alone']:>8.2f}"
        )


if __name__ == "__main__":
    main()
