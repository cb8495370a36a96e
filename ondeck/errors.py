"""The errors ondeck raises on purpose: each names what failed and why."""

from __future__ import annotations


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
