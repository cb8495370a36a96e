"""A cast that reads pinned host memory straight from the device, against a copy then a
cast: could an fp8 read issue one operation per chunk, as a bf16 read does?

    python benchmarks/zero_copy_cast.py [--mib 256]

A pinned host buffer of ``--mib`` MiB of bf16 values is viewed as a CUDA tensor (its
pointer handed to ``torch.as_tensor`` through ``__cuda_array_interface__``; pinned
memory is mapped into the device's address space), and cast to fp8 on the device by
one ``copy_`` whose kernel reads the host bytes over the bus. Against it: the copy
engine's copy into device memory, then the cast there (what the reader does), and the
copy alone. Whole, and in 4 and 16 MiB chunks (the reader's chunk is 4 MiB). GB/s of
host bytes, best of three rounds of ten. Checks the zero-copy cast's bits against the
cast of a device copy. Writes zero_copy_cast.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_document  # noqa: E402


class _DeviceView:
    """``__cuda_array_interface__`` of ``numel`` uint16 values at a host pointer."""

    def __init__(self, pointer: int, numel: int):
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": "<u2",
            "data": (pointer, False),
            "strides": None,
            "version": 2,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()

    import torch

    nbytes = args.mib << 20
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host.view(torch.bfloat16).copy_(torch.randn(nbytes // 2))
    device_view = torch.as_tensor(_DeviceView(host.data_ptr(), nbytes // 2), device="cuda")
    source = device_view.view(torch.bfloat16)
    out = torch.empty(nbytes // 2, dtype=torch.float8_e4m3fn, device="cuda")
    staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    reference = host.view(torch.bfloat16).cuda().to(torch.float8_e4m3fn)
    out.copy_(source)
    torch.cuda.synchronize()
    equal = torch.equal(out.view(torch.uint8), reference.view(torch.uint8))

    def rate(work, rounds: int = 3, repeats: int = 10) -> float:
        work()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(repeats):
                work()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return nbytes * repeats / best / 1e9

    def chunked(mib: int | None):
        step = (mib << 20) if mib else nbytes
        spans = [(i // 2, min(i + step, nbytes) // 2) for i in range(0, nbytes, step)]
        staged = staging.view(torch.bfloat16)

        def zero_copy():
            for lo, hi in spans:
                out[lo:hi].copy_(source[lo:hi])

        def copy_then_cast():
            for lo, hi in spans:
                staging[2 * lo : 2 * hi].copy_(host[2 * lo : 2 * hi], non_blocking=True)
                out[lo:hi].copy_(staged[lo:hi])

        def copy_alone():
            for lo, hi in spans:
                staging[2 * lo : 2 * hi].copy_(host[2 * lo : 2 * hi], non_blocking=True)

        return zero_copy, copy_then_cast, copy_alone

    rows = {}
    for mib in (None, 16, 4):
        zero_copy, copy_then_cast, copy_alone = chunked(mib)
        rows["whole" if mib is None else f"{mib} MiB chunks"] = {
            "zero_copy_cast_gb_per_second": rate(zero_copy),
            "copy_then_cast_gb_per_second": rate(copy_then_cast),
            "copy_alone_gb_per_second": rate(copy_alone),
        }
    write_document("zero_copy_cast", {"mib": args.mib, "bits_equal": equal, "rows": rows})
    print(f"\n{args.mib} MiB of bf16 in pinned memory to fp8 on the device; bits equal: {equal}")
    print(
        f"{'pieces':<16} {'zero-copy cast':>15} {'copy, then cast':>16} {'copy alone':>11}  (GB/s)"
    )
    for name, row in rows.items():
        print(
            f"{name:<16} {row['zero_copy_cast_gb_per_second']:>15.1f} "
            f"{row['copy_then_cast_gb_per_second']:>16.1f} {row['copy_alone_gb_per_second']:>11.1f}"
        )


if __name__ == "__main__":
    main()
