"""``ondeck generate``: build the pipeline, run it, and write what it made.

On disk, in order: ``report.json``, ``timeline.png``, then ``video.mp4`` (a video
pipeline) or ``image.png`` / ``image-N.png`` (an image pipeline), each complete or
not there. Frames that cannot be written, or are not finite, are kept as
``frames.npy`` and fail the command with one line. One run at a time holds the
output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

# write_video, write_images and embedded_default are called through their modules,
# where tests replace them.
from .. import distributed, output
from ..arguments import MAX_BATCH
from ..errors import BudgetError
from ..hub import model_label
from ..interrupt import stop_at_once_when_asked_again
from ..memory import format_bytes, freeze_what_lives
from ..output import OutputError, atomic_path, check_writable_folder, write_frames, write_json
from ..parallel import describe_split
from . import commands
from .budget_hint import fitting_hint, fp8_would_shrink
from .finite import FiniteWatch
from .media import Media, check_media_flags, media_of, read_input_image
from .options import UsageError, check_policy_flags, weight_files
from .shape import Shape

OUTPUT_NAMES = ("report.json", "timeline.png", "video.mp4", "frames.npy", "image.png")
EMBEDDED_MODELS = {"text_encoder", "transformer", "vae"}


def generate(args: argparse.Namespace) -> int:
    stop_at_once_when_asked_again()
    _check_flags(args)
    out = Path(args.output)
    # Every rank runs every stage on the same inputs; rank 0 alone prints and writes.
    joined = commands.start_distributed(args)
    main = distributed.is_main()
    created = next((f for f in (out, *out.parents) if f.parent.exists()), None)
    created = created if main and not out.exists() else None
    if main:  # before any work: a run that cannot write its result is not started
        images = min(args.images or 1, MAX_BATCH)  # a count past it is refused later
        if out.exists() and not out.is_dir():
            raise UsageError(f"argument --output: {out} is a file; give a folder")
        under = next((f for f in out.parents if f.exists()), None)
        if under is not None and not under.is_dir():
            raise UsageError(f"argument --output: {under} is a file; {out} cannot be a folder")
        check_writable_folder(out, (*OUTPUT_NAMES, *output.image_names(images)))
    holding = output.holding_folder(out) if main else contextlib.nullcontext()
    try:
        with holding:
            return _generate(args, out, joined, main)
    except BaseException:
        _remove_created(out, created)
        raise


def _remove_created(out: Path, created: Path | None) -> None:
    """The folders this command made for its output (``created``, the outermost), where
    it failed before writing anything in them."""
    folder = out
    while created is not None:
        try:
            folder.rmdir()
        except OSError:  # not empty, or not there
            return
        if folder == created:
            return
        folder = folder.parent


def _check_flags(args: argparse.Namespace) -> None:
    check_policy_flags(args)
    weight_files(args)  # each file there, before a base is downloaded or built
    commands.check_text("--prompt", args.prompt)
    commands.check_text("--negative-prompt", args.negative_prompt)
    commands.check_device(args.device)
    shard = commands.shard_names(args)
    unknown = sorted(set(shard) - EMBEDDED_MODELS)
    if unknown and args.model_dir is None:
        raise UsageError(
            f"argument --shard: cannot shard {unknown}; the embedded default's models are "
            "text_encoder, transformer, vae"
        )
    if args.model_dir is not None and Path(args.model_dir).expanduser().is_dir():
        # Before joining the ranks: a repo id's models are checked once it is found.
        libraries = tuple(args.library or ())
        commands.check_shard_names(shard, Path(args.model_dir).expanduser(), libraries)
    if args.context_parallel is not None and args.parallel is not None:
        raise UsageError("give --context-parallel N or --parallel context, not both")


def _given_files(args: argparse.Namespace) -> dict[str, Any]:
    """The single files and LoRAs the flags gave, as report.json holds them."""
    given = weight_files(args)
    where = {name: _absolute(file) for name, file in given.get("components", {}).items()}
    return {
        "components": where,
        "loras": [[_absolute(file), scale] for file, scale in given.get("loras", [])],
    }


def _absolute(file: Any) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(file)))


def _generate(args: argparse.Namespace, out: Path, joined: bool, main: bool) -> int:
    say = print if main else (lambda *_, **__: None)
    image = read_input_image(args.image) if args.image is not None else None
    with distributed.main_first():  # rank 0 builds the embedded default, if needed, alone
        path, embedded = commands.model_dir(args, say)
    media = media_of(path)
    check_media_flags(args, media)  # before the pipeline is built: nothing loads
    pipe = commands.build_pipeline(args, path)
    shape = commands.call_shape(args, media, embedded=embedded)
    commands.check_call(args, pipe, shape, media, embedded=embedded)
    split = commands.context_split(pipe, shape.height, shape.width, shape.frames)
    say(f"ondeck: {pipe.policy.reason}")
    pipe.more_runs = args.runs > 1  # the plan shown is the first run's
    files = _given_files(args)  # as checked before the runs: not checked again after
    extra = commands.call_extra(args, media, image, pipe)
    plan = commands.first_plan(args, pipe, shape, extra)
    say(plan)
    if split is not None:
        say(f"ondeck: {describe_split(split, pipe.component_bytes())}")
    watch = FiniteWatch()
    watch.attach(pipe)
    try:
        frames, timings, bad_stage = _run_all(args, pipe, shape, extra, watch, main)
    except BudgetError as error:
        fp8 = fp8_would_shrink(pipe, error.plan, args.weights)
        raise fitting_hint(error, video=media.video, fp8=fp8) from error
    report = pipe.report()
    report.update(
        model_dir=str(path),
        embedded_default=embedded,
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        seed=args.seed,  # every run's
        policy_reason=pipe.policy.reason or None,  # auto's choice and why
        guidance=args.guidance,  # None: the pipeline's own
        true_cfg=getattr(args, "true_cfg", None),
        images=args.images,
        dtype=args.dtype,  # None: not given (bf16 on CUDA, float32 elsewhere)
        files=files,
        shape={"height": shape.height, "width": shape.width, "frames": shape.frames,
               "steps": shape.steps},
        run_seconds=timings,
        sum_bytes=sum(v or 0 for v in report["component_bytes"].values()),
        predicted_peak_bytes=plan.peak_bytes,
        weights=args.weights or "as computed",
        output={"kind": "video" if media.video else "images", "pipeline": media.pipeline_class,
                **({"fps": args.fps or media.fps,
                    "fps_from": "--fps" if args.fps else media.fps_from} if media.video else {}),
                # As a path from anywhere: the report runs the same command again.
                "input_image": args.image and str(Path(args.image).expanduser().resolve()),
                "finite": bad_stage is None},
    )  # fmt: skip
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
    fps = args.fps or media.fps
    shown = path.name if args.model_dir is None else model_label(args.model_dir)
    title = f"ondeck {pipe.policy.name}: {shown}"
    code = write_results(out, report, pipe, frames, media, fps, title=title, bad_stage=bad_stage)
    if embedded and code == 0:
        print(
            "ondeck: what you see is the embedded default's random weights decoding seeded "
            "noise into colour blotches, not the prompt; give a real model for a real video"
        )
    return code


def _run_all(
    args: argparse.Namespace, pipe: Any, shape: Shape, extra: dict, watch: FiniteWatch, main: bool
) -> tuple[Any, list[float], str | None]:
    """Every run; stops at the first whose frames are not finite, naming its stage."""
    import numpy as np
    from tqdm import tqdm

    timings: list[float] = []
    frames = None
    # The pipeline outlives every run: no run rescans it. One run ends the process, and
    # what setting up left for the collector can wait for that.
    freeze_what_lives(collect=args.runs > 1)
    for run in range(args.runs):
        watch.reset()
        pipe.more_runs = run + 1 < args.runs  # nothing is loaded ahead after the last
        started = time.perf_counter()
        label = f"run {run + 1}/{args.runs} denoising"
        quiet = not main or os.environ.get("ONDECK_PROGRESS") == "0"
        with tqdm(total=shape.steps, desc=label, unit="step", disable=quiet) as bar:
            try:
                frames = pipe.generate(
                    args.prompt,
                    **commands.call_options(args, shape),
                    progress=bar,
                    # Only rank 0 writes the video; the others decode only when sharing the VAE.
                    output_type="np" if main or "vae" in commands.shard_names(args) else "latent",
                    **extra,
                )
            except BudgetError as error:
                if run or not main or error.plan is None:
                    raise  # a later run's plan is not the one printed: it comes with it
                # The first run's plan is printed above: its own line, not the plan again.
                raise BudgetError(str(error).split("\n", 1)[0], plan=error.plan) from error
        timings.append(time.perf_counter() - started)
        if main and not np.isfinite(np.asarray(frames, dtype=np.float32)).all():
            return frames, timings, watch.first_bad_stage(pipe)
    return frames, timings, None


def write_results(
    out: Path,
    report: dict,
    pipe: Any,
    frames: Any,
    media: Media,
    fps: float,
    *,
    title: str,
    bad_stage: str | None = None,
) -> int:
    """report.json and the timeline first, then the video or images; each renamed into
    place. Frames that cannot be written, or are not finite, are kept as frames.npy
    and fail the command. report.json is then written again with the outcome: the files
    written (``output.files``), or the error and where the frames are kept."""
    earlier = output.earlier_results(out)  # before this run's report replaces its report
    pixels = frames[0] if media.video else _images(frames)
    names = ["video.mp4"] if media.video else output.image_names(len(pixels))
    report.setdefault("output", {})["pending"] = output.pending_results(out, earlier, names)
    report_path = write_json(out / "report.json", report)
    plot_path = out / "timeline.png"
    written = [report_path]
    if draw_timeline(pipe, plot_path, title):
        written.append(plot_path)
    else:  # an earlier run's timeline would pass for this run's
        plot_path.unlink(missing_ok=True)
    try:
        if bad_stage is not None:
            raise OutputError(
                f"the output is not finite (NaN or infinity), so it is not written; the "
                f"first stage whose output was not finite: {bad_stage}"
            )
        if media.video:
            results = [output.write_video(out / "video.mp4", pixels, fps=fps)]
        else:
            results = output.write_images(out, pixels, earlier=earlier)
    except OutputError as error:
        print(f"ondeck: wrote {_shown(written)}")
        # A result is written whole or not at all: none of this run's is in the folder.
        outcome = {"error": str(error), "pending": sorted(earlier)}
        try:
            kept = write_frames(out / "frames.npy", pixels)
        except OutputError as second:
            _record_outcome(report_path, report, {**outcome, "frames_kept": None})
            raise OutputError(f"{error}; keeping the frames failed too ({second})") from error
        _record_outcome(report_path, report, {**outcome, "frames_kept": kept.name})
        raise OutputError(f"{error}; the frames are kept in {kept} (numpy.load)") from error
    (out / "frames.npy").unlink(missing_ok=True)  # an earlier run's, kept when it failed
    # An image beside this video, or the reverse: those an earlier run wrote.
    output.remove_earlier_results(out, results, earlier=earlier)
    del report["output"]["pending"]  # every result is in place, an earlier run's gone
    if not _record_outcome(report_path, report, {"files": [path.name for path in results]}):
        written.remove(report_path)  # the first one stays, listing no files: not this run's
    print(f"ondeck: wrote {_shown([*results, *written])}")
    return 0


def _record_outcome(path: Path, report: dict, outcome: dict) -> bool:
    """report.json again, its ``output`` saying what became of the results; whether it
    was written. Where that write fails, the first report.json stays (it lists no files)
    and a warning says so."""
    report.setdefault("output", {}).update(outcome)
    try:
        write_json(path, report)
    except OutputError as error:
        warnings.warn(f"{error}; it does not say what was written", RuntimeWarning, stacklevel=3)
        return False
    return True


def _shown(paths: list[Path]) -> str:
    """Paths to print: a name that is not valid UTF-8 is shown escaped, not a failure."""
    text = ", ".join(map(str, paths))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _images(frames: Any) -> Any:
    """B×1×H×W×C one-frame videos (how ``generate`` returns images) as B×H×W×C."""
    import numpy as np

    frames = np.asarray(frames)
    return frames[:, 0] if frames.ndim == 5 else frames


def draw_timeline(pipe: Any, path: Path, title: str) -> bool:
    """The timeline PNG, or a warning: a plot that fails never costs the frames."""
    try:
        with atomic_path(path) as temporary:
            pipe.tracker.plot(temporary, title=title, budget_bytes=pipe.policy.budget_bytes)
        return True
    except Exception as error:  # matplotlib's failures are of every kind
        warnings.warn(
            f"could not draw {path} ({type(error).__name__}: "
            f"{commands.first_line(error)}); the results are written without it",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


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
