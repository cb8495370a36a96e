"""Streamed blocks' host copies filled behind the compute of the first pass.

The first load under a plan reads each streamed block's bytes into its host copy:
page-locked memory, allocated (or made ahead by the preparing thread) on first use. Done
before the module is handed to its stage, the stage waits for every block: reading
27 GiB from the page cache and page-locking whatever was not locked ahead, about 2 s for
a 14B video transformer on an 8 GiB card. Filled here instead, on a thread of its own,
block after block in the order they stream, the first pass computes each block as soon
as its own copy is in, while the later ones are read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..errors import LoadError

__all__ = ["HostFill"]


class HostFill:
    """Fills the host copies of ``blocks``, in that order, on a thread of its own.

    ``fill(block)`` allocates one block's copy and reads its bytes. ``ready(block)`` asks
    without waiting; ``wait(block)`` waits for that block and raises a ``LoadError``
    naming ``component`` where its fill, or one before it, failed. ``join()`` waits for
    the thread to end; ``stop()`` ends it after the block in flight and waits for it:
    blocks not filled by then stay unfilled (a later load reads them again).
    """

    def __init__(self, component: str, blocks: Sequence[int], fill: Callable[[int], None]):
        self.component = component
        self.blocks = tuple(blocks)
        self._fill = fill
        self._done: set[int] = set()
        self._error: BaseException | None = None
        self._stopping = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ondeck-host-fill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for block in self.blocks:
            with self._condition:
                if self._stopping:
                    break
            try:
                self._fill(block)
            except BaseException as error:  # told to whoever waits for this block or later
                with self._condition:
                    self._error = error
                    self._condition.notify_all()
                return
            with self._condition:
                self._done.add(block)
                self._condition.notify_all()
        with self._condition:
            self._stopping = True
            self._condition.notify_all()

    def ready(self, block: int) -> bool:
        with self._condition:
            return block in self._done

    def wait(self, block: int) -> None:
        with self._condition:
            while block not in self._done:
                if self._error is not None:
                    raise LoadError(
                        f"component '{self.component}': reading its streamed blocks' host "
                        f"copies failed: {self._error}",
                        component=self.component,
                    ) from self._error
                if self._stopping:
                    raise RuntimeError(
                        f"component '{self.component}': block {block} was asked for after "
                        "the filling of its host copies stopped"
                    )
                self._condition.wait()

    def join(self) -> None:
        """Wait for every block's fill (or the first failure) to end."""
        self._thread.join()

    def stop(self) -> None:
        with self._condition:
            self._stopping = True
        self._thread.join()
