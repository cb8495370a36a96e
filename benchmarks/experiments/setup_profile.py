"""Where a pipeline's construction spends its time, before any weight is read.

    python benchmarks/setup_profile.py [--folder DIR] [--top 25]

In a fresh process: the seconds to import each component's class (in the order the
stages use them), then ``WanTextToVideo.from_folder`` under cProfile (skeletons,
headers, the policy's device facts), then the plan. Prints the profile's top entries by
cumulative time and writes setup_profile.json to $OUT.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import out_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    started = time.perf_counter()
    import torch

    from ondeck.loading.model_folder import ModelFolder
    from ondeck.pipelines.wan import WanTextToVideo

    result: dict = {"import_ondeck_seconds": time.perf_counter() - started, "classes": {}}
    folder = ModelFolder.open(args.folder)
    for name in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler"):
        began = time.perf_counter()
        folder.component_class(name)
        result["classes"][name] = time.perf_counter() - began
    began = time.perf_counter()
    if args.device == "cuda":
        torch.cuda.init()
        torch.cuda.mem_get_info()
    result["cuda_init_seconds"] = time.perf_counter() - began
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    pipe = WanTextToVideo.from_folder(
        args.folder, device=args.device, dtype=torch.bfloat16, progress=False
    )
    profile.disable()
    result["construct_seconds"] = time.perf_counter() - began
    began = time.perf_counter()
    pipe.plan()
    result["plan_seconds"] = time.perf_counter() - began
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    result["profile"] = text.getvalue()
    (out_dir() / "setup_profile.json").write_text(json.dumps(result, indent=2))
    print(result["profile"])
    for label, key in (
        ("import ondeck and torch", "import_ondeck_seconds"),
        ("CUDA init", "cuda_init_seconds"),
        ("from_folder (classes imported)", "construct_seconds"),
        ("plan", "plan_seconds"),
    ):
        print(f"{label}: {result[key]:.2f} s")
    for name, seconds in result["classes"].items():
        print(f"import {name} class: {seconds:.2f} s")


if __name__ == "__main__":
    main()
