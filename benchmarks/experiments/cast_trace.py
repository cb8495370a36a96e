"""Where a reload's copy engine waits: the GPU timeline of one load, bf16 and fp8.

    python benchmarks/cast_trace.py [--folder DIR] [--components text_encoder,transformer]

Each component of the Wan 2.1 14B-shaped folder is loaded from the page cache in four
arms (bf16 and fp8 storage, pipelined as the pipelines load and whole), one warm-up load
each, then one load per arm under ``torch.profiler`` tracing the device only (no CPU ops
recorded, so the copying thread runs as it does untraced). From each trace: the span of
the host-to-device copies, the time the copy engine was busy inside it and the GB/s while
busy, the idle gaps (count and seconds above 50 us, the five longest), and the kernels'
busy time (the casts, and the non-block parts' own work). Writes
cast_trace.json to $OUT and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ready_wan14b_folder, reload_arm_loader, union_of, write_document  # noqa: E402

ARMS = ("bf16", "fp8", "bf16, whole", "fp8, whole")
GAP_US = 50


def timeline(trace: dict) -> dict:
    """Copy-engine and kernel figures of one chrome trace (times in microseconds)."""
    copies, kernels = [], []
    copied_bytes = 0
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        category = event.get("cat", "")
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        if category == "gpu_memcpy" and "HtoD" in event.get("name", ""):
            copies.append(span)
            copied_bytes += int(event.get("args", {}).get("bytes", 0))
        elif category == "kernel":
            kernels.append(span)
    if not copies:
        return {"copies": 0}
    busy = union_of(copies)
    first, last = busy[0][0], busy[-1][1]
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:], strict=False)]
    long_gaps = sorted((g for g in gaps if g > GAP_US), reverse=True)
    busy_us = sum(b - a for a, b in busy)
    kernel_us = sum(b - a for a, b in union_of(kernels))
    last_kernel = max((end for _, end in kernels), default=last)
    return {
        # the device's work after the last copy ended (the last casts)
        "tail_us": max(0.0, last_kernel - last),
        "copies": len(copies),
        "copied_bytes": copied_bytes,
        "span_ms": (last - first) / 1e3,
        "busy_ms": busy_us / 1e3,
        "busy_fraction": busy_us / (last - first),
        "gb_per_s_busy": copied_bytes / (busy_us * 1e-6) / 1e9 if busy_us else None,
        "gb_per_s_span": copied_bytes / ((last - first) * 1e-6) / 1e9,
        "gaps_over_50us": len(long_gaps),
        "gap_ms_over_50us": sum(long_gaps) / 1e3,
        "longest_gaps_us": [round(g) for g in long_gaps[:5]],
        "kernels": len(kernels),
        "kernel_busy_ms": kernel_us / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved"))
    parser.add_argument("--components", default="text_encoder,transformer")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ondeck.loading import ModelFolder

    path, _ = ready_wan14b_folder(Path(args.folder))
    folder = ModelFolder.open(path)
    results: dict[str, dict] = {}
    for name in args.components.split(","):
        for arm in ARMS:
            loader = reload_arm_loader(folder, name, arm)
            loader()  # warm-up: the reading processes start, the allocator fills
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as traced:
                started = time.perf_counter()
                module = loader()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
            with tempfile.TemporaryDirectory() as scratch:
                trace_path = Path(scratch) / "trace.json"
                traced.export_chrome_trace(str(trace_path))
                figures = timeline(json.loads(trace_path.read_text()))
            figures["load_seconds"] = seconds
            figures["read_seconds"] = loader.last_read_seconds
            results[f"{name} {arm}"] = figures
            print(f"{name} {arm}: {json.dumps(figures)}", flush=True)
            del module
            gc.collect()
            torch.cuda.empty_cache()
    write_document("cast_trace", {"rows": results})
    print(
        f"\n{'load':<26} {'read s':>7} {'span ms':>8} {'busy':>6} {'GB/s busy':>9} "
        f"{'GB/s span':>9} {'gaps>50us':>9} {'gap ms':>7} {'kernel ms':>9}  longest gaps (us)"
    )
    for key, row in results.items():
        if not row.get("copies"):
            print(f"{key:<26} no copies traced")
            continue
        print(
            f"{key:<26} {row['read_seconds']:7.3f} {row['span_ms']:8.1f} "
            f"{row['busy_fraction']:6.3f} {row['gb_per_s_busy']:9.1f} {row['gb_per_s_span']:9.1f} "
            f"{row['gaps_over_50us']:9d} {row['gap_ms_over_50us']:7.1f} "
            f"{row['kernel_busy_ms']:9.1f}  {row['longest_gaps_us']}"
        )


if __name__ == "__main__":
    main()
