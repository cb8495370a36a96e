"""ondeck generate | plan | bench | inspect."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# embedded_default, pipeline_for_folder and write_video are called through their modules,
# where tests replace them.
from . import distributed, folder_pipelines, output
from . import embedded as embedded_module
from .errors import LoadError, OndeckError
from .hub import resolve_model
from .lazy import loader_of
from .loading import FolderLoader, HostCache, ModelFolder
from .loading.fp8 import parse_storage_dtype
from .memory import format_bytes, parse_bytes, resolve_device
from .output import (
    OutputError,
    atomic_path,
    check_writable_folder,
    write_frames,
    write_json,
)
from .parallel import describe_split, resolve_parallel, sequence_split
from .pipelines import read_model_index
from .pipelines.wan import is_wan_folder
from .profiles import ActivationProfiles, profiles_path
from .serve import cli as serve_cli

EMBEDDED_SHAPE = {"height": 192, "width": 320, "frames": 17, "steps": 6}
REAL_SHAPE = {"height": 480, "width": 832, "frames": 81, "steps": 50}
OUTPUT_NAMES = ("report.json", "timeline.png", "video.mp4", "frames.npy")
DEBUG_HINT = "run with --debug (or ONDECK_DEBUG=1) to see the traceback"


class UsageError(OndeckError):
    """A command-line argument is wrong; exits with status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line instead of the usage text and an exit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--budget -1GiB` reaches the option's check (argparse would take -1GiB for an
        # option and say "expected one argument"): any dash-digit word is a value.
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d)")

    def error(self, message: str) -> Any:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _dtype(name: str | None, device: Any) -> Any:
    import torch

    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _whole_number(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"from {low} to {high}"
        raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
    return value


def _positive(text: str) -> int:
    return _whole_number(text, 1)


def _degree(text: str) -> int:
    return _whole_number(text, 2)


def _seed(text: str) -> int:
    # torch.Generator.manual_seed takes an unsigned 64-bit seed.
    return _whole_number(text, 0, 2**64 - 1)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _size(text: str, *, allow_zero: bool) -> int:
    """A size in bytes: ``24GiB``, ``500MB``, or a plain number of bytes (``1e9`` too)."""
    hint = "write e.g. 24GiB, 500MB or a number of bytes such as 1e9"
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {text!r}")
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        if not math.isfinite(number) or number != int(number):
            raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; {hint}")
        nbytes = int(number)
    else:
        try:
            nbytes = parse_bytes(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; {hint}") from None
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return nbytes


def _budget(text: str) -> int:
    return _size(text, allow_zero=False)


def _host_cache(text: str) -> int:
    return _size(text, allow_zero=True)


def _weights(text: str) -> str | dict[str, str]:
    """``fp8`` (the big components), or ``NAME=fp8[,NAME=fp8...]`` per component."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected fp8 or NAME=fp8, got nothing")
    chosen: dict[str, str] = {}
    for part in parts:
        name, _, dtype = part.rpartition("=")
        try:
            parse_storage_dtype(dtype)
        except LoadError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if not name and len(parts) > 1:
            raise argparse.ArgumentTypeError(f"name the component of {part!r} (NAME=fp8)")
        chosen[name] = dtype
    return chosen[""] if "" in chosen else chosen


def _component_file(text: str) -> tuple[str, str]:
    name, _, file = text.partition("=")
    if not name or not file:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {text!r}")
    return name, file


def _lora(text: str) -> tuple[str, float]:
    file, _, scale = text.rpartition(":")
    try:
        return (file, _finite(scale)) if file else (text, 1.0)
    except argparse.ArgumentTypeError:
        return text, 1.0  # a ':' in the file name, no scale


def _weight_files(args: argparse.Namespace) -> dict[str, Any]:
    """--transformer, --component and --lora as the pipeline takes them."""
    components = dict(getattr(args, "component", None) or [])
    if getattr(args, "transformer", None):
        components["transformer"] = args.transformer
    loras = list(getattr(args, "lora", None) or [])
    return {
        **({"components": components} if components else {}),
        **({"loras": loras} if loras else {}),
    }


def _add_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--height", type=_positive, help="pixels; Wan: a multiple of 16")
    parser.add_argument("--width", type=_positive, help="pixels; Wan: a multiple of 16")
    parser.add_argument("--frames", type=_positive, help="Wan: 4k+1 (e.g. 17, 33, 81)")


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="auto", choices=["auto", "eager", "release", "budget"])
    parser.add_argument(
        "--budget", type=_budget, help="memory budget, e.g. 24GiB (implies --policy budget)"
    )
    parser.add_argument("--device", help="cuda, cuda:1, cpu, mps (default: cuda if present)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    parser.add_argument(
        "--weights",
        type=_weights,
        metavar="fp8",
        help="keep weights in fp8 and compute in --dtype: fp8 for every model but the VAE, "
        "or NAME=fp8[,NAME=fp8] per component (default: stored as they compute)",
    )
    parser.add_argument(
        "--transformer",
        metavar="FILE",
        help="the transformer from one .safetensors (original or diffusers key names, "
        "float8 and fp8_scaled too) or .gguf file; the rest from MODEL_DIR",
    )
    parser.add_argument(
        "--component",
        action="append",
        default=[],
        type=_component_file,
        metavar="NAME=FILE",
        help="any component from one such file (repeat for more)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        type=_lora,
        metavar="FILE[:SCALE]",
        help="apply this LoRA (default scale 1.0; repeat for more; on both experts of a "
        "two-transformer model)",
    )
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument(
        "--host-cache",
        type=_host_cache,
        help="keep released weights in pinned host memory up to this size (e.g. 40GiB, 0 = off); "
        "under torchrun the size is per process, and a --shard component keeps only the "
        "rank's own rows",
    )
    _add_library(parser)


def _add_library(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--library",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="an installed package, beyond diffusers and transformers, whose classes the "
        "folder's model_index.json may name (repeat for more); nothing else is imported",
    )


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (also ONDECK_DEBUG=1)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ondeck",
        description="Run multi-stage generative pipelines in the memory of their largest stage.",
    )
    _add_debug(parser)  # before the command too: `ondeck --debug generate`
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a video from a model folder")
    generate.add_argument(
        "model_dir",
        nargs="?",
        help="diffusers-format folder or Hub repo id (owner/name); default: embedded",
    )
    generate.add_argument("--prompt", default="a red fox running through fresh snow at dawn")
    generate.add_argument("--negative-prompt", default="")
    _add_shape(generate)
    generate.add_argument("--steps", type=_positive)
    generate.add_argument("--guidance", type=_finite, default=5.0)
    generate.add_argument("--seed", type=_seed, default=0)
    generate.add_argument(
        "--runs", type=_positive, default=1, help="generate this many times in a row"
    )
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
    generate.add_argument(
        "--context-parallel",
        type=_degree,
        metavar="N",
        help="split the transformer's sequence over the N processes of a torchrun launch "
        "(diffusers' context parallelism, Ulysses attention); each rank computes its slice, "
        "rank 0 writes the video, e.g. `torchrun --nproc-per-node 2 -m ondeck generate "
        "MODEL_DIR --context-parallel 2 --shard transformer`",
    )
    generate.add_argument(
        "--parallel",
        choices=["context"],
        help="context: --context-parallel over every process of the torchrun launch",
    )
    _add_runtime(generate)
    _add_debug(generate)

    plan = commands.add_parser("plan", help="predict memory per stage without loading weights")
    plan.add_argument("model_dir", help="diffusers-format folder or Hub repo id (owner/name)")
    _add_shape(plan)
    _add_runtime(plan)
    _add_debug(plan)

    inspect = commands.add_parser("inspect", help="list components, classes, dtypes and bytes")
    inspect.add_argument("model_dir", help="diffusers-format folder or Hub repo id (owner/name)")
    _add_library(inspect)
    _add_debug(inspect)

    profiles = commands.add_parser(
        "profiles", help="show where measured activation peaks are stored, or clear them"
    )
    profiles.add_argument("--clear", action="store_true", help="delete the stored profiles")
    _add_debug(profiles)

    bench = commands.add_parser("bench", help="compare policies on a model folder")
    bench.add_argument("model_dir", nargs="?")
    bench.add_argument("--runs", type=_positive, default=2)
    bench.add_argument("--device")
    _add_debug(bench)
    serve_cli.add_parser(commands)
    return parser


