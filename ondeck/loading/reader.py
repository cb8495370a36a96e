"""Stream safetensors data into tensors that already sit where they will live.

Threads read with ``os.preadv`` (the GIL is released) in chunks. A CPU destination of the
file's dtype is read into directly, with no copy. Anything else is staged through a small
ring of host buffers (pinned for CUDA) and copied, so the next read overlaps the current
copy. Device copies are all issued by one copier thread, on a side stream: the reading
threads make no CUDA calls, since many threads issuing copies and waiting on events
contend in the driver and ran at a third of the rate one thread does. Host memory a load
takes is the ring, never the file.
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
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
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
    target: torch.Tensor  # contiguous, the destination's dtype; the destination or a temporary
    lo: int  # byte range within the tensor's file data, element aligned
    hi: int
    direct: bool


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

    ``while_reading`` runs on the calling thread once every read is queued (CPU work that
    overlaps the reads). Every failure raises :class:`LoadError` naming the file and
    tensor; worker threads have stopped and pending device copies have finished before
    it propagates.
    """
    started = time.perf_counter()
    total = sum(job.info.nbytes for job in jobs)
    paths = sorted({job.info.path for job in jobs if job.info.nbytes})
    source = describe_source(paths) if paths else "disk"
    buffer_bytes = max(buffer_bytes, 64)
    chunks, temporaries = _plan(jobs, buffer_bytes, component)
    devices = {job.destination.device for job in jobs if job.destination.device.type == "cuda"}
    streams = _side_streams(devices)
    needs_ring = any(not chunk.direct and chunk.job.capture is None for chunk in chunks)
    ring = _Ring(buffer_bytes, buffer_count, pinned=bool(devices)) if needs_ring else None
    files: dict[str, int] = {}
    bar = _progress_bar(total, progress, component, source)
    stop = threading.Event()
    copier = _Copier(streams, ring, stop) if streams else None
    try:
        for path in paths:
            files[path] = _open(path, component)
        worker_count = threads or min(16, max(4, os.cpu_count() or 4))
        finished = False
        pool = ThreadPoolExecutor(worker_count, thread_name_prefix="ondeck-read")
        try:
            futures = [
                pool.submit(_run_chunk, chunk, files, ring, copier, stop, bar, component)
                for chunk in chunks
            ]
            if while_reading is not None:
                while_reading()
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()
            finished = True
        finally:
            if not finished:
                # Workers write into memory the caller frees on failure: stop them first.
                stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            if copier is not None:
                copier.close()  # issues what the workers handed over, unless stopped
        if copier is not None:
            copier.raise_failure()
        for stream in streams.values():
            stream.synchronize()  # the temporaries below were filled on the side stream
        for target, job in temporaries:
            job.destination.copy_(target)
    finally:
        for stream in streams.values():
            stream.synchronize()
        for fd in files.values():
            os.close(fd)
        if bar is not None:
            bar.close()
    return ReadStats(total, time.perf_counter() - started, source)


class _Copier:
    """The one thread that issues device copies of staged chunks, in the order handed over,
    and gives each ring buffer back once its copy has finished on the device."""

    def __init__(self, streams: dict, ring: _Ring | None, stop: threading.Event):
        self._streams = streams
        self._ring = ring
        self._stop = stop
        self._handed: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ondeck-copy", daemon=True)
        self._thread.start()

    def hand(self, chunk: _Chunk, staged: torch.Tensor, buffer: torch.Tensor | None) -> None:
        """Copy ``staged`` into the chunk's target; ``buffer`` (a ring buffer) goes back after."""
        self._handed.put((chunk, staged, buffer))

    def close(self) -> None:
        self._handed.put(None)
        self._thread.join()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        in_flight: deque = deque()  # (event, ring buffer) of copies still running
        try:
            while True:
                while in_flight and in_flight[0][0].query():
                    self._ring.release(in_flight.popleft()[1])
                try:
                    item = self._handed.get(block=not in_flight)
                except queue.Empty:
                    # Nothing to issue: wait for the oldest copy, a reader may need its buffer.
                    event, buffer = in_flight.popleft()
                    event.synchronize()
                    self._ring.release(buffer)
                    continue
                if item is None:
                    return
                chunk, staged, buffer = item
                event = None
                if not self._stop.is_set():
                    try:
                        event = _deliver(chunk, staged, self._streams)
                    except BaseException as error:  # keep serving: readers wait for buffers
                        self._failure = self._failure or error
                        self._stop.set()
                if buffer is None:
                    continue
                if event is None:
                    self._ring.release(buffer)
                else:
                    in_flight.append((event, buffer))
        finally:
            for event, buffer in in_flight:
                event.synchronize()
                self._ring.release(buffer)


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


