"""The ring that blocks read from the files each pass go through on their way to the device.

A few pinned host buffers, each sized for a block, filled on a thread of the ring's own
in the order the blocks run: while block i computes, the next blocks are read, so a
pass waits on the files only where they are slower than the compute. A buffer is read
into again only once the copy out of it to the device has finished.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..memory import pinned_host_bytes

__all__ = ["FileRing"]


class _Buffer:
    def __init__(self, memory: Any):
        self.memory = memory
        self.block: int | None = None
        self.state = "free"  # "reading", "ready" (holds ``block``), "taken"
        self.copied: Any = None  # the copy out of it (a CUDA event); None: nothing pending


class FileRing:
    """``count`` host buffers of ``nbytes`` (pinned when ``pinned``) that ``read(block,
    buffer)`` fills, ahead of need, with the blocks ``want`` lists.

    ``take(block)`` waits for the block's bytes and hands its buffer out; ``give_back``
    returns it with the event its copy to the device ends with. A read that fails is
    raised by the next ``take``. ``close`` stops the thread, after the read in flight,
    and waits for the copies out of the buffers; ``memory`` (the buffers of a closed
    ring of the same sizes) is used instead of allocating new ones.
    ``on_read(nbytes, seconds)`` sees each block read.
    """

    def __init__(
        self,
        count: int,
        nbytes: int,
        *,
        pinned: bool,
        read: Callable[[int, Any], int],
        on_read: Callable[[int, float], None] | None = None,
        memory: Sequence[Any] = (),
    ):
        import torch

        def allocate() -> Any:
            return pinned_host_bytes(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)

        count = max(1, count)
        given = [m for m in memory if m.numel() == nbytes][:count]
        self.buffers = [_Buffer(m) for m in given]
        self.buffers += [_Buffer(allocate()) for _ in range(count - len(given))]
        self.read = read
        self.on_read = on_read
        self._wanted: list[int] = []
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closed = False

    @property
    def nbytes(self) -> int:
        return sum(buffer.memory.numel() for buffer in self.buffers)

    def stand_in(self) -> Any:
        """Memory a block's tensors may view until the module is armed (never computed on)."""
        return self.buffers[0].memory

    def start(self) -> None:
        with self._condition:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="ondeck-stream-reads", daemon=True
                )
                self._thread.start()

    def want(self, blocks: Sequence[int]) -> None:
        """Read these blocks next, in this order; blocks read ahead that it does not list
        give their buffers back."""
        with self._condition:
            wanted = list(dict.fromkeys(blocks))
            for buffer in self.buffers:
                if buffer.state == "ready" and buffer.block not in wanted:
                    buffer.state, buffer.block = "free", None
            held = {b.block for b in self.buffers if b.state in ("ready", "reading")}
            self._wanted = [block for block in wanted if block not in held]
            self._condition.notify_all()

    def ready(self, block: int) -> bool:
        """Whether ``block``'s bytes are read and waiting: ``take`` would not wait."""
        with self._condition:
            holding = self._holding(block)
            return holding is not None and holding.state == "ready"

    def take(self, block: int) -> Any:
        """The buffer holding ``block``'s bytes, once read (read now if nobody asked)."""
        with self._condition:
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._closed:
                    raise RuntimeError("the ring of blocks read from the files is closed")
                holding = self._holding(block)
                if holding is not None and holding.state == "ready":
                    holding.state = "taken"
                    return holding.memory
                if holding is None:
                    if block in self._wanted:
                        self._wanted.remove(block)
                    self._wanted.insert(0, block)
                    if not any(b.state == "free" for b in self.buffers):
                        # Every buffer holds a block read ahead: the one read last goes.
                        ready = [b for b in self.buffers if b.state == "ready"]
                        if ready:
                            ready[-1].state, ready[-1].block = "free", None
                    self._condition.notify_all()
                self._condition.wait()

    def give_back(self, block: int, copied: Any = None) -> None:
        """``block``'s buffer is free again once ``copied`` (an event, or None) completes."""
        with self._condition:
            holding = self._holding(block)
            if holding is not None and holding.state == "taken":
                holding.state, holding.block, holding.copied = "free", None, copied
                self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()  # a read in flight writes into the buffers
        for buffer in self.buffers:
            copied, buffer.copied = buffer.copied, None
            if copied is not None:
                copied.synchronize()  # the buffers may be read into by a later ring

    def memory(self) -> list[Any]:
        """The buffers' memory, for a later ring once this one is closed."""
        return [buffer.memory for buffer in self.buffers]

    def _holding(self, block: int) -> _Buffer | None:
        for buffer in self.buffers:
            if buffer.block == block and buffer.state in ("reading", "ready", "taken"):
                return buffer
        return None

    def _next(self) -> tuple[int, _Buffer] | None:
        """The next block to read and a free buffer for it; None to wait."""
        while self._wanted:
            block = self._wanted[0]
            if self._holding(block) is not None:
                self._wanted.pop(0)
                continue
            free = [b for b in self.buffers if b.state == "free"]
            if not free:
                return None
            self._wanted.pop(0)
            return block, free[0]
        return None

    def _run(self) -> None:
        while True:
            with self._condition:
                found = self._next()
                while found is None and not self._closed:
                    self._condition.wait()
                    found = self._next()
                if self._closed:
                    return
                block, buffer = found
                buffer.state, buffer.block = "reading", block
                copied, buffer.copied = buffer.copied, None
            try:
                if copied is not None:
                    copied.synchronize()  # the last copy out of this buffer has finished
                started = time.perf_counter()
                nbytes = self.read(block, buffer.memory)
                seconds = time.perf_counter() - started
            except BaseException as error:
                with self._condition:
                    self._failure = error
                    buffer.state, buffer.block = "free", None
                    self._condition.notify_all()
                return
            with self._condition:
                if buffer.block == block and buffer.state == "reading":
                    buffer.state = "ready"
                if self.on_read is not None:
                    self.on_read(nbytes, seconds)
                self._condition.notify_all()
