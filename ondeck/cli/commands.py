"""What the commands share (the model folder, the pipeline built from the flags, the
checks made before anything loads), and the commands other than ``generate``."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from .. import distributed, folder_pipelines
from .. import embedded as embedded_module
from ..arguments import ArgumentError, check_generate_arguments
from ..errors import LoadError, OndeckError
from ..hub import model_label, resolve_model
from ..loading import (
    FolderLoader,
    HostCache,
    ModelFolder,
    QuantizedComponentLoader,
    component_loader,
)
from ..loading.sharded import shardable_models
from ..loading.single_file import SingleFileFolder
from ..memory import format_bytes, process_rss_bytes, resolve_device
from ..parallel import resolve_parallel, sequence_split
from ..profiles import ActivationProfiles, profiles_path
from ..serve.residency import ServedModel, plan_models
from .budget_hint import pipeline_loaders
from .media import Media, check_input_image, check_media_flags, media_of, read_input_image
from .options import UsageError, check_policy_flags, weight_files
from .shape import EMBEDDED_SHAPE, Shape, asked_shape, own_shape

# The command-line flag of each ``generate()`` argument, for the check's messages.
FLAGS = {
    "height": "--height",
    "width": "--width",
    "num_frames": "--frames",
    "num_inference_steps": "--steps",
    "guidance_scale": "--guidance",
    "seed": "--seed",
    "num_images_per_prompt": "--images",
}


def dtype_for(name: str | None, device: Any) -> Any:
    import torch

    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def check_device(name: str | None) -> None:
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


def check_text(option: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"argument {option}: not valid UTF-8 text") from None


def check_shape(
    pipe: Any,
    height: Any = None,
    width: Any = None,
    frames: Any = None,
    *,
    defaults: dict[str, str] | None = None,
    **more: Any,
) -> None:
    """The arguments suit the model, by the one check ``generate()`` makes too (from the
    configs; nothing loads), with the flag's name in the message. ``defaults``: where a
    value the command line did not give came from, by ``generate()``'s argument name
    ("height": "the pipeline's default"), said beside the value it refuses."""
    try:
        check_generate_arguments(pipe, height=height, width=width, num_frames=frames, **more)
    except ArgumentError as error:
        flag = FLAGS.get(error.argument, error.argument)
        origin = (defaults or {}).get(error.argument)
        problem = error.problem
        if origin is not None:
            given = {"height": height, "width": width, "num_frames": frames, **more}
            problem = _untyped_problem(problem, given.get(error.argument), flag, origin)
        raise UsageError(f"argument {flag}: {problem}") from None


def _untyped_problem(problem: str, value: Any, flag: str, origin: str) -> str:
    """``problem`` with ``origin`` beside the refused ``value`` (the flag was not typed),
    and which flag gives another."""
    shown, count = re.subn(
        rf"(^|got ){re.escape(str(value))}\b",
        lambda found: f"{found.group(0)} ({origin})",
        problem,
        count=1,
    )
    if not count:
        shown = f"{problem} ({value} is {origin})"
    return f"{shown}; give a smaller {flag}" if "too large" in problem else f"{shown}; give {flag}"


def model_dir(args: argparse.Namespace, say: Any = print) -> tuple[Path, bool]:
    if args.model_dir is not None:  # "" is no folder, not the embedded default
        return resolve_model(args.model_dir), False
    say("ondeck: no model folder given; using the embedded default (a small Wan-architecture")
    say("        model with random weights: its output is coloured noise). For a real video,")
    say(
        "        point it at a diffusers-format checkpoint or a Hub repo id: ondeck generate "
        "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    )
    quiet_library_bars()  # the build saves through the libraries, with their bars
    path, built = embedded_module.embedded_default(say=say)
    if built:
        say(f"ondeck: built the embedded default in {path}")
    return path, True


def quiet_library_bars() -> None:
    """``ONDECK_PROGRESS=0`` hides diffusers' "Loading pipeline components" bar too, and
    transformers' loading bars (a GGUF text encoder's); the command's process is its own:
    the setting is global."""
    if os.environ.get("ONDECK_PROGRESS") == "0":
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        with contextlib.suppress(ImportError):
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()


def build_pipeline(args: argparse.Namespace, path: Path) -> Any:
    quiet_library_bars()
    device = resolve_device(args.device)
    host_cache = HostCache.from_setting(args.host_cache)
    policy = args.policy  # auto with a budget is budget, and says so
    shard = shard_names(args)
    parallel = _parallel(args)
    check_shard_names(shard, path, tuple(getattr(args, "library", None) or ()))
    check_weight_names(args, path, tuple(getattr(args, "library", None) or ()))
    check_host_memory(getattr(args, "host_memory", None))
    pipe = folder_pipelines.pipeline_for_folder(
        path,
        device=device,
        dtype=dtype_for(args.dtype, device),
        policy=policy,
        budget=args.budget,
        prefetch=not args.no_prefetch,
        host_cache=host_cache,
        **({"storage_dtype": args.weights} if getattr(args, "weights", None) else {}),
        **({"shard": shard} if shard else {}),
        **({"parallel": parallel} if parallel is not None else {}),
        **({"libraries": tuple(args.library)} if getattr(args, "library", None) else {}),
        **({"host_memory": args.host_memory} if getattr(args, "host_memory", None) else {}),
        **weight_files(args),
    )
    if "ONDECK_RESET_PEAKS" not in os.environ:
        # The command owns its process: no caller's peak figure to keep, so every stage's
        # activation peak is measured exactly (resetting torch's peak statistics per stage).
        pipe.tracker.reset_peaks = True
    return pipe


def check_host_memory(budget: int | None) -> None:
    """``--host-memory`` leaves the run some room: not at most what this process holds
    before a weight is read (every figure the plan would print after it is nothing)."""
    if not budget:
        return
    held = process_rss_bytes()
    if budget <= held:
        raise UsageError(
            f"argument --host-memory: {format_bytes(budget)} is no more than the "
            f"{format_bytes(held)} this process holds before reading a weight; give more"
        )


def check_shard_names(shard: tuple[str, ...], path: Path, libraries: tuple[str, ...]) -> None:
    """Each --shard name one of the folder's models, from model_index.json alone."""
    if not shard:
        return
    models = shardable_models(ModelFolder.open(path, libraries=libraries))
    unknown = sorted(set(shard) - set(models))
    if unknown:
        raise UsageError(
            f"--shard: cannot shard {unknown}; {path.name}'s models are {', '.join(models)}"
        )