# What the command's own process sets before CUDA starts, unless the user set it: with
# expandable segments, memory freed between stages is reused whole rather than left in
# fragments, which the budgets planned close to a card's size need.
PROCESS_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def console() -> int:
    """The ``ondeck`` command: ``main`` in a process of its own."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)
    code = main()
    if distributed.joined():  # a torchrun worker: see end_process for why it ends so
        distributed.end_process(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command. Errors are one line on stderr: status 2 for a wrong argument,
    1 for any other failure, 130 for Ctrl-C; ``--debug`` or ``ONDECK_DEBUG=1`` shows
    the traceback instead."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in arguments or os.environ.get("ONDECK_DEBUG", "") not in ("", "0")
    finished = False
    try:
        args = build_parser().parse_args(arguments)
        commands = {
            "generate": serve_cli.remote_or(generate),
            "serve": serve_cli.serve,
            "plan": plan,
            "inspect": inspect,
            "bench": bench,
            "profiles": profiles,
        }
        with _warnings_as_lines(debug):
            code = commands[args.command](args)
        finished = True
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        print("\nondeck: interrupted", file=sys.stderr)
        return 130
    except OndeckError as error:
        if debug:
            raise
        print(f"ondeck: error: {_describe(error)}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    except Exception as error:
        if debug:
            raise
        first = _first_line(error)
        print(f"ondeck: error: {type(error).__name__}: {first} ({DEBUG_HINT})", file=sys.stderr)
        return 1
    finally:
        # Every rank leaves together after a command that finished; after a failure the
        # others may never arrive, so this rank leaves alone.
        distributed.shutdown(wait=finished)


@contextlib.contextmanager
def _warnings_as_lines(debug: bool):
    """ondeck's warnings as ``ondeck: warning: ...`` lines, not Python's two-line form
    with a line of ondeck's source; ``--debug`` keeps Python's form."""
    if debug:
        yield
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"ondeck: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _describe(error: OndeckError) -> str:
    """One line for the error; what follows its first line (a plan table) comes after."""
    text = str(error).strip() or type(error).__name__
    if type(error).__name__ not in ("UsageError", "OutputError", "OndeckError"):
        text = f"{type(error).__name__}: {text}"
    return text


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def _check_device(name: str | None) -> None:
    """``--device`` names a device this machine has; one line when it does not."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"argument --device: {name!r} is not a device (use cpu, cuda, cuda:N or mps)"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"argument --device: {name} asked for, but CUDA is not available here "
                f"(torch {torch.__version__}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"argument --device: {name} asked for, but there are {count} GPU(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"argument --device: {name} asked for, but MPS is not available")
    elif device.type != "cpu":
        raise UsageError(f"argument --device: {name!r}: ondeck runs on cpu, cuda or mps")


