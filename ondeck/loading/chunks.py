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
    "CAST_GROUP_BYTES",
    "CastGroup",
    "Chunk",
    "PROGRESS_MIN_BYTES",
    "ReadJob",
    "ReadStats",
    "plan_chunks",
    "progress_bar",
    "reads_directly",
    "where",
]

# Below this, a progress bar is noise.
PROGRESS_MIN_BYTES = 64 * 2**20
BAR_LOCK = threading.Lock()  # progress bars updated from several reading threads
# A cast to a CUDA destination is issued once per this many file bytes of a tensor (a
# group of consecutive chunks), not once per chunk: the one thread that issues a
# process-read load's copies pays a device allocation and a cast launch per group
# instead. Whether that lifts the fp8 reload rate is not shown yet (BENCHMARKS.md).
CAST_GROUP_BYTES = 16 * 2**20


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
    # stored in fp8 is rounded as its bfloat16 model would be (``loading.storage``).
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
    # This chunk's part of the destination (or of its contiguous temporary), flat: raw
    # bytes when the file's dtype is kept, elements of the destination's dtype when cast.
    target: torch.Tensor
    lo: int  # byte range within the tensor's file data, element aligned
    hi: int
    direct: bool
    cast: bool
    # For a cast to a CUDA destination: the group of consecutive chunks cast together when
    # one thread delivers them all (``CastGroup``); None otherwise.
    group: CastGroup | None = None


class CastGroup:
    """Consecutive chunks of one tensor whose file bytes are copied one by one into a
    device buffer in the file's dtype, then cast into the destination at once when the
    last has arrived. Every copy and the cast go to the stream of the one thread that
    delivers the group (a buffer freed here is reused only after them, on that stream).
    """

    def __init__(self, target: torch.Tensor, lo: int, hi: int, chunks: int, job: ReadJob):
        self.target = target  # the group's part of the destination, flat
        self.lo, self.hi = lo, hi  # byte range within the tensor's file data
        self.left = chunks
        self.job = job
        self._buffer: torch.Tensor | None = None

    def deliver(self, chunk: Chunk, staged: torch.Tensor) -> None:
        """Copy ``chunk``'s staged file bytes to the device; cast once all have come."""
        if self._buffer is None:
            self._buffer = torch.empty(
                self.hi - self.lo, dtype=torch.uint8, device=self.target.device
            )
        self._buffer[chunk.lo - self.lo : chunk.hi - self.lo].copy_(staged, non_blocking=True)
        self.left -= 1
        if not self.left:
            source = self._buffer.view(self.job.info.dtype)
            if self.job.via is not None:
                source = source.to(self.job.via)
            self.target.copy_(source, non_blocking=True)
            self._buffer = None


def plan_chunks(jobs: Sequence[ReadJob], buffer_bytes: int, component: str | None):
    """The chunks of every job, in file order, at most ``buffer_bytes`` each, and the
    contiguous temporaries of destinations that are not contiguous (copied in after)."""
    chunks: list[Chunk] = []
    temporaries: list[tuple[torch.Tensor, ReadJob]] = []
    for job in sorted(jobs, key=lambda j: (j.info.path or "", j.info.start)):
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
        direct = reads_directly(job)
        cast = destination.dtype != info.dtype
        flat = target.reshape(-1)
        if not cast:
            flat = flat.view(torch.uint8)
        itemsize = info.dtype.itemsize
        step = max(itemsize, buffer_bytes // itemsize * itemsize)
        grouped = cast and target.device.type == "cuda"
        span = step * max(1, CAST_GROUP_BYTES // step)  # a group: whole chunks
        for start in range(0, info.nbytes, span):
            end = min(start + span, info.nbytes)
            group = None
            if grouped:
                count = -(-(end - start) // step)
                whole = flat[start // itemsize : end // itemsize]
                group = CastGroup(whole, start, end, count, job)
            for lo in range(start, end, step):
                hi = min(lo + step, end)
                part = flat[lo // itemsize : hi // itemsize] if cast else flat[lo:hi]
                chunks.append(Chunk(job, part, lo, hi, direct, cast, group))
    return chunks, temporaries


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