def _side_streams(devices) -> dict[torch.device, torch.cuda.Stream]:
    streams = {}
    for device in devices:
        stream = torch.cuda.Stream(device)
        # Destinations may reuse memory the current stream still reads: start after it.
        stream.wait_stream(torch.cuda.current_stream(device))
        streams[device] = stream
    return streams


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
        itemsize = info.dtype.itemsize
        step = max(itemsize, buffer_bytes // itemsize * itemsize)
        for lo in range(0, info.nbytes, step):
            chunks.append(_Chunk(job, target, lo, min(lo + step, info.nbytes), direct))
    return chunks, temporaries


def _run_chunk(chunk, files, ring, copier, stop, bar, component) -> None:
    if stop.is_set():
        return
    job, info = chunk.job, chunk.job.info
    length = chunk.hi - chunk.lo
    fd = files[info.path]
    on_device = chunk.target.device.type == "cuda"
    if chunk.direct:
        address = chunk.target.data_ptr() + chunk.lo
        _pread_exact(fd, address, length, info.start + chunk.lo, info, component)
    elif job.capture is not None:
        staged = job.capture[chunk.lo : chunk.hi]
        _pread_exact(fd, staged.data_ptr(), length, info.start + chunk.lo, info, component)
        if on_device:
            copier.hand(chunk, staged, None)
        else:
            _deliver(chunk, staged, {})
    else:
        buffer = ring.acquire(stop)
        if buffer is None:
            return  # stopped while waiting
        handed = False
        try:
            staged = buffer[:length]
            _pread_exact(fd, staged.data_ptr(), length, info.start + chunk.lo, info, component)
            if on_device:
                copier.hand(chunk, staged, buffer)
                handed = True
            else:
                _deliver(chunk, staged, {})
        finally:
            if not handed:
                ring.release(buffer)
    if bar is not None:
        with _BAR_LOCK:
            bar.update(length)


def _deliver(chunk: _Chunk, staged: torch.Tensor, streams) -> torch.cuda.Event | None:
    """Copy staged file bytes into the chunk's part of the target, casting if needed."""
    itemsize = chunk.job.info.dtype.itemsize
    source = staged.view(chunk.job.info.dtype)
    target = chunk.target.view(-1)[chunk.lo // itemsize : chunk.hi // itemsize]
    stream = streams.get(chunk.target.device)
    if stream is None:
        target.copy_(source)
        return None
    with torch.cuda.stream(stream):
        target.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


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


class _Ring:
    """A few reusable staging buffers, made as first needed; one is handed out again only
    once it is released (for a device copy: once that copy has finished)."""

    def __init__(self, buffer_bytes: int, count: int, *, pinned: bool):
        self._buffer_bytes = buffer_bytes
        self._pinned = pinned and torch.cuda.is_available()
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._remaining = max(1, count)

    def acquire(self, stop: threading.Event) -> torch.Tensor | None:
        """A free buffer, or None once ``stop`` is set."""
        with self._lock:
            grow = self._free.empty() and self._remaining > 0
            if grow:
                self._remaining -= 1
        if grow:
            return torch.empty(self._buffer_bytes, dtype=torch.uint8, pin_memory=self._pinned)
        while not stop.is_set():
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


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
