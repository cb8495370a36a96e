"""The server's state: the served models, the residency manager, the queue, the outputs.

No HTTP here: ``app.py`` puts an ASGI app in front of a ``Server``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import folder_pipelines
from ..arguments import MAX_SEED, ArgumentError, check_generate_arguments, shape_rule
from ..cli.media import FALLBACK_FPS, Media, media_of
from ..cli.shape import EMBEDDED_SHAPE, own_shape
from ..embedded import default_cache_dir
from ..errors import BudgetError, LoadError, OndeckError
from ..hub import resolve_model
from ..loading import HostCache
from ..memory import format_bytes, resolve_device
from ..policy import BudgetPolicy, device_budget_bytes
from .jobs import Job, JobCancelled, JobFailed, JobQueue
from .outputs import OutputStore, draw_timeline, timeline_view, write_job_files
from .residency import ResidencyManager, ServedModel

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class Limits:
    """What a request may ask for; larger asks are refused before they are queued."""

    body_bytes: int = 8 * 2**20
    image_bytes: int = 4 * 2**20
    image_pixels: int = 4096 * 4096
    prompt_chars: int = 4000
    side: int = 2048
    frames: int = 241
    steps: int = 200
    images_per_request: int = 4
    waiting_jobs: int = 64


@dataclass
class ServeConfig:
    models: dict[str, str]
    budget_bytes: int | None = None
    device: str | None = None
    dtype: str | None = None
    host_cache_bytes: int | str | None = None  # "auto": an elastic cache
    weights: Any = None
    outputs: Path | None = None
    outputs_cap_bytes: int = 20 * 2**30
    api_key: str | None = None
    steps: int | None = None
    shutdown_grace_seconds: float = 30.0
    # Whether the queue steers residency: eviction by the waiting jobs' next use, and the
    # next job's first components loaded beside the current decode. Off: least recently
    # used, nothing ahead (what the benchmark compares against).
    lookahead: bool = True
    # Put into every job id: which server, of several behind one balancer, holds a job.
    instance: str | None = None
    limits: Limits = field(default_factory=Limits)
    # The name of the model served as the embedded default (no model given): a request
    # naming no shape gets its small one, as `ondeck generate` with no model asks.
    embedded: str | None = None
    # By model name: the single files (``components``) and LoRAs (``loras``) its pipeline
    # takes, as ``ondeck.diffusers.from_pretrained`` takes them.
    brought: dict[str, dict[str, Any]] = field(default_factory=dict)


def models_from_root(root: str | os.PathLike) -> dict[str, str]:
    """Each subfolder of ``root`` holding a model_index.json is a model, by its name."""
    root = Path(root)
    if not root.is_dir():
        raise OndeckError(f"--model-root {root}: not a folder")
    found = {
        path.name: str(path)
        for path in sorted(root.iterdir())
        if (path / "model_index.json").is_file() and MODEL_NAME.match(path.name)
    }
    if not found:
        raise OndeckError(f"--model-root {root}: no subfolder holds a model_index.json")
    return found


def _torch_dtype(name: str | None, device: Any) -> Any:
    import torch

    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def check_inputs(media: Media) -> None:
    """``OndeckError`` for a pipeline that needs an input no request can give it: a
    second input beside its image (a mask, a control image). Its image comes with the
    request (a video's ``input_reference``, an image edit's ``image``)."""
    if media.other_input is not None:
        raise OndeckError(
            f"{media.pipeline_class} needs a {media.other_input} besides its image, which "
            "no request to ondeck serve can give; call the pipeline from Python "
            "(ondeck.diffusers.from_pretrained)"
        )


class StepProgress:
    """What a pipeline advances once per denoising step: counts the job's steps, stops a
    cancelled job there, and starts the next job's loads at the last step."""

    def __init__(self, job: Job, at_last_step: Any):
        self.job = job
        self.at_last_step = at_last_step

    def update(self, n: int = 1) -> None:
        if self.job.cancel_event.is_set():
            raise JobCancelled(self.job.id)
        self.job.step += n
        if self.job.step >= self.job.total_steps:
            self.at_last_step()


# How long a stop waits past the running job's grace for the step it is in, and how long
# the server keeps answering after a job that completed while it stopped.
STOP_MARGIN_SECONDS = 10.0
LINGER_SECONDS = 5.0


