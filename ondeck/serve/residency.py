"""One device budget across every served pipeline.

Each pipeline's own policy decides within a job; this manager decides between them.
Before a job it frees room by next use, which the queue tells (the waiting jobs say
which model comes next, and each pipeline's stages say which of its components that
model needs first); with nothing waiting, the least recently used model goes first.
While a job decodes, the next job's first components load beside it when they fit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..lazy import is_loaded
from ..memory import format_bytes
from ..planning import bytes_loaded_per_run, loads_from
from ..policy import BudgetPolicy


@dataclass
class ServedModel:
    """One model the server holds: its pipeline and the policy the manager steers."""

    name: str
    source: str
    pipeline: Any
    policy: BudgetPolicy
    kind: str  # "video" or "image"
    last_used: float = 0.0
    # A video model's frame rate and where it was read (``cli.media.model_fps``): what a
    # request's seconds count in, and what its video is written at.
    fps: float = 0.0
    fps_from: str = ""
    takes_image: bool = False  # an input image (image-to-video, image edits)
    needs_image: bool = False  # a call without one fails (image-to-video)
    image_argument: str = "image"  # the call's name for it (a ControlNet's control_image)
    # The call sizes its output from an area cap (Flux Kontext's max_area), which a job's
    # size sets.
    takes_max_area: bool = False
    # What a job asks where its request names none: the pipeline's own size, frames and
    # steps (``cli.shape.own_shape``; None where the call computes one it cannot tell).
    own_shape: Any = None

    def first_use(self) -> dict[str, int]:
        """Each deferred component's first stage index."""
        order: dict[str, int] = {}
        for index, use in enumerate(self.pipeline.stage_uses()):
            for component in use.components:
                order.setdefault(component, index)
        return order

    def resident(self) -> dict[str, int]:
        """Bytes of each component loaded now."""
        sizes = self.pipeline.component_bytes()
        return {
            name: sizes.get(name) or 0
            for name, proxy in self.pipeline.deferred.items()
            if is_loaded(proxy)
        }


@dataclass(frozen=True)
class Eviction:
    model: str
    component: str
    nbytes: int
    reason: str
    for_model: str
    seconds: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "component": self.component,
            "bytes": self.nbytes,
            "reason": self.reason,
            "for_model": self.for_model,
            "at": self.seconds,
        }


@dataclass(frozen=True)
class Holding:
    """What one model holds on the device, as eviction sees it."""

    name: str
    last_used: float
    first_use: Mapping[str, int]  # component -> index of the first stage using it
    resident: Mapping[str, int]  # component -> bytes


def eviction_order(
    holdings: Sequence[Holding], name: str, upcoming: Sequence[str]
) -> list[tuple[str, str, int, str]]:
    """The resident components of the models other than ``name``, the one needed last
    first: a model no waiting job needs before one that is queued (the least recently
    used first), a later-queued one before an earlier one, and within a model its
    last-needed component first. Each with the reason it goes."""
    candidates = []
    for held in holdings:
        if held.name == name:
            continue
        position = next((i for i, m in enumerate(upcoming) if m == held.name), math.inf)
        for component, nbytes in held.resident.items():
            stage = held.first_use.get(component, math.inf)
            if position == math.inf:
                reason = "next use: no waiting job needs it (least recently used first)"
                key = (1, -held.last_used, stage)
            else:
                reason = (
                    f"next use: queued job {position + 1} ({held.name}), "
                    f"stage {int(stage) + 1 if stage != math.inf else '-'}"
                )
                key = (0, position, stage)
            candidates.append((key, held.name, component, nbytes, reason))
    candidates.sort(key=lambda item: item[0], reverse=True)
    return [
        (other, component, nbytes, reason) for _, other, component, nbytes, reason in candidates
    ]


