"""The state of one read and its ring: the chunks handed out, the slots and their copy
events, the fences and side streams, and each chunk's delivery to its target.

Shared by the two kinds of reader (:mod:`.thread_reads`, :mod:`.process_feed`) and by
the casts staged on the device (:mod:`.casting`). The ring's size is worked out here,
purely, from what the read asks for (:func:`ring_layout`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
from dataclasses import dataclass

import torch

from ..errors import LoadError
from .chunks import Chunk, ChunkPlan, where
from .driver import Driver, driver
from .safetensors_format import FileIdentity, TensorInfo, check_unchanged

# (buffer bytes, buffer count) by default. The threads' ring of pinned buffers: larger
# chunks mean fewer GIL hand-overs. The processes' ring: small enough to stay in a server
# CPU's last-level cache, as every byte is written to it and read back by the copy engine
# and a ring that spills to DRAM adds two passes over memory (BENCHMARKS.md).
THREAD_RING = (8 * 2**20, 32)
PROCESS_RING = (4 * 2**20, 24)
DEFAULT_BUFFER_BYTES = THREAD_RING[0]
# Copies from the reading processes' ring to one device go through the CUDA driver
# (:mod:`.driver`) where it can be called; False: through torch.
DRIVER_COPIES = True


@dataclass(frozen=True)
class RingLayout:
    """The ring of one read: its buffers' size and count, and the workers filling it."""

    buffer_bytes: int
    buffer_count: int
    workers: int


def ring_buffers(
    buffer_bytes: int | None, buffer_count: int | None, *, pinned: bool
) -> tuple[int, int]:
    """The threads' ring for a read: the sizes asked for, or :data:`THREAD_RING`."""
    buffer_bytes = max(buffer_bytes or THREAD_RING[0], 64)
    buffer_count = buffer_count or THREAD_RING[1]
    if pinned:
        # The pinned allocator rounds each buffer up to a power of two: round down
        # instead, so the ring stays within buffer_bytes x buffer_count.
        buffer_bytes = 1 << (buffer_bytes.bit_length() - 1)
    return buffer_bytes, buffer_count