class Server:
    """Holds the served models under one budget and runs their jobs in order."""

    def __init__(self, config: ServeConfig, *, say: Any = print):
        self.config = config
        self.say = say
        most = config.limits.steps
        if config.steps is not None and not 0 < config.steps <= most:
            # Every request naming no steps would be refused with steps past the limit.
            raise OndeckError(
                f"steps must be from 1 to {most} (a request's limit), got {config.steps}"
            )
        self.device = resolve_device(config.device)
        self.dtype = _torch_dtype(config.dtype, self.device)
        budget = config.budget_bytes
        # At least one byte: a budget of none plans, and each plan refuses its job.
        self.budget_bytes = (
            device_budget_bytes(self.device) if budget is None else max(int(budget), 1)
        )
        self.host_cache = HostCache.from_setting(config.host_cache_bytes)
        outputs = config.outputs or default_cache_dir() / "serve-outputs"
        self.outputs = OutputStore(outputs, config.outputs_cap_bytes)
        self.started_at = time.time()
        self.models: dict[str, ServedModel] = {}
        for name, source in config.models.items():
            self.models[name] = self._build(name, source)
        self.manager = ResidencyManager(self.models, self.budget_bytes)
        self.manager.plan()  # here, before any job runs: the status only reads it
        self.queue = JobQueue(
            self._run_job, max_waiting=config.limits.waiting_jobs, told=self._tell_ended
        )
        for job in recovered_jobs(self.outputs):  # an earlier server's, on the same folder
            self.queue.adopt(job)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ondeck-serve-writer")
        self._writing: set[str] = set()
        self._drawing = threading.Lock()
        self._grace_timer: threading.Timer | None = None
        self._stopping_since = 0.0
        # Set when the running job's grace is over: a caller waiting on it is answered
        # then, not when the job reaches its next step (which may come after the HTTP
        # server has stopped waiting for its answer).
        self.grace_over = threading.Event()
        self.last_report: dict[str, Any] | None = None
        self.last_job_id: str | None = None

    def _build(self, name: str, source: str) -> ServedModel:
        if not MODEL_NAME.match(name):
            raise OndeckError(
                f"model name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)"
            )
        path = resolve_model(source)
        policy = BudgetPolicy(self.budget_bytes)
        brought = self.config.brought.get(name, {})
        try:
            pipeline = folder_pipelines.pipeline_for_folder(
                path,
                device=self.device,
                dtype=self.dtype,
                policy=policy,
                host_cache=self.host_cache,
                **({"storage_dtype": self.config.weights} if self.config.weights else {}),
                **brought,
            )
        except LoadError as error:
            if not brought:
                raise
            # Which model a file given for one failed for.
            raise LoadError(f"model {name!r}: {error}", path=error.path) from error
        media = media_of(Path(path))  # what it makes and takes, as `ondeck generate` reads it
        try:  # a model every job of which would fail is refused at start
            folder_pipelines.check_requirements(pipeline)
            check_inputs(media)
        except OndeckError as error:
            raise OndeckError(f"model {name!r} ({source}): {error}") from None
        # Each job's timeline and report are its own: the tracker keeps the job's runs
        # (``_run`` counts them: an image job runs once for each image).
        # The residency manager releases a model's components to make room for another.
        pipeline.released_between_runs = True
        pipeline.tracker.keep_runs = 1
        pipeline.tracker.reset_peaks = True  # the server owns its process's peak counters
        served = ServedModel(
            name=name,
            source=str(source),
            pipeline=pipeline,
            policy=policy,
            kind="video" if media.video else "image",
            fps=media.fps,
            fps_from=media.fps_from,
            takes_image=media.takes_image,
            needs_image=media.needs_image,
            image_argument=media.image_argument or "image",
            takes_max_area=media.takes_max_area,
            own_shape=EMBEDDED_SHAPE
            if name == self.config.embedded
            else own_shape(media, pipeline),
        )
        served.path = Path(path)  # type: ignore[attr-defined]
        return served

    def _tell_ended(self, job: Job) -> None:
        """One line in the server's log for each job that ends: done, or why not."""
        if job.status == "completed":
            seconds = f" in {job.run_seconds:.1f} s" if job.run_seconds is not None else ""
            self.say(f"ondeck: job {job.id} ({job.model}) done{seconds}")
        elif job.error is not None:
            error = job.error
            self.say(f"ondeck: job {job.id} ({job.model}) {error.code}: {error.message}")

    @property
    def jobs_run(self) -> int:
        """Jobs that completed: run, and their files written."""
        return self.queue.ended["completed"]

    @property
    def jobs_failed(self) -> int:
        """Jobs that ended failed, however: in their run, cancelled (waiting or
        running), or waiting when the server stopped."""
        return self.queue.ended["failed"]

    def job_in_hand(self) -> Job | None:
        """The job the device thread runs, else the last one it ran while its files are
        still being written; None when there is neither."""
        job = self.queue.current or self.queue.last_finished
        return job if job is not None and not job.finished else None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.queue.start()

    def begin_shutdown(self) -> None:
        """Waiting jobs fail now; the running one gets the grace period to finish, then
        is stopped at its next step."""
        if self._grace_timer is not None:
            return
        self._stopping_since = time.monotonic()
        self.queue.close()
        current = self.queue.current

        def grace_over() -> None:
            if current is not None:
                current.cancel("stopped by shutdown")
            self.grace_over.set()

        self._grace_timer = threading.Timer(self.config.shutdown_grace_seconds, grace_over)
        self._grace_timer.daemon = True
        self._grace_timer.start()

    def stop(self) -> bool:
        """``begin_shutdown``, then wait for the running job and the files being written,
        and close every pipeline. A step cannot be cut short: where the running job is
        still in one ``STOP_MARGIN_SECONDS`` after its grace, nothing more is waited for
        or closed, and False says so."""
        self.begin_shutdown()
        job = self.job_in_hand()
        deadline = self._stopping_since + self.config.shutdown_grace_seconds
        left = deadline + STOP_MARGIN_SECONDS - time.monotonic()
        if job is not None and not job.done_event.wait(max(0.0, left)):
            return False
        # What the device thread does after a job (freeing, measuring) has the margin again.
        self.queue.stop(timeout=STOP_MARGIN_SECONDS)
        self._grace_timer.cancel()
        if self.queue.busy:
            return False
        self._writer.shutdown(wait=True)
        self.manager.wait_for_prefetch()
        for model in self.models.values():
            model.pipeline.close()
        return True

    # -- jobs -----------------------------------------------------------------------

    def default_steps(self, model: ServedModel) -> int | None:
        """``--steps``, else the pipeline's own (None: its call computes them)."""
        if self.config.steps is not None:
            return self.config.steps
        return model.own_shape.steps

    def frames_for(self, model: ServedModel, seconds: str | None, frames: int | None) -> int | None:
        """A job's frame count: ``frames`` as asked (``check_shape`` refuses a count the
        model does not take), else ``seconds`` at the model's frame rate, fitted to the
        counts its VAE takes (step·k+1 frames), else the pipeline's own count, as a local
        run makes it, at most the frames limit allows (None: the call computes it)."""
        if frames is not None:
            return frames
        step = shape_rule(model.pipeline).frame_step or 1
        most = self.config.limits.frames
        if seconds is None:
            own = model.own_shape.frames
            return own if own is None or own <= most else (most - 1) // step * step + 1
        try:
            duration = float(seconds)
        except ValueError:
            raise JobFailed(
                400, "invalid_value", f"seconds {seconds!r} is not a number", "seconds"
            ) from None
        # First where no seconds fit: a range of them would name lengths that never do.
        if (most - 1) // step < 1:
            raise JobFailed(
                400,
                "invalid_value",
                f"the shortest {model.name} video seconds asks for is {step + 1} frames, past "
                f"this server's limit of {most}: ask for frames, not seconds",
                "seconds",
            )
        longest = (most - 1) / model.fps
        if not 0 < duration <= longest:
            raise JobFailed(
                400,
                "invalid_value",
                f"seconds must be more than 0 and at most {longest:g} ({model.name} makes "
                f"{model.fps:g} frames a second)",
                "seconds",
            )
        intervals = max(1, min(round(duration * model.fps / step), (most - 1) // step))
        return intervals * step + 1

    def check_shape(self, model: ServedModel, job: Job, *, own_size: bool = False) -> None:
        """Refuse, before queueing, a shape the model cannot take: sides that are not a
        multiple of what its VAE and patches divide, frames its VAE does not take
        (``ondeck.arguments``, as ``generate`` checks them), and Wan's rotary positions.
        Other inputs the pipeline checks when the job runs. ``own_size``: the request
        named no size, the job's is the model's own (the error says so)."""
        try:
            check_generate_arguments(
                model.pipeline, height=job.height, width=job.width, num_frames=job.frames
            )
        except ArgumentError as error:
            param = "frames" if error.argument == "num_frames" else "size"
            own = (
                f" ({job.model}'s own size: ask for another)"
                if own_size and param == "size"
                else ""
            )
            raise JobFailed(400, "invalid_value", f"{error}{own}", param) from None
        geometry = getattr(model.pipeline, "geometry", None)
        if geometry is None or job.height is None or job.width is None:
            return
        for side, value, why in geometry.beyond_positions(job.height, job.width, job.frames or 1):
            param = "frames" if side == "frames" else "size"
            raise JobFailed(
                400, "invalid_value", f"{side} {value} is too large for {job.model}: {why}", param
            )

    def submit(self, job: Job) -> Job:
        job.total_steps = (job.steps or 0) * (job.n if job.kind == "image" else 1)
        return self.queue.submit(job)

    def _run_job(self, job: Job, upcoming: list[str]) -> None:
        started = time.perf_counter()
        try:
            self._run(job, upcoming)
        finally:
            job.memory_after = self._memory_after()
            # All the device thread spent on the job: making room, the run, and the wait
            # for what loaded ahead beside it (a switch's cost, wherever it fell).
            job.device_seconds = time.perf_counter() - started
            # The set's plan takes in the job's measurements while its output is written
            # on the writer thread, not before: the client waits for the files, not this.
            started = time.perf_counter()
            self.manager.finished(job.model)
            job.plan_seconds = time.perf_counter() - started

    def _memory_after(self) -> dict[str, int | None]:
        """What the server holds once a job is over, and what was loading ahead of the
        next job has landed: device bytes allocated, the served weights' bytes, the
        process's RSS. Allocated less resident is what no served weight explains."""
        self.manager.wait_for_prefetch()
        return {
            "device_allocated_bytes": _allocated(self.device),
            "resident_bytes": self.manager.resident_bytes(),
            "process_rss_bytes": _rss(),
        }

    def _run(self, job: Job, upcoming: list[str]) -> None:
        model = self.models[job.model]
        pipeline = model.pipeline
        if not job.start():  # cancelled between the queue and here
            return
        job.started_at = time.perf_counter()
        lookahead = self.config.lookahead
        try:
            self.manager.prepare(job.model, upcoming if lookahead else [])
            # What stayed from earlier jobs (or loaded ahead): the job's own events hold
            # no load of it, and its timeline draws it from the start.
            resident_at_start = dict(pipeline.tracker.resident)

            def at_last_step() -> None:
                waiting = self.queue.upcoming_models()
                if lookahead and waiting:
                    self.manager.prefetch_ahead(job.model, waiting[0])

            progress = StepProgress(job, at_last_step)
            plan = pipeline.plan(model.policy.budget_bytes)
            started = time.perf_counter()
            outputs = []
            for index in range(job.n if job.kind == "image" else 1):
                # The report and timeline hold the job's runs, every image's, and none
                # of an earlier job's.
                pipeline.tracker.keep_runs = index + 1
                outputs.append(
                    pipeline.generate(
                        job.prompt,
                        negative_prompt=job.negative_prompt,
                        height=job.height,
                        width=job.width,
                        num_inference_steps=job.steps,
                        # One seed after another, back to 0 past the largest.
                        seed=(job.seed + index) % (MAX_SEED + 1),
                        progress=progress,
                        **asked_beyond_defaults(job, model),
                    )
                )
            job.run_seconds = time.perf_counter() - started
            frames = outputs if job.kind == "image" else outputs[0]
            self._check_finite(frames)
            _fill_shape(job, outputs[0], model.fps)
            if job.cancel_event.is_set():  # cancelled during the decode: nothing is written
                raise JobCancelled(job.id)
        except Exception as error:
            # What the model held is freed before the job answers: its caller's next
            # request finds the server as it was before.
            self._after_failure(model)
            if isinstance(error, JobCancelled):
                failure = JobFailed(
                    409, "cancelled", f"the job was {job.cancel_reason} at step {job.step}"
                )
            else:
                failure = error if isinstance(error, JobFailed) else describe_failure(error)
            job.fail(failure)
            return
        finally:
            job.input_image = None  # a kept job keeps no request payload
        report = self._report(job, model, plan.peak_bytes, resident_at_start)
        self.last_report = report
        self.last_job_id = job.id
        self._writing.add(job.id)
        self._writer.submit(self._write, job, report, frames, model)

    def _report(
        self, job: Job, model: ServedModel, predicted_peak: int, resident_at_start: dict
    ) -> dict:
        """The job's report.json: the pipeline's report and what a local run's adds."""
        report = model.pipeline.report()
        tracker = model.pipeline.tracker
        report.update(
            # The job's own, from the runs the tracker keeps (``keep_runs``): not the
            # totals since the server started.
            exposed_load_seconds=tracker.exposed_load_seconds(),
            peak_measured_bytes=max((e.measured_bytes or 0 for e in tracker.events), default=0),
            model=job.model,
            model_dir=str(model.path),  # type: ignore[attr-defined]
            prompt=job.prompt,
            shape={
                "height": job.height,
                "width": job.width,
                "frames": job.frames,
                "steps": job.steps,
            },
            seed=job.seed,
            n=job.n,
            created_at=job.created_at,
            run_seconds=[job.run_seconds],
            sum_bytes=sum(v or 0 for v in report["component_bytes"].values()),
            predicted_peak_bytes=predicted_peak,
            resident_at_start=resident_at_start,
            weights=self.config.weights or "as computed",
            server_budget_bytes=self.budget_bytes,
            job_budget_bytes=model.policy.budget_bytes,
            output={  # as a local run's report says it
                "kind": "video" if model.kind == "video" else "images",
                **({"fps": model.fps, "fps_from": model.fps_from} if model.kind == "video" else {}),
            },
        )
        return report

    def _write(self, job: Job, report: dict, frames: Any, model: ServedModel) -> None:
        try:
            started = time.perf_counter()
            folder = self.outputs.folder(job.id)
            job.files = write_job_files(folder, report, frames, kind=model.kind, fps=model.fps)
            job.write_seconds = time.perf_counter() - started
            if not job.complete_unless_cancelled():  # cancelled while written: they go
                self.outputs.remove(job.id)
                job.files = {}
                job.fail(JobFailed(409, "cancelled", f"the job was {job.cancel_reason} at its end"))
        except Exception as error:
            job.fail(JobFailed(500, "output_failed", f"writing the job's files failed: {error}"))
            self.outputs.remove(job.id)
        finally:
            try:
                # The job just written stays until the next one: its client is about to
                # read it. Trimmed before the job stops counting as written: whoever
                # waits for the writing to end finds the folder within its cap.
                self.outputs.trim(keep={*self._writing, job.id})
            finally:
                self._writing.discard(job.id)

    def timeline(self, job: Job) -> str | None:
        """The path of the job's timeline.png, drawn now if it was not yet; None when
        the job has none (not completed, or its folder went past the cap)."""
        with self._drawing:
            if "timeline" in job.files or "report" not in job.files:
                return job.files.get("timeline")
            # Drawn from report.json, which holds the job's events: nothing of a finished
            # job stays in memory for a timeline that may never be asked for.
            try:
                report = json.loads(Path(job.files["report"]).read_text())
            except (OSError, ValueError):
                return None
            title = f"ondeck serve: {job.model} ({job.id[:12]})"
            folder = Path(job.files["report"]).parent
            path = str(draw_timeline(folder, timeline_view(report), title=title))
            # A new dict, never the one a route may be reading on another thread.
            job.files = {**job.files, "timeline": path}
            # The plot grows the folder: back towards its cap, this job's and the newest
            # kept (a timeline asked of an older job must not take the newest's results).
            self.outputs.trim(keep={*self._writing, job.id}, keep_newest=True)
            return path

    @staticmethod
    def _check_finite(frames: Any) -> None:
        import numpy as np

        for batch in frames if isinstance(frames, list) else [frames]:
            if not np.isfinite(np.asarray(batch)).all():
                raise JobFailed(
                    500,
                    "non_finite_output",
                    "the pipeline produced NaN or infinite pixels; nothing was written",
                )

    def _after_failure(self, model: ServedModel) -> None:
        """A failed job frees what its model holds (a run that raised has released it
        already; one whose output was refused has not), and the allocator's cache, so
        the next job starts from no more than the server held before."""
        self.manager.wait_for_prefetch()
        model.pipeline.release_all()
        gc.collect()
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    # -- reading --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        current = self.queue.current
        residency = self.manager.status()
        return {
            "object": "ondeck.status",
            "device": str(self.device),
            "budget_bytes": self.budget_bytes,
            "budget": format_bytes(self.budget_bytes),
            "resident_bytes": residency["resident_bytes"],
            "device_allocated_bytes": _allocated(self.device),
            "process_rss_bytes": _rss(),
            "resident": residency["resident"],
            "evictions": residency["evictions"],
            "prefetched": residency["prefetched"],
            "models": {
                name: {
                    "kind": model.kind,
                    "source": model.source,
                    "component_bytes": model.pipeline.component_bytes(),
                    "policy_budget_bytes": model.policy.budget_bytes,
                }
                for name, model in self.models.items()
            },
            "running": job_summary(current) if current is not None else None,
            "queue": [job_summary(job) for job in self.queue.waiting()],
            "jobs_run": self.jobs_run,
            "jobs_failed": self.jobs_failed,
            "jobs_cancelled": self.queue.ended["cancelled"],
            "last_job": {"id": self.last_job_id, "report": _brief(self.last_report)},
            "plan": self.manager.plan().to_dict(),
            "outputs": {
                "folder": str(self.outputs.root),
                "bytes": self.outputs.total_bytes(),
                "cap_bytes": self.outputs.cap_bytes,
            },
        }


def _allocated(device: Any) -> int | None:
    """Device bytes allocated by torch now (CUDA only)."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.memory_allocated(device))


def _rss() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def _brief(report: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The last job's report without its event list (that is in report.json)."""
    if report is None:
        return None
    return {k: v for k, v in report.items() if k != "events"}


def job_summary(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "model": job.model,
        "kind": job.kind,
        "status": job.status,
        "progress": job.progress,
        "step": job.step,
        "total_steps": job.total_steps,
        "memory_after": job.memory_after,
        "run_seconds": job.run_seconds,
        "device_seconds": job.device_seconds,
        "write_seconds": job.write_seconds,
        "plan_seconds": job.plan_seconds,
    }


def describe_failure(error: BaseException) -> JobFailed:
    """The one error a failed job answers with."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, BudgetError) or _is_out_of_memory(error):
        return JobFailed(503, "insufficient_memory", f"out of memory after retries: {text}")
    if isinstance(error, (ValueError, TypeError)):
        return JobFailed(400, "invalid_value", text)
    return JobFailed(500, "server_error", f"{type(error).__name__}: {text}")


def _is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def recovered_jobs(outputs: OutputStore) -> list[Job]:
    """The completed jobs whose files an earlier server left in ``outputs``: their
    status, report and content answer as before the restart."""
    jobs = []
    for job_id, report, files, made in outputs.finished():
        shape = report.get("shape") or {}
        kind = "video" if job_id.startswith("video_") else "image"
        fps = (report.get("output") or {}).get("fps") or FALLBACK_FPS
        job = Job(
            kind=kind,
            model=str(report.get("model", "")),
            prompt=str(report.get("prompt", "")),
            width=shape.get("width"),
            height=shape.get("height"),
            frames=shape.get("frames"),
            steps=shape.get("steps"),
            seed=int(report.get("seed") or 0),
            n=int(report.get("n") or 1),
            seconds=seconds_of(shape.get("frames"), fps) if kind == "video" else None,
            id=job_id,
            status="completed",
            created_at=int(report.get("created_at") or made),
            completed_at=int(made),
            files=files,
        )
        job.done_event.set()
        jobs.append(job)
    return jobs


def seconds_of(frames: int | None, fps: float) -> str | None:
    """A video's length as OpenAI's ``seconds`` writes it; None while it is not known."""
    return None if frames is None else f"{(frames - 1) / fps:g}"


def _fill_shape(job: Job, made: Any, fps: float) -> None:
    """A size or frame count the pipeline computed itself, read from what it made
    (B×F×H×W×C, an image as one frame)."""
    import numpy as np

    shape = np.shape(made)
    if len(shape) != 5:
        return
    _, frames, height, width, _ = shape
    job.height = height if job.height is None else job.height
    job.width = width if job.width is None else job.width
    if job.kind == "video" and job.frames is None:
        job.frames = frames
        job.seconds = seconds_of(frames, fps)


def asked_beyond_defaults(job: Job, model: ServedModel) -> dict[str, Any]:
    """Only what the request set: each pipeline keeps its own defaults for the rest."""
    extra: dict[str, Any] = {}
    if job.input_image is not None:
        extra[model.image_argument] = job.input_image
    if job.guidance is not None:
        extra["guidance_scale"] = job.guidance
    if job.kind == "video":
        extra["num_frames"] = job.frames
    if model.takes_max_area and job.height is not None and job.width is not None:
        extra["max_area"] = job.height * job.width  # the size asked, not a megapixel's
    return extra