class ResidencyManager:
    """Keeps the components of all served models under one device budget."""

    def __init__(self, models: Mapping[str, ServedModel], budget_bytes: int):
        self.models = dict(models)
        self.budget_bytes = int(budget_bytes)
        self.evictions: list[Eviction] = []
        self.prefetched: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._prefetch_thread: threading.Thread | None = None
        self._plan: ServePlan | None = None

    # -- what is resident -----------------------------------------------------------

    def resident(self) -> dict[str, dict[str, int]]:
        return {name: model.resident() for name, model in self.models.items()}

    def resident_bytes(self, *, excluding: str | None = None) -> int:
        return sum(
            sum(model.resident().values())
            for name, model in self.models.items()
            if name != excluding
        )

    # -- before and after a job -----------------------------------------------------

    def prepare(self, name: str, upcoming: Sequence[str]) -> list[Eviction]:
        """Make room for a job of model ``name``; ``upcoming`` lists the models of the
        jobs waiting after it, in queue order. Returns what was evicted."""
        self.wait_for_prefetch()
        model = self.models[name]
        with self._lock:
            need = self._need_bytes(model)
            evicted = []
            for other, component, nbytes, reason in self._victims(name, upcoming):
                if self.resident_bytes(excluding=name) + need <= self.budget_bytes:
                    break
                pipeline = self.models[other].pipeline
                pipeline.cancel_prefetch_quietly()
                freed = pipeline.deferred[component].release()
                record = Eviction(other, component, freed or nbytes, reason, name)
                evicted.append(record)
                self.evictions.append(record)
            del self.evictions[:-100]  # a bounded log: a long-lived server must not grow
            # The job's own policy plans within what the others leave.
            model.policy.budget_bytes = max(
                1, self.budget_bytes - self.resident_bytes(excluding=name)
            )
            model.last_used = time.monotonic()
            return evicted

    def _need_bytes(self, model: ServedModel) -> int:
        """The most a job of ``model`` holds at once under the whole budget: its largest
        stage's components and activations, or everything it keeps across runs."""
        return need_bytes(model.pipeline.plan(self.budget_bytes))

    def _victims(self, name: str, upcoming: Sequence[str]) -> list[tuple[str, str, int, str]]:
        holdings = [
            Holding(other, model.last_used, model.first_use(), model.resident())
            for other, model in self.models.items()
        ]
        return eviction_order(holdings, name, upcoming)

    def finished(self, name: str) -> None:
        """A job of ``name`` is over; the plan for the set is worked out again here, on
        the device thread (a job's measurements refine it; the status only reads it)."""
        self.models[name].last_used = time.monotonic()
        self._plan = plan_models(self.models, self.budget_bytes)

    # -- loading the next job's first components -----------------------------------

    def prefetch_ahead(self, current: str, next_name: str | None) -> list[str]:
        """While ``current`` decodes, load the first components of ``next_name``'s job
        that fit beside what ``current`` still needs. Returns the names started."""
        if next_name is None or next_name == current or self._prefetch_thread is not None:
            return []
        with self._lock:
            running = self.models[current]
            upcoming = self.models[next_name]
            others = self.resident_bytes(excluding=current)
            room = self.budget_bytes - others - self._still_needed(running)
            if room <= 0:
                return []
            sizes = upcoming.pipeline.component_bytes()
            loaded = upcoming.resident()
            chosen: list[str] = []
            for use in upcoming.pipeline.stage_uses():
                wanted = [c for c in use.components if c not in loaded and c not in chosen]
                nbytes = sum(sizes.get(c) or 0 for c in wanted)
                if not wanted:
                    continue
                if nbytes > room:
                    break
                chosen.extend(wanted)
                room -= nbytes
            if not chosen:
                return []
            # The running job's room shrinks by what loads beside it: the sum stays within.
            taken = sum(sizes.get(c) or 0 for c in chosen)
            running.policy.budget_bytes = max(1, self.budget_bytes - others - taken)
            proxies = [upcoming.pipeline.deferred[c] for c in chosen]

        def load() -> None:
            started = time.perf_counter()
            for proxy in proxies:
                try:
                    proxy.materialize()
                except Exception:  # the job's own access loads again and reports it
                    return
            self.prefetched.append(
                {
                    "model": next_name,
                    "components": chosen,
                    "bytes": taken,
                    "seconds": time.perf_counter() - started,
                    "beside": current,
                }
            )
            del self.prefetched[:-100]

        self._prefetch_thread = threading.Thread(target=load, name="ondeck-serve-prefetch")
        self._prefetch_thread.start()
        return chosen

    def _still_needed(self, running: ServedModel) -> int:
        """What the running job holds now plus what its remaining stages load and
        allocate (activations where a profile knows them)."""
        pipeline = running.pipeline
        index = pipeline.current_stage_index
        uses = pipeline.stage_uses()
        later = uses[(index + 1 if index is not None else 0) :]
        sizes = pipeline.component_bytes()
        resident = running.resident()
        to_load = {c for use in later for c in use.components if c not in resident}
        plan = pipeline.plan(running.policy.budget_bytes)
        activations = [plan.activation_bytes.get(use.name) or 0 for use in later]
        return (
            sum(resident.values())
            + sum(sizes.get(c) or 0 for c in to_load)
            + max(activations, default=0)
        )

    def wait_for_prefetch(self) -> None:
        thread, self._prefetch_thread = self._prefetch_thread, None
        if thread is not None:
            thread.join()

    # -- the plan for the set -------------------------------------------------------

    def plan(self) -> ServePlan:
        """The plan for every served model, as of the last job's end."""
        plan = self._plan
        if plan is None:
            plan = self._plan = plan_models(self.models, self.budget_bytes)
        return plan

    def status(self) -> dict[str, Any]:
        resident = self.resident()
        return {
            "budget_bytes": self.budget_bytes,
            "resident_bytes": sum(sum(r.values()) for r in resident.values()),
            "resident": resident,
            "evictions": [e.to_dict() for e in self.evictions[-20:]],
            "prefetched": self.prefetched[-20:],
        }


