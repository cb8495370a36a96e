"""Stream safetensors data into tensors that already sit where they will live.

Threads read with ``os.preadv`` (the GIL is released) in chunks. A CPU destination of the
file's dtype is read into directly, with no copy. Anything else is staged through a small
ring of host buffers (pinned for CUDA) and copied, so the next read overlaps the current
copy. Host memory a load takes is the ring, never the file.

Each thread owns its share of the ring and its own side stream, and issues its own
copies: a chunk costs a handful of GIL hand-overs and nothing is passed between threads.
Every hand-over is contended by all the readers, so this is what sets the rate from a
warm page cache (a shared ring with a copier thread ran at a third of it).
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import LoadError
from .page_cache import describe_source
from .safetensors_format import TensorInfo

__all__ = [
    "FileRead",
    "ReadJob",
    "ReadStats",
    "HostCopy",
    "read_into",
    "DEFAULT_BUFFER_BYTES",
]

DEFAULT_BUFFER_BYTES = 8 * 2**20
DEFAULT_BUFFER_COUNT = 32
# Below this, a progress bar is noise.
PROGRESS_MIN_BYTES = 64 * 2**20
_BAR_LOCK = threading.Lock()


@dataclass
class ReadJob:
    """Fill ``destination`` from ``info``; also keep the raw file bytes in ``capture`` if given.

    ``capture`` is a flat uint8 host tensor of ``info.nbytes`` (a host cache entry); it then
    serves as the staging buffer itself.
    """

    info: TensorInfo
    destination: torch.Tensor
    capture: torch.Tensor | None = None


@dataclass
class ReadStats:
    nbytes: int
    seconds: float
    source: str

    @property
    def gb_per_second(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Chunk:
    job: ReadJob
    # This chunk's part of the destination (or of its contiguous temporary), flat: raw
    # bytes when the file's dtype is kept, elements of the destination's dtype when cast.
    target: torch.Tensor
    lo: int  # byte range within the tensor's file data, element aligned
    hi: int
    direct: bool
    cast: bool
    fence: torch.cuda.Event | None = None  # copies start after it (a device target only)


def read_into(
    jobs: Sequence[ReadJob],
    *,
    threads: int | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    buffer_count: int = DEFAULT_BUFFER_COUNT,
    progress: bool = True,
    component: str | None = None,
    while_reading: Callable[[], None] | None = None,
) -> ReadStats:
    """Read every job's tensor from its file into its destination. Blocks until done.

    ``while_reading`` runs on the calling thread once the reads have started (CPU work
    that overlaps them). Every failure raises :class:`LoadError` naming the file and
    tensor; worker threads have stopped and their device copies have finished before it
    propagates.
    """
    read = FileRead(
        [job.info for job in jobs],
        threads=threads,
        buffer_bytes=buffer_bytes,
        buffer_count=buffer_count,
        progress=progress,
        component=component,
    )
    try:
        for job in sorted(jobs, key=lambda j: (j.info.path or "", j.info.start)):
            read.add(job)
    except BaseException:
        read.close()
        raise
    return read.finish(while_reading)


# Chunks are handed to the reading threads in batches of about this many bytes, each after
# a fence on the caller's stream: destinations allocated so far may reuse memory that work
# already queued there still reads.
READ_BATCH_BYTES = 256 * 2**20


class FileRead:
    """Reads from the files into destinations as they are added, so allocating the next
    destination overlaps reading into the last.

    Built from the :class:`TensorInfo` of everything the read will hold (for the source
    and the progress bar); then ``add`` each :class:`ReadJob` and ``finish`` (or ``close``
    after a failure, which stops the threads and waits for their copies).
    """

    def __init__(
        self,
        infos: Sequence[TensorInfo],
        *,
        threads: int | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        buffer_count: int = DEFAULT_BUFFER_COUNT,
        progress: bool = True,
        component: str | None = None,
    ):
        self._started = time.perf_counter()
        self._total = sum(info.nbytes for info in infos)
        paths = sorted({info.path for info in infos if info.nbytes})
        self._source = describe_source(paths) if paths else "disk"
        self._component = component
        self._buffer_bytes = max(buffer_bytes, 64)
        self._temporaries: list[tuple[torch.Tensor, ReadJob]] = []
        self._batch: list[_Chunk] = []
        self._batch_bytes = 0
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._bar = _progress_bar(self._total, progress, component, self._source)
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._state = _ReadState(
            work=self._work,
            files={},
            buffer_bytes=self._buffer_bytes,
            buffers_per_thread=1,
            bar=self._bar,
            component=component,
        )
        try:
            for path in paths:
                self._state.files[path] = _open(path, component)
        except BaseException:
            self.close()
            raise
        worker_count = threads or min(16, max(4, os.cpu_count() or 4))
        # Each thread owns at least one ring buffer: the ring, not the threads, bounds memory.
        worker_count = min(worker_count, max(1, buffer_count // 2))
        worker_count = max(1, min(worker_count, -(-self._total // self._buffer_bytes)))
        self._state.buffers_per_thread = max(1, buffer_count // worker_count)
        self._worker_count = worker_count if self._total else 0

    def add(self, job: ReadJob) -> None:
        """Queue ``job``'s reads; its destination must not be used until ``finish``."""
        chunks = _plan_job(job, self._buffer_bytes, self._component, self._temporaries)
        self._batch += chunks
        self._batch_bytes += job.info.nbytes
        if self._batch_bytes >= READ_BATCH_BYTES:
            self._release_batch()

    def finish(self, while_reading: Callable[[], None] | None = None) -> ReadStats:
        """Read what was added, running ``while_reading`` meanwhile; raise the first failure."""
        try:
            self._release_batch()
            try:
                if while_reading is not None:
                    while_reading()
            except BaseException as error:
                # Workers write into memory the caller frees on failure: stop them first.
                self._state.fail(error)
            self._join()
            if self._state.failure is not None:
                raise self._state.failure
            for target, job in self._temporaries:
                job.destination.copy_(target)
        finally:
            self.close()
        return ReadStats(self._total, time.perf_counter() - self._started, self._source)

    def close(self) -> None:
        """Stop reading (if still going), wait for the threads and their copies, close files."""
        if self._closed:
            return
        self._closed = True
        if self._workers:
            self._state.fail(LoadError("the read was abandoned", component=self._component))
            self._join()
        for fd in self._state.files.values():
            os.close(fd)
        if self._bar is not None:
            self._bar.close()

    def _release_batch(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if not batch:
            return
        fences = {}
        for device in {
            chunk.target.device for chunk in batch if chunk.target.device.type == "cuda"
        }:
            fences[device] = torch.cuda.Event()
            fences[device].record(torch.cuda.current_stream(device))
        for chunk in batch:
            chunk.fence = fences.get(chunk.target.device)
            self._work.put(chunk)
        while len(self._workers) < self._worker_count:
            worker = threading.Thread(
                target=_read_chunks,
                args=(self._state,),
                name=f"ondeck-read-{len(self._workers)}",
                daemon=True,
            )
            worker.start()
            self._workers.append(worker)

    def _join(self) -> None:
        for _ in self._workers:
            self._work.put(None)
        for worker in self._workers:
            worker.join()  # each waits for its own device copies before it ends
        self._workers.clear()


@dataclass
class _ReadState:
    """What every reading thread shares: the queue of chunks, the files and the outcome."""

    work: queue.SimpleQueue
    files: dict
    buffer_bytes: int
    buffers_per_thread: int
    bar: object
    component: str | None

    def __post_init__(self):
        self.stop = threading.Event()
        self.failure: BaseException | None = None
        self._lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error
        self.stop.set()


class _Slot:
    """One ring buffer and the event of the device copy that last read from it."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.event: torch.cuda.Event | None = None
        self.event_device: torch.device | None = None
        self.copying = False

    def wait(self) -> None:
        if self.copying:
            self.event.synchronize()
            self.copying = False

    def mark_copying(self, stream: torch.cuda.Stream) -> None:
        if self.event is None or self.event_device != stream.device:
            self.event, self.event_device = torch.cuda.Event(), stream.device
        self.event.record(stream)
        self.copying = True


def _read_chunks(state: _ReadState) -> None:
    """A reading thread: take the next chunk until told to stop or the read has failed."""
    streams: dict[torch.device, torch.cuda.Stream] = {}
    fenced: dict[torch.device, torch.cuda.Event] = {}
    slots: deque[_Slot] = deque()
    try:
        while True:
            chunk = state.work.get()
            if chunk is None or state.stop.is_set():
                return
            job, info = chunk.job, chunk.job.info
            length = chunk.hi - chunk.lo
            offset = info.start + chunk.lo
            fd = state.files[info.path]
            device = chunk.target.device
            if chunk.fence is not None and fenced.get(device) is not chunk.fence:
                stream = streams.get(device)
                if stream is None:
                    stream = streams[device] = torch.cuda.Stream(device)
                    torch.cuda.set_stream(stream)  # this thread's copies to it go there
                stream.wait_event(chunk.fence)
                fenced[device] = chunk.fence
            if chunk.direct:
                _pread_exact(fd, chunk.target.data_ptr(), length, offset, info, state.component)
            elif job.capture is not None:
                staged = job.capture[chunk.lo : chunk.hi]
                _pread_exact(fd, staged.data_ptr(), length, offset, info, state.component)
                _deliver(chunk, staged, streams)
            else:
                if len(slots) < state.buffers_per_thread:
                    pinned = device.type == "cuda"
                    slot = _Slot(
                        torch.empty(state.buffer_bytes, dtype=torch.uint8, pin_memory=pinned)
                    )
                else:
                    slot = slots.popleft()
                    slot.wait()
                slots.append(slot)
                staged = slot.buffer if length == state.buffer_bytes else slot.buffer[:length]
                _pread_exact(fd, staged.data_ptr(), length, offset, info, state.component)
                stream = _deliver(chunk, staged, streams)
                if stream is not None:
                    slot.mark_copying(stream)
            if state.bar is not None:
                with _BAR_LOCK:
                    state.bar.update(length)
    except BaseException as error:
        state.fail(error)
    finally:
        for stream in streams.values():
            stream.synchronize()


# Host-cache copies are issued in batches of about this many bytes: each batch's side
# stream first waits for work queued so far on the current stream, whose freed memory the
# batch's destinations may reuse.
HOST_COPY_BATCH_BYTES = 256 * 2**20


class HostCopy:
    """Copies of raw file bytes kept in host memory into their destinations, issued as
    the destinations are allocated, so allocating the next overlaps copying the last.

    ``add`` each ``(info, raw, destination)``, then ``finish`` (or ``close``, after a
    failure); ``total`` bytes is for the progress bar. On CUDA the copies run
    asynchronously on a side stream; ``finish`` runs ``while_copying`` once all are
    issued, then waits for them.
    """

    def __init__(self, total: int, *, progress: bool = True, component: str | None = None):
        self._started = time.perf_counter()
        self._bar = _progress_bar(total, progress, component, "host cache")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._batch: list[tuple[TensorInfo, torch.Tensor, torch.Tensor]] = []
        self._batch_bytes = 0
        self._copied = 0

    def add(self, info: TensorInfo, raw: torch.Tensor, destination: torch.Tensor) -> None:
        self._batch.append((info, raw, destination))
        self._batch_bytes += info.nbytes
        if self._batch_bytes >= HOST_COPY_BATCH_BYTES:
            self._issue()

    def _issue(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        for device in {dst.device for _, _, dst in batch if dst.device.type == "cuda"}:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        for info, raw, destination in batch:
            if info.nbytes:
                source = raw.view(info.dtype).reshape(info.shape)
                stream = self._streams.get(destination.device)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        destination.copy_(source, non_blocking=True)
                else:
                    destination.copy_(source)
            self._copied += info.nbytes
            if self._bar is not None:
                self._bar.update(info.nbytes)

    def finish(self, while_copying: Callable[[], None] | None = None) -> ReadStats:
        try:
            self._issue()
            if while_copying is not None:
                while_copying()
        finally:
            self.close()
        return ReadStats(self._copied, time.perf_counter() - self._started, "host cache")

    def close(self) -> None:
        """Wait for what was issued (also after a failure: nothing may copy into freed
        memory later)."""
        for stream in self._streams.values():
            stream.synchronize()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _plan_job(job: ReadJob, buffer_bytes: int, component: str | None, temporaries: list):
    """The chunks of one job, each with its part of the target prepared."""
    info, destination = job.info, job.destination
    if destination.numel() != info.numel:
        raise LoadError(
            f"{_where(info, component)}: file holds shape {list(info.shape)}, destination "
            f"has shape {list(destination.shape)}",
            component=component,
            path=info.path,
        )
    if job.capture is not None and job.capture.numel() != info.nbytes:
        raise LoadError(f"{_where(info, component)}: capture buffer has the wrong size")
    if info.nbytes == 0:
        return []
    target = destination
    if not destination.is_contiguous():
        target = torch.empty(destination.shape, dtype=destination.dtype, device=destination.device)
        temporaries.append((target, job))
    direct = destination.device.type == "cpu" and destination.dtype == info.dtype
    direct = direct and job.capture is None
    cast = destination.dtype != info.dtype
    flat = target.reshape(-1)
    if not cast:
        flat = flat.view(torch.uint8)
    itemsize = info.dtype.itemsize
    step = max(itemsize, buffer_bytes // itemsize * itemsize)
    chunks = []
    for lo in range(0, info.nbytes, step):
        hi = min(lo + step, info.nbytes)
        part = flat[lo // itemsize : hi // itemsize] if cast else flat[lo:hi]
        chunks.append(_Chunk(job, part, lo, hi, direct, cast))
    return chunks


def _deliver(chunk: _Chunk, staged: torch.Tensor, streams: dict) -> torch.cuda.Stream | None:
    """Copy staged file bytes into the chunk's target, casting if needed. A device copy is
    issued on this thread's stream for the device, which is returned."""
    source = staged.view(chunk.job.info.dtype) if chunk.cast else staged
    stream = streams.get(chunk.target.device)
    chunk.target.copy_(source, non_blocking=stream is not None)
    return stream


def _pread_exact(fd: int, address: int, length: int, offset: int, info, component) -> None:
    done = 0
    while done < length:
        view = (ctypes.c_char * (length - done)).from_address(address + done)
        try:
            count = os.preadv(fd, [view], offset + done)
        except OSError as error:
            raise LoadError(
                f"{_where(info, component)}: read failed at byte {offset + done}: "
                f"{error.strerror or error}",
                component=component,
                path=info.path,
            ) from error
        if count == 0:
            raise LoadError(
                f"{_where(info, component)}: file ended at byte {offset + done}, the header "
                f"places the tensor up to byte {info.end} (truncated download?)",
                component=component,
                path=info.path,
            )
        done += count


def _open(path: str, component: str | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as error:
        where = f"component '{component}' from {path}" if component else path
        raise LoadError(
            f"{where}: cannot open ({error.strerror or error})", component=component, path=path
        ) from error


def _progress_bar(total: int, wanted: bool, component: str | None, source: str):
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


def _where(info: TensorInfo, component: str | None) -> str:
    place = f"{info.path}, tensor '{info.name}'"
    return f"component '{component}' from {place}" if component else place