def _check_text(option: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"argument {option}: not valid UTF-8 text") from None


def _check_shape(pipe: Any, height: int | None, width: int | None, frames: int | None) -> None:
    """The shape suits the model, from its configs (no weights): Wan's sides are
    multiples of the VAE's scale times the patch size, its frames 4k+1."""
    geometry = getattr(pipe, "geometry", None)
    if geometry is None:
        return
    sides = (
        ("--height", height, geometry.scale_spatial * geometry.patch_size[1]),
        ("--width", width, geometry.scale_spatial * geometry.patch_size[2]),
    )
    for option, value, step in sides:
        if value is not None and value % step:
            below = value // step * step
            raise UsageError(
                f"argument {option}: must be a multiple of {step} for this model, got {value} "
                f"(try {_either(below, below + step)})"
            )
    step = geometry.scale_temporal
    if frames is not None and frames % step != 1:
        below = (frames - 1) // step * step + 1
        raise UsageError(
            f"argument --frames: must be {step}k+1 for this model (1, {step + 1}, "
            f"{2 * step + 1}, ...), got {frames} (try {_either(below, below + step)})"
        )
    for side, value, why in geometry.beyond_positions(height, width, frames):
        raise UsageError(f"argument --{side}: {value} is too large for this model: {why}")


def _either(below: int, above: int) -> str:
    return f"{below} or {above}" if below > 0 else str(above)


