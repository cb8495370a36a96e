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

    Past ``PRESSURE_FRACTION`` of ``budget_bytes``, once the process grew by more than
    ``reserve_bytes`` (or past the budget itself), it calls ``relieve()`` (which frees
    what it can, returning the bytes); still over the budget after that, the run fails
    at its next stage with :class:`HostMemoryError` (``check``). ``peak_bytes`` is the
    highest reading.

    ``counted()`` is the host memory a plan counts on its own (host copies, rings, the
    host cache; what ondeck allocates is counted before it is touched): ``growth_bytes``
    is how far the rest of the process rose during the run above where it started, the
    reserve the next plan keeps for a run.
    """

    def __init__(
        self,
        budget_bytes: int,
        relieve: Callable[[], int],
        *,
        interval: float = 0.05,
        rss: Callable[[], int] = process_rss_bytes,
        counted: Callable[[], int] = lambda: 0,
    ):
        self.budget_bytes = int(budget_bytes)
        self.relieve = relieve
        self.interval = interval
        self.rss = rss
        self.counted = counted
        self.peak_bytes = 0
        self.relieved_bytes = 0
        self.exceeded: int | None = None
        self.started_uncounted: int | None = None  # the process besides ``counted``, at start
        self.peak_uncounted = 0
        # The plan's reserve for the process's growth: within it, a run near its budget
        # is as planned and nothing is dropped.
        self.reserve_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampling = threading.Lock()  # the thread's samples and ``check``'s, one at a time

    @property
    def growth_bytes(self) -> int:
        """How far the process besides ``counted()`` rose above its start, in the run
        watched last."""
        if self.started_uncounted is None:
            return 0
        return max(0, self.peak_uncounted - self.started_uncounted)

    def start(self) -> None:
        self.exceeded = None
        self.started_uncounted = None
        self.peak_uncounted = 0
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="ondeck-host-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self.read()  # the run's end: its output is often the last thing it grew by

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:
                # A reading that failed (a relief racing a re-plan, say) is taken again
                # next time: a watch that died would leave the run unwatched.
                continue

    def read(self) -> int:
        """One reading of the RSS, noted in the peaks; returns it."""
        # What ondeck holds is read on both sides of the RSS, the larger taken: a buffer
        # allocated or freed between the readings then counts as ondeck's, never as growth.
        before = self.counted()
        rss = self.rss()
        uncounted = rss - max(before, self.counted())
        self.peak_bytes = max(self.peak_bytes, rss)
        if self.started_uncounted is None:
            self.started_uncounted = uncounted
        self.peak_uncounted = max(self.peak_uncounted, uncounted)
        return rss

    def sample(self) -> None:
        """One reading: relieve past the pressure mark, note an excess that remains."""
        with self._sampling:
            rss = self.read()
            if rss <= PRESSURE_FRACTION * self.budget_bytes:
                return
            if rss <= self.budget_bytes and self.growth_bytes <= self.reserve_bytes:
                return  # as planned: a plan fills its budget, its reserve included
            self.relieved_bytes += self.relieve()
            after = self.rss()
            if after > self.budget_bytes:
                self.exceeded = after

    def check(self) -> None:
        """Raise if the process is over its budget after relief. An excess a sample saw
        is read again: gone back within the budget (a buffer since freed), the run goes
        on, and the watch keeps watching."""
        if self.exceeded is not None:
            with self._sampling:
                now = self.read()
                self.exceeded = now if now > self.budget_bytes else None
        elif self._thread is not None:
            self.sample()
        if self.exceeded is not None:
            raise HostMemoryError(
                f"host memory: the process holds {format_bytes(self.exceeded)}, more than its "
                f"host budget of {format_bytes(self.budget_bytes)}, after dropping the host "
                f"cache and idle streaming copies ({format_bytes(self.relieved_bytes)}); "
                "stopped before the kernel would kill it. Give a larger host budget "
                "(--host-memory, host_memory=), a smaller host cache (--host-cache, "
                "host_cache=), or fp8 storage (--weights fp8, storage_dtype=) to stream half "
                "the bytes"
            )