@dataclass
class ModelPlan:
    name: str
    component_bytes: dict[str, int]
    peak_bytes: int
    kept_bytes: int
    stages: list[tuple[str, list[str], int]]
    fits: bool
    # Device bytes a job loads after a job of its own model, and with nothing resident
    # (host copies of streamed blocks stay across evictions: not counted).
    run_bytes: int = 0
    first_run_bytes: int = 0
    # Where it does not fit: the stage that overflows the budget most, and by how much.
    overflow: tuple[str, int] | None = None


@dataclass
class ServePlan:
    """What stays resident across a set of models under one budget, and what a switch
    from one to another loads."""

    budget_bytes: int
    models: dict[str, ModelPlan]
    all_resident: bool
    # (from, to) -> bytes the job of ``to`` loads after a job of ``from``.
    switch_bytes: dict[tuple[str, str], int]

    def switch_seconds(self, bytes_per_second: float) -> dict[tuple[str, str], float]:
        return {key: nbytes / bytes_per_second for key, nbytes in self.switch_bytes.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "all_resident": self.all_resident,
            "models": {
                name: {
                    "component_bytes": plan.component_bytes,
                    "peak_bytes": plan.peak_bytes,
                    "kept_bytes": plan.kept_bytes,
                    "run_bytes": plan.run_bytes,
                    "first_run_bytes": plan.first_run_bytes,
                    "fits": plan.fits,
                }
                for name, plan in self.models.items()
            },
            "switch_bytes": [
                {"from": a, "to": b, "bytes": nbytes}
                for (a, b), nbytes in self.switch_bytes.items()
            ],
        }

    def __str__(self) -> str:
        lines = [f"one budget of {format_bytes(self.budget_bytes)} for {len(self.models)} models"]
        lines.append(f"  {'model':<20} {'components':>12} {'peak':>12} {'kept':>12}  fits")
        for name, plan in self.models.items():
            lines.append(
                f"  {name:<20} {format_bytes(sum(plan.component_bytes.values())):>12} "
                f"{format_bytes(plan.peak_bytes):>12} {format_bytes(plan.kept_bytes):>12}  "
                f"{'yes' if plan.fits else 'NO'}"
            )
        for name, plan in self.models.items():
            if plan.overflow is not None:
                stage, over = plan.overflow
                lines.append(
                    f"  {name}: its stage '{stage}' needs {format_bytes(over)} more than the "
                    f"budget (`ondeck plan` of it alone, with this budget, says what would fit)"
                )
        if self.all_resident:
            lines.append("every model stays resident: a switch loads nothing")
        else:
            lines.append("a switch loads:")
            for (a, b), nbytes in self.switch_bytes.items():
                lines.append(f"  {a} -> {b}: {format_bytes(nbytes)}")
        return "\n".join(lines)


