"""Stream safetensors data into tensors that already sit where they will live.

Threads read with ``os.preadv`` (the GIL is released) in chunks. A CPU destination of the
file's dtype is read into directly, with no copy. Anything else is staged through a small
ring of host buffers (pinned for CUDA) and copied, so the next read overlaps the current
copy. Host memory a load takes is the ring, never the file.

Each thread owns its share of the ring and its own side stream, and issues its own
copies: a chunk costs a few GIL hand-overs (the read, the copy, at times a wait for the
buffer's last copy) and nothing is passed between threads. Every hand-over is contended
by all the readers, so their number sets the rate from a warm page cache: a ring shared
by all threads, or one copier thread issuing every copy, ran at 55-65% of it.

A cast to a CUDA destination (file dtype differs) goes through a temporary on the
device in the file's dtype, which torch's allocator then keeps cached for that thread's
stream: up to a 20 MiB block per reading thread, reusable by later loads' threads.
"""

from __future__ import annotations

import ctypes
import itertools
import os
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
    that overlaps them). A read that fails raises :class:`LoadError` naming the file and
    tensor; other errors (CUDA, pinned memory, ``while_reading``'s own) propagate as they
    are. Either way the reading threads have stopped and their device copies have
    finished before it propagates.
    """
    started = time.perf_counter()
    total = sum(job.info.nbytes for job in jobs)
    paths = sorted({job.info.path for job in jobs if job.info.nbytes})
    source = describe_source(paths) if paths else "disk"
    devices = {job.destination.device for job in jobs if job.destination.device.type == "cuda"}
    pinned = bool(devices)
    buffer_bytes = max(buffer_bytes, 64)
    if pinned:
        # The pinned allocator rounds each buffer up to a power of two: round down instead,
        # so the ring stays within buffer_bytes x buffer_count.
        buffer_bytes = 1 << (buffer_bytes.bit_length() - 1)
    chunks, temporaries = _plan(jobs, buffer_bytes, component)
    worker_count = threads or min(16, max(4, os.cpu_count() or 4))
    staging = any(not chunk.direct and chunk.job.capture is None for chunk in chunks)
    if staging:
        # Each thread owns two ring buffers or more (one is read into while the other's
        # copy runs): the ring, not the thread count, bounds memory.
        worker_count = min(worker_count, max(1, buffer_count // 2))
    worker_count = max(1, min(worker_count, len(chunks)))
    files: dict[str, int] = {}
    workers: list[threading.Thread] = []
    bar = None
    try:
        bar = _progress_bar(total, progress, component, source)
        state = _ReadState(
            chunks=chunks,
            files=files,
            fences=_fences(devices),
            buffer_bytes=buffer_bytes,
            buffers_per_thread=max(1, buffer_count // worker_count),
            pinned=pinned,
            bar=bar,
            component=component,
        )
        for path in paths:
            files[path] = _open(path, component)
        for index in range(worker_count if chunks else 0):
            # Listed before it starts: an interrupt inside start() still finds it to join.
            workers.append(
                threading.Thread(
                    target=_read_chunks, args=(state,), name=f"ondeck-read-{index}", daemon=True
                )
            )
            workers[-1].start()
        interrupted = None
        try:
            if while_reading is not None:
                while_reading()
        except BaseException as error:
            # Workers write into memory the caller frees on failure: stop them first.
            interrupted = error
            state.fail(error)
        _join(workers)
        if interrupted is not None:
            raise interrupted
        if state.failure is not None:
            raise state.failure
        for target, job in temporaries:
            job.destination.copy_(target)
    finally:
        if workers:  # left early (an interrupt, say): still let no worker outlive the read
            state.fail(LoadError("the read was interrupted", component=component))
            _join(workers)
        for fd in files.values():
            os.close(fd)
        if bar is not None:
            bar.close()
    return ReadStats(total, time.perf_counter() - started, source)


def _join(workers: list[threading.Thread]) -> None:
    """Wait for every started worker (each waits for its own device copies), and forget them."""
    for worker in workers:
        if worker.ident is not None:
            worker.join()
    workers.clear()


@dataclass
class _ReadState:
    """What every reading thread shares: the chunks, handed out in order, and the outcome."""

    chunks: list
    files: dict
    fences: dict  # device -> event on the caller's stream that copies must start after
    buffer_bytes: int
    buffers_per_thread: int
    pinned: bool
    bar: object
    component: str | None

    def __post_init__(self):
        self.next_index = itertools.count()  # atomic under the GIL
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


def _fences(devices) -> dict:
    """Destinations may reuse memory the caller's stream still reads: copies start after it."""
    fences = {}
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        fences[device] = event
    return fences


def _read_chunks(state: _ReadState) -> None:
    """A reading thread: take the next chunk until none are left or the read has failed."""
    streams = {}
    slots: deque[_Slot] = deque()
    try:
        for device, fence in state.fences.items():
            stream = torch.cuda.Stream(device)
            stream.wait_event(fence)
            torch.cuda.set_stream(stream)  # this thread's copies to that device go there
            streams[device] = stream
        while not state.stop.is_set():
            index = next(state.next_index)
            if index >= len(state.chunks):
                return
            chunk = state.chunks[index]
            job, info = chunk.job, chunk.job.info
            length = chunk.hi - chunk.lo
            offset = info.start + chunk.lo
            fd = state.files[info.path]
            if chunk.direct:
                _pread_exact(fd, chunk.target.data_ptr(), length, offset, info, state.component)
            elif job.capture is not None:
                staged = job.capture[chunk.lo : chunk.hi]
                _pread_exact(fd, staged.data_ptr(), length, offset, info, state.component)
                _deliver(chunk, staged, streams)
            else:
                if len(slots) < state.buffers_per_thread:
                    slot = _Slot(
                        torch.empty(state.buffer_bytes, dtype=torch.uint8, pin_memory=state.pinned)
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
        # Asynchronous copy errors surface here: they fail the read, and every stream is
        # still waited for, since the caller frees the destinations on failure.
        for stream in streams.values():
            try:
                stream.synchronize()
            except BaseException as error:
                state.fail(error)


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


def _plan(jobs: Sequence[ReadJob], buffer_bytes: int, component: str | None):
    chunks: list[_Chunk] = []
    temporaries: list[tuple[torch.Tensor, ReadJob]] = []
    for job in sorted(jobs, key=lambda j: (j.info.path or "", j.info.start)):
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
            continue
        target = destination
        if not destination.is_contiguous():
            target = torch.empty(
                destination.shape, dtype=destination.dtype, device=destination.device
            )
            temporaries.append((target, job))
        direct = (
            destination.device.type == "cpu"
            and destination.dtype == info.dtype
            and job.capture is None
        )
        cast = destination.dtype != info.dtype
        flat = target.reshape(-1)
        if not cast:
            flat = flat.view(torch.uint8)
        itemsize = info.dtype.itemsize
        step = max(itemsize, buffer_bytes // itemsize * itemsize)
        for lo in range(0, info.nbytes, step):
            hi = min(lo + step, info.nbytes)
            part = flat[lo // itemsize : hi // itemsize] if cast else flat[lo:hi]
            chunks.append(_Chunk(job, part, lo, hi, direct, cast))
    return chunks, temporaries


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
