"""Feeding the reading processes: one thread of a load hands each free slot of their
shared ring the next chunk, and copies each slot that comes back full into its chunk's
target, through the CUDA driver where it can be called.

No reader holds this process's GIL. The processes (:mod:`.process_pool`) are leased for
one load at a time; a load that finds them busy, or a platform where they cannot run,
reads on threads instead (:mod:`.thread_reads`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter

from ..errors import LoadError
from ..memory import local_ranks
from . import casting, process_pool, ring
from .chunks import Chunk, ReadJob, reads_directly
from .read_worker import FILE_ENDED

# A failed or stopped load waits this long for the processes' last reads to answer.
STUCK_READ_SECONDS = 60


def processes_wanted(jobs: Sequence[ReadJob], processes: bool | None, devices) -> bool:
    """Asked for, or by default: destinations on CUDA, none read into directly. Never
    when a job captures (the capture buffer is the staging buffer then)."""
    if any(job.capture is not None for job in jobs):
        return False
    if processes is not None:
        return processes
    return bool(devices) and not any(reads_directly(job) for job in jobs)


def lease_if_wanted(jobs, processes, devices, threads, buffer_bytes, buffer_count):
    """The reading processes' lease for a read of ``jobs``, if it has bytes and wants
    them (``processes_wanted``) and they are free; else None."""
    if any(job.info.nbytes for job in jobs) and processes_wanted(jobs, processes, devices):
        return lease_processes(threads, buffer_bytes, buffer_count, pinned=bool(devices))
    return None


def lease_processes(threads, buffer_bytes, buffer_count, pinned):
    # Slots start at multiples of the slot size: keep them aligned for every dtype.
    slot_bytes = max(64, (buffer_bytes or ring.PROCESS_RING[0]) // 64 * 64)
    slot_count = buffer_count or ring.PROCESS_RING[1]
    # Each process owns two ring slots or more, as each thread owns two buffers, and no
    # more than its socket can hold the answers of.
    count = min(threads or default_processes(), max(1, slot_count // 2))
    slot_count = min(slot_count, count * process_pool.MAX_SLOTS_PER_PROCESS)
    return process_pool.acquire(count, slot_bytes, slot_count, register=pinned)


def default_processes() -> int:
    """Reading processes per load: enough that page-cache copies are not the limit (three
    quarters of the cores, at most 12), leaving cores for the thread that issues the copies
    and for building the module; shared among the ranks a launcher started on this host
    (``LOCAL_WORLD_SIZE``), which load at the same time."""
    return max(1, min(12, (os.cpu_count() or 4) * 3 // 4 // local_ranks()))


def feed(state: ring.ReadState, lease: process_pool.Lease) -> None:
    """The one thread of a load read by processes: hand each free ring slot the next
    chunk, and copy each slot that comes back full into its chunk's target. A slot is free
    again once its copy has finished."""
    if not lease.claim():  # the load was given up before this thread started
        state.fail(LoadError("the read was interrupted", component=state.component))
        return
    try:
        feed_claimed(state, lease.pool)
    finally:
        lease.release()


def feed_claimed(state: ring.ReadState, pool: process_pool.ReadingProcesses) -> None:
    streams = {}
    casts = {}
    # slot -> the chunks being read into it, and the number in the plan of the first
    reading: dict[int, tuple[int, list[Chunk]]] = {}
    requested = 0  # chunks asked for
    opened = False
    try:
        streams = ring.side_streams(state.fences)
        driver = ring.driver_for(streams)
        casts = casting.device_casts(state, streams, driver)
        file_ids = pool.open_files(state.files)
        opened = True
        if state.group_chunks is not None:
            state.advance_groups(streams, casts)  # groups with nothing to read
        if driver is None:
            slots = [ring.Slot(pool.slot(index)) for index in range(pool.slot_count)]
        else:
            (stream,) = streams.values()
            slots = [ring.DriverSlot(pool.slot(i), driver, stream) for i in range(pool.slot_count)]
        free = deque(range(pool.slot_count))
        copying: deque[int] = deque()  # slots whose copies run, in the order issued
        reads = read_runs(state.chunks, pool.slot_bytes)
        left = len(state.chunks)
        while left and not state.stop.is_set():
            while copying and slots[copying[0]].finished():
                free.append(copying.popleft())
            asked = []
            while free and requested < len(state.chunks):
                run = next(reads)
                slot = free.popleft()
                first, last = run[0], run[-1]
                start = first.job.info.start + first.lo
                length = last.job.info.start + last.hi - start
                asked.append((slot, file_ids[first.job.info.path], start, length))
                reading[slot] = (requested, run)
                requested += len(run)
            if asked:
                pool.request(asked)
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
            for _, run, slot, status, reached in answered:
                if status:
                    reason = None if status == FILE_ENDED else os.strerror(status)
                    info = _reaching(run, reached).job.info
                    raise ring.read_error(info, state.component, reached, reason)
                if _deliver_run(state, run, slots[slot], streams, casts, driver):
                    copying.append(slot)
                else:
                    free.append(slot)
                left -= len(run)
    except process_pool.ReadingProcessExited as error:
        where = f"component '{state.component}': " if state.component else ""
        state.fail(LoadError(f"{where}{error}", component=state.component))
    except BaseException as error:
        state.fail(error)
    finally:
        _settle(state, pool, reading, opened)
        casting.finish_casts(casts, state)
        ring.wait_for(streams, state)


def read_runs(chunks: Iterable[Chunk], slot_bytes: int) -> Iterator[list[Chunk]]:
    """The chunks in plan order, grouped into the reads the processes are asked for: a
    chunk alone, or chunks that follow one another in one file and fit a slot together
    (a model's biases and norms, a few KiB each) and go to one device, read as one.
    Each read costs the copying thread a request, an answer and a wait, and each wait
    hands the interpreter's lock to a thread that may keep it for milliseconds. A chunk
    that is cast is read alone: its elements must start where the slot does."""
    run: list[Chunk] = []
    size = 0
    for chunk in chunks:
        nbytes = chunk.hi - chunk.lo
        if run:
            last = run[-1]
            follows = (
                chunk.job.info.path == last.job.info.path
                and chunk.job.info.start + chunk.lo == last.job.info.start + last.hi
                # One device: a slot is free again once its copies on one stream are done.
                and chunk.target.device == last.target.device
            )
            if chunk.cast or last.cast or not follows or size + nbytes > slot_bytes:
                yield run
                run, size = [], 0
        run.append(chunk)
        size += nbytes
    if run:
        yield run


def _reaching(run: list[Chunk], reached: int) -> Chunk:
    """The chunk of ``run`` whose bytes include file byte ``reached`` (else the last)."""
    for chunk in run:
        if chunk.job.info.start + chunk.lo <= reached < chunk.job.info.start + chunk.hi:
            return chunk
    return run[-1]


def _deliver_run(state: ring.ReadState, run: list[Chunk], slot, streams, casts, driver) -> bool:
    """Issue the copies of a read's chunks out of its slot; whether any runs on a
    stream (the slot is free again once the last has finished)."""
    offset = 0
    stream = None
    for chunk in run:
        issued = ring.deliver(chunk, slot.buffer, streams, casts, driver, offset)
        stream = issued or stream
        offset += chunk.hi - chunk.lo
        state.delivered_chunk(chunk, streams, casts)
        if state.bar is not None:
            state.bar.update(chunk.hi - chunk.lo)
    if stream is not None:
        slot.mark_copying(stream)
    return stream is not None


def _settle(state: ring.ReadState, pool: process_pool.ReadingProcesses, reading, opened) -> None:
    """After a load through the processes, done or failed: take every answer still due
    (the processes are shared by the next load: let no answer of this one reach it) and
    close its files there."""
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
    except process_pool.ReadingProcessExited:
        # Every byte answered is in place; only the processes are in doubt: the next
        # load starts new ones. (A load that failed keeps its own error.)
        pool.broken = True
    except BaseException as error:
        pool.broken = True
        state.fail(error)
