"""What a read is made of: the jobs (a file tensor and its destination), the chunks they
are read in, what a read reports, and its progress bar. Pure planning: no reading here."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import LoadError
from .safetensors_format import TensorInfo

__all__ = [
    "Chunk",
    "PROGRESS_MIN_BYTES",
    "ReadJob",
    "ReadStats",
    "plan_chunks",
    "ChunkPlan",
    "progress_bar",
    "reads_directly",
    "where",
]

# Below this, a progress bar is noise.
PROGRESS_MIN_BYTES = 64 * 2**20
BAR_LOCK = threading.Lock()  # progress bars updated from several reading threads


@dataclass
class ReadJob:
    """Fill ``destination`` from ``info``; also keep the raw file bytes in ``capture`` if given.

    ``capture`` is a flat uint8 host tensor of ``info.nbytes`` (a host cache entry); it then
    serves as the staging buffer itself.
    """

    info: TensorInfo
    destination: torch.Tensor
    capture: torch.Tensor | None = None
    # A dtype a cast rounds through on its way to the destination's: a float32 file
    # stored in fp8 is rounded as its bfloat16 model would be (``loading.fp8``).
    via: torch.dtype | None = None


@dataclass
class ReadStats:
    nbytes: int
    seconds: float
    source: str
    readers: str = "threads"  # or "processes"

    @property
    def gb_per_second(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class Chunk:
    """One read: a byte range of a job's tensor, and where in the destination it goes."""

    job: ReadJob
    # The destination (or its contiguous temporary), all of it: as it is when the file's
    # dtype is kept, flat (its elements) when cast. ``part`` is this chunk's. The copying
    # thread of a read through the processes makes no view per chunk or per tensor: it
    # copies to an address (a view is a torch operation, which gives up the interpreter's
    # lock), and casts make one view per run of chunks.
    target: torch.Tensor
    lo: int  # byte range within the tensor's file data, element aligned
    hi: int
    direct: bool
    cast: bool
    group: int = 0  # the job's group in a read in groups (``read_in_groups``)

    def part(self) -> torch.Tensor:
        """This chunk's part of the target."""
        if not self.cast:
            return self.target.reshape(-1).view(torch.uint8)[self.lo : self.hi]
        itemsize = self.job.info.dtype.itemsize
        return self.target[self.lo // itemsize : self.hi // itemsize]

    @property
    def address(self) -> int:
        """Where this chunk's bytes go, when the file's dtype is kept."""
        return self.target.data_ptr() + self.lo


def plan_chunks(
    jobs: Sequence[ReadJob],
    buffer_bytes: int,
    component: str | None,
    groups: Sequence[int] | None = None,
) -> tuple[ChunkPlan, list[tuple[torch.Tensor, ReadJob]]]:
    """The chunks of every job, in file order, at most ``buffer_bytes`` each, and the
    contiguous temporaries of destinations that are not contiguous (copied in after).
    ``groups``: each job's group (a read in groups); the chunks then come group by
    group, in file order within each. Every job is checked here; its chunks are made
    when the plan reaches it (:class:`ChunkPlan`)."""
    planned: list[_JobChunks] = []
    temporaries: list[tuple[torch.Tensor, ReadJob]] = []
    group_of = dict(zip(map(id, jobs), groups, strict=True)) if groups is not None else {}
    for job in sorted(
        jobs, key=lambda j: (group_of.get(id(j), 0), j.info.path or "", j.info.start)
    ):
        info, destination = job.info, job.destination
        if destination.numel() != info.numel:
            raise LoadError(
                f"{where(info, component)}: file holds shape {list(info.shape)}, destination "
                f"has shape {list(destination.shape)}",
                component=component,
                path=info.path,
            )
        if job.capture is not None and job.capture.numel() != info.nbytes:
            raise LoadError(f"{where(info, component)}: capture buffer has the wrong size")
        if info.nbytes == 0:
            continue
        target = destination
        if not destination.is_contiguous():
            target = torch.empty(
                destination.shape, dtype=destination.dtype, device=destination.device
            )
            temporaries.append((target, job))
        itemsize = info.dtype.itemsize
        planned.append(
            _JobChunks(
                job,
                target,
                direct=reads_directly(job),
                cast=destination.dtype != info.dtype,
                group=group_of.get(id(job), 0),
                step=max(itemsize, buffer_bytes // itemsize * itemsize),
            )
        )
    return ChunkPlan(planned), temporaries


@dataclass
class _JobChunks:
    """One job's part of a plan: its chunks, made when asked for."""

    job: ReadJob
    target: torch.Tensor  # the destination, or its contiguous temporary
    direct: bool
    cast: bool
    group: int
    step: int  # bytes per chunk, whole elements

    @property
    def count(self) -> int:
        return -(-self.job.info.nbytes // self.step)

    def chunks(self) -> list[Chunk]:
        info = self.job.info
        target = self.target.reshape(-1) if self.cast else self.target
        job, direct, cast, group, nbytes = self.job, self.direct, self.cast, self.group, info.nbytes
        return [
            Chunk(job, target, lo, min(lo + self.step, nbytes), direct, cast, group)
            for lo in range(0, nbytes, self.step)
        ]


class ChunkPlan(Sequence):
    """Every job's chunks in plan order. Iterating makes each job's chunks as it reaches
    them, so the first read does not wait for a whole component's (a 27 GB transformer
    has 7,000). Indexing (the reading threads take chunks by number) makes them all,
    once."""

    def __init__(self, jobs: list[_JobChunks]):
        self.jobs = jobs
        self._count = sum(job.count for job in jobs)
        self._made: list[Chunk] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        if self._made is not None:
            yield from self._made
            return
        for job in self.jobs:
            yield from job.chunks()

    def __getitem__(self, index):
        if self._made is None:
            with self._lock:
                if self._made is None:
                    self._made = [chunk for job in self.jobs for chunk in job.chunks()]
        return self._made[index]


def reads_directly(job: ReadJob) -> bool:
    """A CPU destination of the file's dtype is read into as it is, with no staging."""
    destination = job.destination
    return (
        destination.device.type == "cpu"
        and destination.dtype == job.info.dtype
        and job.capture is None
    )


def progress_bar(total: int, wanted: bool, component: str | None, source: str):
    if not wanted or total < PROGRESS_MIN_BYTES or os.environ.get("ONDECK_PROGRESS") == "0":
        return None
    from tqdm.auto import tqdm

    label = f"{component} from {source}" if component else f"from {source}"
    return tqdm(
        total=total,
        desc=label,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        file=sys.stderr,
        leave=False,
    )


def where(info: TensorInfo, component: str | None) -> str:
    place = f"{info.path}, tensor '{info.name}'"
    return f"component '{component}' from {place}" if component else place
