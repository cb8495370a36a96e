"""The reading threads: threads of this process that read chunks into a ring of pinned
buffers and copy each to its target, for loads into CPU memory and wherever the reading
processes cannot run.

Each thread owns its share of the ring and its own side stream, and issues its own
copies: a chunk costs a few GIL hand-overs (the read, the copy, at times a wait for the
buffer's last copy) and nothing is passed between threads. Every hand-over is contended
by all the threads, which holds a warm page-cache load well below what the processes
reach (BENCHMARKS.md). A CPU destination of the file's dtype is read into directly.
"""

from __future__ import annotations

from collections import deque

import torch

from . import casting, ring
from .chunks import BAR_LOCK


def read_chunks(state: ring.ReadState) -> None:
    """A reading thread: take the next chunk until none are left or the read has failed."""
    streams = {}
    casts = {}
    slots: deque[ring.Slot] = deque()
    try:
        streams = ring.side_streams(state.fences)
        casts = casting.device_casts(state, streams)
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
                ring.pread_exact(fd, chunk.address, length, offset, info, state.component)
            elif job.capture is not None:
                staged = job.capture[chunk.lo : chunk.hi]
                ring.pread_exact(fd, staged.data_ptr(), length, offset, info, state.component)
                ring.deliver(chunk, staged, streams, casts)
            else:
                if len(slots) < state.buffers_per_thread:
                    slot = ring.Slot(
                        torch.empty(state.buffer_bytes, dtype=torch.uint8, pin_memory=state.pinned)
                    )
                else:
                    slot = slots.popleft()
                    slot.wait()
                slots.append(slot)
                staged = slot.buffer if length == state.buffer_bytes else slot.buffer[:length]
                ring.pread_exact(fd, staged.data_ptr(), length, offset, info, state.component)
                stream = ring.deliver(chunk, staged, streams, casts)
                if stream is not None:
                    slot.mark_copying(stream)
            if state.bar is not None:
                with BAR_LOCK:
                    state.bar.update(length)
    except BaseException as error:
        state.fail(error)
    finally:
        casting.finish_casts(casts, state)
        ring.wait_for(streams, state)
        ring.close_own_files()
