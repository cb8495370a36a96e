"""ondeck against diffusers' offloading and mmgp 3.8.2 (the memory manager behind Wan2GP)
on a Wan 2.1 14B-shaped folder: the README's results table.

    python benchmarks/compare.py [--folder DIR] [--modes eager,mmgp-1,...] [--mmgp-vae-bf16]

mmgp (``pip install mmgp==3.8.2``, with optimum-quanto and accelerate) is given the stock
diffusers WanPipeline loaded on the CPU and moves the models itself. Compared in one run,
each mode in its own process (480x832, 33 frames, 4 steps, guidance on, three
generations):

    eager      diffusers, everything on the GPU (the reference time; ~65 s)
    mmgp-1     mmgp profile HighRAM_HighVRAM, no quantization (~80 s)
    mmgp-2     mmgp profile HighRAM_LowVRAM, no quantization (~95 s)
    release    ondeck release, no host cache: weights from the page cache (~60 s)
    budget-32  ondeck budget + prefetch on a device emulated at 32 GiB, the budget
               automatic from that device, 64 GiB host cache (~70 s)
    stream-8   ondeck budget on a device emulated at 8 GiB, streaming the transformer's
               blocks that do not fit (~90 s)
    stream-24, stream-16   the same at 24 and 16 GiB (~100 s, ~110 s)
    group-offload  diffusers enable_group_offload(block_level, 1 block, use_stream) (~155 s)
    model-offload  diffusers enable_model_cpu_offload() (~165 s)

mmgp is told to keep the VAE in float32 like every other mode (its default casts every
float32 weight to bfloat16; ``--mmgp-vae-bf16`` lets it). Per mode: wall time of runs 2-3 (median), the
ratio to eager's, peak device bytes allocated, peak host RSS (VmHWM, setup included, and
over the generations alone), exposed load seconds (ondeck), setup seconds (load, and
for mmgp its profile). Then three targets, PASS or MISS from these numbers (n/a where a
mode they compare against did not run or failed):

    budget-32 no slower than mmgp-1, and a peak allocated no higher
    release within 1.2x eager's time, and a peak RSS at most 1/4 of mmgp-1's
    stream-8 no slower than mmgp-2, and a peak RSS below mmgp-2's

Building the folder takes ~80 s. Modes run in the order given; one that would not finish
before ``--deadline-s`` (counted from the start) is skipped and named, with the command
that runs it, and no mode runs past the deadline. Every mode runs with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the variable is already set.
Results go to $OUT/compare.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Comparison,
    GiB,
    Mode,
    add_comparison_arguments,
    later_seconds,
    parse_modes,
    run_comparison,
)

# name: the wan_modes mode, the emulated device GiB (None: whole card), seconds on an
# H200, extra arguments
MODES = {
    "eager": Mode("diffusers-eager", None, 65),
    "mmgp-1": Mode("mmgp-1", None, 80),
    "mmgp-2": Mode("mmgp-2", None, 95),
    "release": Mode("ondeck-release", None, 60),
    "budget-32": Mode("ondeck-budget-prefetch", 32, 70, ("--host-cache-gib", "64")),
    "stream-8": Mode("ondeck-stream", 8, 90),
    "stream-24": Mode("ondeck-stream", 24, 100),
    "stream-16": Mode("ondeck-stream", 16, 110),
    "group-offload": Mode("diffusers-group-offload", None, 155),
    "model-offload": Mode("diffusers-model-offload", None, 165),
}
DEFAULT_MODES = ["eager", "mmgp-1", "mmgp-2", "release", "budget-32", "stream-8"]
# Whose peak host RSS the release target is held against.
MMGP_RSS_REFERENCE = "mmgp-1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser, MODES, DEFAULT_MODES, deadline_s=560)
    parser.add_argument(
        "--mmgp-vae-bf16",
        action="store_true",
        help="let mmgp cast the VAE to bfloat16 (its default); float32 otherwise",
    )
    args = parser.parse_args()
    names = parse_modes(parser, args.modes, MODES)
    modes = dict(MODES)
    if args.mmgp_vae_bf16:
        for name, mode in MODES.items():
            if mode.wan_mode.startswith("mmgp"):
                modes[name] = replace(mode, extra=(*mode.extra, "--mmgp-vae-bf16"))

    missing = [m for m in ("mmgp", "optimum.quanto", "accelerate") if not importable(m)]

    def unavailable(name: str, mode: Mode) -> str | None:
        # Not worth a load of the whole pipeline to find out.
        if mode.wan_mode.startswith("mmgp") and missing:
            return f"mmgp cannot be imported: no {', '.join(missing)}"
        return None

    result = run_comparison(
        args,
        names,
        modes,
        label=lambda name, mode: f"{name} ({mode.wan_mode} @ {mode.memory_gib or 139} GiB)",
        png_prefix="compare",
        unavailable=unavailable,
        after_each=lambda done: write(done, args),
    )
    rows = result.rows
    print()
    print_table(rows)
    results = targets(rows)
    print()
    print_targets(results)
    write(result, args, results)
    result.print_skipped("compare.py", " --mmgp-vae-bf16" if args.mmgp_vae_bf16 else "")
    result.print_total("compare.json")


def write(result: Comparison, args, results: list[dict] | None = None) -> None:
    result.write(
        "compare.json",
        targets=results,
        mmgp_vae="bfloat16 (mmgp default)" if args.mmgp_vae_bf16 else "float32",
        mmgp_rss_reference=MMGP_RSS_REFERENCE,
        pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    )


def print_table(rows: list[dict]) -> None:
    reference = next((later_seconds(r) for r in rows if r.get("name") == "eager" and ok(r)), None)
    print(
        f"{'mode':<46} {'runs 2-3 s':>10} {'vs eager':>8} {'peak alloc':>10} {'peak RSS':>9} "
        f"{'gen RSS':>8} {'exposed s':>9} {'setup s':>7} {'streamed/gen':>12}"
    )
    for row in rows:
        runs = row.get("runs", [])
        if not runs:
            print(f"{row['label']:<46} failed: {str(row.get('error', ''))[:90]}")
            continue
        seconds = later_seconds(row)
        ratio = f"{seconds / reference:.2f}x" if reference else "-"
        generation_rss = row.get("generation_peak_rss_bytes")
        generation_rss_text = f"{generation_rss / GiB:.1f}G" if generation_rss else "-"
        exposed = exposed_seconds(row)
        exposed_text = "-" if exposed is None else f"{exposed:.2f}"
        setup = row.get("setup_seconds")
        setup_text = "-" if setup is None else f"{setup:.1f}"
        streamed = [r.get("bytes_streamed") for r in runs[1:] or runs]
        streamed_text = "-"
        if streamed and None not in streamed:
            streamed_text = f"{sum(streamed) / len(streamed) / GiB:.1f} GiB"
        print(
            f"{row['label']:<46} {seconds:>10.1f} {ratio:>8} "
            f"{row['peak_allocated_bytes'] / GiB:>9.1f}G {row['peak_rss_bytes'] / GiB:>8.1f}G "
            f"{generation_rss_text:>8} {exposed_text:>9} {setup_text:>7} {streamed_text:>12}"
        )
        if row.get("error"):
            print(f"{'':<46} error: {str(row['error'])[:200]}")


def targets(rows: list[dict]) -> list[dict]:
    """The three targets, each PASS, MISS, or n/a where a row it needs is missing."""
    by_name = {row["name"]: row for row in rows}

    def time_of(name):
        return later_seconds(by_name[name])

    def alloc_of(name):
        return by_name[name]["peak_allocated_bytes"] / GiB

    def rss_of(name):
        return by_name[name]["peak_rss_bytes"] / GiB

    mmgp = MMGP_RSS_REFERENCE
    specs = [
        (
            "budget-32 vs mmgp-1",
            "budget-32",
            ["mmgp-1"],
            lambda: [
                ("runs 2-3 s", time_of("budget-32"), "<=", time_of("mmgp-1"), "mmgp-1"),
                ("peak alloc GiB", alloc_of("budget-32"), "<=", alloc_of("mmgp-1"), "mmgp-1"),
            ],
        ),
        (
            f"release vs eager and {mmgp}",
            "release",
            ["eager", mmgp],
            lambda: [
                ("runs 2-3 s", time_of("release"), "<=", 1.2 * time_of("eager"), "1.2x eager"),
                ("peak RSS GiB", rss_of("release"), "<=", rss_of(mmgp) / 4, f"1/4 {mmgp}"),
            ],
        ),
        (
            "stream-8 vs mmgp-2",
            "stream-8",
            ["mmgp-2"],
            lambda: [
                ("runs 2-3 s", time_of("stream-8"), "<=", time_of("mmgp-2"), "mmgp-2"),
                ("peak RSS GiB", rss_of("stream-8"), "<", rss_of("mmgp-2"), "mmgp-2"),
            ],
        ),
    ]
    results = []
    for title, subject, references, compute in specs:
        result: dict = {"target": title, "checks": []}
        absent = [name for name in [subject, *references] if name not in by_name]
        failed_references = [
            name for name in references if name in by_name and not ok(by_name[name])
        ]
        if absent:
            result.update(verdict="n/a", reason=f"no result for {', '.join(absent)}")
        elif not ok(by_name[subject]):
            error = str(by_name[subject].get("error", ""))[:120]
            result.update(verdict="MISS", reason=f"{subject} failed: {error}")
        elif failed_references:
            result.update(verdict="n/a", reason=f"{', '.join(failed_references)} failed")
        else:
            for what, value, op, bound, against in compute():
                held = value <= bound if op == "<=" else value < bound
                result["checks"].append(
                    {
                        "what": what,
                        "value": value,
                        "op": op,
                        "bound": bound,
                        "against": against,
                        "held": held,
                    }
                )
            passed = all(check["held"] for check in result["checks"])
            result["verdict"] = "PASS" if passed else "MISS"
        results.append(result)
    return results


def print_targets(results: list[dict]) -> None:
    print(f"targets (mmgp's peak RSS taken from {MMGP_RSS_REFERENCE}):")
    for result in results:
        if not result["checks"]:
            print(f"  {result['verdict']:<4}  {result['target']}: {result['reason']}")
            continue
        checks = "; ".join(
            f"{c['what']} {c['value']:.1f} {c['op']} {c['bound']:.1f} ({c['against']}) "
            f"{'yes' if c['held'] else 'NO'}"
            for c in result["checks"]
        )
        print(f"  {result['verdict']:<4}  {result['target']}: {checks}")


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def ok(row: dict) -> bool:
    """Ran every generation (an error after the last one, e.g. plotting, is tolerated)."""
    runs = row.get("runs") or []
    return bool(runs) and (not row.get("error") or len(runs) >= row.get("runs_asked", 0))


def exposed_seconds(row: dict) -> float | None:
    """Mean exposed load seconds of runs 2 and later (ondeck rows), else None."""
    runs = row["runs"]
    exposed = [r.get("exposed_load_seconds") for r in runs[1:] or runs]
    if not exposed or None in exposed:
        return None
    return sum(exposed) / len(exposed)


if __name__ == "__main__":
    main()
