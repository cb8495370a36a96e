"""Copies, events and stream waits queued straight through the CUDA driver, for the
reader's copying thread.

A read through the reading processes has one Python thread that issues every copy of a
load, one per 4 MiB chunk (1,300 for 5 GiB), and marks each ring slot with an event it
polls. Its time per chunk bounds the read. ``Tensor.copy_`` spends most of it per copy
before the DMA is queued (views, dispatch, checks of dtype, device and pinning) and hands
the GIL over and back (BENCHMARKS.md has the figures); the copies here are raw bytes
from memory registered with CUDA to device memory, and need none of that. One call of
``cuMemcpyHtoDAsync`` through ``ctypes.PyDLL`` (which keeps the GIL: the call only
queues) does the same.

The calls act on the calling thread's current CUDA context: the copying thread makes
its device current first. Where the driver library cannot be loaded (a CPU or ROCm build
of torch, no NVIDIA driver), :func:`driver` is None and the reader copies with torch.
"""

from __future__ import annotations

import ctypes
import functools
import sys

__all__ = ["Driver", "driver"]

_SUCCESS = 0
_NOT_READY = 600


class Driver:
    """The few driver calls the copying thread makes, each raising on an error."""

    def __init__(self, library: ctypes.PyDLL):
        self._library = library
        copy = library.cuMemcpyHtoDAsync_v2
        copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        copy.restype = ctypes.c_int
        record = library.cuEventRecord
        record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        record.restype = ctypes.c_int
        query = library.cuEventQuery
        query.argtypes = [ctypes.c_void_p]
        query.restype = ctypes.c_int
        wait = library.cuStreamWaitEvent
        wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        wait.restype = ctypes.c_int
        self._copy, self._record, self._query, self._wait = copy, record, query, wait

    def copy(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """Queue ``nbytes`` from host address ``source`` (registered or pinned) to device
        address ``destination`` on stream handle ``stream``."""
        status = self._copy(destination, source, nbytes, stream)
        if status:
            raise self._error("cuMemcpyHtoDAsync", status)

    def record(self, event: int, stream: int) -> None:
        """Record event handle ``event`` (made by torch: ``Event.cuda_event``) on ``stream``."""
        status = self._record(event, stream)
        if status:
            raise self._error("cuEventRecord", status)

    def wait(self, stream: int, event: int) -> None:
        """Make ``stream``'s later work wait for the work before ``event``'s last record."""
        status = self._wait(stream, event, 0)
        if status:
            raise self._error("cuStreamWaitEvent", status)

    def done(self, event: int) -> bool:
        """Whether the work before the event's last record has finished."""
        status = self._query(event)
        if status == _SUCCESS:
            return True
        if status == _NOT_READY:
            return False
        raise self._error("cuEventQuery", status)

    def _error(self, call: str, status: int) -> RuntimeError:
        name = ctypes.c_char_p()
        self._library.cuGetErrorName(status, ctypes.byref(name))
        text = name.value.decode() if name.value else "unknown error"
        return RuntimeError(f"CUDA driver: {call} failed: {text} ({status})")


@functools.cache
def driver() -> Driver | None:
    """The driver's calls, or None where torch is not built for CUDA or the library is
    not there."""
    import torch

    if torch.version.cuda is None or not sys.platform.startswith("linux"):
        return None
    try:
        return Driver(ctypes.PyDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
