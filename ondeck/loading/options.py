"""How a pipeline's components load: one frozen set of options, passed from the front
doors (``WanTextToVideo.from_folder``, ``ondeck.diffusers.from_pretrained``) through
the helpers that build each component's loader, down to the loaders themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

if TYPE_CHECKING:
    from .host_cache import HostCache

__all__ = ["DeviceChoice", "LoadOptions", "StorageChoice"]

# A device as callers name it: ``"cuda"``, ``"cuda:1"``, a ``torch.device``, an index;
# None: CUDA where there is one.
DeviceChoice: TypeAlias = "torch.device | str | int | None"
# fp8 storage as callers ask for it: ``"fp8"`` or a float8 dtype for the big components,
# or one (or None) by component name; None: weights kept as they compute.
StorageChoice: TypeAlias = "str | torch.dtype | Mapping[str, str | torch.dtype | None] | None"


@dataclass(frozen=True)
class LoadOptions:
    """The options every loader of a pipeline shares, and the two a component may set
    for itself (``dtype``, ``storage_dtype``).

    ``device``: where the weights go. ``dtype``: the compute dtype (None: the folder's).
    ``host_cache``: pinned host copies of released weights, for fast reloads.
    ``progress``: a progress bar for large reads. ``pipelined``: whether a stage may
    start computing while its component's blocks still arrive (None: the large
    components). ``storage_dtype``: a narrower dtype the weights are kept in (``"fp8"``).
    """

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype | str | None = None
    host_cache: HostCache | None = None
    progress: bool = True
    pipelined: bool | None = None
    storage_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))

    def replace(self, **changes: Any) -> LoadOptions:
        """These options with ``changes`` (a component's own dtype, say)."""
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """As the loaders' keyword arguments."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def split(
        cls, options: LoadOptions | None, keywords: dict[str, Any]
    ) -> tuple[LoadOptions, dict[str, Any]]:
        """``options`` (or the defaults) updated with the ``keywords`` that name its
        fields, and the keywords left over (a loader's own: ``placement``, ``threads``)."""
        names = {field.name for field in dataclasses.fields(cls)}
        mine = {key: value for key, value in keywords.items() if key in names}
        rest = {key: value for key, value in keywords.items() if key not in names}
        return (options or cls()).replace(**mine), rest