def _model_dir(args: argparse.Namespace, say: Any = print) -> tuple[Path, bool]:
    if args.model_dir:
        return resolve_model(args.model_dir), False
    say("ondeck: no model folder given; using the embedded default (a small Wan-architecture")
    say("        model with random weights: its output is coloured noise). For a real video,")
    say(
        "        point it at a diffusers-format checkpoint or a Hub repo id: ondeck generate "
        "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    )
    path, built = embedded_module.embedded_default(say=say)
    if built:
        say(f"ondeck: built the embedded default in {path}")
    return path, True


def _pipeline(args: argparse.Namespace, path: Path) -> Any:
    device = resolve_device(args.device)
    host_cache = None
    if args.host_cache:
        host_cache = HostCache(args.host_cache)
    policy = "budget" if args.budget and args.policy == "auto" else args.policy
    shard = _shard_names(args)
    parallel = _parallel(args)
    if shard and not is_wan_folder(read_model_index(path)):
        raise UsageError(f"--shard: {path} is not a Wan 2.1 folder; sharding supports Wan only")
    unknown = sorted(set(shard) - {"text_encoder", "transformer", "vae"})
    if unknown:
        raise UsageError(
            f"--shard: cannot shard {unknown}; Wan's are text_encoder, transformer, vae"
        )
    pipe = folder_pipelines.pipeline_for_folder(
        path,
        device=device,
        dtype=_dtype(args.dtype, device),
        policy=policy,
        budget=args.budget,
        prefetch=not args.no_prefetch,
        host_cache=host_cache,
        **({"storage_dtype": args.weights} if getattr(args, "weights", None) else {}),
        **({"shard": shard} if shard else {}),
        **({"parallel": parallel} if parallel is not None else {}),
        **({"libraries": tuple(args.library)} if getattr(args, "library", None) else {}),
        **_weight_files(args),
    )
    if "ONDECK_RESET_PEAKS" not in os.environ:
        # The command owns its process: no caller's peak figure to keep, so every stage's
        # activation peak is measured exactly (resetting torch's peak statistics per stage).
        pipe.tracker.reset_peaks = True
    return pipe


def _shard_names(args: argparse.Namespace) -> tuple[str, ...]:
    names = [
        part.strip() for value in getattr(args, "shard", None) or () for part in value.split(",")
    ]
    return tuple(dict.fromkeys(name for name in names if name))


def _parallel(args: argparse.Namespace) -> int | str | None:
    """``parallel=`` from --context-parallel N or --parallel context; None for neither."""
    degree = getattr(args, "context_parallel", None)
    if degree is not None:
        return degree
    return getattr(args, "parallel", None)


def _start_distributed(args: argparse.Namespace) -> bool:
    """Join torchrun's process group when sharding, splitting the sequence or launched by
    it; True when joined."""
    parallel = resolve_parallel(_parallel(args))
    if parallel is not None:
        parallel.join()  # says how to launch when this is not torchrun's process
        return True
    if not _shard_names(args) and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    distributed.init()
    return True


def _context_split(pipe: Any, height: int, width: int, frames: int) -> dict[str, Any] | None:
    """What each rank computes and exchanges at this shape; checks the sequence splits.

    From configs only: nothing loads.
    """
    parallel = getattr(pipe, "parallel", None)
    geometry = getattr(pipe, "geometry", None)
    if parallel is None or geometry is None:
        return None
    height, width, frames = geometry.snap(height, width, frames)
    tokens = geometry.tokens(height, width, frames)
    parallel.check_sequence("transformer", tokens, f"{height}x{width}, {frames} frames")
    transformer = pipe.components["transformer"]
    dtype = transformer.dtype
    return sequence_split(
        parallel,
        tokens=tokens,
        config=transformer.config,
        element_bytes=dtype.itemsize if dtype is not None else 2,
    )


def generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    _check_text("--prompt", args.prompt)
    _check_text("--negative-prompt", args.negative_prompt)
    _check_device(args.device)
    unknown = sorted(set(_shard_names(args)) - {"text_encoder", "transformer", "vae"})
    if unknown:
        raise UsageError(
            f"argument --shard: cannot shard {unknown}; Wan's are text_encoder, transformer, vae"
        )
    out = Path(args.output)
    if args.context_parallel is not None and args.parallel is not None:
        raise UsageError("give --context-parallel N or --parallel context, not both")
    # Every rank runs every stage on the same inputs; rank 0 alone prints and writes.
    joined = _start_distributed(args)
    main = distributed.is_main()
    if main:  # before any work: a run that cannot write its result is not started
        check_writable_folder(out, OUTPUT_NAMES)
    say = print if main else (lambda *_, **__: None)
    with distributed.main_first():  # rank 0 builds the embedded default, if needed, alone
        path, embedded = _model_dir(args, say)
    shape = EMBEDDED_SHAPE if embedded else REAL_SHAPE
    # `is None`, not `or`: a 0 is refused by the parser, never replaced by a default.
    height = shape["height"] if args.height is None else args.height
    width = shape["width"] if args.width is None else args.width
    frames = shape["frames"] if args.frames is None else args.frames
    steps = shape["steps"] if args.steps is None else args.steps
    pipe = _pipeline(args, path)
    _check_shape(pipe, height, width, frames)
    split = _context_split(pipe, height, width, frames)
    say(f"ondeck: {pipe.policy.reason}")
    plan_ = pipe.plan()
    say(plan_)
    if split is not None:
        say(f"ondeck: {describe_split(split, pipe.component_bytes())}")
    timings = []
    for run in range(args.runs):
        started = time.perf_counter()
        label = f"run {run + 1}/{args.runs} denoising"
        quiet = not main or os.environ.get("ONDECK_PROGRESS") == "0"
        with tqdm(total=steps, desc=label, unit="step", disable=quiet) as bar:
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
        weights=args.weights or "as computed",
    )
    if split is not None:
        report["context_parallel"] = split
    if joined:
        report = distributed.merged_report(pipe, report)  # collective: every rank sends
        if not main:
            return 0
    print(
        f"ondeck: components sum to {format_bytes(report['sum_bytes'])}; "
        f"peak resident {format_bytes(report['peak_resident_bytes'])} "
        f"under '{pipe.policy.name}'; runs took {', '.join(f'{t:.1f}s' for t in timings)}"
    )
    if joined:
        _print_ranks(report["ranks"])
    code = _write_results(
        out, report, pipe, frames_out[0], title=f"ondeck {pipe.policy.name}: {path.name}"
    )
    if embedded and code == 0:
        print(
            "ondeck: what you see is the embedded default's random weights decoding seeded "
            "noise into colour blotches, not the prompt; give a real model for a real video"
        )
    return code


