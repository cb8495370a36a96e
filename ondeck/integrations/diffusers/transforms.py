"""A transform a caller gives a component through ``pipe.ondeck.add_transform``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...lazy import is_out_of_memory
from .component import PipelineComponent

__all__ = ["FirstApplied"]


class FirstApplied:
    """A transform that takes itself off ``component`` where its first application fails:
    a mistake in it then fails one call, not every call after. Once applied it stays, and
    a later failure fails that load alone. Running out of memory, an interrupt, or a
    failure in a load ahead of the call (whose error is only a warning: the call's own
    load meets it again and says so) do not take it off."""

    def __init__(self, fn: Callable[[Any], Any], component: PipelineComponent):
        self.fn = fn
        self.component = component
        self.applied = False

    def __call__(self, module: Any) -> Any:
        try:
            result = self.fn(module)
        except Exception as error:
            if not is_out_of_memory(error):
                self._failed()
            raise
        self.applied = True
        return result  # None: the module changed in place

    def _failed(self) -> None:
        if not self.applied and not self.component.in_load_ahead():
            self.component.remove_transform(self)

    def __repr__(self) -> str:
        return repr(self.fn)
