"""Jobs and their queue: first in, first out, one device job at a time.

The device thread runs one job after another; writing a finished job's files happens
on a writer thread beside it, so the next job starts at once.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("queued", "in_progress", "completed", "failed")


class JobCancelled(Exception):
    """Raised at a denoising step of a job that was cancelled or whose client left."""


class JobFailed(Exception):
    """A job's one clear error: an HTTP status, a machine-readable code and a message."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


INSTANCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,31}$")


def new_job_id(kind: str, instance: str | None = None) -> str:
    """``video_<32 hex>`` (or ``img_``), with ``instance-`` before the hex when given: a
    load balancer in front of several servers routes a job's later requests by it."""
    # 128 random bits: a job id is the only key to its output, so it must not be guessed.
    prefix = "video" if kind == "video" else "img"
    tag = f"{instance}-" if instance else ""
    return f"{prefix}_{tag}{secrets.token_hex(16)}"


@dataclass
class Job:
    kind: str  # "video" or "image"
    model: str
    prompt: str
    # None: the pipeline's own, where its call computes it; filled in once it has run.
    width: int | None
    height: int | None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    negative_prompt: str = ""
    n: int = 1
    input_image: Any = None  # a PIL image where the pipeline takes one
    seconds: str | None = "1"
    id: str = ""
    status: str = "queued"
    step: int = 0
    total_steps: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    started_at: float | None = None
    completed_at: int | None = None
    error: JobFailed | None = None
    cancelled: bool = False
    cancel_reason: str = ""
    files: dict[str, str] = field(default_factory=dict)
    run_seconds: float | None = None  # the pipeline's call(s)
    device_seconds: float | None = None  # the device thread's whole time on the job
    write_seconds: float | None = None  # its files, on the writer thread
    plan_seconds: float | None = None  # the set's plan worked out again after it
    memory_after: dict[str, int | None] | None = None  # measured once the job is over
    cancel_event: threading.Event = field(default_factory=threading.Event)
    done_event: threading.Event = field(default_factory=threading.Event)
    # A cancel and the job's start or completion: one or the other, never both.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # Told once the job is over, whichever way (the queue counts how jobs ended).
    on_finish: Callable[[Job], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_job_id(self.kind)

    @property
    def progress(self) -> int:
        if self.status == "completed":
            return 100
        if not self.total_steps:
            return 0
        # The last percent is for decoding and writing the file.
        return min(99, int(100 * self.step / self.total_steps))

    def cancel(self, why: str = "cancelled") -> bool:
        """Stop the job at its next step, or before it starts; False once it is over."""
        with self._lock:
            if self.finished:
                return False
            self.cancelled = True
            self.cancel_reason = why
            self.cancel_event.set()
            if self.status == "queued":
                self.fail(JobFailed(409, "cancelled", f"the job was {why} before it started"))
            return True

    def start(self) -> bool:
        """The job runs now; False when a cancel came first."""
        with self._lock:
            if self.cancelled:
                return False
            self.status = "in_progress"
            return True

    def complete_unless_cancelled(self) -> bool:
        """Completed, unless a cancel came first (then False: the caller fails it)."""
        with self._lock:
            if self.cancelled:
                return False
            self.complete()
            return True

    def fail(self, error: JobFailed) -> None:
        """Failed with ``error``; nothing once the job is over (it ends once)."""
        self._finish("failed", error)

    def complete(self) -> None:
        self._finish("completed", None)

    def _finish(self, status: str, error: JobFailed | None) -> None:
        with self._lock:
            if self.finished:
                return
            self.status, self.error = status, error
            self.completed_at = int(time.time())
            self.input_image = None  # a kept job keeps no request payload, run or not
            self.done_event.set()
        if self.on_finish is not None:
            try:
                self.on_finish(self)
            except Exception:  # counting and the log line must not undo the job's end
                pass

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")


class QueueFull(Exception):
    code = "queue_full"


class ServerStopping(QueueFull):
    code = "server_shutdown"


class JobQueue:
    """Holds every known job by id and runs the waiting ones in order on one thread."""

    def __init__(
        self,
        run: Callable[[Job, list[str]], None],
        *,
        max_waiting: int = 64,
        max_kept: int = 1000,
        told: Callable[[Job], None] | None = None,
    ):
        self._run = run
        self._told = told  # each job once it is over, whichever way it ended
        self.max_waiting = max_waiting
        self.max_kept = max_kept
        self.jobs: dict[str, Job] = {}
        self._waiting: deque[Job] = deque()
        self._condition = threading.Condition()
        self._stopping = False
        self.current: Job | None = None
        self.last_finished: Job | None = None
        # How the jobs submitted ended: completed, failed, and of those failed cancelled.
        self.ended = {"completed": 0, "failed": 0, "cancelled": 0}
        self._counting = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ondeck-serve-device", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._condition:
            if self._stopping:
                raise ServerStopping("the server is shutting down: it takes no new job")
            # A job cancelled while it waits gives its place up at once.
            self._waiting = deque(j for j in self._waiting if not j.cancelled)
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} jobs are waiting already; try again later")
            job.on_finish = self._count
            self.jobs[job.id] = job
            self._waiting.append(job)
            self._forget_old()
            self._condition.notify_all()
        return job

    def adopt(self, job: Job) -> None:
        """Keep ``job``, over already (an earlier server's): found by id, never run."""
        with self._condition:
            self.jobs[job.id] = job
            self._forget_old()

    def _count(self, job: Job) -> None:
        with self._counting:
            self.ended[job.status] += 1
            if job.error is not None and job.error.code == "cancelled":
                self.ended["cancelled"] += 1
        if self._told is not None:
            self._told(job)

    def _forget_old(self) -> None:
        """Finished jobs past ``max_kept`` are forgotten, oldest first."""
        if len(self.jobs) <= self.max_kept:
            return
        for job_id in [j.id for j in self.jobs.values() if j.finished][
            : len(self.jobs) - self.max_kept
        ]:
            self.jobs.pop(job_id, None)

    def waiting(self) -> list[Job]:
        with self._condition:
            return [job for job in self._waiting if not job.cancelled]

    def upcoming_models(self) -> list[str]:
        return [job.model for job in self.waiting()]

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def remove(self, job_id: str) -> Job | None:
        with self._condition:
            return self.jobs.pop(job_id, None)

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._waiting and not self._stopping:
                    self._condition.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                if job.cancelled:
                    continue
                self.current = job
            try:
                self._run(job, [j.model for j in self.waiting()])
            except Exception as error:  # the device thread outlives any one job
                if not job.finished:
                    job.fail(JobFailed(500, "server_error", f"{type(error).__name__}: {error}"))
            finally:
                with self._condition:
                    self.current = None
                    self.last_finished = job
                    self._condition.notify_all()

    @property
    def busy(self) -> bool:
        """The device thread is still on a job (or waiting for one, before ``close``)."""
        return self._thread.is_alive()

    def stop(self, *, timeout: float | None = None) -> None:
        """``close``, then return once the device thread is idle."""
        self.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def close(self) -> None:
        """No new jobs; the waiting ones fail; the running one goes on (or is cancelled
        by the caller)."""
        with self._condition:
            self._stopping = True
            while self._waiting:
                job = self._waiting.popleft()
                if not job.finished:
                    job.fail(
                        JobFailed(
                            503, "server_shutdown", "the server shut down before the job started"
                        )
                    )
            self._condition.notify_all()
