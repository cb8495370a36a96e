"""Casts staged on the device while the reader copies.

A cast to a CUDA destination (file dtype differs) goes through a staging buffer on the
device in the file's dtype, one per copying thread, in two halves (:class:`DeviceCasts`).
Chunks are copied into one half, one after the other, on the thread's stream; once it is
full, the casts out of it are issued together on a stream of their own while the next
chunks are copied into the other half. The copy engine runs as it does for a load without
a cast, and the two streams wait for each other once per half, not once per chunk: cast
after each chunk's copy on one stream, the copies stop for every cast.
A tensor's chunks that lie side by side in a half are cast in one operation. The load
allocates the buffers on the caller's stream before the copies' fence, so the allocator
reuses them from one load (or pipelined group) to the next; allocated on a side stream,
each would be a new allocator segment per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ring
from .chunks import Chunk, ChunkPlan, ReadJob
from .driver import Driver

# The staging's parts, filled in turn (two: halves).
CAST_SECTIONS = 2
# Device bytes a load's casts are staged in, shared among its copying threads. A thread
# whose share holds less than two chunks gets one chunk and casts chunk by chunk.
CAST_STAGING_BYTES = 32 * 2**20
# Each chunk's place in a staging half starts at a multiple of this: a view of any dtype.
_ALIGN = 256


def cast_staging(chunks: ChunkPlan, buffer_bytes: int, workers: int) -> dict:
    """For each CUDA device some chunk is cast on: ``workers`` staging buffers
    (``staging_bytes``), allocated on the caller's current stream."""
    devices = {j.target.device for j in chunks.jobs if j.cast and j.target.device.type == "cuda"}
    nbytes = staging_bytes(buffer_bytes, workers)
    return {
        device: [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(workers)]
        for device in devices
    }


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def staging_bytes(buffer_bytes: int, workers: int) -> int:
    """A copying thread's staging buffer: its share of :data:`CAST_STAGING_BYTES`, two
    aligned halves, where that holds two chunks; else one chunk."""
    share = CAST_STAGING_BYTES // workers // (2 * _ALIGN) * (2 * _ALIGN)
    chunk = aligned(buffer_bytes)
    return share if share >= 2 * chunk else chunk


class DeviceCasts:
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
        sections = min(CAST_SECTIONS, buffer.numel() // aligned(chunk_bytes))
        if sections >= 2:
            size = buffer.numel() // sections // _ALIGN * _ALIGN
            self.halves = tuple(buffer[i * size : (i + 1) * size] for i in range(sections))
            self.casts = torch.cuda.Stream(copies.device)
            self.casts.wait_event(fence)  # its casts write where the caller's stream may read
        else:
            self.halves = (buffer,)
            self.casts = copies
        self.half_bytes = self.halves[0].numel()
        self.chunk_bytes, self.step = chunk_bytes, aligned(chunk_bytes)
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
        self.used = aligned(end)
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


def device_casts(state: ring.ReadState, streams: dict, driver: Driver | None = None) -> dict:
    """This copying thread's :class:`DeviceCasts` on each device that casts, copying
    through ``driver`` if given."""
    return {
        device: DeviceCasts(
            buffers.pop(), streams[device], state.fences[device], state.buffer_bytes, driver
        )
        for device, buffers in state.staging.items()
        if buffers
    }


def finish_casts(casts: dict, state: ring.ReadState) -> None:
    """Issue the casts still staged (unless the read failed), then wait for them."""
    for device_casts in casts.values():
        try:
            if state.failure is None:
                device_casts.flush()
        except BaseException as error:
            state.fail(error)
    ring.wait_for(
        {i: c.casts for i, c in enumerate(casts.values()) if c.casts is not c.copies}, state
    )
