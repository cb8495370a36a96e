"""Block streaming against diffusers' offloading, on a Wan 2.1 14B-shaped folder.

    python benchmarks/streaming.py [--folder DIR] [--modes stream-24,stream-16,eager,...]

The transformer alone (26.6 GiB) does not fit a 24 GiB card, so ``release`` cannot run
it; ondeck's budget policy streams the blocks that do not fit. Compared in one run, each
mode in its own process (480x832, 33 frames, 4 steps, guidance on, three generations):

    eager          diffusers, everything on the GPU (the reference time; ~55 s)
    group-offload  diffusers enable_group_offload(block_level, 1 block, use_stream) (~140 s)
    model-offload  diffusers enable_model_cpu_offload() (~150 s)
    stream-24      ondeck, policy budget on a device emulated at 24 GiB
    stream-16      ondeck, policy budget on a device emulated at 16 GiB

Per mode: wall time of runs 2-3, peak device bytes allocated, peak host RSS (VmHWM),
bytes streamed per generation. Building the folder takes ~55 s. Modes run in the order
given; one that would not finish before ``--deadline-s`` (counted from the start) is
skipped and named, with the command that runs it, and no mode runs past the deadline.
Every mode runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the variable
is already set. Results go to $OUT/streaming.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GiB, later_seconds, parse_modes  # noqa: E402
from wan_suite import Mode, add_comparison_arguments, run_comparison  # noqa: E402

# name: the wan_modes mode, the emulated device GiB (None: whole card), seconds on an H200
MODES = {
    "stream-24": Mode("ondeck-stream", 24, 100),
    "stream-16": Mode("ondeck-stream", 16, 110),
    "eager": Mode("diffusers-eager", None, 65),
    "group-offload": Mode("diffusers-group-offload", None, 155),
    "model-offload": Mode("diffusers-model-offload", None, 165),
}
DEFAULT_MODES = ["stream-24", "stream-16", "eager", "group-offload", "model-offload"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser, MODES, DEFAULT_MODES, deadline_s=500)
    args = parser.parse_args()
    names = parse_modes(parser, args.modes, MODES)

    result = run_comparison(
        args,
        names,
        MODES,
        label=lambda name, mode: f"{mode.wan_mode} @ {mode.memory_gib or 139} GiB",
        png_prefix="streaming",
        after_each=lambda done: done.write("streaming.json"),
    )
    result.write("streaming.json")  # also the modes skipped after the last that ran
    print()
    print_table(result.rows)
    result.print_skipped("streaming.py")
    result.print_total("streaming.json")


def print_table(rows: list[dict]) -> None:
    reference = next(
        (later_seconds(r) for r in rows if r.get("name") == "eager" and r.get("runs")), None
    )
    print(
        f"{'mode':<34} {'runs 2-3 s':>10} {'vs eager':>8} {'peak alloc':>10} {'peak RSS':>9} "
        f"{'streamed/gen':>12} {'resident blocks':>15}"
    )
    for row in rows:
        runs = row.get("runs", [])
        if not runs:
            print(f"{row['label']:<34} failed: {str(row.get('error', ''))[:90]}")
            continue
        seconds = later_seconds(row)
        ratio = f"{seconds / reference:.2f}x" if reference else "-"
        streamed = [r.get("bytes_streamed") for r in runs[1:] or runs]
        streamed_text = "-"
        if streamed and None not in streamed:
            streamed_text = f"{sum(streamed) / len(streamed) / GiB:.1f} GiB"
        layout = (runs[-1].get("streaming") or {}).get("transformer")
        resident = "-"
        if layout:
            total = len(layout["resident_blocks"]) + len(layout["streamed_blocks"])
            resident = f"{len(layout['resident_blocks'])}/{total}"
        print(
            f"{row['label']:<34} {seconds:>10.1f} {ratio:>8} "
            f"{row['peak_allocated_bytes'] / GiB:>9.1f}G {row['peak_rss_bytes'] / GiB:>8.1f}G "
            f"{streamed_text:>12} {resident:>15}"
        )
        if row.get("error"):
            print(f"{'':<34} error: {str(row['error'])[:200]}")


if __name__ == "__main__":
    main()
