"""A transform a caller gives a component through ``pipe.ondeck.add_transform``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...lazy import LazyModule

__all__ = ["FirstApplied"]


class FirstApplied:
    """A transform that takes itself off ``component`` where its first application fails:
    a mistake in it then fails one load, not every load after. Once applied it stays,
    and a later failure (out of memory, say) fails that load alone."""

    def __init__(self, fn: Callable[[Any], Any], component: LazyModule):
        self.fn = fn
        self.component = component
        self.applied = False

    def __call__(self, module: Any) -> Any:
        try:
            result = self.fn(module)
        except BaseException:
            if not self.applied:
                self.component.remove_transform(self)
            raise
        if result is None and not self.applied:
            self.component.remove_transform(self)
        self.applied = result is not None
        return result

    def __repr__(self) -> str:
        return repr(self.fn)
