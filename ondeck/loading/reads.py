"""Stream safetensors data into tensors that already sit where they will live.

Data is read with ``os.preadv`` in chunks (:mod:`.chunks`). A CPU destination of the
file's dtype is read into directly, with no copy. Anything else is staged through a
small ring of host buffers and copied, so the next read overlaps the current copy. Host
memory a load takes is the ring, never the file. Two kinds of reader fill the ring:

- reading processes, for loads into CUDA memory (:mod:`.process_feed`, over the pool in
  :mod:`.process_pool`), whose one copying thread issues every copy;
- threads of this process, for everything else and as the fallback (:mod:`.thread_reads`).

Both share the state of one read (:mod:`.ring`) and stage casts on the device
(:mod:`.casting`). This module orchestrates them: :func:`read_into` for one read,
:func:`read_in_groups` for a pipelined load, whose groups of blocks are one read through
the processes: the copying thread hands each group over, in order, with events its
copies and casts end with, and the caller's thread waits on them and lets the group
compute. Group after group as separate reads, each drained and started anew, left the
copy engine idle between groups.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LoadError
from . import casting, process_feed, process_pool, ring, thread_reads
from .chunks import ReadJob, ReadStats, plan_chunks, progress_bar
from .host_cache import HostCopy
from .page_cache import describe_source
from .ring import DEFAULT_BUFFER_BYTES, PROCESS_RING, THREAD_RING
from .safetensors_format import check_unchanged

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "HostCopy",
    "PROCESS_RING",
    "ReadJob",
    "ReadStats",
    "THREAD_RING",
    "progress_bar",
    "read_in_groups",
    "read_into",
]


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
) -> ReadStats:
    """Read every job's tensor from its file into its destination. Blocks until done.

    ``while_reading`` runs on the calling thread once the reads have started (CPU work
    that overlaps them). A read that fails raises :class:`LoadError` naming the file and
    tensor, as does a reading process that dies mid-load; other errors (CUDA, pinned
    memory, ``while_reading``'s own) propagate as they are. Either way the readers have
    stopped and their device copies have finished before it propagates (a second
    interrupt during that wait is the one way out earlier).

    ``processes``: read through ``threads`` reading processes (:mod:`.process_pool`);
    by default when some destination is on CUDA and none is a CPU tensor of the file's
    dtype; never when a job captures. Where they are unavailable or busy, threads read
    instead. ``buffer_bytes`` and ``buffer_count`` default to :data:`PROCESS_RING` or
    :data:`THREAD_RING`. ``bar``: a progress bar to advance (left open) instead of one of
    its own, for a load read in several parts.
    """
    _check_sizes(threads, buffer_bytes, buffer_count)
    devices = _cuda_devices(jobs)
    lease = process_feed.lease_if_wanted(
        jobs, processes, devices, threads, buffer_bytes, buffer_count
    )
    sizes = _Sizes(threads, buffer_bytes, buffer_count)
    return _read(jobs, lease, None, sizes, progress, component, while_reading, bar)


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
    nothing drains or starts again between groups. Otherwise one read per group.
    """
    _check_sizes(threads, buffer_bytes, buffer_count)
    jobs = [job for group in groups for job in group]
    lease = process_feed.lease_if_wanted(
        jobs, processes, _cuda_devices(jobs), threads, buffer_bytes, buffer_count
    )
    if lease is not None:
        indices = [index for index, group in enumerate(groups) for _ in group]
        grouping = _Grouping(indices, len(groups), reached)
        sizes = _Sizes(threads, buffer_bytes, buffer_count)
        return _read(jobs, lease, grouping, sizes, progress, component, None, bar)
    started = time.perf_counter()
    options = dict(threads=threads, buffer_bytes=buffer_bytes, buffer_count=buffer_count)
    options.update(progress=progress, component=component, bar=bar, processes=processes)
    parts = []
    for index, group in enumerate(groups):
        parts.append(read_into(group, **options))
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


@dataclass(frozen=True)
class _Sizes:
    """What a read was asked for; None: the ring's defaults."""

    threads: int | None
    buffer_bytes: int | None
    buffer_count: int | None


@dataclass(frozen=True)
class _Grouping:
    """A read in groups: each job's group, the number of groups, and the caller's
    ``reached``."""

    indices: Sequence[int]
    count: int
    reached: Callable[[int], None]


def _cuda_devices(jobs: Sequence[ReadJob]) -> set[torch.device]:
    return {job.destination.device for job in jobs if job.destination.device.type == "cuda"}


def _buffers(lease: process_pool.Lease | None, sizes: _Sizes, *, pinned: bool) -> tuple[int, int]:
    """The ring's buffer size and count: the processes' slots, or the threads' ring."""
    if lease is not None:
        return lease.pool.slot_bytes, lease.pool.slot_count
    return ring.ring_buffers(sizes.buffer_bytes, sizes.buffer_count, pinned=pinned)


def _read(
    jobs: Sequence[ReadJob],
    lease: process_pool.Lease | None,
    grouping: _Grouping | None,
    sizes: _Sizes,
    progress: bool,
    component: str | None,
    while_reading: Callable[[], None] | None,
    bar: Any,
) -> ReadStats:
    """One read of ``jobs``, through ``lease``'s processes or on threads."""
    started = time.perf_counter()
    total = sum(job.info.nbytes for job in jobs)
    paths = sorted({job.info.path for job in jobs if job.info.nbytes})
    source = describe_source(paths) if paths else "disk"
    devices = _cuda_devices(jobs)
    own_bar = bar is None
    files: dict[str, int] = {}
    workers: list[threading.Thread] = []
    state = None
    try:
        buffer_bytes, buffer_count = _buffers(lease, sizes, pinned=bool(devices))
        groups = grouping.indices if grouping is not None else None
        chunks, temporaries = plan_chunks(jobs, buffer_bytes, component, groups)
        staging = any(not job.direct and job.job.capture is None for job in chunks.jobs)
        layout = ring.ring_layout(
            buffer_bytes,
            buffer_count,
            threads=sizes.threads,
            chunk_count=len(chunks),
            staging=staging,
            processes=lease is not None,
        )
        if own_bar:
            bar = progress_bar(total, progress, component, source)
        state = ring.ReadState(
            chunks=chunks,
            files=files,
            # Before the fences: the copies that use it start after the caller's stream.
            staging=casting.cast_staging(chunks, buffer_bytes, layout.workers),
            fences=ring.fences(devices),
            buffer_bytes=buffer_bytes,
            buffers_per_thread=max(1, buffer_count // layout.workers),
            pinned=bool(devices),
            bar=bar,
            component=component,
        )
        if grouping is not None:
            while_reading, temporaries = _in_groups(state, grouping, jobs, temporaries)
        identities = {job.info.path: job.info.identity for job in jobs}
        for path in paths:
            files[path] = ring.open_file(path, component)
            check_unchanged(path, identities.get(path), component=component, descriptor=files[path])
        _start(workers, state, lease, layout.workers if chunks else 0)
        _run_beside(state, workers, while_reading)
        for target, job in temporaries:
            job.destination.copy_(target)
    finally:
        _end(state, workers, lease, files, bar if own_bar else None, component)
    readers = "threads" if lease is None else "processes"
    return ReadStats(total, time.perf_counter() - started, source, readers)


def _in_groups(state: ring.ReadState, grouping: _Grouping, jobs, temporaries):
    """Set ``state`` up for a read in groups; returns what the calling thread runs
    meanwhile (:func:`_reaching`) and the temporaries left to copy in after the read
    (none: each group's are copied in once it is reached)."""
    state.count_groups(grouping.count)
    job_group = dict(zip(map(id, jobs), grouping.indices, strict=True))
    waiting: dict[int, list] = {}
    for target, job in temporaries:
        waiting.setdefault(job_group[id(job)], []).append((target, job))
    if not state.chunks:
        state.advance_groups({}, {})
    return _reaching(state, grouping.reached, waiting), []


def _start(workers: list, state: ring.ReadState, lease, count: int) -> None:
    """Start ``count`` readers: threads, or the one thread that feeds ``lease``'s processes."""
    for index in range(count):
        if lease is None:
            target, args = thread_reads.read_chunks, (state,)
        else:
            target, args = process_feed.feed, (state, lease)
        # Listed before it starts: an interrupt inside start() still finds it to join.
        workers.append(
            threading.Thread(target=target, args=args, name=f"ondeck-read-{index}", daemon=True)
        )
        workers[-1].start()


def _run_beside(state: ring.ReadState, workers: list, while_reading) -> None:
    """Run ``while_reading`` beside the readers, then wait for them; raise what failed."""
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


def _end(state, workers: list, lease, files: dict, bar, component: str | None) -> None:
    """Whatever happened: no reader outlives the read, the processes are given back,
    the files are closed and a bar of the read's own is closed."""
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
        if bar is not None:
            bar.close()


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


def _reaching(state: ring.ReadState, reached: Callable[[int], None], waiting: dict) -> Callable:
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