def check_weight_names(args: argparse.Namespace, path: Path, libraries: tuple[str, ...]) -> None:
    """Each name of ``--weights NAME=...`` and ``--component NAME=FILE`` one of the
    folder's models, from model_index.json alone: a scheduler or a typo is the flag's
    error, not a failed load."""
    weights = getattr(args, "weights", None)
    named = [
        ("--weights", sorted(weights) if isinstance(weights, dict) else []),
        ("--component", [name for name, _ in getattr(args, "component", None) or ()]),
    ]
    if not any(names for _, names in named):
        return
    folder = ModelFolder.open(path, libraries=libraries)
    models = shardable_models(folder)
    for flag, names in named:
        wrong = [name for name in names if name not in models and _resolves(folder, name)]
        if wrong:
            raise UsageError(
                f"argument {flag}: {', '.join(wrong)} is not a model of {path.name} "
                f"(its models: {', '.join(models) or 'none'})"
            )


def _resolves(folder: Any, name: str) -> bool:
    """Whether model_index.json names ``name`` with a class that resolves, or not at all;
    a listed class that does not resolve is the loader's to explain."""
    if name not in folder.component_names:
        return True
    try:
        folder.component_class(name)
    except OndeckError:
        return False
    return True


def shard_names(args: argparse.Namespace) -> tuple[str, ...]:
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


def start_distributed(args: argparse.Namespace) -> bool:
    """Join torchrun's process group when sharding, splitting the sequence or launched by
    it; True when joined."""
    parallel = resolve_parallel(_parallel(args))
    if parallel is not None:
        parallel.join()  # says how to launch when this is not torchrun's process
        return True
    if not shard_names(args) and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    distributed.init()
    return True


def context_split(pipe: Any, height: int, width: int, frames: int) -> dict[str, Any] | None:
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


def call_shape(args: argparse.Namespace, media: Media, *, embedded: bool = False) -> Shape:
    """What the flags give, else the pipeline's own (None where its call computes it);
    the embedded default's small shape for the embedded default."""
    own = EMBEDDED_SHAPE if embedded else own_shape(media)
    return asked_shape(own, args.height, args.width, args.frames, args.steps)


def untyped_sizes(args: argparse.Namespace, origin: str) -> dict[str, str]:
    """``origin`` by ``generate()``'s argument name for each size flag not typed
    (``check_shape``'s ``defaults``)."""
    typed = {"height": args.height, "width": args.width, "num_frames": args.frames,
             "num_inference_steps": args.steps}  # fmt: skip
    return {name: origin for name, value in typed.items() if value is None}