def need_bytes(plan: Any) -> int:
    """The most a job holds at once under ``plan``: its largest stage's components and
    activations, or everything it keeps across runs."""
    requirement = max((nbytes for _, nbytes in plan.stage_requirements()), default=0)
    return max(requirement, plan.peak_bytes)


def plan_models(models: Mapping[str, ServedModel], budget_bytes: int) -> ServePlan:
    """The plan for a set of served models under one budget; reads no weights.

    Each model plans alone under the whole budget. What a switch from ``a`` to ``b``
    loads is what the manager and ``b``'s policy do when jobs of the two alternate with
    nothing else queued: before ``b``'s job, ``a``'s components go in eviction order
    until ``b``'s need fits; ``b`` plans within what ``a`` left and loads what it lacks
    of what it did not keep, its next-run prefetch included. The alternation runs until
    it repeats, and the figure is its steady state's.
    """
    plans: dict[str, ModelPlan] = {}
    planned = _Plans()
    for name, model in models.items():
        plan = planned(model, budget_bytes)
        kept = plan.stages[-1][2] if plan.stages else 0
        plans[name] = ModelPlan(
            name=name,
            component_bytes={k: v or 0 for k, v in plan.component_bytes.items()},
            peak_bytes=need_bytes(plan),
            kept_bytes=kept,
            stages=plan.stages,
            fits=plan.fits(budget_bytes),
            run_bytes=bytes_loaded_per_run(plan),
            first_run_bytes=loads_from(plan, ())[0],
            overflow=plan.overflow(budget_bytes),
        )
    all_resident = sum(p.peak_bytes for p in plans.values()) <= budget_bytes
    switch = {
        (a, b): _alternation(models[a], models[b], budget_bytes, planned)
        for a in models
        for b in models
        if a != b
    }
    return ServePlan(budget_bytes, plans, all_resident, switch)


ALTERNATIONS = 4  # jobs of each model: enough for the residency to repeat


class _Plans:
    """Each model's plan under a budget, made once for the set's plan."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, int], Any] = {}

    def __call__(self, model: ServedModel, budget_bytes: int) -> Any:
        key = (model.name, budget_bytes)
        if key not in self._made:
            self._made[key] = model.pipeline.plan(budget_bytes)
        return self._made[key]


def _alternation(
    first: ServedModel, second: ServedModel, budget_bytes: int, planned: _Plans
) -> int:
    """Bytes a job of ``second`` loads after one of ``first``, the two alternating."""
    held: dict[str, frozenset[str]] = {first.name: frozenset(), second.name: frozenset()}
    sizes = {m.name: m.pipeline.component_bytes() for m in (first, second)}
    loaded = 0
    for turn in range(2 * ALTERNATIONS):
        model, other = (first, second) if turn % 2 == 0 else (second, first)
        need = need_bytes(planned(model, budget_bytes))
        holding = Holding(
            other.name,
            float(turn),
            other.first_use(),
            {c: sizes[other.name].get(c) or 0 for c in held[other.name]},
        )
        left = dict(holding.resident)
        for _, component, _, _ in eviction_order([holding], model.name, []):
            if sum(left.values()) + need <= budget_bytes:
                break
            del left[component]
        held[other.name] = frozenset(left)
        own = planned(model, max(1, budget_bytes - sum(left.values())))
        loaded, held[model.name] = loads_from(own, held[model.name])
    return loaded
