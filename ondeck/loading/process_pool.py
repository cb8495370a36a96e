"""Reading processes: a few small processes that pread into one ring of shared memory.

From a warm page cache, the reading threads of one Python process spend most of a load
waiting to take the GIL back after each read and each copy, so adding threads stops
paying off well below what the page cache and the copy engine can do. Processes share no
GIL. Each runs :mod:`ondeck.loading.read_worker` (standard library only, a few MiB),
reads the ranges it is sent into its own slots of a ring in shared memory, and answers
when a slot is full. The ring is registered with CUDA once, so every copy from it is a
DMA; this process only hands out ranges and issues copies.

The processes start on the first load that uses them and stay for the next; each exits
when its socket closes (this process closing the pool, or exiting). A load that finds one
gone starts them afresh. ``ONDECK_READ_PROCESSES=0`` keeps every read on threads; so does
a platform without ``memfd_create``, and anything that stops them from starting (an
interpreter that cannot run the program, CUDA refusing to register the ring), after one
warning.
"""

from __future__ import annotations

import atexit
import mmap
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import torch

from ..memory import register_host_memory
from .read_worker import MAX_READS, OPEN, READ, READY, REPLY
from .ring import read_path

__all__ = ["Lease", "ReadingProcesses", "ReadingProcessExited", "acquire"]

_PROGRAM = Path(__file__).with_name("read_worker.py")
# Every process must have said it is ready within this, or they are not used.
START_SECONDS = 10.0
# Closing waits this long in all for the processes to leave, then kills the rest.
CLOSE_SECONDS = 5.0
# Requests waiting at one process, at most: its unread answers must fit its socket's send
# buffer, or it blocks sending an answer while this process blocks sending it a request.
MAX_SLOTS_PER_PROCESS = MAX_READS  # and one message asks a process for them all


class ReadingProcessExited(RuntimeError):
    """A reading process is gone (killed, out of memory) or stopped answering."""


class RingUnavailable(RuntimeError):
    """A ring of this size could not be made or registered; another size may be."""