def check_call(
    args: argparse.Namespace, pipe: Any, shape: Shape, media: Media, *, embedded: bool = False
) -> None:
    """The call the flags make suits the model (``check_shape``), before anything loads;
    a value not typed is said to be the pipeline's own (the ``embedded`` default's)."""
    origin = "the embedded default's" if embedded else "the pipeline's default"
    check_shape(
        pipe,
        shape.height,
        shape.width,
        shape.frames,
        defaults=untyped_sizes(args, origin),
        num_inference_steps=shape.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
        num_images_per_prompt=args.images if media.takes_count else None,
    )


def call_extra(
    args: argparse.Namespace, media: Media, image: Any, pipe: Any = None
) -> dict[str, Any]:
    """The call's arguments beyond ``call_options``: the input image under the name the
    pipeline takes it by, the image count where it makes several, and the area cap of a
    pipeline that sizes its output from one (the side not asked for is the built
    ``pipe``'s own)."""
    extra = media.image_arguments(image)
    if getattr(args, "true_cfg", None) is not None:  # a pipeline that takes it: checked
        extra["true_cfg_scale"] = args.true_cfg
    if args.images is not None and media.takes_count:
        extra["num_images_per_prompt"] = args.images
    if media.takes_max_area and (args.height is not None or args.width is not None):
        # The size asked for, not a megapixel at the shape of the sides asked for.
        shape = asked_shape(own_shape(media, pipe), args.height, args.width, None, None)
        if shape.height is not None and shape.width is not None:
            extra["max_area"] = shape.height * shape.width
    return extra


