"""What every loader of a model folder's component shares: the folder and the component,
where its weights go, and what its last load did."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import LoadError
from ..loader import DeclaredLoader
from .host_cache import component_owner
from .model_folder import ModelFolder
from .options import LoadOptions

__all__ = ["FolderLoader", "open_folder"]


class FolderLoader(DeclaredLoader):
    """The shared part of :class:`~.components.ComponentLoader` and
    :class:`~.quantized.QuantizedComponentLoader`: a :class:`ondeck.loader.Loader` for one
    component of ``folder``, built from :class:`~.options.LoadOptions`.

    ``places_blocks``: it takes a ``placement`` (``ComponentLoader`` describes the protocol)
    and a ``template`` (the module on the meta device as it loads), so block streaming
    can keep some blocks in host memory; ``placement`` is the one it holds (None: every
    weight on ``device``). ``storage_dtype`` is the narrower dtype its weights are kept
    in (None: as they compute); ``bytes_read`` the bytes it has read from the files,
    where it counts them (None: it does not); ``mesh`` the device mesh it shards over
    (None: it loads whole).

    What its last load did: ``last_load_bytes``, ``last_load_seconds``, ``last_source``,
    and ``last_read_seconds``, the reads and copies alone without building the module
    (a pipelined load's: from its first group's to the end of its last; 0 where not
    timed); ``last_allocate_seconds``, allocating the load's memory (streamed blocks'
    host copies, page-locked, the first time), and ``last_placed_read_seconds``, filling
    those host copies (0 once they hold their blocks).
    """

    # Each call builds a new module, so a LazyModule may free its storage on release.
    returns_fresh_module = True
    places_blocks = False
    placement: Any = None
    storage_dtype: torch.dtype | None = None
    bytes_read: int | None = None
    mesh = None

    def __init__(self, folder: ModelFolder | str | os.PathLike, name: str, options: LoadOptions):
        self.folder = open_folder(folder, name)
        self.name = name
        self.device = options.device
        self.progress = options.progress
        self.pipelined = options.pipelined
        cache = options.host_cache
        self.host_cache = cache if cache and cache.enabled_for(self.device) else None
        self.last_load_bytes = 0
        self.last_load_seconds = 0.0
        self.last_read_seconds = 0.0
        self.last_allocate_seconds = 0.0
        self.last_placed_read_seconds = 0.0
        self.last_source: str | None = None
        self.last_readers: str | None = None  # "processes" or "threads", for benchmarks

    @property
    def cache_owner(self) -> tuple[str, str]:
        """What its host-cache keys start with (``host_cache.component_owner``)."""
        return component_owner(self.folder.path, self.name)

    def weightless_module(self) -> torch.nn.Module:
        """A fresh module of this component on the meta device: what a call that changes
        its layers (a LoRA's) is tried on before any weight loads."""
        return self.folder.skeleton(self.name, self.dtype).module

    @property
    def setup_seconds(self) -> float:
        """The last load's allocating and host-copy filling, where it filled host copies
        (a reload under the same plan finds them made and filled). The allocating also
        holds the device tensors', which a reload repeats: small beside page-locking."""
        if self.last_placed_read_seconds <= 0:
            return 0.0
        return self.last_placed_read_seconds + self.last_allocate_seconds


def open_folder(folder: ModelFolder | str | os.PathLike, name: str) -> ModelFolder:
    """``folder`` opened, an error naming the component ``name`` it was opened for."""
    if isinstance(folder, ModelFolder):
        return folder
    try:
        return ModelFolder.open(folder)
    except LoadError as error:
        raise LoadError(f"component '{name}': {error}", component=name, path=error.path) from None