class ReadingProcesses:
    """``count`` processes and a ring of ``slot_count`` slots of ``slot_bytes``; slot ``s``
    belongs to process ``s % count``. One load at a time uses them (see :func:`acquire`)."""

    def __init__(self, count: int, slot_bytes: int, slot_count: int, *, register: bool):
        self.count, self.slot_bytes, self.slot_count = count, slot_bytes, slot_count
        self.lock = threading.Lock()
        self.broken = False
        self.registered = False
        self._processes: list[subprocess.Popen] = []
        self._channels: list[socket.socket] = []
        self._selector = selectors.DefaultSelector()  # no fd-number limit, unlike select()
        self._mapping: mmap.mmap | None = None
        self.ring: torch.Tensor | None = None
        _instances.add(self)
        ring_fd = os.memfd_create("ondeck-read-ring", os.MFD_CLOEXEC)
        try:
            try:
                os.ftruncate(ring_fd, slot_bytes * slot_count)
                self._mapping = mmap.mmap(ring_fd, slot_bytes * slot_count)
                self.ring = torch.frombuffer(self._mapping, dtype=torch.uint8)
                if register:
                    self._register()
            except (OSError, ValueError, RuntimeError) as error:
                raise RingUnavailable(
                    f"a ring of {slot_bytes * slot_count} bytes: {error}"
                ) from error
            for _ in range(count):
                self._start(ring_fd)
            self._await_ready()
        except BaseException:
            self.close()
            raise
        finally:
            os.close(ring_fd)

    def _register(self) -> None:
        status = register_host_memory(self.ring.data_ptr(), self.ring.numel())
        if status != 0:
            raise RuntimeError(f"cudaHostRegister of the read ring failed: {status}")
        self.registered = True

    def _start(self, ring_fd: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_PROGRAM), str(ring_fd), str(theirs.fileno())],
                pass_fds=(ring_fd, theirs.fileno()),
                stdin=subprocess.DEVNULL,
                # Out of the terminal's process group: Ctrl-C interrupts the load here,
                # which then stops them in order, instead of killing them mid-read.
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._processes.append(process)
        self._channels.append(ours)
        self._selector.register(ours, selectors.EVENT_READ)

    def _await_ready(self) -> None:
        """An interpreter that starts but cannot run the program (a frozen app's
        executable, say) never says it is ready: then the processes are not used."""
        deadline = time.monotonic() + START_SECONDS
        for channel, process in zip(self._channels, self._processes, strict=True):
            channel.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                answer = channel.recv(len(READY))
            except (TimeoutError, OSError) as error:
                answer = repr(error)
            finally:
                channel.settimeout(None)
            if answer != READY:
                raise RuntimeError(
                    f"'{sys.executable} {_PROGRAM.name}' did not start (exit status "
                    f"{process.poll()}, answer {answer!r})"
                )

    def alive(self) -> bool:
        return not self.broken and all(process.poll() is None for process in self._processes)

    def slot(self, index: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.ring[start : start + self.slot_bytes]

    def open_files(self, files: dict[str, int]) -> dict[str, int]:
        """Hand every process the open files (descriptors travel over the socket); returns
        each path's id for :meth:`request`."""
        ids = {path: index for index, path in enumerate(files)}
        for channel in self._channels:
            for path, fd in files.items():
                self._send(channel, OPEN.pack(b"O", ids[path]), [fd])
        return ids

    def close_files(self) -> None:
        for channel in self._channels:
            self._send(channel, b"C")

    def request(self, reads: list[tuple[int, int, int, int]]) -> None:
        """For each ``(slot, file id, offset, length)``, read ``length`` bytes at
        ``offset`` into ``slot``; each is answered by :meth:`replies`. One message per
        process: each send can hand the interpreter's lock to another thread."""
        messages: dict[int, list[bytes]] = {}
        for slot, file_id, offset, length in reads:
            message = READ.pack(b"R", file_id, slot * self.slot_bytes, offset, length, slot)
            messages.setdefault(slot % self.count, []).append(message)
        for index, parts in messages.items():
            self._send(self._channels[index], b"".join(parts))

    def _send(self, channel: socket.socket, message: bytes, fds: list[int] = ()) -> None:
        try:
            socket.send_fds(channel, [message], fds) if fds else channel.send(message)
        except OSError as error:
            self.broken = True
            raise ReadingProcessExited(f"a reading process is gone: {error}") from error

    def replies(self, timeout: float | None) -> list[tuple[int, int, int]]:
        """``(slot, status, byte reached)`` of reads finished so far, an answer from each
        process that has one, waiting up to ``timeout`` seconds for the first. (A process
        with a second answer waiting is ready again at the next call: one receive per
        process, rather than receiving until one fails, which raises.) Status 0: done;
        an errno; or :data:`~ondeck.loading.read_worker.FILE_ENDED`."""
        answers = []
        for key, _ in self._selector.select(timeout):
            try:
                message = key.fileobj.recv(REPLY.size, socket.MSG_DONTWAIT)
            except BlockingIOError:  # ready, yet nothing there: not seen, but never block
                continue
            except OSError as error:
                self.broken = True
                raise ReadingProcessExited(f"a reading process failed: {error}") from error
            if not message:
                self.broken = True
                raise ReadingProcessExited("a reading process exited in the middle of a load")
            answers.append(REPLY.unpack(message))
        return answers

    def close(self) -> None:
        """End the processes and free the ring. Only with :attr:`lock` held, or when
        nothing else can use them."""
        self.broken = True
        self._selector.close()
        for channel in self._channels:
            channel.close()  # each process exits when its socket closes
        deadline = time.monotonic() + CLOSE_SECONDS
        for process in self._processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Its whole session: it leads one (start_new_session). A process stuck in
                # a read of a dead disk may outlive even this.
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=1.0)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        self._channels.clear()
        self._processes.clear()
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.ring.data_ptr())
            except Exception:  # CUDA already torn down at exit: the memory goes with us
                pass
            self.registered = False
        self.ring = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def forget(self) -> None:
        """In a forked child: close this process's copies of the sockets, so the parent's
        processes still see theirs close when the parent's do; touch nothing else."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        self._processes.clear()  # the parent's children: not ours to wait for
        self.broken = True


class Lease:
    """One load's hold on the processes. The thread that feeds them claims it and
    releases it when it is done with them; the load releases it only if that thread
    never claimed it. Either way the lock is released once, and never while a thread
    still uses the processes."""

    def __init__(self, pool: ReadingProcesses):
        self.pool = pool
        self._lock = threading.Lock()
        self._claimed = False
        self._released = False

    def claim(self) -> bool:
        with self._lock:
            self._claimed = not self._released
            return self._claimed

    def release(self) -> None:
        with self._lock:
            if not self._released:
                self._released = True
                self.pool.lock.release()

    def release_unclaimed(self) -> None:
        with self._lock:
            if not self._claimed and not self._released:
                self._released = True
                self.pool.lock.release()


_shared: ReadingProcesses | None = None
_shared_lock = threading.Lock()
_unavailable = False  # they failed to start once: not tried again
_warned = False
# Every pool of this process, also one still starting: a forked child lets go of all.
_instances: weakref.WeakSet[ReadingProcesses] = weakref.WeakSet()


def acquire(count: int, slot_bytes: int, slot_count: int, *, register: bool) -> Lease | None:
    """A lease on the process-wide reading processes for one load, started or restarted
    to this shape if needed. None when they cannot be used: switched off, unavailable
    here, or busy with another load."""
    global _shared, _unavailable, _warned
    if _unavailable or os.environ.get("ONDECK_READ_PROCESSES") == "0":
        return None
    if not hasattr(os, "memfd_create") or not sys.executable:
        return None
    if read_path() == "portable":
        return None  # the portable path reads on threads alone
    if getattr(sys, "frozen", False):  # a bundled app's executable runs the app, not -S
        return None
    if count < 1 or slot_count < count or slot_count > count * MAX_SLOTS_PER_PROCESS:
        raise ValueError(f"{slot_count} slots cannot be shared by {count} reading processes")
    with _shared_lock:
        current = _shared
        if current is not None and not current.lock.acquire(blocking=False):
            return None  # another load is using them: that one reads on threads
        shape = (count, slot_bytes, slot_count, register)
        if current is not None and (
            not current.alive()
            or (current.count, current.slot_bytes, current.slot_count, current.registered) != shape
        ):
            _shared = None
            try:
                current.close()
            finally:
                current.lock.release()
            current = None
        if current is None:
            try:
                current = ReadingProcesses(count, slot_bytes, slot_count, register=register)
            except Exception as error:
                # The program cannot run here: not tried again. A ring that could not be
                # made may work at another size: tried again, warned about once.
                if _warned and isinstance(error, RingUnavailable):
                    return None
                _warned = True
                _unavailable = not isinstance(error, RingUnavailable)
                warnings.warn(
                    f"ondeck: reading processes unavailable ({error}); reading on threads",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return None
            current.lock.acquire()
            _shared = current
        return Lease(current)


def _forget_after_fork() -> None:
    """A forked child must not talk to its parent's processes (their answers would go to
    whichever process reads first): it starts its own if it loads."""
    global _shared, _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork
    for pool in list(_instances):
        pool.forget()
    _shared = None


if hasattr(os, "register_at_fork"):  # absent on Windows, where nothing forks
    os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def close_shared(wait_seconds: float = 10.0) -> None:
    """End the process-wide reading processes, once no load uses them. A load still
    running after ``wait_seconds`` (a daemon thread at exit) keeps them: they leave when
    this process does."""
    global _shared
    with _shared_lock:
        pool = _shared
        if pool is None or not pool.lock.acquire(timeout=wait_seconds):
            return
        _shared = None
        try:
            pool.close()
        finally:
            pool.lock.release()
