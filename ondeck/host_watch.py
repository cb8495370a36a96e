"""The process's host memory, watched while a pipeline runs: ondeck drops what it can
(host-cache entries, idle streaming copies) before the kernel would kill the process,
and fails the run with a clear error when that is not enough."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import BudgetError
from .memory import format_bytes, process_rss_bytes

__all__ = ["HostMemoryError", "HostWatch"]

# Past this share of the host budget the watch frees what it can.
PRESSURE_FRACTION = 0.95


class HostMemoryError(BudgetError):
    """The process's host memory outgrew its budget and nothing more could be freed."""


class HostWatch:
    """Samples the process's RSS every ``interval`` seconds while a run is on.

    Past ``PRESSURE_FRACTION`` of ``budget_bytes`` it calls ``relieve()`` (which frees
    what it can, returning the bytes); still over the budget after that, the run fails
    at its next stage with :class:`HostMemoryError` (``check``). ``peak_bytes`` is the
    highest reading.
    """

    def __init__(
        self,
        budget_bytes: int,
        relieve: Callable[[], int],
        *,
        interval: float = 0.05,
        rss: Callable[[], int] = process_rss_bytes,
    ):
        self.budget_bytes = int(budget_bytes)
        self.relieve = relieve
        self.interval = interval
        self.rss = rss
        self.peak_bytes = 0
        self.relieved_bytes = 0
        self.exceeded: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.exceeded = None
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="ondeck-host-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """One reading: relieve past the pressure mark, note an excess that remains."""
        rss = self.rss()
        self.peak_bytes = max(self.peak_bytes, rss)
        if rss <= PRESSURE_FRACTION * self.budget_bytes:
            return
        self.relieved_bytes += self.relieve()
        after = self.rss()
        if after > self.budget_bytes:
            self.exceeded = after

    def check(self) -> None:
        """Raise if the process outgrew its budget since the run started."""
        if self.exceeded is not None:
            raise HostMemoryError(
                f"host memory: the process holds {format_bytes(self.exceeded)}, more than its "
                f"host budget of {format_bytes(self.budget_bytes)}, after dropping the host "
                f"cache and idle streaming copies ({format_bytes(self.relieved_bytes)}); "
                "stopped before the kernel would kill it. Give a larger --host-memory, a "
                "smaller --host-cache, or fp8 storage (--weights fp8) to stream half the bytes"
            )
