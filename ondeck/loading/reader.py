"""Stream safetensors data into tensors that already sit where they will live.

Data is read with ``os.preadv`` in chunks. A CPU destination of the file's dtype is read
into directly, with no copy. Anything else is staged through a small ring of host
buffers and copied, so the next read overlaps the current copy. Host memory a load takes
is the ring, never the file. Two kinds of reader fill the ring:

- Reading processes (:mod:`.process_reader`), for loads into CUDA memory: they pread into
  a ring of shared memory registered with CUDA, and one thread here (``_feed``) hands out
  the chunks and issues every copy, through the CUDA driver where it can be called
  (:mod:`.driver`: half the thread's time per chunk of ``Tensor.copy_``). No reader
  holds this process's GIL.
- Threads of this process (``_read_chunks``), for everything else and as the fallback.
  Each owns its share of a ring of pinned buffers and its own side stream, and issues its
  own copies: a chunk costs a few GIL hand-overs (the read, the copy, at times a wait for
  the buffer's last copy) and nothing is passed between threads. Every hand-over is
  contended by all the threads, which holds a warm page-cache load to about half of what
  the processes reach (BENCHMARKS.md).

A pipelined load reads its groups of blocks in one read through the processes
(:func:`read_in_groups`): the copying thread hands each group over, in order, with
events its copies and casts end with, and the caller's thread waits on them and lets
the group compute. Group after group as separate reads, each drained and started anew,
left the copy engine idle 3-5 ms between groups.

A cast to a CUDA destination (file dtype differs) goes through a staging buffer on the
device in the file's dtype, one per copying thread, in two halves (:class:`_DeviceCasts`).
Chunks are copied into one half, one after the other, on the thread's stream; once it is
full, the casts out of it are issued together on a stream of their own while the next
chunks are copied into the other half. The copy engine runs as it does for a load without
a cast, and the two streams wait for each other once per half, not once per chunk: cast
after each chunk's copy on one stream, the copies stop for every cast (BENCHMARKS.md
compares the two: the halves read closer to bf16's rate, still short of it).
A tensor's chunks that lie side by side in a half are cast in one operation. The load
allocates the buffers on the caller's stream before the copies' fence, so the allocator
reuses them from one load (or pipelined group) to the next; allocated on a side stream,
each would be a new allocator segment per group.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from ..errors import LoadError
from . import process_reader
from .chunks import (
    BAR_LOCK,
    Chunk,
    ChunkPlan,
    ReadJob,
    ReadStats,
    plan_chunks,
    progress_bar,
    reads_directly,
    where,
)
from .driver import Driver, driver
from .host_cache import HostCopy
from .page_cache import describe_source
from .reading_process import FILE_ENDED
from .safetensors_format import TensorInfo, check_unchanged

__all__ = [
    "ReadJob",
    "ReadStats",
    "HostCopy",
    "progress_bar",
    "read_into",
    "read_in_groups",
    "DEFAULT_BUFFER_BYTES",
]

# (buffer bytes, buffer count) by default. The threads' ring of pinned buffers: larger
# chunks mean fewer GIL hand-overs. The processes' ring: small enough to stay in a server
# CPU's last-level cache, as every byte is written to it and read back by the copy engine
# and a ring that spills to DRAM adds two passes over memory (benchmarks/read_path.py:
# 4 MiB x 24 beat 8 MiB x 32 there, and 8 MiB x 32 beat 4 MiB x 24 on threads).
THREAD_RING = (8 * 2**20, 32)
PROCESS_RING = (4 * 2**20, 24)
DEFAULT_BUFFER_BYTES = THREAD_RING[0]
# Copies from the reading processes' ring to one device go through the CUDA driver
# (:mod:`.driver`) where it can be called; False: through torch.
DRIVER_COPIES = True
# The staging's parts, filled in turn (two: halves).
CAST_SECTIONS = 2
# Device bytes a load's casts are staged in, shared among its copying threads. A thread
# whose share holds less than two chunks gets one chunk and casts chunk by chunk.
CAST_STAGING_BYTES = 32 * 2**20
# A failed or stopped load waits this long for the processes' last reads to answer.
STUCK_READ_SECONDS = 60


def read_into(
    jobs: Sequence[ReadJob],
    *,
    threads: int | None = None,
    buffer_bytes: int | None = None,
    buffer_count: int | None = None,
    progress: bool = True,
    component: str | None = None,
    while_reading: Callable[[], None] | None = None,
    processes: bool | None = None,
    bar: Any = None,
    _lease: process_reader.Lease | None = None,
    _grouped: tuple[Sequence[int], int, Callable[[int], None]] | None = None,
) -> ReadStats:
    """Read every job's tensor from its file into its destination. Blocks until done.

    ``while_reading`` runs on the calling thread once the reads have started (CPU work
    that overlaps them). A read that fails raises :class:`LoadError` naming the file and
    tensor, as does a reading process that dies mid-load; other errors (CUDA, pinned
    memory, ``while_reading``'s own) propagate as they are. Either way the readers have
    stopped and their device copies have finished before it propagates (a second
    interrupt during that wait is the one way out earlier).

    ``processes``: read through ``threads`` reading processes (:mod:`.process_reader`);
    by default when some destination is on CUDA and none is a CPU tensor of the file's
    dtype; never when a job captures. Where they are unavailable or busy, threads read
    instead. ``buffer_bytes`` and ``buffer_count`` default to :data:`PROCESS_RING` or
    :data:`THREAD_RING`. ``bar``: a progress bar to advance (left open) instead of one of
    its own, for a load read in several parts. (``_lease``, ``_grouped``: see
    :func:`read_in_groups`.)
    """
    _check_sizes(threads, buffer_bytes, buffer_count)
    started = time.perf_counter()
    total = sum(job.info.nbytes for job in jobs)
    paths = sorted({job.info.path for job in jobs if job.info.nbytes})
    source = describe_source(paths) if paths else "disk"
    devices = {job.destination.device for job in jobs if job.destination.device.type == "cuda"}
    pinned = bool(devices)
    lease = _lease
    own_bar = bar is None
    files: dict[str, int] = {}
    workers: list[threading.Thread] = []
    bar = None
    try:
        if lease is None:
            lease = _lease_if_wanted(jobs, processes, devices, threads, buffer_bytes, buffer_count)
        if lease is not None:
            buffer_bytes, buffer_count = lease.pool.slot_bytes, lease.pool.slot_count
        else:
            buffer_bytes = max(buffer_bytes or THREAD_RING[0], 64)
            buffer_count = buffer_count or THREAD_RING[1]
            if pinned:
                # The pinned allocator rounds each buffer up to a power of two: round
                # down instead, so the ring stays within buffer_bytes x buffer_count.
                buffer_bytes = 1 << (buffer_bytes.bit_length() - 1)
        groups = _grouped[0] if _grouped is not None else None
        chunks, temporaries = plan_chunks(jobs, buffer_bytes, component, groups)
        worker_count = threads or min(16, max(4, os.cpu_count() or 4))
        staging = any(not job.direct and job.job.capture is None for job in chunks.jobs)
        if staging:
            # Each thread owns two ring buffers or more (one is read into while the
            # other's copy runs): the ring, not the thread count, bounds memory.
            worker_count = min(worker_count, max(1, buffer_count // 2))
        worker_count = max(1, min(worker_count, len(chunks)))
        if lease is not None:
            worker_count = 1  # the thread that feeds the processes and issues the copies
        if own_bar:
            bar = progress_bar(total, progress, component, source)
        state = _ReadState(
            chunks=chunks,
            files=files,
            # Before the fences: the copies that use it start after the caller's stream.
            staging=_cast_staging(chunks, buffer_bytes, worker_count),
            fences=_fences(devices),
            buffer_bytes=buffer_bytes,
            buffers_per_thread=max(1, buffer_count // worker_count),
            pinned=pinned,
            bar=bar,
            component=component,
        )
        if _grouped is not None:
            if lease is None:
                raise ValueError("a read in groups goes through the reading processes")
            groups, count, reached = _grouped
            state.count_groups(count)
            job_group = dict(zip(map(id, jobs), groups, strict=True))
            waiting: dict[int, list] = {}
            for target, job in temporaries:
                waiting.setdefault(job_group[id(job)], []).append((target, job))
            temporaries = []  # each group's are copied in once it is reached
            while_reading = _reaching(state, reached, waiting)
            if not chunks:
                state.advance_groups({}, {})
        identities = {job.info.path: job.info.identity for job in jobs}
        for path in paths:
            files[path] = _open(path, component)
            check_unchanged(path, identities.get(path), component=component, descriptor=files[path])
        for index in range(worker_count if chunks else 0):
            # Listed before it starts: an interrupt inside start() still finds it to join.
            target, args = (_read_chunks, (state,)) if lease is None else (_feed, (state, lease))
            workers.append(
                threading.Thread(target=target, args=args, name=f"ondeck-read-{index}", daemon=True)
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
        try:
            if workers:  # left early (an interrupt, say): let no worker outlive the read
                state.fail(LoadError("the read was interrupted", component=component))
            if lease is not None:
                # A feeder that claimed the processes releases them itself; one not yet
                # started now never will.
                lease.release_unclaimed()
            _join(workers)
        finally:
            for fd in files.values():
                os.close(fd)
            if bar is not None and own_bar:
                bar.close()
    readers = "threads" if lease is None else "processes"
    return ReadStats(total, time.perf_counter() - started, source, readers)


def read_in_groups(
    groups: Sequence[Sequence[ReadJob]],
    reached: Callable[[int], None],
    *,
    threads: int | None = None,
    buffer_bytes: int | None = None,
    buffer_count: int | None = None,
    progress: bool = True,
    component: str | None = None,
    processes: bool | None = None,
    bar: Any = None,
) -> ReadStats:
    """Read ``groups`` of jobs in order (a pipelined load: the parts a forward pass uses
    first, then each block). ``reached(i)`` runs on the calling thread once group ``i``
    is complete on its devices, group after group, while the later groups are read; an
    error it raises stops the read and propagates.

    Through the reading processes (as :func:`read_into` chooses them) it is one read:
    the next group's chunks are read and copied while the last ones of a group are, and
    nothing drains or starts again between groups (each did: about 4 ms a group on the
    H200, a third of a 0.3 s text encoder load). Otherwise one read per group.
    """
    _check_sizes(threads, buffer_bytes, buffer_count)  # before the lease, which read_into frees
    jobs = [job for group in groups for job in group]
    devices = {job.destination.device for job in jobs if job.destination.device.type == "cuda"}
    lease = _lease_if_wanted(jobs, processes, devices, threads, buffer_bytes, buffer_count)
    options = dict(threads=threads, buffer_bytes=buffer_bytes, buffer_count=buffer_count)
    options.update(progress=progress, component=component, bar=bar)
    if lease is not None:
        indices = [index for index, group in enumerate(groups) for _ in group]
        return read_into(jobs, _lease=lease, _grouped=(indices, len(groups), reached), **options)
    started = time.perf_counter()
    parts = []
    for index, group in enumerate(groups):
        parts.append(read_into(group, processes=processes, **options))
        # A destination that is not contiguous was copied in on this thread's stream.
        _synchronize_current(j.destination for j in group if not j.destination.is_contiguous())
        reached(index)
    sources = [part.source for part in parts if part.nbytes] or ["disk"]
    return ReadStats(
        sum(part.nbytes for part in parts),
        time.perf_counter() - started,
        sources[0],
        parts[-1].readers if parts else "threads",
    )


def _synchronize_current(destinations: Iterable[torch.Tensor]) -> None:
    """Wait for this thread's current stream on each CUDA device of ``destinations``: the
    temporaries of destinations that are not contiguous are copied in on it."""
    for device in {tensor.device for tensor in destinations}:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _check_sizes(threads, buffer_bytes, buffer_count) -> None:
    sizes = {"threads": threads, "buffer_bytes": buffer_bytes, "buffer_count": buffer_count}
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")


def _join(workers: list[threading.Thread]) -> None:
    """Wait for every started worker (each waits for its own device copies), and forget them."""
    for worker in workers:
        while worker.ident is not None:
            try:
                worker.join()
                break
            except RuntimeError:  # interrupted inside start(): running, not yet joinable
                time.sleep(0.001)
    workers.clear()


@dataclass
class _ReadState:
    """What every reading thread shares: the chunks, handed out in order, and the outcome."""

    chunks: ChunkPlan
    files: dict
    # device -> one staging buffer per copying thread, for casts on the device
    staging: dict
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
        self.group_chunks: list[int] | None = None  # a read in groups: see count_groups

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error
        self.stop.set()

    # A read in groups (``read_in_groups``): the one copying thread counts each group's
    # chunks as it issues their copies and, group by group in order, hands the caller's
    # thread the events its copies and casts end with.

    def count_groups(self, count: int) -> None:
        self.group_chunks = [0] * count
        for job in self.chunks.jobs:
            self.group_chunks[job.group] += job.count
        self.delivered = [0] * count
        self.next_group = 0
        self.reached: queue.SimpleQueue = queue.SimpleQueue()

    def delivered_chunk(self, chunk: Chunk, streams: dict, casts: dict) -> None:
        if self.group_chunks is not None:
            self.delivered[chunk.group] += 1
            self.advance_groups(streams, casts)

    def advance_groups(self, streams: dict, casts: dict) -> None:
        """Hand over every group whose copies are all issued, and all before it."""
        counts = self.group_chunks
        while (
            self.next_group < len(counts)
            and self.delivered[self.next_group] == counts[self.next_group]
        ):
            events = []
            for device_casts in casts.values():
                device_casts.flush()  # its casts too, out of a half it then leaves
                if device_casts.casts is not device_casts.copies:
                    events.append(_recorded(device_casts.casts))
            events.extend(_recorded(stream) for stream in streams.values())
            self.reached.put((self.next_group, events))
            self.next_group += 1


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _reaching(state: _ReadState, reached: Callable[[int], None], waiting: dict) -> Callable:
    """The calling thread's part of a read in groups: wait for each group's copies and
    casts on the device, in order, copy in its temporaries (``waiting``), then hand it
    to ``reached``. Returns early if the read stops (its error is raised after)."""

    def reach() -> None:
        for _ in range(len(state.group_chunks)):
            while True:
                try:
                    group, events = state.reached.get(timeout=0.05)
                    break
                except queue.Empty:
                    if state.stop.is_set():
                        return
            for event in events:
                event.synchronize()
            copies = waiting.pop(group, ())
            for target, job in copies:
                job.destination.copy_(target)
            _synchronize_current(job.destination for _, job in copies)
            reached(group)

    return reach


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

    def finished(self) -> bool:
        """Whether its last copy is done, without waiting."""
        if self.copying and self.event.query():
            self.copying = False
        return not self.copying

    def mark_copying(self, stream: torch.cuda.Stream) -> None:
        if self.event is None or self.event_device != stream.device:
            self.event, self.event_device = torch.cuda.Event(), stream.device
        self.event.record(stream)
        self.copying = True


class _DriverSlot(_Slot):
    """A ring slot of a read onto one device whose copies go through the driver
    (``_deliver`` given one): its event is recorded on that device's copy stream and
    polled through the driver too."""

    def __init__(self, buffer: torch.Tensor, driver: Driver, stream: torch.cuda.Stream):
        super().__init__(buffer)
        self.event, self.event_device = torch.cuda.Event(), stream.device
        self.event.record(stream)  # torch makes the event on its first record
        self.handle, self.stream = self.event.cuda_event, stream.cuda_stream
        self.driver = driver

    def finished(self) -> bool:
        if self.copying and self.driver.done(self.handle):
            self.copying = False
        return not self.copying

    def mark_copying(self, stream: torch.cuda.Stream) -> None:
        self.driver.record(self.handle, self.stream)
        self.copying = True


def _cast_staging(chunks: ChunkPlan, buffer_bytes: int, workers: int) -> dict:
    """For each CUDA device some chunk is cast on: ``workers`` staging buffers
    (``_staging_bytes``), allocated on the caller's current stream."""
    devices = {j.target.device for j in chunks.jobs if j.cast and j.target.device.type == "cuda"}
    nbytes = _staging_bytes(buffer_bytes, workers)
    return {
        device: [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(workers)]
        for device in devices
    }


# Each chunk's place in a staging half starts at a multiple of this: a view of any dtype.
_ALIGN = 256


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _staging_bytes(buffer_bytes: int, workers: int) -> int:
    """A copying thread's staging buffer: its share of :data:`CAST_STAGING_BYTES`, two
    aligned halves, where that holds two chunks; else one chunk."""
    share = CAST_STAGING_BYTES // workers // (2 * _ALIGN) * (2 * _ALIGN)
    chunk = _aligned(buffer_bytes)
    return share if share >= 2 * chunk else chunk


class _DeviceCasts:
    """One copying thread's casts on one device, staged in the halves of its buffer (or
    :data:`CAST_SECTIONS` parts of it, filled in turn as the halves are).

    ``add`` copies a chunk's file bytes into the current half on the thread's stream
    (``copies``). When the half is full, ``flush`` issues every cast out of it on the
    ``casts`` stream, after the copies, and the next chunks go to the other half, once
    the casts last issued from that one are done. Chunks of one tensor that arrive in
    order lie side by side in the half and are cast in one operation.

    This runs on the copying thread for every chunk, and that one Python thread also
    feeds the reading processes and issues every copy: its time per chunk bounds the
    read. So ``add`` issues the copy into a view made once (a whole chunk's place in a
    half) and keeps byte offsets; typed views are made in ``flush``, once per run of
    chunks, with the cast stream set current by hand rather than through a context.
    With ``driver`` (the processes' thread, one device) the copies, event records,
    queries and stream waits go through the driver by handle, and the cast stream
    stays current: only the casts themselves go through torch.

    A buffer too small for two chunks of ``chunk_bytes`` is one half: each chunk's casts
    are issued on the thread's stream when the next chunk comes, before its copy.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        copies: torch.cuda.Stream,
        fence,
        chunk_bytes: int,
        driver: Driver | None = None,
    ):
        self.copies = copies
        self.driver = driver
        sections = min(CAST_SECTIONS, buffer.numel() // _aligned(chunk_bytes))
        if sections >= 2:
            size = buffer.numel() // sections // _ALIGN * _ALIGN
            self.halves = tuple(buffer[i * size : (i + 1) * size] for i in range(sections))
            self.casts = torch.cuda.Stream(copies.device)
            self.casts.wait_event(fence)  # its casts write where the caller's stream may read
        else:
            self.halves = (buffer,)
            self.casts = copies
        self.half_bytes = self.halves[0].numel()
        self.chunk_bytes, self.step = chunk_bytes, _aligned(chunk_bytes)
        if driver is not None:  # copies by address
            self.addresses = tuple(half.data_ptr() for half in self.halves)
        else:
            # A whole chunk's places in each half, at multiples of its aligned size.
            last = self.half_bytes - chunk_bytes  # the last start a whole chunk fits at
            self.places = tuple(
                [half[start : start + chunk_bytes] for start in range(0, last + 1, self.step)]
                for half in self.halves
            )
        self.cast = tuple(torch.cuda.Event() for _ in self.halves)
        self.copied = torch.cuda.Event()  # the casts of a half start after its copies
        self.cast_issued = [False] * len(self.halves)
        self.current = 0
        self.used = 0
        self.pending: list[_Staged] = []
        if driver is not None:
            self._by_driver()

    def _by_driver(self) -> None:
        """Copies, event records, queries and stream waits through the driver, by handle;
        the thread's current stream becomes the casts' (torch issues the casts there),
        unless the casts follow the copies on one stream."""
        self.copies_handle = self.copies.cuda_stream
        self.casts_handle = self.casts.cuda_stream
        # torch makes an event on its first record: here, where it waits for nothing.
        for event in self.cast:
            event.record(self.casts)
        self.copied.record(self.copies)
        self.cast_handles = tuple(event.cuda_event for event in self.cast)
        self.copied_handle = self.copied.cuda_event
        if self.casts is not self.copies:
            torch.cuda.set_stream(self.casts)

    def add(self, chunk: Chunk, source: torch.Tensor) -> None:
        """Stage ``chunk``'s file bytes for its cast from ``source`` (pinned host bytes,
        ``uint8``, starting with the chunk's: a ring slot may be longer)."""
        nbytes = chunk.hi - chunk.lo
        if self.used + nbytes > self.half_bytes:
            self.flush()
        start, current = self.used, self.current
        if start == 0 and self.cast_issued[current]:
            self.cast_issued[current] = False
            self._wait_for_casts(current)
        if self.driver is not None:
            address = self.addresses[current] + start
            self.driver.copy(address, source.data_ptr(), nbytes, self.copies_handle)
        else:
            if nbytes == self.chunk_bytes and start % self.step == 0:
                place = self.places[current][start // self.step]
            else:
                place = self.halves[current][start : start + nbytes]
            place.copy_(source if source.numel() == nbytes else source[:nbytes], non_blocking=True)
        end = start + nbytes
        self.used = _aligned(end)
        pending = self.pending
        last = pending[-1] if pending else None
        if last is not None and last.job is chunk.job and last.hi == chunk.lo and last.end == start:
            # The tensor's next bytes, staged right behind its last ones: one cast for both.
            last.hi, last.end = chunk.hi, end
        else:
            pending.append(_Staged(chunk.job, chunk.target, start, chunk.lo, chunk.hi, end))

    def _wait_for_casts(self, half: int) -> None:
        """Before copying into ``half`` again: its last casts read it. Usually they are
        done by now (the other half was filled meanwhile), and then the copy stream is
        not made to wait at all."""
        driver = self.driver
        if driver is None:
            if not self.cast[half].query():
                self.copies.wait_event(self.cast[half])
        elif not driver.done(self.cast_handles[half]):
            driver.wait(self.copies_handle, self.cast_handles[half])

    def flush(self) -> None:
        """Issue the casts of every chunk staged in the current half; later chunks go to
        the other half, once its last casts are done."""
        if not self.pending:
            return
        half = self.halves[self.current]
        if self.casts is self.copies:  # one half: in stream order behind the copies
            self._issue(self.pending, half)
        elif self.driver is not None:  # the casts' stream is current (``_by_driver``)
            driver, current = self.driver, self.current
            driver.record(self.copied_handle, self.copies_handle)
            driver.wait(self.casts_handle, self.copied_handle)
            self._issue(self.pending, half)
            driver.record(self.cast_handles[current], self.casts_handle)
            self.cast_issued[current] = True
        else:
            # Not ``wait_stream``: that makes a new event every time.
            self.copied.record(self.copies)
            self.casts.wait_event(self.copied)
            torch.cuda.set_stream(self.casts)  # the thread's current stream is the copies'
            try:
                self._issue(self.pending, half)
            finally:
                torch.cuda.set_stream(self.copies)
            self.cast[self.current].record(self.casts)
            self.cast_issued[self.current] = True
        self.pending = []
        self.used = 0
        self.current = (self.current + 1) % len(self.halves)

    @staticmethod
    def _issue(pending: list[_Staged], half: torch.Tensor) -> None:
        """Every cast out of ``half``: one ``copy_`` for the usual half (a run of one
        tensor's chunks), else one call for all its runs, not one per run."""
        targets, sources = [], []
        for staged in pending:
            info, via = staged.job.info, staged.job.via
            source = half[staged.start : staged.end].view(info.dtype)
            first = staged.lo // info.dtype.itemsize
            targets.append(staged.target[first : first + source.numel()])
            sources.append(source if via is None else source.to(via))
        if len(targets) == 1:  # the usual half: one tensor's run
            targets[0].copy_(sources[0], non_blocking=True)
        else:
            _copy_all(targets, sources)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, issued by one call where torch has
    it (``_foreach_copy_`` casts as ``copy_`` does; it is not public API, so a torch
    without it gets the loop)."""
    copy_all = getattr(torch, "_foreach_copy_", None)
    if copy_all is not None:
        copy_all(targets, sources, non_blocking=True)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source, non_blocking=True)


@dataclass(slots=True)
class _Staged:
    """Consecutive bytes of one tensor staged in a half, from ``start`` to ``end`` there,
    bytes ``lo`` to ``hi`` of the tensor's file data; ``target``: the chunks' target (all
    of the destination's elements, flat)."""

    job: ReadJob
    target: torch.Tensor
    start: int
    lo: int
    hi: int
    end: int


def _device_casts(state: _ReadState, streams: dict, driver: Driver | None = None) -> dict:
    """This copying thread's :class:`_DeviceCasts` on each device that casts, copying
    through ``driver`` if given."""
    return {
        device: _DeviceCasts(
            buffers.pop(), streams[device], state.fences[device], state.buffer_bytes, driver
        )
        for device, buffers in state.staging.items()
        if buffers
    }


def _finish_casts(casts: dict, state: _ReadState) -> None:
    """Issue the casts still staged (unless the read failed), then wait for them."""
    for device_casts in casts.values():
        try:
            if state.failure is None:
                device_casts.flush()
        except BaseException as error:
            state.fail(error)
    _wait_for({i: c.casts for i, c in enumerate(casts.values()) if c.casts is not c.copies}, state)


def _fences(devices) -> dict:
    """Destinations may reuse memory the caller's stream still reads: copies start after it."""
    return {device: _recorded(torch.cuda.current_stream(device)) for device in devices}


def _side_streams(fences: dict) -> dict:
    """A side stream per device for the calling thread, made current there (the thread's
    copies to that device go to it), starting after the caller's fence."""
    streams = {}
    for device, fence in fences.items():
        stream = torch.cuda.Stream(device)
        stream.wait_event(fence)
        torch.cuda.set_stream(stream)
        streams[device] = stream
    return streams


def _wait_for(streams: dict, state: _ReadState) -> None:
    """Wait for every stream, also after a failure (the caller frees the destinations
    then); an asynchronous copy error surfacing here fails the read."""
    for stream in streams.values():
        try:
            stream.synchronize()
        except BaseException as error:
            state.fail(error)


def _read_chunks(state: _ReadState) -> None:
    """A reading thread: take the next chunk until none are left or the read has failed."""
    streams = {}
    casts = {}
    slots: deque[_Slot] = deque()
    try:
        streams = _side_streams(state.fences)
        casts = _device_casts(state, streams)
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
                _pread_exact(fd, chunk.address, length, offset, info, state.component)
            elif job.capture is not None:
                staged = job.capture[chunk.lo : chunk.hi]
                _pread_exact(fd, staged.data_ptr(), length, offset, info, state.component)
                _deliver(chunk, staged, streams, casts)
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
                stream = _deliver(chunk, staged, streams, casts)
                if stream is not None:
                    slot.mark_copying(stream)
            if state.bar is not None:
                with BAR_LOCK:
                    state.bar.update(length)
    except BaseException as error:
        state.fail(error)
    finally:
        _finish_casts(casts, state)
        _wait_for(streams, state)


def _processes_wanted(jobs: Sequence[ReadJob], processes: bool | None, devices) -> bool:
    """Asked for, or by default: destinations on CUDA, none read into directly. Never
    when a job captures (the capture buffer is the staging buffer then)."""
    if any(job.capture is not None for job in jobs):
        return False
    if processes is not None:
        return processes
    return bool(devices) and not any(reads_directly(job) for job in jobs)


def _lease_if_wanted(jobs, processes, devices, threads, buffer_bytes, buffer_count):
    """The reading processes' lease for a read of ``jobs``, if it has bytes and wants
    them (``_processes_wanted``) and they are free; else None."""
    if any(job.info.nbytes for job in jobs) and _processes_wanted(jobs, processes, devices):
        return _lease_processes(threads, buffer_bytes, buffer_count, pinned=bool(devices))
    return None


def _lease_processes(threads, buffer_bytes, buffer_count, pinned):
    # Slots start at multiples of the slot size: keep them aligned for every dtype.
    slot_bytes = max(64, (buffer_bytes or PROCESS_RING[0]) // 64 * 64)
    slot_count = buffer_count or PROCESS_RING[1]
    # Each process owns two ring slots or more, as each thread owns two buffers, and no
    # more than its socket can hold the answers of.
    count = min(threads or default_processes(), max(1, slot_count // 2))
    slot_count = min(slot_count, count * process_reader.MAX_SLOTS_PER_PROCESS)
    return process_reader.acquire(count, slot_bytes, slot_count, register=pinned)


def default_processes() -> int:
    """Reading processes per load: enough that page-cache copies are not the limit (12
    on the H200 machine's 16 cores), leaving cores for the thread that issues the copies
    and for building the module; shared among the ranks a launcher started on this host
    (``LOCAL_WORLD_SIZE``), which load at the same time."""
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(12, (os.cpu_count() or 4) * 3 // 4 // ranks))


def _feed(state: _ReadState, lease: process_reader.Lease) -> None:
    """The one thread of a load read by processes: hand each free ring slot the next
    chunk, and copy each slot that comes back full into its chunk's target. A slot is free
    again once its copy has finished."""
    if not lease.claim():  # the load was given up before this thread started
        state.fail(LoadError("the read was interrupted", component=state.component))
        return
    try:
        _feed_claimed(state, lease.pool)
    finally:
        lease.release()


def _feed_claimed(state: _ReadState, pool: process_reader.ReadingProcesses) -> None:
    streams = {}
    casts = {}
    # slot -> the chunk being read into it, and its number in the plan
    reading: dict[int, tuple[int, Chunk]] = {}
    requested = 0
    opened = False
    try:
        streams = _side_streams(state.fences)
        driver = _driver_for(streams)
        casts = _device_casts(state, streams, driver)
        file_ids = pool.open_files(state.files)
        opened = True
        if state.group_chunks is not None:
            state.advance_groups(streams, casts)  # groups with nothing to read
        if driver is None:
            slots = [_Slot(pool.slot(index)) for index in range(pool.slot_count)]
        else:
            (stream,) = streams.values()
            slots = [_DriverSlot(pool.slot(i), driver, stream) for i in range(pool.slot_count)]
        free = deque(range(pool.slot_count))
        copying: deque[int] = deque()  # slots whose copies run, in the order issued
        chunks = iter(state.chunks)
        left = len(state.chunks)
        while left and not state.stop.is_set():
            while copying and slots[copying[0]].finished():
                free.append(copying.popleft())
            while free and len(reading) < left:
                chunk = next(chunks)
                slot = free.popleft()
                info = chunk.job.info
                pool.request(slot, file_ids[info.path], info.start + chunk.lo, chunk.hi - chunk.lo)
                reading[slot] = (requested, chunk)
                requested += 1
            if not reading:  # every slot waits for its copy
                slots[copying[0]].wait()
                continue
            # Poll soon while copies may free slots; otherwise wait, waking to notice a stop.
            # Every answered slot leaves ``reading`` before any copy is issued: if one
            # fails, the clean-up must not wait for answers that already came.
            answered = [
                (*reading.pop(slot), slot, status, reached)
                for slot, status, reached in pool.replies(0.0002 if copying else 0.05)
            ]
            # In plan order: a tensor's chunks answered together are staged side by side
            # and cast as one.
            answered.sort(key=itemgetter(0))
            for _, chunk, slot, status, reached in answered:
                if status:
                    reason = None if status == FILE_ENDED else os.strerror(status)
                    raise _read_error(chunk.job.info, state.component, reached, reason)
                stream = _deliver(chunk, slots[slot].buffer, streams, casts, driver)
                if stream is None:
                    free.append(slot)
                else:
                    slots[slot].mark_copying(stream)
                    copying.append(slot)
                state.delivered_chunk(chunk, streams, casts)
                left -= 1
                if state.bar is not None:
                    state.bar.update(chunk.hi - chunk.lo)
    except process_reader.ReadingProcessExited as error:
        where = f"component '{state.component}': " if state.component else ""
        state.fail(LoadError(f"{where}{error}", component=state.component))
    except BaseException as error:
        state.fail(error)
    finally:
        # The processes are shared by the next load: let no answer of this one reach it.
        try:
            silent_seconds = 0
            while reading and not pool.broken:
                answers = pool.replies(1.0)
                for slot, _, _ in answers:
                    reading.pop(slot, None)
                silent_seconds = 0 if answers else silent_seconds + 1
                if silent_seconds >= STUCK_READ_SECONDS:
                    pool.broken = True  # a read hung (a dead disk?): start afresh next load
            if opened and not pool.broken:
                pool.close_files()
        except process_reader.ReadingProcessExited:
            # Every byte answered is in place; only the processes are in doubt: the next
            # load starts new ones. (A load that failed keeps its own error.)
            pool.broken = True
        except BaseException as error:
            pool.broken = True
            state.fail(error)
        _finish_casts(casts, state)
        _wait_for(streams, state)


def _read_error(info: TensorInfo, component: str | None, reached: int, reason: str | None):
    """The error of a read that failed at byte ``reached`` with ``reason``, or ended
    early when ``reason`` is None."""
    if reason is None:
        problem = (
            f"file ended at byte {reached}, the header places the tensor up to byte "
            f"{info.end} (truncated download?)"
        )
    else:
        problem = f"read failed at byte {reached}: {reason}"
    return LoadError(f"{where(info, component)}: {problem}", component=component, path=info.path)


def _driver_for(streams: dict) -> Driver | None:
    """The driver's calls for a copying thread whose copies all go to one CUDA device
    (made current on this thread: the calls act on its context), if it can be called
    and :data:`DRIVER_COPIES`; else None (copies by torch)."""
    if not DRIVER_COPIES or len(streams) != 1:
        return None
    (device,) = streams
    calls = driver() if device.type == "cuda" else None
    if calls is not None:
        torch.cuda.set_device(device)
    return calls


def _deliver(
    chunk: Chunk,
    staged: torch.Tensor,
    streams: dict,
    casts: dict,
    driver: Driver | None = None,
) -> torch.cuda.Stream | None:
    """Copy staged file bytes into the chunk's target, casting if needed. ``staged``:
    pinned host bytes starting with the chunk's (a ring slot may be longer). A device
    copy is issued on this thread's stream for the device, which is returned, through
    ``driver`` if given (every CUDA destination is then on that stream's device).
    ``casts``: this thread's :class:`_DeviceCasts` on each device that casts."""
    device = chunk.target.device
    stream = streams.get(device)
    if chunk.cast and stream is not None:
        # Cast on the device: a host-to-device copy_ that changes the dtype converts on
        # the host first, on this thread, and the read then runs at the CPU's pace.
        casts[device].add(chunk, staged)
        return stream
    nbytes = chunk.hi - chunk.lo
    if driver is not None and stream is not None:
        driver.copy(chunk.address, staged.data_ptr(), nbytes, stream.cuda_stream)
        return stream
    if staged.numel() != nbytes:
        staged = staged[:nbytes]
    source = staged.view(chunk.job.info.dtype) if chunk.cast else staged
    if chunk.cast and chunk.job.via is not None:
        source = source.to(chunk.job.via)
    chunk.part().copy_(source, non_blocking=stream is not None)
    return stream


def _pread_exact(fd: int, address: int, length: int, offset: int, info, component) -> None:
    done = 0
    while done < length:
        view = (ctypes.c_char * (length - done)).from_address(address + done)
        try:
            count = os.preadv(fd, [view], offset + done)
        except OSError as error:
            reason = error.strerror or str(error)
            raise _read_error(info, component, offset + done, reason) from error
        if count == 0:
            raise _read_error(info, component, offset + done, None)
        done += count


def _open(path: str, component: str | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as error:
        where = f"component '{component}' from {path}" if component else path
        raise LoadError(
            f"{where}: cannot open ({error.strerror or error})", component=component, path=path
        ) from error
