"""Wan 2.1 14B-shaped pipeline on one GPU against context parallelism over two.

    python benchmarks/context_parallel.py [--folder .bench-data/wan14b] [--steps 4]
                                          [--runs 3] [--gpus 2]

Builds the 14B-shaped folder once (random weights, real shapes and bytes), reads it into
the page cache, then runs in the same call, each in fresh processes, under ``release``
in bf16 at 480x832, 33 frames, one prompt per run (three prompts):

- ``single``: one process, one GPU;
- ``context``: ``torchrun --nproc-per-node 2``, ``parallel=2`` (diffusers' Ulysses
  context parallelism) with the transformer and the text encoder split by FSDP2, as
  ``ondeck generate MODEL --context-parallel 2 --shard transformer,text_encoder`` runs.

Per rank and run: wall time, peak device bytes allocated (``torch.cuda.max_memory_
allocated``, reset before each run), bytes read from the safetensors files; per prompt,
the largest and mean absolute difference between the two variants' frames against the
tolerance the README states (``ondeck.parallel.BF16_FRAME_TOLERANCE``). Writes
``$OUT/context_parallel.json`` after every variant and prints a short table last.

``--device cpu --folder SMALL_WAN_FOLDER --height 32 --width 32 --frames 5`` runs the
same flow over gloo on a small folder (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Before anything starts NCCL, here and in every process launched from here.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GiB, emit, folder_bytes, out_dir, ready_wan14b_folder  # noqa: E402
from sharded import count_reads, run_variant  # noqa: E402

HERE = Path(__file__).resolve()
PROMPTS = [
    "a red fox trotting through fresh snow at dawn",
    "a grey heron standing in a misty river",
    "a paper boat drifting down a rainy street",
]
# Targets, checked in the table: runs 2-3 time and per-rank peak, each
# against the single GPU measured in the same call.
TIME_TARGET = 0.60
PEAK_TARGET = 0.60


def child(args: argparse.Namespace) -> None:
    """One variant; under torchrun, one rank of it. Rank 0 prints the RESULT line."""
    import numpy as np
    import torch

    from ondeck import distributed
    from ondeck.pipelines.wan import WanTextToVideo

    parallel = args.degree if args.degree > 1 else None
    shard = tuple(name for name in args.shard.split(",") if name)
    cuda = args.device == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if parallel:
        distributed.init()
    main = distributed.is_main()
    result: dict = {"parallel": parallel, "shard": shard, "runs": []}
    try:
        started = time.perf_counter()
        pipe = WanTextToVideo.from_folder(
            args.folder,
            device=args.device,
            dtype=dtype,
            policy="release",
            shard=shard,
            parallel=parallel,
            progress=False,
        )
        result["setup_seconds"] = time.perf_counter() - started
        # Plain loaders (the single variant) do not count what they read: an observer does.
        single_reads = None if parallel else count_reads(pipe)
        for run, prompt in enumerate(PROMPTS[: args.runs]):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            frames = pipe.generate(
                prompt,
                height=args.height,
                width=args.width,
                num_frames=args.frames,
                num_inference_steps=args.steps,
                seed=run,
                # Rank 0 writes the video: only it decodes (the VAE is not split).
                output_type="np" if main else "latent",
            )
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            peak = torch.cuda.max_memory_allocated() if cuda else None
            result["runs"].append({"prompt": prompt, "seconds": seconds, "peak_bytes": peak})
            if main:
                np.save(Path(args.frames_dir) / f"{args.label}-{run}.npy", frames)
        result["summary"] = distributed.rank_summary(pipe)
        if single_reads is not None:
            result["summary"]["bytes_read_from_files"] = single_reads
            result["summary"]["bytes_read_from_files_total"] = sum(single_reads.values())
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    if distributed.is_active():
        gathered = distributed.gather_all(result)
        distributed.shutdown()
        if not main:
            return
        result = {"parallel": parallel, "world_size": len(gathered), "ranks": gathered}
    else:
        result = {"parallel": None, "world_size": 1, "ranks": [result]}
    emit(result)


def later_seconds(rank_result: dict) -> float | None:
    """Mean wall time of runs 2 and later (run 1 when there is only one)."""
    runs = rank_result.get("runs") or []
    later = [run["seconds"] for run in runs[1:]] or [run["seconds"] for run in runs]
    return sum(later) / len(later) if later else None


def variant_figures(result: dict) -> dict:
    """Per variant: the slowest rank's runs, the largest per-rank peak, bytes read per rank."""
    ranks = result.get("ranks") or []
    if not ranks or any(rank.get("error") for rank in ranks):
        errors = [rank.get("error") for rank in ranks if rank.get("error")]
        return {"error": result.get("error") or (errors[0] if errors else "no result")}
    runs = [
        max(rank["runs"][index]["seconds"] for rank in ranks)
        for index in range(min(len(rank["runs"]) for rank in ranks))
    ]
    peaks = [max((run["peak_bytes"] or 0) for run in rank["runs"]) for rank in ranks]
    read = [rank["summary"].get("bytes_read_from_files_total") for rank in ranks]
    return {
        "run_seconds": runs,
        "later_seconds": sum(runs[1:]) / len(runs[1:]) if len(runs) > 1 else runs[0],
        "peak_bytes_per_rank": peaks,
        "bytes_read_per_rank": read,
    }


