"""Residency policies on the Wan 2.1 14B-shaped pipeline under emulated device sizes.

    python benchmarks/policies.py [--folder DIR] [--only 139,48,32]

Three generations with different prompts per mode (480x832, 33 frames, 4 steps):
diffusers' own eager pipeline as the reference, then eager, release, budget, budget+prefetch at 139 GiB (the whole H200), 48 GiB and 32 GiB,
plus auto at 32 GiB. Writes policies.json and the 48 GiB timeline PNG to $OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wan_suite import run_suite  # noqa: E402

SIZES = {
    139: ["diffusers-eager", "ondeck-eager", "ondeck-release", "ondeck-budget"],
    48: ["ondeck-release", "ondeck-budget", "ondeck-budget-prefetch"],
    32: ["ondeck-eager", "ondeck-auto"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=".bench-data/wan14b")
    parser.add_argument("--only", default="139,48,32")
    parser.add_argument("--skip", default="", help="comma-separated size:mode pairs to leave out")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    modes = []
    for size in (int(s) for s in args.only.split(",")):
        for mode in SIZES[size]:
            if f"{size}:{mode}" in args.skip.split(","):
                continue
            spec = {"mode": mode, "memory_gib": None if size == 139 else size}
            if size == 48 and mode == "ondeck-budget-prefetch":
                spec["png"] = "timeline-48gib.png"
            modes.append(spec)
    run_suite("policies", modes, folder=args.folder, runs=args.runs)


if __name__ == "__main__":
    main()
