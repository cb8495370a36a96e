"""What a policy decides from: a frozen, read-only view of a pipeline at one moment.

The pipeline builds it (``Pipeline.snapshot()``) from what it already knows, without
loading anything; a policy reads it and answers with ``Steps``, which the executor
carries out. Nothing here can load, release or start a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .planning import StageUse

__all__ = ["Snapshot", "Steps"]


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Snapshot:
    """A pipeline's stages, bytes, residency and activation needs at one moment.

    ``fit_activations`` holds each stage's ``Stage.fit_activations`` (a tiled decode
    answers less than it measured); ``loaders`` maps each deferred component to its
    loader, for block streaming's planning, which reads skeletons, never weights.
    """

    uses: tuple[StageUse, ...]
    # Bytes per deferred component: measured once loaded, else planned from its spec.
    nbytes: Mapping[str, int | None]
    # What a streamed component takes on the device under its layout.
    streamed_bytes: Mapping[str, int] = field(default_factory=dict)
    resident: frozenset[str] = frozenset()
    prefetching: frozenset[str] = frozenset()
    index: int | None = None
    run_shape: Mapping[str, Any] | None = None
    stored_activation: Mapping[str, int] = field(default_factory=dict)
    stored_note: str = ""
    measured_activation: Mapping[str, int] = field(default_factory=dict)
    # Whether the peaks this process measured stand beside the stored ones (each fills
    # what the other lacks, a stored one counting where both hold a stage), rather than
    # the stored profile alone counting once a pipeline looks one up.
    measured_beside_stored: bool = False
    # Stages never measured exactly, each with the most its activations can be
    # (``MemoryTracker.activation_bounds``).
    activation_bounds: Mapping[str, int] = field(default_factory=dict)
    # Stages whose CUDA allocator kept retrying, with how many runs (this process) it did.
    retried_stages: Mapping[str, int] = field(default_factory=dict)
    # Stages during which the CUDA allocator retried at all (and never ran out of
    # memory), in any run of this process: their peaks reached the device's limit.
    limit_stages: frozenset[str] = frozenset()
    device: Any = None
    fit_activations: tuple[Callable[[int, int], int], ...] = ()
    # Whether the stage about to run will touch its components (a cache may say no).
    needs_components: bool = True
    # Later stages that will not touch theirs, as far as the state now tells.
    later_unneeded: frozenset[int] = frozenset()
    loaders: Mapping[str, Any] = field(default_factory=dict)
    streamable_blocks: Mapping[str, str | None] = field(default_factory=dict)
    # Per component kept in a storage dtype: the most bytes one layer's upcast copies take.
    upcast_bytes: Mapping[str, int] = field(default_factory=dict)
    # Per component, its calls (forward passes) in the last run that completed; empty
    # before one has.
    calls_per_run: Mapping[str, int] = field(default_factory=dict)
    # Per component, its quickest call's device seconds in that run; empty off CUDA.
    seconds_per_call: Mapping[str, float] = field(default_factory=dict)
    # Per component loaded in that run, the rate its load reached, where it is not the
    # process's first run's alone (``MemoryTracker.later_load_bytes_per_second``).
    load_bytes_per_second: Mapping[str, float] = field(default_factory=dict)
    # Host memory streamed blocks' pinned copies and rings may take (the host budget less
    # the process and the host cache's budget); None where unknown.
    host_room_bytes: int | None = None
    # The host budget the pipeline was given (``host_memory``); None: the machine's.
    host_memory: int | None = None
    # Whether another run is expected (``Pipeline.more_runs``): without one, nothing is
    # loaded ahead for it.
    more_runs: bool = True
    # Runs of this pipeline that completed so far: a call that starts again after running
    # out of memory is the same run.
    runs_completed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "nbytes",
            "streamed_bytes",
            "stored_activation",
            "measured_activation",
            "activation_bounds",
            "retried_stages",
            "loaders",
            "streamable_blocks",
            "upcast_bytes",
            "calls_per_run",
            "seconds_per_call",
            "load_bytes_per_second",
        ):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "uses", tuple(self.uses))

    # The pipeline's own reading names, so a function written against a pipeline
    # (``choose_auto``) reads a snapshot the same way.
    def stage_uses(self) -> list[StageUse]:
        return list(self.uses)

    def component_bytes(self) -> dict[str, int | None]:
        return dict(self.nbytes)

    def device_bytes(self) -> dict[str, int]:
        """Bytes per component on the device: unknown sizes count 0, and a streamed
        component counts what its layout keeps on the device."""
        sizes = {name: value or 0 for name, value in self.nbytes.items()}
        sizes.update(self.streamed_bytes)
        return sizes

    @property
    def in_flight(self) -> frozenset[str]:
        """Resident, or on their way: loaded, or being prefetched now."""
        return self.resident | self.prefetching


@dataclass(frozen=True)
class Steps:
    """What a policy decided: the executor releases, loads, then prefetches, in order.

    ``release`` goes before ``load`` (making room); ``prefetch_release`` before
    ``prefetch``; ``prefetch_next_run`` loads the next run's first components one after
    another in the background while the last stage computes. ``keep`` names what stays
    resident on purpose (it is for reading: nothing is done for it). ``streaming`` is a
    ``(BlockStreaming, Plan)`` pair: the plan's block layouts go on the loaders before
    anything loads.
    """

    release: tuple[str, ...] = ()
    load: tuple[str, ...] = ()
    prefetch_release: tuple[str, ...] = ()
    prefetch: tuple[str, ...] = ()
    prefetch_next_run: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    streaming: tuple[Any, Any] | None = None


NOTHING = Steps()
