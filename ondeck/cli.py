"""ondeck generate | plan | bench | inspect."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .errors import OndeckError
from .memory import format_bytes, parse_bytes

EMBEDDED_SHAPE = {"height": 192, "width": 320, "frames": 17, "steps": 6}
REAL_SHAPE = {"height": 480, "width": 832, "frames": 81, "steps": 50}


def _dtype(name: str | None, device: Any) -> Any:
    import torch

    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _add_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--frames", type=int)


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="auto", choices=["auto", "eager", "release", "budget"])
    parser.add_argument("--budget", help="memory budget, e.g. 24GiB (implies --policy budget)")
    parser.add_argument("--device", help="cuda, cuda:1, cpu, mps (default: cuda if present)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument(
        "--host-cache",
        help="keep released weights in pinned host memory up to this size (e.g. 40GiB, 0 = off)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ondeck",
        description="Run multi-stage generative pipelines in the memory of their largest stage.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a video from a model folder")
    generate.add_argument(
        "model_dir", nargs="?", help="diffusers-format folder (default: embedded)"
    )
    generate.add_argument("--prompt", default="a red fox running through fresh snow at dawn")
    generate.add_argument("--negative-prompt", default="")
    _add_shape(generate)
    generate.add_argument("--steps", type=int)
    generate.add_argument("--guidance", type=float, default=5.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--runs", type=int, default=1, help="generate this many times in a row")
    generate.add_argument("--output", default="ondeck-out", help="folder for video and report")
    generate.add_argument(
        "--shard",
        action="append",
        default=[],
        metavar="COMPONENT",
        help="split this component's weights across the processes of a torchrun launch "
        "(FSDP2), e.g. `torchrun --nproc-per-node 2 -m ondeck generate MODEL_DIR --shard "
        "transformer`; repeat or comma-separate for more (text_encoder)",
    )
    _add_runtime(generate)

    plan = commands.add_parser("plan", help="predict memory per stage without loading weights")
    plan.add_argument("model_dir")
    _add_shape(plan)
    _add_runtime(plan)

    inspect = commands.add_parser("inspect", help="list components, classes, dtypes and bytes")
    inspect.add_argument("model_dir")

    bench = commands.add_parser("bench", help="compare policies on a model folder")
    bench.add_argument("model_dir", nargs="?")
    bench.add_argument("--runs", type=int, default=2)
    bench.add_argument("--device")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": generate, "plan": plan, "inspect": inspect, "bench": bench}[
            args.command
        ](args)
    except OndeckError as error:
        print(f"ondeck: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


def _model_dir(args: argparse.Namespace, say: Any = print) -> tuple[Path, bool]:
    if args.model_dir:
        return Path(args.model_dir), False
    from .embedded import embedded_default

    say("ondeck: no model folder given; using the embedded default (a small Wan-architecture")
    say("        model with random weights: its output is noise). For a real video, point it")
    say(
        "        at a diffusers-format checkpoint: ondeck generate /path/to/Wan2.1-T2V-14B-Diffusers"
    )
    path, built = embedded_default()
    if built:
        say(f"ondeck: built the embedded default in {path}")
    return path, True


def _pipeline(args: argparse.Namespace, path: Path) -> Any:
    from .loading import HostCache
    from .memory import resolve_device
    from .pipelines import pipeline_for_folder, read_model_index
    from .pipelines.wan import is_wan_folder

    device = resolve_device(args.device)
    host_cache = None
    if args.host_cache is not None and parse_bytes(args.host_cache):
        host_cache = HostCache(parse_bytes(args.host_cache))
    policy = "budget" if args.budget and args.policy == "auto" else args.policy
    shard = _shard_names(args)
    if shard and not is_wan_folder(read_model_index(path)):
        raise OndeckError(f"--shard: {path} is not a Wan 2.1 folder; sharding supports Wan only")
    return pipeline_for_folder(
        path,
        device=device,
        dtype=_dtype(args.dtype, device),
        policy=policy,
        budget=args.budget,
        prefetch=not args.no_prefetch,
        host_cache=host_cache,
        **({"shard": shard} if shard else {}),
    )


def _shard_names(args: argparse.Namespace) -> tuple[str, ...]:
    names = [
        part.strip() for value in getattr(args, "shard", None) or () for part in value.split(",")
    ]
    return tuple(dict.fromkeys(name for name in names if name))


def _start_distributed(args: argparse.Namespace) -> bool:
    """Join torchrun's process group when sharding or launched by it; True when joined."""
    from . import distributed

    if not _shard_names(args) and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    distributed.init()
    return True


def generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import distributed

    # Every rank runs every stage on the same inputs; rank 0 alone prints and writes.
    joined = _start_distributed(args)
    main = distributed.is_main()
    say = print if main else (lambda *_, **__: None)
    with distributed.main_first():  # rank 0 builds the embedded default, if needed, alone
        path, embedded = _model_dir(args, say)
    shape = EMBEDDED_SHAPE if embedded else REAL_SHAPE
    height = args.height or shape["height"]
    width = args.width or shape["width"]
    frames = args.frames or shape["frames"]
    steps = args.steps or shape["steps"]
    pipe = _pipeline(args, path)
    say(f"ondeck: {pipe.policy.reason}")
    plan_ = pipe.plan()
    say(plan_)
    out = Path(args.output)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    timings = []
    for run in range(args.runs):
        started = time.perf_counter()
        label = f"run {run + 1}/{args.runs} denoising"
        with tqdm(total=steps, desc=label, unit="step", disable=not main) as bar:
            frames_out = pipe.generate(
                args.prompt,
                negative_prompt=args.negative_prompt,
                height=height,
                width=width,
                num_frames=frames,
                num_inference_steps=steps,
                guidance_scale=args.guidance,
                seed=args.seed,
                progress=bar,
                # Only rank 0 writes the video; the others decode only when sharing the VAE.
                output_type="np" if main or "vae" in _shard_names(args) else "latent",
            )
        timings.append(time.perf_counter() - started)
    report = pipe.report()
    report.update(
        model_dir=str(path),
        embedded_default=embedded,
        prompt=args.prompt,
        shape={"height": height, "width": width, "frames": frames, "steps": steps},
        run_seconds=timings,
        sum_bytes=sum(v or 0 for v in report["component_bytes"].values()),
        predicted_peak_bytes=plan_.peak_bytes,
    )
    if joined:
        report = distributed.merged_report(pipe, report)  # collective: every rank sends
        if not main:
            distributed.shutdown()
            return 0
    video_path = out / "video.mp4"
    _write_video(frames_out[0], video_path)
    report_path = out / "report.json"
    report_path.write_text(json.dumps(report, indent=2, default=str))
    plot_path = pipe.tracker.plot(
        out / "timeline.png", title=f"ondeck {pipe.policy.name}: {path.name}"
    )
    print(
        f"ondeck: components sum to {format_bytes(report['sum_bytes'])}; "
        f"peak resident {format_bytes(report['peak_resident_bytes'])} "
        f"under '{pipe.policy.name}'; runs took {', '.join(f'{t:.1f}s' for t in timings)}"
    )
    print(f"ondeck: wrote {video_path}, {report_path}, {plot_path}")
    if joined:
        _print_ranks(report["ranks"])
        distributed.shutdown()
    if embedded:
        print("ondeck: (embedded default: random weights, so the video is noise)")
    return 0


def _print_ranks(ranks: list[dict]) -> None:
    for summary in ranks:
        allocated = summary["peak_allocated_bytes"]
        allocated = f", peak allocated {format_bytes(allocated)}" if allocated else ""
        print(
            f"ondeck: rank {summary['rank']} ({summary['device']}): peak resident "
            f"{format_bytes(summary['peak_resident_bytes'])}{allocated}, read "
            f"{format_bytes(summary['bytes_read_from_files_total'])} from files"
        )


def _write_video(frames: Any, path: Path, fps: int = 16) -> None:
    import imageio.v2 as imageio
    import numpy as np

    pixels = (np.clip(frames, 0.0, 1.0) * 255).round().astype("uint8")
    with imageio.get_writer(path, fps=fps, macro_block_size=1) as writer:
        for frame in pixels:
            writer.append_data(frame)


def plan(args: argparse.Namespace) -> int:
    pipe = _pipeline(args, Path(args.model_dir))
    budget = parse_bytes(args.budget) if args.budget else None
    shape = getattr(pipe, "set_plan_shape", None)
    if shape is not None:
        shape(height=args.height, width=args.width, frames=args.frames)
    result = pipe.plan(budget)
    print(result)
    return 0 if result.fits() else 1


def inspect(args: argparse.Namespace) -> int:
    from .loading import ModelFolder

    folder = ModelFolder.open(args.model_dir)
    print(f"{folder.path}: {folder.pipeline_class_name}")
    total = 0
    for name in folder.component_names:
        if folder.is_model(name):
            spec = folder.spec(name)
            total += spec.nbytes or 0
            print(
                f"  {name:<16} {spec.cls.__name__:<28} {str(spec.dtype):<16} "
                f"{format_bytes(spec.nbytes):>12}"
            )
        else:
            library, class_name = folder.model_index[name]
            print(f"  {name:<16} {class_name:<28} ({library}, no weights)")
    print(f"  {'sum':<16} {'':<28} {'':<16} {format_bytes(total):>12}")
    return 0


def bench(args: argparse.Namespace) -> int:
    """Each policy on the same folder, runs back to back: time, peak resident, bytes loaded."""
    path, embedded = _model_dir(args)
    rows = []
    for policy in ("eager", "release", "budget"):
        namespace = argparse.Namespace(
            device=args.device,
            dtype=None,
            policy=policy,
            budget=None,
            no_prefetch=False,
            host_cache=None,
        )
        pipe = _pipeline(namespace, path)
        seconds = []
        for _ in range(args.runs):
            started = time.perf_counter()
            pipe.generate(
                "bench", height=128, width=128, num_frames=9, num_inference_steps=2, seed=0
            )
            seconds.append(time.perf_counter() - started)
        rows.append((policy, seconds, pipe.tracker.peak_resident_bytes, pipe.tracker.bytes_loaded))
        pipe.release_all()
    print(f"{'policy':<10} {'run 1':>8} {'last run':>9} {'peak resident':>14} {'loaded':>12}")
    for policy, seconds, peak, loaded in rows:
        print(
            f"{policy:<10} {seconds[0]:>7.2f}s {seconds[-1]:>8.2f}s "
            f"{format_bytes(peak):>14} {format_bytes(loaded):>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
