"""What the budget policy does around each stage: which components to evict, load and
load ahead, as pure functions of names, bytes and which stage holds what.

``planning.simulate`` runs the same steps over whole runs, so the plan predicts the peak
the policy's run will have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .memory import format_bytes

__all__ = [
    "StageStep",
    "StageUse",
    "budget_step",
    "choose_evictions",
    "next_stage_with_loads",
    "next_use_distance",
    "total_bytes",
    "unavoidable_peak",
]

# Components smaller than this share of the budget load at their own stage rather than
# early, where loading early would raise the run's peak (see ``_PeakGuard``).
SMALL_PREFETCH_FRACTION = 0.05


@dataclass(frozen=True)
class StageUse:
    """A top-level stage and the deferred components it holds."""

    name: str
    components: tuple[str, ...]


def next_use_distance(component: str, uses: Sequence[StageUse], index: int) -> float:
    """Stages from ``index`` until ``component`` is next needed, wrapping into the next run."""
    count = len(uses)
    for step in range(1, count + 1):
        if component in uses[(index + step) % count].components:
            return step
    return math.inf


def total_bytes(names: Iterable[str], nbytes: Mapping[str, int]) -> int:
    """The bytes of ``names``, each counted once."""
    return sum(nbytes[name] for name in set(names))


def choose_evictions(
    resident: Iterable[str],
    keep: Iterable[str],
    incoming: Iterable[str],
    *,
    uses: Sequence[StageUse],
    index: int,
    nbytes: Mapping[str, int],
    limit: int,
    protect_within: float = 0,
) -> list[str] | None:
    """Which resident components to evict so ``resident + incoming`` fits ``limit``.

    Evicts the component whose next use is farthest away first (larger first on ties).
    Components in ``keep`` are never chosen, nor any needed within ``protect_within``
    stages. Returns None when no choice of evictions makes it fit.
    """
    resident = set(resident)
    keep = set(keep)
    wanted = resident | set(incoming)
    evicted: list[str] = []
    candidates = sorted(
        (c for c in resident if c not in keep),
        key=lambda c: (next_use_distance(c, uses, index), nbytes[c]),
        reverse=True,
    )
    for candidate in candidates:
        if total_bytes(wanted, nbytes) <= limit:
            break
        if next_use_distance(candidate, uses, index) <= protect_within:
            break
        wanted.discard(candidate)
        evicted.append(candidate)
    if total_bytes(wanted, nbytes) > limit:
        return None
    return evicted


@dataclass(frozen=True)
class StageStep:
    """What the budget policy does around one stage."""

    evict: tuple[str, ...]
    load: tuple[str, ...]
    prefetch_evict: tuple[str, ...]
    prefetch: tuple[str, ...]


def next_stage_with_loads(
    uses: Sequence[StageUse], index: int, resident: Iterable[str], *, next_run: bool = True
) -> tuple[int, int] | None:
    """The next stage that needs a component not yet resident, and how many stages away
    it is. After the last stage this looks into the next run: a pipeline that runs again
    (a new prompt) needs its first stages' components then, and the budget policy keeps
    what it loaded between runs. Without a ``next_run``, only this run's later stages."""
    resident = set(resident)
    count = len(uses)
    for step in range(1, count if next_run else count - index):
        later = (index + step) % count
        if set(uses[later].components) - resident:
            return later, step
    return None


def unavoidable_peak(
    uses: Sequence[StageUse], nbytes: Mapping[str, int], activation: Mapping[str, int | None]
) -> int:
    """The largest stage's own components and activations: no schedule peaks lower."""
    return max(
        (total_bytes(use.components, nbytes) + (activation.get(use.name) or 0) for use in uses),
        default=0,
    )


def budget_step(
    resident: Iterable[str],
    index: int,
    *,
    uses: Sequence[StageUse],
    nbytes: Mapping[str, int],
    budget: int,
    activation: Mapping[str, int | None],
    prefetch: bool,
    next_run: bool = True,
) -> StageStep:
    """Decide evictions and loads before stage ``index``, and what to prefetch during it
    (the next stage that needs a load, in the next run after the last stage unless there
    is no ``next_run``).

    Raises ``ValueError`` when the stage's own components and activations cannot fit.
    """
    resident = set(resident)
    use = uses[index]
    headroom = activation.get(use.name) or 0
    needed = set(use.components)
    required = total_bytes(needed, nbytes) + headroom
    if required > budget:
        raise ValueError(
            f"stage '{use.name}' needs {format_bytes(required)} "
            f"({', '.join(sorted(needed)) or 'no components'} plus "
            f"{format_bytes(headroom)} of activations), "
            f"{format_bytes(required - budget)} more than the budget of {format_bytes(budget)}"
        )
    missing = [c for c in use.components if c not in resident]
    evict = choose_evictions(
        resident,
        needed,
        missing,
        uses=uses,
        index=index,
        nbytes=nbytes,
        limit=budget - headroom,
    )
    assert evict is not None  # the stage alone fits, so evicting everything else fits
    resident = (resident - set(evict)) | needed
    guard = _PeakGuard(uses, nbytes, budget, activation)
    evict = [*evict, *guard.idle_to_drop(resident, needed, headroom)]
    resident -= set(evict)
    prefetch_evict: list[str] = []
    prefetched: list[str] = []
    if prefetch:
        found = next_stage_with_loads(uses, index, resident, next_run=next_run)
        if found is not None:
            later, distance = found
            incoming = [c for c in uses[later].components if c not in resident]
            choice = choose_evictions(
                resident,
                needed | set(uses[later].components),
                incoming,
                uses=uses,
                index=index,
                nbytes=nbytes,
                limit=budget - headroom,
                protect_within=distance,
            )
            if choice is not None and guard.worth_prefetching(
                (resident - set(choice)) | set(incoming), incoming, headroom
            ):
                prefetch_evict, prefetched = choice, incoming
    return StageStep(tuple(evict), tuple(missing), tuple(prefetch_evict), tuple(prefetched))


class _PeakGuard:
    """Keeps small components from lifting the run's peak when components move anyway.

    When everything fits the budget at once, everything stays (nothing moves after the
    first run). Otherwise the peak is the largest stage's own need where possible: a small
    component, whose load at its own stage takes milliseconds, is neither loaded early nor
    held through a stage that does not use it if that would lift the peak above it.
    """

    def __init__(self, uses, nbytes: Mapping[str, int], budget: int, activation) -> None:
        self.nbytes = nbytes
        everything = {c for use in uses for c in use.components}
        largest_activation = max((activation.get(use.name) or 0 for use in uses), default=0)
        self.active = total_bytes(everything, nbytes) + largest_activation > budget
        self.peak = unavoidable_peak(uses, nbytes, activation)
        self.small = SMALL_PREFETCH_FRACTION * budget

    def _lifts(self, resident: Iterable[str], headroom: int) -> bool:
        return self.active and total_bytes(resident, self.nbytes) + headroom > self.peak

    def idle_to_drop(self, resident: set[str], needed: set[str], headroom: int) -> list[str]:
        resident = set(resident)
        dropped = []
        idle = [c for c in resident - needed if self.nbytes[c] < self.small]
        for component in sorted(idle, key=lambda c: (-self.nbytes[c], c)):
            if not self._lifts(resident, headroom):
                break
            resident.discard(component)
            dropped.append(component)
        return dropped

    def worth_prefetching(
        self, resident_after: set[str], incoming: Sequence[str], headroom: int
    ) -> bool:
        if not self._lifts(resident_after, headroom):
            return True
        return total_bytes(incoming, self.nbytes) >= self.small  # too large to load late
