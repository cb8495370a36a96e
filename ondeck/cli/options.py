"""The command line's arguments: each option's type (one line when a value is wrong),
and the arguments of each command."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Any

from ..errors import LoadError, OndeckError
from ..memory import parse_bytes


class UsageError(OndeckError):
    """A command-line argument is wrong; exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line instead of the usage text and an exit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--budget -1GiB` reaches the option's check (argparse would take -1GiB for an
        # option and say "expected one argument"): any dash-digit word is a value.
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d)")

    def error(self, message: str) -> Any:
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's, with an unknown option sent to the help of the command it was
        given to (``ondeck generate --stpes 4``: ``ondeck generate --help``)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            where = f"{self.prog} {command}" if command else self.prog
            raise UsageError(f"unrecognized arguments: {' '.join(extras)} (see `{where} --help`)")
        return parsed


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


def _folder(text: str) -> str:
    if not text.strip():
        # `--output "$OUT"` with OUT unset: not the current folder, written over unasked.
        raise argparse.ArgumentTypeError(
            "an empty folder name (an unset shell variable?); leave it out for ondeck-out/"
        )
    # `--output=~/x`, or an argument no shell expanded, is the folder x in the home folder.
    return os.path.expanduser(text)


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


def host_cache_argument(text: str) -> int | str:
    """``--host-cache``: ``auto`` (an elastic cache, ``HostCache(elastic=True)``), or a
    size (0: none)."""
    if text.strip().lower() == "auto":
        return "auto"
    return _size(text, allow_zero=True)


def _weights(text: str) -> str | dict[str, str]:
    """``fp8`` (the big components), or ``NAME=fp8[,NAME=fp8...]`` per component."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected fp8 or NAME=fp8, got nothing")
    chosen: dict[str, str] = {}
    from ..loading.fp8 import parse_storage_dtype

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


def require_file(flag: str, file: str) -> None:
    path = Path(os.path.expanduser(file))
    if not path.exists():
        raise UsageError(f"argument {flag}: {file} does not exist")
    if not path.is_file():
        raise UsageError(f"argument {flag}: {file} is not a file")


def lora_argument(text: str) -> tuple[str, float]:
    """FILE or FILE:SCALE. A whole text that names a file is a file (a ':' in its name);
    one whose part before the last ':' names a file has a scale, which must be a number."""
    file, _, scale = text.rpartition(":")
    if not file or os.path.exists(os.path.expanduser(text)):
        return text, 1.0
    try:
        return file, _finite(scale)
    except argparse.ArgumentTypeError as error:
        if os.path.exists(os.path.expanduser(file)):
            raise argparse.ArgumentTypeError(f"{text!r}: the scale after ':' {error}") from None
        return text, 1.0  # no such file either way: the load names it


def weight_files(args: argparse.Namespace) -> dict[str, Any]:
    """--transformer, --component and --lora as the pipeline takes them; a file that is
    not there is the flag's error, found before anything is built or downloaded."""
    given = [("--component", name, file) for name, file in getattr(args, "component", None) or []]
    if getattr(args, "transformer", None):
        given.append(("--transformer", "transformer", args.transformer))
    components: dict[str, Any] = {}
    for flag, name, file in given:
        if name in components:
            raise UsageError(
                f"argument --component: {name} is given twice ({components[name]} and "
                f"{file}; --transformer FILE is --component transformer=FILE)"
            )
        require_file(flag, file)
        components[name] = file
    loras = list(getattr(args, "lora", None) or [])
    for file, _ in loras:
        before, equals, after = file.rpartition("=")
        if (
            equals
            and not os.path.exists(os.path.expanduser(file))
            and os.path.exists(os.path.expanduser(before))
        ):
            raise UsageError(f"argument --lora: {file}: a scale follows a ':' ({before}:{after})")
        require_file("--lora", file)
    if loras:
        from ..integrations.diffusers.loading import checked_loras

        try:
            checked_loras(loras)  # the library's own checks: a file given twice, say
        except ValueError as error:
            raise UsageError(f"argument --lora: {error}") from None
    return {
        **({"components": components} if components else {}),
        **({"loras": loras} if loras else {}),
    }


def _add_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--height", type=_positive, help="pixels; Wan: a multiple of 16")
    parser.add_argument("--width", type=_positive, help="pixels; Wan: a multiple of 16")
    parser.add_argument("--frames", type=_positive, help="Wan: 4k+1 (e.g. 17, 33, 81)")


def _add_call(parser: argparse.ArgumentParser) -> None:
    """The flags that make ``generate``'s call: its prompt, size and settings."""
    parser.add_argument("--prompt", default="a red fox running through fresh snow at dawn")
    parser.add_argument("--negative-prompt", default="")
    _add_shape(parser)
    parser.add_argument("--steps", type=_positive)
    parser.add_argument(
        "--guidance", type=_finite, help="guidance_scale (default: the pipeline's own)"
    )
    parser.add_argument(
        "--true-cfg",
        type=_finite,
        metavar="SCALE",
        help="true_cfg_scale of a pipeline that takes one (Flux, Flux Kontext, QwenImage, "
        "HunyuanVideo): above 1 runs the negative prompt too (default: the pipeline's own)",
    )
    parser.add_argument("--seed", type=_seed, default=0)
    parser.add_argument(
        "--image",
        metavar="PATH",
        help="the input image of an image-to-video or image-edit pipeline (PNG, JPEG, ...)",
    )
    parser.add_argument(
        "--images",
        type=_positive,
        metavar="N",
        help="images per prompt, for an image pipeline: image-1.png ... image-N.png",
    )


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
    _add_single_files(parser)
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        type=lora_argument,
        metavar="FILE[:SCALE]",
        help="apply this LoRA (default scale 1.0; repeat for more; on both experts of a "
        "two-transformer model)",
    )
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument(
        "--host-cache",
        type=host_cache_argument,
        help="keep released weights in pinned host memory up to this size (e.g. 40GiB, "
        "0 = off), or auto: what the plan leaves once the streamed blocks' pinned copies are "
        "counted, for the components a run loads again; under torchrun the size is per "
        "process, and a --shard component keeps only the rank's own rows",
    )
    parser.add_argument(
        "--host-memory",
        type=_budget,
        help="the process's host memory budget, e.g. 32GiB (default: what the machine and "
        "its cgroup leave, less a reserve); the plan shows the host pool against it, and a "
        "run that outgrows it stops before the kernel would kill it",
    )
    _add_library(parser)


def _add_single_files(parser: argparse.ArgumentParser) -> None:
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


def _add_library(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--library",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="an installed package, beyond diffusers and transformers, whose classes the "
        "folder's model_index.json may name (repeat for more); nothing else is imported",
    )


def add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (also ONDECK_DEBUG=1)"
    )


def _fps(text: str) -> float:
    value = _finite(text)
    if not 0.001 <= value <= 1000:  # what the video encoder takes
        raise argparse.ArgumentTypeError(f"must be from 0.001 to 1000, got {text!r}")
    return value


def add_generate(generate: argparse.ArgumentParser) -> None:
    generate.add_argument(
        "model_dir",
        nargs="?",
        help="diffusers-format folder or Hub repo id (owner/name); default: embedded",
    )
    _add_call(generate)
    generate.add_argument(
        "--fps",
        type=_fps,
        help="frames per second of video.mp4 (default: the model's, from its pipeline)",
    )
    generate.add_argument(
        "--runs", type=_positive, default=1, help="generate this many times in a row"
    )
    generate.add_argument(
        "--output",
        default="ondeck-out",
        type=_folder,
        help="folder for the video or images and the report; one run at a time uses it",
    )
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


def add_plan(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("model_dir", help="diffusers-format folder or Hub repo id (owner/name)")
    plan.add_argument(
        "more_models",
        nargs="*",
        metavar="MODEL_DIR",
        help="more models, planned as a set under one --budget (as `ondeck serve` holds "
        "them): what stays resident and what each switch loads",
    )
    _add_call(plan)  # the call generate would make with the same flags
    _add_runtime(plan)


def add_inspect(inspect: argparse.ArgumentParser) -> None:
    inspect.add_argument("model_dir", help="diffusers-format folder or Hub repo id (owner/name)")
    _add_single_files(inspect)
    _add_library(inspect)


def add_profiles(profiles: argparse.ArgumentParser) -> None:
    profiles.add_argument("--clear", action="store_true", help="delete the stored profiles")


def add_bench(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "model_dir",
        nargs="?",
        help="diffusers-format folder or Hub repo id (owner/name); default: embedded",
    )
    bench.add_argument(
        "--runs",
        type=_positive,
        default=2,
        help="runs per policy, back to back, each with the same seed (default 2)",
    )
    bench.add_argument("--device", help="cuda, cuda:1, cpu, mps (default: cuda if present)")
    bench.add_argument(
        "--image",
        metavar="PATH",
        help="the input image of an image-to-video or image-edit pipeline (PNG, JPEG, ...)",
    )
    # A short run by default: the policies' loads and peaks, not the model's compute.
    bench.add_argument("--height", type=_positive, help="pixels (default 128)")
    bench.add_argument("--width", type=_positive, help="pixels (default 128)")
    bench.add_argument("--frames", type=_positive, help="a video model's (default 9)")
    bench.add_argument("--steps", type=_positive, help="denoising steps (default 2)")


def check_policy_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other are refused, never one of them ignored."""
    if args.budget is not None and args.policy in ("eager", "release"):
        raise UsageError(
            f"argument --budget: --policy {args.policy} does not use a budget; give "
            "--policy budget or auto with --budget, or leave --budget out"
        )