def compare_variants(frames_dir: Path, runs: int) -> list[dict]:
    import numpy as np

    from ondeck.parallel import compare_frames

    compared = []
    for run in range(runs):
        single, context = frames_dir / f"single-{run}.npy", frames_dir / f"context-{run}.npy"
        if not (single.exists() and context.exists()):
            compared.append({"prompt": PROMPTS[run], "note": "frames missing"})
            continue
        found = compare_frames(np.load(single), np.load(context))
        compared.append({"prompt": PROMPTS[run], **found})
    return compared


def table(report: dict) -> str:
    single = report["variants"].get("single", {}).get("figures", {})
    context = report["variants"].get("context", {}).get("figures", {})
    lines = [f"{'variant':<22} {'runs (s)':<24} {'peak/rank GiB':<16} {'read/rank GiB':<16}"]
    for label, figures in (("single (1 GPU)", single), ("context parallel x2", context)):
        if "error" in figures or not figures:
            lines.append(f"{label:<22} ERROR {figures.get('error', 'not run')}"[:300])
            continue
        runs = ", ".join(f"{s:.1f}" for s in figures["run_seconds"])
        peaks = ", ".join(f"{p / GiB:.2f}" for p in figures["peak_bytes_per_rank"])
        read = ", ".join(
            f"{r / GiB:.2f}" if r is not None else "?" for r in figures["bytes_read_per_rank"]
        )
        lines.append(f"{label:<22} {runs:<24} {peaks:<16} {read:<16}")
    if single.get("run_seconds") and context.get("run_seconds"):
        time_ratio = context["later_seconds"] / single["later_seconds"]
        single_peak = max(single["peak_bytes_per_rank"]) or 1
        peak_ratio = max(context["peak_bytes_per_rank"]) / single_peak
        lines.append(
            f"runs 2-3 time ratio {time_ratio:.2f} (target <= {TIME_TARGET}); per-rank peak "
            f"ratio {peak_ratio:.2f} (target <= {PEAK_TARGET})"
        )
    for found in report.get("frames", []):
        if "max_abs_diff" in found:
            lines.append(
                f"frames '{found['prompt'][:28]}': max abs diff {found['max_abs_diff']:.4f}, "
                f"mean {found['mean_abs_diff']:.5f}, within tolerance: {found['within_tolerance']}"
            )
        else:
            lines.append(f"frames '{found['prompt'][:28]}': {found.get('note')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=".bench-data/wan14b")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the context variant")
    parser.add_argument("--shard", default="transformer,text_encoder", help="split by FSDP2")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--timeout", type=float, default=240, help="most seconds per variant")
    parser.add_argument(
        "--budget", type=float, default=525, help="seconds for the whole call, build included"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--degree", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--label", help=argparse.SUPPRESS)
    parser.add_argument("--frames-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import torch

    started = time.perf_counter()
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "device": args.device,
        "torch": torch.__version__,
        "shape": {"height": args.height, "width": args.width, "frames": args.frames},
        "steps": args.steps,
        "dtype": args.dtype,
        "policy": "release",
        "prompts": PROMPTS[: args.runs],
        "variants": {},
    }
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        sys.exit(1)
    # Built once (kept between calls on a warm machine), then read into the page cache so
    # that both variants start from the same warm files.
    path, _ = ready_wan14b_folder(Path(args.folder))
    report["folder_bytes"] = folder_bytes(path)
    report["build_seconds"] = time.perf_counter() - started
    print(f"folder {path} ready after {report['build_seconds']:.0f}s", flush=True)
    frames_dir = Path(tempfile.mkdtemp(prefix="ondeck-context-"))
    common = ["--child", "--device", args.device, "--dtype", args.dtype, "--folder", str(path)]
    common += ["--height", str(args.height), "--width", str(args.width)]
    common += ["--frames", str(args.frames), "--steps", str(args.steps)]
    common += ["--runs", str(args.runs), "--frames-dir", str(frames_dir)]
    variants = {
        "single": [str(HERE), *common, "--label", "single", "--shard", ""],
        "context": [
            *("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"),
            *(str(HERE), *common, "--label", "context", "--degree", str(args.gpus)),
            *("--shard", args.shard),
        ],
    }
    path_json = out_dir() / "context_parallel.json"
    for label, command in variants.items():
        # Each variant gets what is left of the budget, so the call ends within it.
        left = args.budget - (time.perf_counter() - started) - 15
        if left < 60:
            report["variants"][label] = {"skipped": f"{left:.0f}s left of the budget"}
            continue
        result = run_variant(command, timeout=min(args.timeout, left))
        result["command"] = result.pop("args")
        result["figures"] = variant_figures(result)
        report["variants"][label] = result
        print(f"{label}: {json.dumps(result['figures'], default=str)}", flush=True)
        path_json.write_text(json.dumps(report, indent=2, default=str))
    report["frames"] = compare_variants(frames_dir, args.runs)
    report["total_seconds"] = time.perf_counter() - started
    path_json.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path_json} after {report['total_seconds']:.0f}s")
    print(table(report))


if __name__ == "__main__":
    main()