def call_options(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    """``generate``'s options for each run of the command, but its progress bar; no
    ``--guidance``: the pipeline's own guidance_scale."""
    options = dict(
        negative_prompt=args.negative_prompt,
        height=shape.height,
        width=shape.width,
        num_frames=shape.frames,
        num_inference_steps=shape.steps,
        seed=args.seed,
    )
    if args.guidance is not None:
        options["guidance_scale"] = args.guidance
    return options


def first_plan(args: argparse.Namespace, pipe: Any, shape: Shape, extra: dict) -> Any:
    """The plan the first run of the flags' call will take: of the very call on the
    diffusers path (its size, and the activations, allocator evidence and turns stored for
    a call like it), else at its size."""
    plan_call = getattr(pipe, "plan_call", None)
    if plan_call is not None:
        return plan_call(args.prompt, **call_options(args, shape), **extra)
    plan_shape = getattr(pipe, "set_plan_shape", None)
    if plan_shape is not None:  # at the call's size: its decode and stored activations
        plan_shape(height=shape.height, width=shape.width, frames=shape.frames)
    return pipe.plan()


def plan(args: argparse.Namespace) -> int:
    """The plan ``generate`` with the same flags would print before its first run."""
    check_policy_flags(args)
    weight_files(args)  # each file there, before a base is downloaded
    check_text("--prompt", args.prompt)
    check_text("--negative-prompt", args.negative_prompt)
    check_device(args.device)
    if args.more_models:
        return _plan_set(args)
    path = resolve_model(args.model_dir)
    media = media_of(path)
    check_media_flags(args, media, image_needed=False)  # a plan can be made without it
    image = read_input_image(args.image) if args.image is not None else None
    pipe = build_pipeline(args, path)
    # The sizes given are checked; the pipeline's own are planned as they are.
    check_call(args, pipe, Shape(args.height, args.width, args.frames, args.steps), media)
    shape = call_shape(args, media)
    if args.budget is None:
        print(f"ondeck: {pipe.policy.reason}")
    extra = call_extra(args, media, image, pipe)
    result = first_plan(args, pipe, shape, extra)
    print(result)
    if args.budget is not None:
        _print_storage_choices(args, path, pipe, result, (shape, extra))
    return 0 if result.fits() else 1


def _plan_set(args: argparse.Namespace) -> int:
    """Several models under one budget, as the server's residency manager plans them."""
    if args.budget is None:
        raise UsageError("argument --budget: a plan for several models needs their one budget")
    sources = [os.fspath(source) for source in (args.model_dir, *args.more_models)]
    names = [model_label(source) for source in sources]
    if len(set(names)) < len(names):  # two folders of one name: each as typed
        names = [source.rstrip("/") or source for source in sources]
    if len(set(names)) < len(names):
        raise UsageError("a model is named twice: plan each once")
    models: dict[str, ServedModel] = {}
    for name, source in zip(names, sources, strict=True):
        path = resolve_model(source)
        pipeline = build_pipeline(args, path)
        models[name] = ServedModel(name, str(path), pipeline, pipeline.policy, kind="")
    result = plan_models(models, args.budget)
    print(result)
    return 0 if all(model.fits for model in result.models.values()) else 1


def _print_storage_choices(
    args: argparse.Namespace, path: Path, pipe: Any, result: Any, call: tuple[Shape, dict]
) -> None:
    """What fits ``--budget`` with weights as they compute and with fp8 storage, for the
    flags' ``call`` (its shape and extra arguments)."""
    import copy

    computed = str(dtype_for(args.dtype, resolve_device(args.device))).removeprefix("torch.")
    print(f"what fits {format_bytes(args.budget)}, by how the weights are stored:")
    for weights in (None, "fp8"):
        label = computed if weights is None else f"fp8 ({_stored_names(pipe, weights)})"
        if weights == args.weights:
            print(f"  {label}: {result.fit_summary()}")
            continue
        other = copy.copy(args)
        other.weights = weights
        try:
            choice = build_pipeline(other, path)
            summary = first_plan(other, choice, *call).fit_summary()
            label = computed if weights is None else f"fp8 ({_stored_names(choice, weights)})"
        except OndeckError as error:
            summary = f"cannot: {first_line(error)}"
        print(f"  {label}: {summary}")


def _stored_names(pipe: Any, weights: Any) -> str:
    """The components a ``--weights`` choice stores in fp8, as the pipeline's loaders say."""
    loaders = pipeline_loaders(pipe)
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
    files = weight_files(args).get("components") or {}
    if files:
        folder = SingleFileFolder(folder, files)
    if not folder.pipeline_class_name:
        raise LoadError(
            f"{folder.path}: its model_index.json has no _class_name (the pipeline class)",
            path=str(folder.path),
        )
    print(f"{folder.path}: {folder.pipeline_class_name}")
    rows: list[tuple[str, str, str, int | None, str]] = []  # name, class, dtype, bytes, note
    for name in folder.component_names:
        if name in files:
            cls, dtype, nbytes = _single_file_facts(folder, name)
            rows.append((name, cls.__name__, dtype, nbytes, f"  from {files[name]}"))
        elif folder.is_model(name):
            spec = folder.spec(name)
            dtype = str(spec.dtype).removeprefix("torch.")
            rows.append((name, spec.cls.__name__, dtype, spec.nbytes or 0, ""))
        else:
            library, class_name = folder.model_index[name]
            rows.append((name, class_name, f"({library}, no weights)", None, ""))
    # Columns as wide as their longest entry (HunyuanVideoTransformer3DModel, say).
    named = max([16, *(len(row[0]) for row in rows)])
    classes = max([28, *(len(row[1]) for row in rows)])
    weighed = [row for row in rows if row[3] is not None]
    dtypes = max([16, *(len(row[2]) for row in weighed)])
    for name, class_name, dtype, nbytes, note in rows:
        if nbytes is None:
            print(f"  {name:<{named}} {class_name:<{classes}} {dtype}")
        else:
            size = format_bytes(nbytes)
            print(f"  {name:<{named}} {class_name:<{classes}} {dtype:<{dtypes}} {size:>12}{note}")
    total = format_bytes(sum(row[3] or 0 for row in rows))
    print(f"  {'sum':<{named}} {'':<{classes}} {'':<{dtypes}} {total:>12}")
    return 0


def _single_file_facts(folder: Any, name: str) -> tuple[type, str, int]:
    """(class, how its weights are stored, device bytes) of a component from a single
    file, as its loader would load it: float8 tensors as stored, a GGUF file through its
    library; from the file's header alone."""
    loader = component_loader(folder, name, progress=False)
    spec = loader.spec
    if isinstance(loader, QuantizedComponentLoader):
        stored = loader.method
    else:
        stored = str(loader.storage_dtype or spec.dtype)
    return spec.cls, stored.removeprefix("torch."), spec.nbytes or 0


def profiles(args: argparse.Namespace) -> int:
    """Where activation profiles live, what they hold; ``--clear`` deletes them."""
    path = profiles_path()
    store = ActivationProfiles(path, warn=False)  # what is wrong is said here, or cleared
    if args.clear:
        removed = store.clear()
        print(f"ondeck: {'deleted' if removed else 'no profiles at'} {path}")
        return 0
    print(f"ondeck: activation profiles in {path}" + ("" if path.exists() else " (none yet)"))
    if store.problem is not None:
        print(
            f"ondeck: warning: activation profiles {path}: {store.problem}; "
            "`ondeck profiles --clear` removes the file",
            file=sys.stderr,
        )
    for model, shape, stages in store.entries():
        measured = ", ".join(f"{stage} {format_bytes(n)}" for stage, n in stages.items())
        print(f"  {model}  {shape}: {measured}")
    for model, shape, evidence in store.allocator_entries():
        shown = [
            f"{stage} kept retrying in {n} run(s)" for stage, n in evidence.retried_runs.items()
        ]
        shown += [f"{stage} reached the device's limit" for stage in sorted(evidence.limit)]
        print(f"  {model}  {shape}: allocator: {', '.join(shown)}")
    for model, shape, turns in store.turn_entries():
        shown = [
            f"{name}'s turn holds {', '.join(h for h in held if h != name)}"
            for name, held in turns
            if len(held) > 1
        ]
        print(f"  {model}  {shape}: turns: {'; '.join(shown)}")
    return 0


# Short runs by default: the policies' loads and peaks, not the model's compute.
BENCH_SHAPE = Shape(height=128, width=128, frames=9, steps=2)
BENCH_POLICIES = ("eager", "release", "budget")


def bench(args: argparse.Namespace) -> int:
    """Each policy on the same folder, runs back to back: time, peak resident, bytes loaded."""
    check_device(args.device)
    image = read_input_image(args.image) if args.image is not None else None
    path, _ = model_dir(args)
    media = media_of(path)
    if args.frames is not None and not media.video:
        raise UsageError(f"argument --frames: {media.pipeline_class} makes images, not a video")
    check_input_image(args.image, media)
    shape = asked_shape(BENCH_SHAPE, args.height, args.width, args.frames, args.steps)
    if not media.video:
        shape.frames = None
    defaults = untyped_sizes(args, "bench's default")
    extra = media.image_arguments(image)
    if media.takes_max_area:  # Flux Kontext sizes its output from an area, not the sides
        extra["max_area"] = shape.height * shape.width
    rows = []
    for policy in BENCH_POLICIES:
        pipe = build_pipeline(_bench_namespace(args.device, policy), path)
        try:
            # Before anything loads, naming the flag.
            check_shape(pipe, shape.height, shape.width, shape.frames, defaults=defaults,
                        num_inference_steps=shape.steps)  # fmt: skip
            seconds = _bench_runs(pipe, policy, args.runs, shape, extra)
        finally:
            pipe.release_all()
        rows.append((policy, seconds, pipe.tracker.peak_resident_bytes, pipe.tracker.bytes_loaded))
    print(f"{'policy':<10} {'run 1':>8} {'last run':>9} {'peak resident':>14} {'loaded':>12}")
    for policy, seconds, peak, loaded in rows:
        print(
            f"{policy:<10} {seconds[0]:>7.2f}s {seconds[-1]:>8.2f}s "
            f"{format_bytes(peak):>14} {format_bytes(loaded):>12}"
        )
    return 0


def _bench_namespace(device: str | None, policy: str) -> argparse.Namespace:
    """``build_pipeline``'s flags for one policy of ``bench``: the folder's own dtype and
    weights, no budget, prefetch on, no host cache."""
    return argparse.Namespace(
        device=device, dtype=None, policy=policy, budget=None, no_prefetch=False, host_cache=None
    )


def _bench_runs(pipe: Any, policy: str, runs: int, shape: Shape, extra: dict) -> list[float]:
    """Each run's seconds, every run at seed 0; the steps' bar as ``generate``'s is shown
    (none under ``ONDECK_PROGRESS=0``), the pipeline's own off."""
    from tqdm import tqdm

    quiet = os.environ.get("ONDECK_PROGRESS") == "0"
    seconds = []
    for run in range(runs):
        label = f"{policy} run {run + 1}/{runs} denoising"
        with tqdm(total=shape.steps, desc=label, unit="step", disable=quiet) as bar:
            started = time.perf_counter()
            pipe.generate(
                "bench",
                height=shape.height,
                width=shape.width,
                num_frames=shape.frames,
                num_inference_steps=shape.steps,
                seed=0,
                progress=bar,
                **extra,
            )
            seconds.append(time.perf_counter() - started)
    return seconds


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