def _write_results(out: Path, report: dict, pipe: Any, frames: Any, *, title: str) -> int:
    """report.json and the timeline first, then the video; each renamed into place.

    A video that cannot be written keeps the frames as frames.npy and fails the command.
    """
    report_path = write_json(out / "report.json", report)
    plot_path = out / "timeline.png"
    try:
        with atomic_path(plot_path) as temporary:
            pipe.tracker.plot(temporary, title=title)
    except OSError as error:
        raise OutputError(f"could not write {plot_path}: {error.strerror or error}") from error
    video_path = out / "video.mp4"
    try:
        output.write_video(video_path, frames)
    except OutputError as error:
        print(f"ondeck: wrote {report_path}, {plot_path}")
        try:
            kept = write_frames(out / "frames.npy", frames)
        except OutputError as second:
            raise OutputError(f"{error}; keeping the frames failed too ({second})") from error
        raise OutputError(f"{error}; the frames are kept in {kept} (numpy.load)") from error
    print(f"ondeck: wrote {video_path}, {report_path}, {plot_path}")
    return 0


def _print_ranks(ranks: list[dict]) -> None:
    for summary in ranks:
        allocated = summary["peak_allocated_bytes"]
        allocated = f", peak allocated {format_bytes(allocated)}" if allocated else ""
        activations = {k: v for k, v in (summary.get("activation_bytes") or {}).items() if v}
        if activations:
            allocated += ", activations " + ", ".join(
                f"{stage} {format_bytes(nbytes)}" for stage, nbytes in activations.items()
            )
        print(
            f"ondeck: rank {summary['rank']} ({summary['device']}): peak resident "
            f"{format_bytes(summary['peak_resident_bytes'])}{allocated}, read "
            f"{format_bytes(summary['bytes_read_from_files_total'])} from files"
        )


