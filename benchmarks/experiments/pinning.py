"""How fast host memory for streamed blocks' pinned copies can be had, one way and another.

    python benchmarks/experiments/pinning.py [--gib 16] [--block-mib 675] [--threads 8]

A streamed component's first load page-locks a region per streamed block
(``memory.pinned_host_bytes``: fresh host memory, then ``cudaHostRegister``), which a
first run waits for. Each arm allocates ``--gib`` GiB in regions of ``--block-mib`` MiB
and page-locks them:

- ``register``: as ondeck does it now;
- ``hugepage``: the same, the range advised ``MADV_HUGEPAGE`` first;
- ``prefault``: the same, the pages first touched by ``--threads`` threads;
- ``hugepage+prefault``: both;
- ``regions-in-parallel``: the regions each touched and registered on one thread, on
  ``--threads`` threads at once (whether registering scales across threads);
- ``torch``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc through torch's allocator,
  which rounds each region up to a power of two).

Prints GB/s per arm (median of the regions' total over ``--repeats``); writes
pinning.json to $OUT.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MADV_HUGEPAGE = 14
HUGE = 2 * 2**20
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
LIBC.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
LIBC.memset.restype = ctypes.c_void_p


def region(nbytes: int, *, hugepage: bool, prefault: int) -> tuple:
    import numpy as np

    from ondeck.memory import register_host_memory

    owner = np.empty(nbytes + HUGE, dtype=np.uint8)
    start = -owner.ctypes.data % HUGE
    pointer = owner.ctypes.data + start
    if hugepage:
        LIBC.madvise(pointer, nbytes, MADV_HUGEPAGE)
    if prefault:
        step = -(-nbytes // prefault // HUGE) * HUGE
        with ThreadPoolExecutor(prefault) as pool:
            list(
                pool.map(
                    lambda offset: LIBC.memset(pointer + offset, 0, min(step, nbytes - offset)),
                    range(0, nbytes, step),
                )
            )
    status = register_host_memory(pointer, nbytes)
    if status != 0:
        raise RuntimeError(f"cudaHostRegister returned {status}")
    return owner, pointer


def main() -> None:
    import torch

    from ondeck.memory import _unregister  # noqa: PLC2701 (an experiment on its internals)

    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--block-mib", type=int, default=675)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.cuda.init()
    block = args.block_mib * 2**20 // HUGE * HUGE
    count = max(1, int(args.gib * 2**30 // block))
    arms = {
        "register": dict(hugepage=False, prefault=0),
        "hugepage": dict(hugepage=True, prefault=0),
        "prefault": dict(hugepage=False, prefault=args.threads),
        "hugepage+prefault": dict(hugepage=True, prefault=args.threads),
        "regions-in-parallel": dict(hugepage=False, prefault=1),
        "torch": None,
    }
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, options in arms.items():
            started = time.perf_counter()
            if options is None:
                held = [
                    torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(count)
                ]
            elif name == "regions-in-parallel":
                with ThreadPoolExecutor(args.threads) as pool:
                    held = list(pool.map(lambda _, o=options: region(block, **o), range(count)))
            else:
                held = [region(block, **options) for _ in range(count)]
            seconds[name].append(time.perf_counter() - started)
            if options is not None:
                for _, pointer in held:
                    _unregister(pointer)
            del held
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
    nbytes = block * count
    rates = {name: nbytes / statistics.median(values) / 1e9 for name, values in seconds.items()}
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pinning.json").write_text(
        json.dumps(
            {
                "bytes": nbytes,
                "regions": count,
                "seconds": seconds,
                "gb_per_s": rates,
                "threads": args.threads,
                "cpus": os.cpu_count(),
                "date": time.strftime("%Y-%m-%d"),
                "command": "python benchmarks/experiments/pinning.py " + " ".join(sys.argv[1:]),
            },
            indent=2,
        )
    )
    print(f"{'arm':<20} {'GB/s':>7} {'/ register':>10}")
    for name, rate in rates.items():
        print(f"{name:<20} {rate:>7.2f} {rate / rates['register']:>10.2f}")


if __name__ == "__main__":
    main()
