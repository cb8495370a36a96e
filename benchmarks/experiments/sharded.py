"""Wan 2.1 14B-shaped pipeline on one GPU against the same pipeline sharded over two.

    python benchmarks/sharded.py [--folder .bench-data/wan14b] [--steps 4] [--runs 2]
                                 [--variants single,transformer,transformer+text_encoder]

Builds the 14B-shaped folder once, then runs each variant in fresh processes, all
under ``release`` in bf16 at 480x832, 33 frames:

- ``single``: one process, one GPU;
- ``shard transformer``: ``torchrun --nproc-per-node 2``, the transformer split by FSDP2;
- ``shard transformer,text_encoder``: both split.

Per rank: peak device bytes allocated (``torch.cuda.max_memory_allocated``, the
tracker's per-stage peaks), bytes read from the safetensors files, wall time per run;
and whether rank 0's frames equal the single-GPU frames. Writes ``$OUT/sharded.json``
after every variant, so a run cut short still leaves what it measured.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    GiB,
    build_wan14b_folder,
    count_reads,
    emit,
    folder_bytes,
    out_dir,
    parse_modes,
    run_variant,
)

HERE = Path(__file__).resolve()
PROMPTS = ["a red fox trotting through fresh snow at dawn", "a grey heron in a misty river"]
VARIANTS = [("single", ()), ("shard transformer", ("transformer",))]
VARIANTS.append(("shard transformer,text_encoder", ("transformer", "text_encoder")))


def child(args: argparse.Namespace) -> None:
    """One variant; under torchrun, one rank of it. Rank 0 prints the RESULT line."""
    import numpy as np
    import torch

    from ondeck import distributed
    from ondeck.pipelines.wan import WanTextToVideo

    shard = tuple(name for name in args.shard.split(",") if name)
    cuda = args.device == "cuda"
    if shard:
        distributed.init()
    main = distributed.is_main()
    result: dict = {"shard": shard, "world_size": distributed.world_size(), "runs": []}
    try:
        started = time.perf_counter()
        pipe = WanTextToVideo.from_folder(
            args.folder,
            device=args.device,
            dtype=torch.bfloat16,
            policy="release",
            shard=shard,
            progress=False,
        )
        result["setup_seconds"] = time.perf_counter() - started
        single_reads = None if shard else count_reads(pipe)
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
                # Only rank 0 needs pixels; the unsharded VAE decodes there alone.
                output_type="np" if main or "vae" in shard else "latent",
            )
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            peak = max(
                torch.cuda.max_memory_allocated() if cuda else 0,
                pipe.tracker.run_peak_measured_bytes(run + 1) or 0,
            )
            result["runs"].append({"seconds": seconds, "peak_allocated_bytes": peak})
            if main and run == 0:
                np.save(args.frames_out, frames)
        result["summary"] = distributed.rank_summary(pipe)
        if single_reads is not None:  # plain loaders do not count: the observer did
            result["summary"]["bytes_read_from_files"] = single_reads
            result["summary"]["bytes_read_from_files_total"] = sum(single_reads.values())
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    if distributed.is_active():
        import torch.distributed as dist

        gathered = [None] * distributed.world_size() if main else None
        dist.gather_object(result, gathered, dst=0)
        distributed.shutdown()
        if not main:
            return
        result = {"shard": shard, "world_size": len(gathered), "ranks": gathered}
    else:
        result = {"shard": shard, "world_size": 1, "ranks": [result]}
    emit(result)


def variant_key(shard: tuple[str, ...]) -> str:
    """A variant's name on the command line: ``single``, ``transformer+text_encoder``."""
    return "+".join(shard) or "single"


def compare_frames(reference: Path, candidate: Path) -> dict:
    import numpy as np

    if not (reference.exists() and candidate.exists()):
        return {"equal": None, "note": "frames missing"}
    a, b = np.load(reference), np.load(candidate)
    if a.shape != b.shape:
        return {"equal": False, "note": f"shapes differ: {a.shape} vs {b.shape}"}
    return {"equal": bool(np.array_equal(a, b)), "max_abs_diff": float(np.abs(a - b).max())}


