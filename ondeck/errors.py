"""The errors ondeck raises on purpose: each names what failed and why."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class OndeckError(Exception):
    """Base of every error ondeck raises deliberately."""


class LoadError(OndeckError):
    """A component could not be loaded.

    The message names the component and, where one is involved, the file and
    tensor; the underlying exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, component: str | None = None, path: str | None = None):
        super().__init__(message)
        self.component = component
        self.path = path


class BudgetError(OndeckError):
    """A stage's components cannot fit the memory budget; raised before any load."""

    def __init__(self, message: str, *, plan=None):
        super().__init__(message)
        self.plan = plan


class ConcurrentRunError(OndeckError):
    """A pipeline was called while another thread was running it."""


@contextlib.contextmanager
def held_logs(*libraries: str) -> Iterator[None]:
    """What the ``libraries``' loggers say meanwhile is held: emitted as it came where
    the block ends well, dropped where it raises (the error raised instead says it once,
    rather than a hundred lines of a library's log before it)."""
    held: list[tuple[logging.Handler, logging.LogRecord]] = []
    holds = []
    for handler in {h for name in libraries for h in logging.getLogger(name).handlers}:

        def hold(record: logging.LogRecord, handler: logging.Handler = handler) -> bool:
            held.append((handler, record))
            return False

        handler.addFilter(hold)
        holds.append((handler, hold))
    try:
        yield
    finally:
        for handler, hold in holds:
            handler.removeFilter(hold)
    for handler, record in held:
        handler.handle(record)
