"""ondeck against diffusers' own memory strategies on the Wan 2.1 14B-shaped pipeline.

    python benchmarks/vs_diffusers.py [--folder DIR] [--modes a,b,...]

Three generations each: diffusers eager (.to("cuda")), enable_model_cpu_offload(),
enable_group_offload(block_level, use_stream=True); ondeck release; ondeck budget at an
emulated 48 GiB. Writes vs_diffusers.json to $OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wan_suite import run_suite  # noqa: E402

MODES = {
    "diffusers-eager": {"mode": "diffusers-eager"},
    "diffusers-model-offload": {"mode": "diffusers-model-offload"},
    "diffusers-group-offload": {"mode": "diffusers-group-offload"},
    "ondeck-release": {"mode": "ondeck-release"},
    "ondeck-budget-48": {"mode": "ondeck-budget-prefetch", "memory_gib": 48},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=".bench-data/wan14b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    run_suite(
        "vs_diffusers",
        [MODES[m] for m in args.modes.split(",")],
        folder=args.folder,
        runs=args.runs,
    )


if __name__ == "__main__":
    main()