def summary_line(label: str, result: dict) -> str:
    if "ranks" not in result:
        return f"{label}: ERROR {result.get('error', '')[:300]} {result.get('tail', '')[-1500:]}"
    parts = []
    for rank, seen in enumerate(result["ranks"]):
        if seen.get("error"):
            parts.append(f"rank {rank} ERROR {seen['error'][:300]}")
            continue
        runs = seen["runs"]
        read = seen["summary"]["bytes_read_from_files_total"]
        read = f"{read / GiB:.2f} GiB" if read is not None else "(not counted)"
        seconds = ", ".join(f"{r['seconds']:.1f}" for r in runs)
        parts.append(
            f"rank {rank}: runs {seconds} s, "
            f"peak alloc {max(r['peak_allocated_bytes'] for r in runs) / GiB:.2f} GiB, "
            f"read {read}"
        )
    frames = result.get("frames_vs_single", {})
    return f"{label}: " + "; ".join(parts) + f"; frames equal to single: {frames.get('equal')}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=".bench-data/wan14b")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per variant")
    parser.add_argument("--deadline", type=float, default=330, help="start no variant after this")
    parser.add_argument(
        "--variants",
        default=",".join(variant_key(shard) for _, shard in VARIANTS),
        help="which to run, comma-separated: "
        + ", ".join(variant_key(shard) for _, shard in VARIANTS),
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", default="", help=argparse.SUPPRESS)
    parser.add_argument("--frames-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    known = [variant_key(shard) for _, shard in VARIANTS]
    wanted = set(parse_modes(parser, args.variants, known, kind="variants"))

    import torch

    started = time.perf_counter()
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "device": args.device,
        "torch": torch.__version__,
        "shape": {"height": args.height, "width": args.width, "frames": args.frames},
        "steps": args.steps,
        "policy": "release",
        "variants": {},
    }
    path = build_wan14b_folder(Path(args.folder))
    report["folder_bytes"] = folder_bytes(path)
    report["build_seconds"] = time.perf_counter() - started
    print(f"folder {path} ready in {report['build_seconds']:.0f}s", flush=True)
    frames_dir = Path(tempfile.mkdtemp(prefix="ondeck-sharded-"))
    common = ["--child", "--device", args.device, "--folder", str(path)]
    common += ["--height", str(args.height)]
    common += ["--width", str(args.width), "--frames", str(args.frames)]
    common += ["--steps", str(args.steps), "--runs", str(args.runs)]
    for label, shard in VARIANTS:
        if variant_key(shard) not in wanted:
            continue
        if time.perf_counter() - started > args.deadline:
            report["variants"][label] = {"skipped": f"past the {args.deadline:.0f}s deadline"}
            continue
        frames_out = frames_dir / f"{label.replace(' ', '_').replace(',', '+')}.npy"
        variant = [str(HERE), *common, "--shard", ",".join(shard), "--frames-out", str(frames_out)]
        if shard:
            if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
                report["variants"][label] = {"error": f"needs {args.gpus} GPUs"}
                continue
            launcher = ["-m", "torch.distributed.run", "--standalone"]
            variant = [*launcher, f"--nproc-per-node={args.gpus}", *variant]
        result = run_variant(variant, timeout=args.timeout)
        if shard:
            result["frames_vs_single"] = compare_frames(frames_dir / "single.npy", frames_out)
        report["variants"][label] = result
        print(summary_line(label, result), flush=True)
        (out_dir() / "sharded.json").write_text(json.dumps(report, indent=2, default=str))
    report["total_seconds"] = time.perf_counter() - started
    (out_dir() / "sharded.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_dir() / 'sharded.json'} after {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
    from ondeck import distributed

    if distributed.joined():  # a torchrun child: see end_process for why it ends so
        distributed.end_process()
