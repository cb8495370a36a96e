"""The contract between a component's proxy, the pipeline and whatever loads the component.

A ``LazyModule`` takes any zero-argument callable as its loader. ondeck's own loaders
(:class:`ondeck.loading.ComponentLoader` and the others, over
:class:`ondeck.loading.FolderLoader`) declare more: a spec known without weights, a
pipelined start, a release hook, whether each call builds a new module, and the room
their upcast copies need. :func:`as_loader` gives every loader that shape: a declared
one as it is, a plain callable with the defaults of :class:`DeclaredLoader`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .lazy import ComponentSpec

__all__ = ["DeclaredLoader", "Loader", "PlainLoader", "as_loader"]


class Loader(Protocol):
    """What ondeck asks of a component loader."""

    @property
    def returns_fresh_module(self) -> bool:
        """Each call builds a new module, so a release may free its storage."""
        ...

    @property
    def spec(self) -> ComponentSpec | None:
        """What is known of the component without loading it (None: nothing)."""
        ...

    @property
    def upcast_bytes(self) -> int:
        """The most bytes of compute-dtype copies one stored layer makes for its forward
        (0 when nothing is stored in a narrower dtype)."""
        ...

    @property
    def setup_seconds(self) -> float:
        """Of its last load's seconds, those a reload under the same plan does not
        repeat (making and filling streamed blocks' host copies; 0: none)."""
        ...

    def __call__(self) -> Any:
        """The loaded component, every weight in place."""
        ...

    def begin(self) -> tuple[Any, Any]:
        """The component once it can start computing, and the filling still bringing its
        weights in (None when every weight is in place)."""
        ...

    def unload(self, module: Any) -> None:
        """Called on release, with the module the load returned."""
        ...


class DeclaredLoader:
    """The defaults of :class:`Loader`, for classes that declare it: a subclass gives
    ``__call__`` and overrides what it does otherwise."""

    returns_fresh_module: bool = False
    upcast_bytes: int = 0
    setup_seconds: float = 0.0

    @property
    def spec(self) -> ComponentSpec | None:
        return None

    def __call__(self) -> Any:
        raise NotImplementedError

    def begin(self) -> tuple[Any, Any]:
        return self(), None

    def unload(self, module: Any) -> None:
        pass


class PlainLoader(DeclaredLoader):
    """A zero-argument callable, as a :class:`Loader` with the defaults."""

    def __init__(self, load: Callable[[], Any]):
        self.load = load

    def __call__(self) -> Any:
        return self.load()

    def __repr__(self) -> str:
        return f"PlainLoader({self.load!r})"


def as_loader(loader: Callable[[], Any]) -> Loader:
    """``loader`` as a :class:`Loader`: itself when it declares the protocol, else a
    :class:`PlainLoader` around it."""
    if isinstance(loader, DeclaredLoader):
        return loader
    return PlainLoader(loader)