def ring_layout(
    buffer_bytes: int,
    buffer_count: int,
    *,
    threads: int | None,
    chunk_count: int,
    staging: bool,
    processes: bool,
) -> RingLayout:
    """How many workers fill a ring of ``buffer_count`` buffers for ``chunk_count``
    chunks: ``threads`` (or one per core, 4 to 16), no more than the chunks, and two
    buffers each or more where chunks are staged (one is read into while the other's
    copy runs: the ring, not the thread count, bounds memory). One for a read by the
    reading processes: the thread that feeds them and issues the copies."""
    workers = threads or min(16, max(4, os.cpu_count() or 4))
    if staging:
        workers = min(workers, max(1, buffer_count // 2))
    workers = max(1, min(workers, chunk_count))
    if processes:
        workers = 1
    return RingLayout(buffer_bytes, buffer_count, workers)


@dataclass
class ReadState:
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
                    events.append(recorded(device_casts.casts))
            events.extend(recorded(stream) for stream in streams.values())
            self.reached.put((self.next_group, events))
            self.next_group += 1


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Slot:
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


class DriverSlot(Slot):
    """A ring slot of a read onto one device whose copies go through the driver
    (``deliver`` given one): its event is recorded on that device's copy stream and
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


def fences(devices) -> dict:
    """Destinations may reuse memory the caller's stream still reads: copies start after it."""
    return {device: recorded(torch.cuda.current_stream(device)) for device in devices}


def side_streams(fences: dict) -> dict:
    """A side stream per device for the calling thread, made current there (the thread's
    copies to that device go to it), starting after the caller's fence."""
    streams = {}
    for device, fence in fences.items():
        stream = torch.cuda.Stream(device)
        stream.wait_event(fence)
        torch.cuda.set_stream(stream)
        streams[device] = stream
    return streams


def wait_for(streams: dict, state: ReadState) -> None:
    """Wait for every stream, also after a failure (the caller frees the destinations
    then); an asynchronous copy error surfacing here fails the read."""
    for stream in streams.values():
        try:
            stream.synchronize()
        except BaseException as error:
            state.fail(error)


def driver_for(streams: dict) -> Driver | None:
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


def deliver(
    chunk: Chunk,
    staged: torch.Tensor,
    streams: dict,
    casts: dict,
    driver: Driver | None = None,
    offset: int = 0,
) -> torch.cuda.Stream | None:
    """Copy staged file bytes into the chunk's target, casting if needed. ``staged``:
    pinned host bytes holding the chunk's from byte ``offset`` (a ring slot may be longer,
    and hold other chunks' before it; a cast's start it). A device copy is issued on this
    thread's stream for the device, which is returned, through ``driver`` if given (every
    CUDA destination is then on that stream's device). ``casts``: this thread's
    :class:`DeviceCasts` on each device that casts."""
    device = chunk.target.device
    stream = streams.get(device)
    if chunk.cast and stream is not None:
        # Cast on the device: a host-to-device copy_ that changes the dtype converts on
        # the host first, on this thread, and the read then runs at the CPU's pace.
        casts[device].add(chunk, staged)
        return stream
    nbytes = chunk.hi - chunk.lo
    if driver is not None and stream is not None:
        driver.copy(chunk.address, staged.data_ptr() + offset, nbytes, stream.cuda_stream)
        return stream
    if offset or staged.numel() != nbytes:
        staged = staged[offset : offset + nbytes]
    source = staged.view(chunk.job.info.dtype) if chunk.cast else staged
    if chunk.cast and chunk.job.via is not None:
        source = source.to(chunk.job.via)
    chunk.part().copy_(source, non_blocking=stream is not None)
    return stream


def read_error(info: TensorInfo, component: str | None, reached: int, reason: str | None):
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


def read_path() -> str:
    """How weights are read: ``"fast"``, positional reads (``os.preadv``) on descriptors
    the threads share, and reading processes where they can start; or ``"portable"``,
    where ``os.preadv`` is missing (Windows) or ``ONDECK_READ_PATH=portable`` asks for it:
    threads only, each reading its own ordinary file object with ``readinto``."""
    if os.environ.get("ONDECK_READ_PATH") == "portable" or not hasattr(os, "preadv"):
        return "portable"
    return "fast"


# Each reading thread's own file objects, by the shared descriptor they stand in for: a
# seek and a read on one object are two calls, so no two threads may share it.
_portable_files = threading.local()


def _own_file(fd: int, info: TensorInfo, component: str | None):
    files = getattr(_portable_files, "files", None)
    if files is None:
        files = _portable_files.files = {}
    found = files.get(fd)
    if found is not None and found[0] == info.path:
        return found[1]
    if found is not None:
        found[1].close()
    try:
        handle = open(info.path, "rb", buffering=0)  # noqa: SIM115 (kept for the thread)
    except OSError as error:
        raise read_error(info, component, info.start, error.strerror or str(error)) from error
    # The file opened again must be the one whose header was read (or, for a tensor
    # known without its header's identity, the one the shared descriptor holds).
    identity = info.identity or FileIdentity.of(os.fstat(fd), b"")
    try:
        check_unchanged(info.path, identity, component=component, descriptor=handle.fileno())
    except LoadError:
        handle.close()
        raise
    files[fd] = (info.path, handle)
    return handle


def close_own_files() -> None:
    """Close the calling reading thread's own file objects (the portable path's), as it
    ends: left to the thread's end, each is a ResourceWarning."""
    files = getattr(_portable_files, "files", None) or {}
    _portable_files.files = {}
    for _, handle in files.values():
        handle.close()


def _read_portable(fd: int, address: int, length: int, offset: int, info, component) -> None:
    handle = _own_file(fd, info, component)
    done = 0
    while done < length:
        view = memoryview((ctypes.c_char * (length - done)).from_address(address + done)).cast("B")
        try:
            handle.seek(offset + done)
            count = handle.readinto(view)
        except OSError as error:
            reason = error.strerror or str(error)
            raise read_error(info, component, offset + done, reason) from error
        if not count:
            raise read_error(info, component, offset + done, None)
        done += count


def pread_exact(fd: int, address: int, length: int, offset: int, info, component) -> None:
    if read_path() == "portable":
        _read_portable(fd, address, length, offset, info, component)
        return
    done = 0
    while done < length:
        view = (ctypes.c_char * (length - done)).from_address(address + done)
        try:
            count = os.preadv(fd, [view], offset + done)
        except OSError as error:
            reason = error.strerror or str(error)
            raise read_error(info, component, offset + done, reason) from error
        if count == 0:
            raise read_error(info, component, offset + done, None)
        done += count


def open_file(path: str, component: str | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as error:
        where = f"component '{component}' from {path}" if component else path
        raise LoadError(
            f"{where}: cannot open ({error.strerror or error})", component=component, path=path
        ) from error