def plan(args: argparse.Namespace) -> int:
    _check_device(args.device)
    path = resolve_model(args.model_dir)
    pipe = _pipeline(args, path)
    _check_shape(pipe, args.height, args.width, args.frames)
    budget = args.budget or None
    shape = getattr(pipe, "set_plan_shape", None)
    if shape is not None:
        shape(height=args.height, width=args.width, frames=args.frames)
    if budget is None:
        print(f"ondeck: {pipe.policy.reason}")
    result = pipe.plan(budget)
    print(result)
    if budget is not None:
        _print_storage_choices(args, path, pipe, result, budget)
    return 0 if result.fits() else 1


def _print_storage_choices(
    args: argparse.Namespace, path: Path, pipe: Any, result: Any, budget: int
) -> None:
    """What fits ``budget`` with weights as they compute and with fp8 storage."""
    import copy

    computed = str(_dtype(args.dtype, resolve_device(args.device))).removeprefix("torch.")
    print(f"what fits {format_bytes(budget)}, by how the weights are stored:")
    for weights in (None, "fp8"):
        label = computed if weights is None else f"fp8 ({_stored_names(pipe, weights)})"
        if weights == args.weights:
            print(f"  {label}: {result.fit_summary()}")
            continue
        other = copy.copy(args)
        other.weights = weights
        try:
            choice = _pipeline(other, path)
            shape = getattr(choice, "set_plan_shape", None)
            if shape is not None:
                shape(height=args.height, width=args.width, frames=args.frames)
            summary = choice.plan(budget).fit_summary()
            label = computed if weights is None else f"fp8 ({_stored_names(choice, weights)})"
        except OndeckError as error:
            summary = f"cannot: {_first_line(error)}"
        print(f"  {label}: {summary}")


def _stored_names(pipe: Any, weights: Any) -> str:
    """The components a ``--weights`` choice stores in fp8, as the pipeline's loaders say."""
    loaders = getattr(pipe, "loaders", None) or {
        name: loader_of(proxy) for name, proxy in getattr(pipe, "deferred", {}).items()
    }
    names = [
        n
        for n, loader in loaders.items()
        if isinstance(loader, FolderLoader) and loader.storage_dtype is not None
    ]
    if names:
        return ", ".join(names)
    return ", ".join(weights) if isinstance(weights, dict) else "none"


def inspect(args: argparse.Namespace) -> int:
    folder = ModelFolder.open(resolve_model(args.model_dir), libraries=tuple(args.library))
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


def profiles(args: argparse.Namespace) -> int:
    """Where activation profiles live, what they hold; ``--clear`` deletes them."""
    path = profiles_path()
    if args.clear:
        removed = ActivationProfiles(path).clear()
        print(f"ondeck: {'deleted' if removed else 'no profiles at'} {path}")
        return 0
    stored = ActivationProfiles(path).entries()
    print(f"ondeck: activation profiles in {path}" + ("" if path.exists() else " (none yet)"))
    for model, shape, stages in stored:
        measured = ", ".join(f"{stage} {format_bytes(n)}" for stage, n in stages.items())
        print(f"  {model}  {shape}: {measured}")
    return 0


def bench(args: argparse.Namespace) -> int:
    """Each policy on the same folder, runs back to back: time, peak resident, bytes loaded."""
    _check_device(args.device)
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
