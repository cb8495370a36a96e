"""Pipelined loading against whole loads and diffusers eager, in one call.

    python benchmarks/pipelined.py [--folder DIR] [--runs 3] [--modes ...]

The Wan 2.1 14B-shaped folder as ``WanPipeline.save_pretrained`` writes it, 480x832,
33 frames, 4 steps, three prompts per mode, each mode a process of its own
(``benchmarks/wan_modes.py``), warm page cache. A throwaway process first imports the
libraries and touches CUDA, so the first mode starts as warm as the others:

    eager          diffusers, everything on the GPU: the reference
    release-whole  ondeck release, each component read whole before its stage computes
                   and nothing loaded ahead of the next run (as before pipelining)
    release        ondeck release: stages compute while blocks arrive; the last stage
                   loads the next run's text encoder when that keeps the peak
    auto           ``ondeck generate`` with no flags on the whole card
    auto-24        the same on a card emulated at 24 GiB
    budget-8       ondeck budget on a card emulated at 8 GiB, 64 GiB host cache
    mmgp-1         mmgp profile 1 (every model pinned in host memory, swapped in whole)
    mmgp-2         mmgp profile 2 (pinned, blocks streamed within its budget); both need
                   mmgp 3.8.2 and optimum-quanto installed (benchmarks/compare.py)

Every mode runs with ONDECK_RESET_PEAKS=1, as ``ondeck generate`` runs: each stage's
activation peak is measured (and stored), which the release policy needs to know that
the next run's text encoder fits beside the decode. The first ondeck mode of a call
finds no stored peaks, as a user's first command does, and its run 2 loads the text
encoder inside its first stage. ``--stored-peaks``: an untimed ondeck process of one run
first, which stores them, as a user's earlier command did; every mode then starts as a
user's second command does.

Per mode: runs 2-3 (median) and their ratio to eager, run 1, exposed load seconds,
peak reserved (sampled), host peak RSS, time to first video (process start to frames
in hand, imports included; and the same less the imports, which every mode's process
makes first, the component classes too), and whether release's frames equal
release-whole's bit for bit (SHA-256 of every run's frames). Writes pipelined.json and
the timeline PNGs of the release modes to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB,
    later_seconds,
    out_dir,
    peak_reserved,
    ready_wan14b_folder,
    run_child,
    wan_modes_command,
    warm_libraries,
)

# name: (wan_modes mode, emulated GiB, extra options)
MODES = {
    "eager": ("diffusers-eager", None, {}),
    "release-whole": ("ondeck-release", None, {"extra": ("--whole-loads",)}),
    "release": ("ondeck-release", None, {}),
    "auto": ("ondeck-default", None, {}),
    "auto-24": ("ondeck-default", 24, {}),
    "budget-8": ("ondeck-budget", 8, {"host_cache_gib": 64}),
    "mmgp-1": ("mmgp-1", None, {}),
    "mmgp-2": ("mmgp-2", None, {}),
}


def after_imports(row: dict) -> float | None:
    """Process start to frames in hand, less the imports before set-up."""
    if row.get("first_video_seconds") is None or row.get("import_seconds") is None:
        return None
    return row["first_video_seconds"] - row["import_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--stored-peaks",
        action="store_true",
        help="run ondeck once, untimed, before the modes: it stores the activation peaks",
    )
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("ONDECK_RESET_PEAKS", "1")  # as `ondeck generate` measures
    started = time.perf_counter()
    path, sizes = ready_wan14b_folder(Path(args.folder))
    warm_seconds = warm_libraries()
    print(f"(libraries warmed in {warm_seconds:.1f}s)", flush=True)
    stored_seconds = None
    if args.stored_peaks:
        spawned = time.perf_counter()
        earlier = run_child(wan_modes_command(path, "ondeck-release", 1), timeout=args.timeout)
        stored_seconds = time.perf_counter() - spawned
        if earlier.get("error"):
            raise SystemExit(f"the earlier process failed: {earlier['error'][:500]}")
        print(f"(activation peaks stored by an earlier process in {stored_seconds:.1f}s)")
    rows: dict[str, dict] = {}

    def write() -> None:
        document = {
            "folder_bytes": sizes,
            "rows": rows,
            "date": time.strftime("%Y-%m-%d"),
            "warm_up_seconds": warm_seconds,
            "stored_peaks_seconds": stored_seconds,
            "command": "python benchmarks/pipelined.py " + " ".join(sys.argv[1:]),
        }
        (out_dir() / "pipelined.json").write_text(json.dumps(document, indent=2, default=str))

    for name in args.modes.split(","):
        mode, memory, options = MODES[name]
        png = f"timeline-{name}.png" if name.startswith("release") else None
        command = wan_modes_command(path, mode, args.runs, memory_gib=memory, png=png, **options)
        spawned = time.time()
        row = run_child(command, timeout=args.timeout)
        if row.get("first_video_unix"):
            row["first_video_seconds"] = row["first_video_unix"] - spawned
        if row.get("setup_start_unix"):
            row["import_seconds"] = row["setup_start_unix"] - spawned
        rows[name] = row
        runs = ", ".join(f"{r['seconds']:.2f}" for r in row.get("runs", []))
        error = f" ERROR {row['error'][:300]}" if row.get("error") else ""
        print(f"{name}: runs {runs} s; {row.get('policy_reason', '')}{error}", flush=True)
        if row.get("error") and row.get("tail"):
            print(row["tail"][-1500:])
        write()

    eager = rows.get("eager")
    eager_seconds = later_seconds(eager) if eager and eager.get("runs") else None
    eager_first = (eager or {}).get("first_video_seconds")
    digests = {
        name: [r.get("frames_sha256") for r in row.get("runs", [])] for name, row in rows.items()
    }
    same = None
    if digests.get("release") and digests.get("release-whole"):
        same = digests["release"] == digests["release-whole"]
    print(
        f"\ntotal {time.perf_counter() - started:.0f}s; results in {out_dir() / 'pipelined.json'}"
    )
    print(f"release frames equal release-whole's bit for bit: {same}")
    print(
        f"\n{'mode':<14} {'runs 2-3 s':>10} {'/ eager':>8} {'last/eager':>10} {'run 1 s':>8} "
        f"{'exposed s':>9} {'peak resv':>9} {'host RSS':>9} {'1st video':>9} {'/ eager':>8}"
    )
    eager_last = eager["runs"][-1]["seconds"] if eager and eager.get("runs") else None
    for name, row in rows.items():
        runs = row.get("runs", [])
        later = later_seconds(row) if runs else float("nan")
        ratio = f"{later / eager_seconds:.3f}" if runs and eager_seconds else "-"
        # The last run alone: the first ondeck mode of a call measures activations in its
        # run 1, so its run 2 may still load what later runs load ahead.
        same_count = eager is not None and len(runs) == len(eager.get("runs", []))
        last = f"{runs[-1]['seconds'] / eager_last:.3f}" if same_count and eager_last else "-"
        exposed = [r.get("exposed_load_seconds") for r in runs[1:]]
        exposed = [e for e in exposed if e is not None]
        first = row.get("first_video_seconds")
        first_ratio = f"{first / eager_first:.2f}" if first and eager_first else "-"
        print(
            f"{name:<14} {later:>10.2f} {ratio:>8} {last:>10} "
            f"{runs[0]['seconds'] if runs else float('nan'):>8.2f} "
            f"{(sum(exposed) / len(exposed)) if exposed else float('nan'):>9.2f} "
            f"{(peak_reserved(row) or 0) / GiB:>8.1f}G {row.get('peak_rss_bytes', 0) / GiB:>8.1f}G "
            f"{first if first else float('nan'):>9.1f} {first_ratio:>8}"
        )
    print(
        "\nfirst video after the imports (libraries and component classes, the same for"
        " every mode): set-up and run 1"
    )
    eager_after = after_imports(eager) if eager else None
    for name, row in rows.items():
        after = after_imports(row)
        if after is not None:
            ratio = f"{after / eager_after:.2f}" if eager_after else "-"
            print(
                f"{name:<14} imports {row['import_seconds']:>5.1f} s "
                f"(classes {row.get('class_import_seconds', float('nan')):.1f} s), "
                f"then {after:>5.1f} s ({ratio} of eager's)"
            )
    print(
        f"\n{'mode':<14} {'imports s':>9} {'setup s':>8} {'run 1 s':>8} {'setup RSS':>9} "
        f"{'cache held':>10} {'cache tensors':>13} {'stream host':>11}"
    )
    for name, row in rows.items():
        runs = row.get("runs", [])
        cache = row.get("host_cache") or {}
        stream_host = sum(
            s.get("host_copy_bytes", 0)
            for s in ((runs[-1].get("streaming") or {}) if runs else {}).values()
        )
        print(
            f"{name:<14} {row.get('import_seconds', float('nan')):>9.1f} "
            f"{row.get('setup_seconds', float('nan')):>8.1f} "
            f"{runs[0]['seconds'] if runs else float('nan'):>8.2f} "
            f"{row.get('setup_rss_bytes', 0) / GiB:>8.1f}G "
            f"{cache.get('held_bytes', 0) / GiB:>9.1f}G {cache.get('tensor_bytes', 0) / GiB:>12.1f}G "
            f"{stream_host / GiB:>10.1f}G"
        )

    print("\nrun 2 by stage: seconds (exposed load seconds)")
    for name, row in rows.items():
        stages = [s for s in row.get("stages", []) if s.get("run") == 2]
        if stages:
            parts = ", ".join(
                f"{s['stage']} {s['seconds']:.2f} ({s['exposed_load_seconds']:.2f})" for s in stages
            )
            print(f"{name:<14} {parts}")

    print("\nper run: allocator retries / cudaMalloc calls; torch's pinned allocator GiB held")
    for name, row in rows.items():
        parts = []
        for run in row.get("runs", []):
            counts = run.get("allocator") or {}
            pinned = (run.get("pinned_allocator_bytes") or {}).get("allocated_bytes.current")
            held = f"{pinned / GiB:.2f}" if pinned is not None else "-"
            parts.append(
                f"{counts.get('num_alloc_retries', '-')}/{counts.get('num_device_alloc', '-')} {held}"
            )
        print(f"{name:<14} " + ", ".join(parts))


if __name__ == "__main__":
    main()
