"""How fast a DiT-sized checkpoint reaches the GPU: ceilings, common loaders, ondeck.

Run on a CUDA machine:  python benchmarks/load_throughput.py [--folder DIR] [--layers 24]

Builds (once) a WanTransformer3DModel at the 14B width with ``--layers`` blocks in bf16
(24 blocks: about 16 GiB), then measures, median of ``--repeats``:
  ceilings   pinned host->device copy; raw O_DIRECT read of the files (1 and 8 threads)
  baselines  safetensors.torch.load_file(device="cuda"); diffusers from_pretrained(device_map)
             fastsafetensors (if importable)
  ondeck     ComponentLoader from a dropped page cache, a warm page cache, the host cache
and the peak host RSS each ondeck load adds. Writes load_throughput.json to $OUT.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    RssSampler,
    build_transformer_folder,
    drop_page_cache,
    median,
    out_dir,
    rss_bytes,
    warm_page_cache,
)

GB = 1e9


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del result
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def pinned_copy_seconds(nbytes: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del host, device
    torch.cuda.empty_cache()
    return seconds


def o_direct_read_seconds(files, threads: int, block: int = 64 << 20) -> float:
    """Read every file with O_DIRECT into an aligned buffer; ``threads`` readers at once."""
    jobs = []
    for path in files:
        size = os.path.getsize(path)
        jobs += [(path, offset) for offset in range(0, size, block)]
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]

    def read(job_and_slot):
        (path, offset), slot = job_and_slot
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buffers[slot]], offset)
        finally:
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        # Each slot is used by one job at a time: jobs are handed out in waves.
        for wave in range(0, len(jobs), threads):
            batch = jobs[wave : wave + threads]
            list(pool.map(read, [(job, slot) for slot, job in enumerate(batch)]))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=".bench-data/dit16")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the warm-cache rows: pinned copy, safetensors, ondeck warm and host cache",
    )
    args = parser.parse_args()

    from ondeck.loading import ComponentLoader, HostCache, ModelFolder, reads

    started = time.perf_counter()
    folder_path = build_transformer_folder(Path(args.folder), num_layers=args.layers)
    build_seconds = time.perf_counter() - started
    files = sorted(str(p) for p in (folder_path / "transformer").glob("*.safetensors"))
    nbytes = sum(os.path.getsize(f) for f in files)
    folder = ModelFolder.open(folder_path)
    largest_tensor = max(info.nbytes for info in folder.tensors("transformer").values())
    print(
        f"checkpoint: {len(files)} files, {nbytes / 2**30:.2f} GiB (built in {build_seconds:.0f}s)"
    )
    results: dict[str, dict] = {}

    def record(name: str, seconds_list: list[float], moved: int = nbytes, **extra) -> None:
        seconds = median(seconds_list)
        results[name] = {
            "median_seconds": seconds,
            "all_seconds": seconds_list,
            "gb_per_second": moved / seconds / GB,
            **extra,
        }
        print(f"{name:<40} {moved / seconds / GB:7.2f} GB/s  ({seconds:.2f}s)", flush=True)

    record(
        "ceiling: pinned host->device",
        [pinned_copy_seconds(4 << 30) for _ in range(args.repeats)],
        moved=4 << 30,
    )
    for threads in () if args.quick else (1, 8):
        runs = []
        for _ in range(args.repeats):
            drop_page_cache(files)
            runs.append(o_direct_read_seconds(files, threads))
        record(f"ceiling: O_DIRECT read, {threads} thread(s)", runs)

    def refill_page_cache() -> None:
        # Both warm rows read a page cache filled the same way: one sequential read.
        drop_page_cache(files)
        warm_page_cache(files)

    refill_page_cache()

    def safetensors_load():
        from safetensors.torch import load_file

        return [load_file(f, device="cuda") for f in files]

    record(
        "safetensors load_file(cuda), warm", [timed(safetensors_load) for _ in range(args.repeats)]
    )

    def diffusers_load():
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel.from_pretrained(
            folder_path / "transformer", torch_dtype=torch.bfloat16, device_map="cuda"
        )

    if not args.quick:
        record(
            "diffusers from_pretrained(device_map), warm",
            [timed(diffusers_load) for _ in range(args.repeats)],
        )

    try:
        if args.quick:
            raise RuntimeError("left out by --quick")
        from fastsafetensors import fastsafe_open

        def fast_load():
            with fastsafe_open(filenames=files, device="cuda:0", nogds=True) as handle:
                return {key: handle.get_tensor(key) for key in handle.keys()}

        record("fastsafetensors (nogds), warm", [timed(fast_load) for _ in range(args.repeats)])
    except Exception as error:  # absent or failing: say so, keep going
        results["fastsafetensors (nogds), warm"] = {"error": repr(error)}
        print(f"fastsafetensors: {error!r}")

    loader = ComponentLoader(
        folder, "transformer", device="cuda", dtype=torch.bfloat16, progress=False
    )

    def ondeck_runs(prepare, count) -> tuple[list[float], list[int]]:
        """One load under the RSS sampler (the first, which allocates the ring), then
        ``count`` timed loads without it: its thread would take the GIL from the readers."""
        prepare()
        gc.collect()
        before = rss_bytes()
        with RssSampler() as sampler:
            timed(loader)
        added = [sampler.peak - before]
        seconds = []
        for _ in range(count):
            prepare()
            gc.collect()
            seconds.append(timed(loader))
        return seconds, added

    cold_rss: list[int] = []
    if not args.quick:
        cold, cold_rss = ondeck_runs(lambda: drop_page_cache(files), args.repeats)
        record("ondeck, dropped page cache", cold, rss_added=cold_rss, readers=loader.last_readers)
    refill_page_cache()
    warm, warm_rss = ondeck_runs(lambda: None, args.repeats)
    record("ondeck, warm page cache", warm, rss_added=warm_rss, readers=loader.last_readers)
    buffer_bytes, buffer_count = (
        reads.PROCESS_RING if loader.last_readers == "processes" else reads.THREAD_RING
    )
    ring_bytes = buffer_bytes * buffer_count

    cache = HostCache(int(nbytes * 1.05))
    cached_loader = ComponentLoader(
        folder, "transformer", device="cuda", dtype=torch.bfloat16, host_cache=cache, progress=False
    )
    fill_seconds = timed(cached_loader)
    loader = cached_loader
    hot, _ = ondeck_runs(lambda: None, args.repeats)
    record("ondeck, host cache", hot, fill_seconds=fill_seconds, cache=repr(cache))

    # Every tensor against safetensors on the device, one file at a time.
    from safetensors.torch import load_file

    mismatched, compared = [], 0
    plain_loader = ComponentLoader(
        folder, "transformer", device="cuda", dtype=torch.bfloat16, progress=False
    )
    for source in (cached_loader, plain_loader):
        module = source()
        state = module.state_dict()
        for path in files:
            reference = load_file(path, device="cuda")
            mismatched += [
                k for k, v in reference.items() if not torch.equal(state[k].to(v.dtype), v)
            ]
            compared += len(reference)
            del reference
        del module, state
        torch.cuda.empty_cache()

    def rate(name: str) -> float | None:
        return results.get(name, {}).get("gb_per_second")

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return numerator / denominator if numerator and denominator else None

    reads = [rate(f"ceiling: O_DIRECT read, {n} thread(s)") for n in (1, 8)]
    ratios = {
        "cold / best raw O_DIRECT read (target >= 0.9)": ratio(
            rate("ondeck, dropped page cache"), max((r for r in reads if r), default=None)
        ),
        "warm / safetensors load_file (target >= 5)": ratio(
            rate("ondeck, warm page cache"), rate("safetensors load_file(cuda), warm")
        ),
        "host cache / pinned copy (target >= 0.8)": ratio(
            rate("ondeck, host cache"), rate("ceiling: pinned host->device")
        ),
        "peak RSS added / (ring + largest tensor) (target <= 1.1)": max(cold_rss + warm_rss)
        / (ring_bytes + largest_tensor),
    }
    summary = {
        "checkpoint_bytes": nbytes,
        "files": len(files),
        "largest_tensor_bytes": largest_tensor,
        "ring_bytes": ring_bytes,
        "results": results,
        "ratios": ratios,
        "tensors_compared_with_safetensors": compared,
        "mismatched_tensors_vs_safetensors": mismatched,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    (out_dir() / "load_throughput.json").write_text(json.dumps(summary, indent=2, default=str))
    print()
    print(f"{'what':<42} {'GB/s':>8}")
    for name, row in results.items():
        if "gb_per_second" in row:
            print(f"{name:<42} {row['gb_per_second']:8.2f}")
    for name, value in ratios.items():
        print(f"{name:<60} {value:6.2f}" if value is not None else f"{name:<60}    -")
    print(f"tensors differing from safetensors: {len(mismatched)} of {compared}")


if __name__ == "__main__":
    main()
