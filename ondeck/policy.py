"""Residency policies: what to load, prefetch, keep or release at stage boundaries.

A policy decides from a ``Snapshot`` of the pipeline and answers with ``Steps``; the
executor (``executor.py``) carries them out. Decisions about budgets come from the
pure functions in ``stage_steps.py``, the same ones ``planning.py`` simulates, so the plan
predicts what the run does.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import memory
from .errors import BudgetError
from .memory import format_bytes, positive_bytes
from .planning import (
    Plan,
    build_plan,
    bytes_loaded_per_run,
    planning_budget,
    release_residency,
)
from .profiles import NO_PROFILE, profiles_path
from .snapshot import NOTHING, Snapshot, Steps
from .stage_steps import budget_step, choose_evictions
from .streaming import BlockStreaming, StreamingInputs, StreamOptions

__all__ = ["Policy", "EagerPolicy", "ReleasePolicy", "BudgetPolicy", "Steps", "make_policy"]

# Share of the device kept free by the automatic budget: allocator fragmentation,
# workspace buffers and whatever else shares the device.
AUTO_HEADROOM_FRACTION = 0.08
AUTO_HEADROOM_MIN_BYTES = 1 << 30
# Once every stage's activations are measured on this device (this process, or a stored
# profile of the same run shape), the reserve covers only what the measured peaks of
# allocated bytes do not: the allocator's fragmentation (reserved beyond allocated) and
# library workspaces. Not on unified memory, where other processes share the pool.
AUTO_MEASURED_HEADROOM_FRACTION = 0.02
AUTO_MEASURED_HEADROOM_MIN_BYTES = 256 << 20
# A stage during which the CUDA allocator kept freeing its cache and trying again (at
# least RETRY_RESERVE_MIN_RETRIES times in a run, and never out of memory) ran at the
# allocator's limit, each retry waiting for the device: its later runs plan with this
# much more reserve for each run that did so, up to RETRY_RESERVE_MAX_STEPS runs. The
# activation profiles keep the runs for later processes (``profiles.AllocatorEvidence``),
# never the reserve's bytes.
RETRY_RESERVE_STEP_BYTES = 512 << 20
RETRY_RESERVE_MAX_STEPS = 2
RETRY_RESERVE_MIN_RETRIES = 8
# A stage computing from weights kept in a storage dtype (fp8) makes a compute-dtype copy
# of each stored layer's weights for its forward and frees it after: allocations of sizes
# the activations do not have, layer after layer, which the allocator must find room for
# beside them. Once the stage's activations are known, its reserve also holds this many
# of the largest such copy (``ComponentLoader.upcast_bytes``). Dropped, with the retry
# reserve, where it alone would make a run refuse.
UPCAST_RESERVE_COPIES = 2
# What a BudgetError suggests; the command line puts one that fits its pipeline here.
OVER_BUDGET_HINT = "Try a lower resolution, fewer frames, or a larger budget."


def _view(source: Any) -> Snapshot:
    """A snapshot, from a snapshot or from a pipeline (which builds one)."""
    return source if isinstance(source, Snapshot) else source.snapshot()


def _in_order(uses: Any, names: Any) -> tuple[str, ...]:
    """``names`` in the order the stages first hold them."""
    names = set(names)
    order = dict.fromkeys(c for use in uses for c in use.components)
    return tuple(c for c in order if c in names)


class Policy:
    """The base policy: loads on first use and never releases on its own.

    Each hook reads a ``Snapshot`` and returns ``Steps``; a policy never touches a
    component or a thread itself.
    """

    name = "base"
    plan_name = "release"
    prefetch = False
    # Whether ``attached`` has anything to do: the pipeline builds no snapshot otherwise.
    loads_up_front = False

    def __init__(self) -> None:
        self.budget_bytes: int | None = None
        self.reason = f"policy '{self.name}' was asked for"
        # Set when a stored activation profile would make a run refuse that fits without
        # it: the run measures again instead (see BudgetPolicy.before_run).
        self.distrust_stored = False
        # Set when the reserves for the allocator (stages whose allocator retried, upcast
        # copies of stored layers) would make a run refuse that fits without them (see
        # BudgetPolicy.plan_for).
        self.skip_retry_reserve = False
        # Set when the reserve kept for stages that reached the device's limit would make
        # a run refuse (see AutoBudgetPolicy.allocator_reserves); dropped before the others.
        self.skip_limit_reserve = False

    def attached(self, snapshot: Snapshot) -> Steps:
        """What to do when the pipeline takes this policy on."""
        return NOTHING

    def before_run(self, snapshot: Snapshot) -> Steps:
        return NOTHING

    def before_stage(self, snapshot: Snapshot, index: int) -> Steps:
        return NOTHING

    def after_stage(self, snapshot: Snapshot, index: int, *, failed: bool) -> Steps:
        return NOTHING

    def before_load(self, snapshot: Snapshot, name: str) -> Steps:
        """A load outside the plan (an unexpected access) is about to happen."""
        return NOTHING

    def recover_from_oom(self, snapshot: Snapshot, index: int) -> Steps | None:
        """Out of memory inside stage ``index``: what to free before one retry, or None
        for no retry."""
        return None

    def streaming_inputs(self, snapshot: Snapshot) -> StreamingInputs | None:
        """What the plan may stream (only the budget policy streams blocks)."""
        return None

    def plan_for(self, source: Any, budget: int | None = None) -> Plan:
        """The plan this policy runs by (under ``budget`` when given); ``source`` is a
        snapshot or a pipeline."""
        snapshot = _view(source)
        budget = budget if budget is not None else self.budget_bytes
        nbytes = {name: value or 0 for name, value in snapshot.component_bytes().items()}
        activation, note = self.activation_estimate(snapshot, budget)
        return build_plan(
            snapshot.stage_uses(),
            nbytes,
            policy="budget" if budget is not None else self.plan_name,
            budget=budget,
            activation=activation,
            activation_note=note,
            prefetch=self.prefetch,
            streaming=self.streaming_inputs(snapshot),
        )

    def activation_needs(self, source: Any) -> tuple[dict[str, int | None], str]:
        """The largest activation peak measured per stage, with room to spare: from the
        profile of this model and shape when the pipeline knows its shape, else as
        measured in this process; and a note on where they come from."""
        needs, note, _, _ = self._needs_and_reserves(_view(source))
        return needs, note

    def _needs_and_reserves(
        self, snapshot: Snapshot
    ) -> tuple[dict[str, int | None], str, list[tuple[str, dict[str, int]]], dict[str, int]]:
        """``activation_needs``, the ``allocator_reserves`` added to them, and the
        stages whose need is their bound (``usable_bounds``)."""
        stored, note = dict(snapshot.stored_activation), snapshot.stored_note
        if self.distrust_stored:
            stored, note = {}, "activations: stored profile set aside, measuring again"
        alone = bool(note) and not snapshot.measured_beside_stored
        measured = {} if alone else snapshot.measured_activation
        known = {**measured, **stored}
        bounded = {} if alone else self.usable_bounds(snapshot)
        bounded = {stage: b for stage, b in bounded.items() if stage not in known}
        needs = {use.name: known.get(use.name, bounded.get(use.name)) for use in snapshot.uses}
        added = self.allocator_reserves(snapshot, needs)
        for _, reserves in added:
            for stage, extra in reserves.items():
                needs[stage] += extra
        return needs, note, added, bounded

    def usable_bounds(self, snapshot: Snapshot) -> dict[str, int]:
        """Of the stages never measured exactly, those whose bound
        (``Snapshot.activation_bounds``) a plan counts as their need: none here (a
        stage not measured is planned as before)."""
        return {}

    def allocator_reserves(
        self, snapshot: Snapshot, needs: Mapping[str, int | None]
    ) -> list[tuple[str, dict[str, int]]]:
        """The reserves for the allocator added to the stages' needs, each with what it
        is for (the plan's activation note says so)."""
        return [
            ("where the CUDA allocator kept retrying", self.retry_reserves(snapshot, needs)),
            (
                "for the upcast copies of stored (fp8) layers",
                self.upcast_reserves(snapshot, needs),
            ),
        ]

    def retry_reserves(self, snapshot: Snapshot, needs: Mapping[str, int | None]) -> dict[str, int]:
        """Reserve added per stage whose allocator kept retrying (``RETRY_RESERVE_*``)."""
        if self.skip_retry_reserve:
            return {}
        return {
            stage: min(runs, RETRY_RESERVE_MAX_STEPS) * RETRY_RESERVE_STEP_BYTES
            for stage, runs in snapshot.retried_stages.items()
            if needs.get(stage) is not None
        }

    def upcast_reserves(
        self, snapshot: Snapshot, needs: Mapping[str, int | None]
    ) -> dict[str, int]:
        """Reserve added per stage whose components compute from stored (fp8) weights
        (``UPCAST_RESERVE_COPIES``)."""
        if self.skip_retry_reserve or not snapshot.upcast_bytes:
            return {}
        reserves = {}
        for use in snapshot.uses:
            largest = max((snapshot.upcast_bytes.get(c, 0) for c in use.components), default=0)
            if largest and needs.get(use.name) is not None:
                reserves[use.name] = UPCAST_RESERVE_COPIES * largest
        return reserves

    def activation_estimate(
        self, source: Any, budget: int | None = None
    ) -> tuple[dict[str, int | None], str]:
        """Activation peaks per stage (``activation_needs``). Under a ``budget``, a stage
        that can work in pieces (a tiled decode) is counted at what it will take in the
        room its components leave it."""
        snapshot = _view(source)
        needs, note, added, bounded = self._needs_and_reserves(snapshot)
        estimate: dict[str, int | None] = {}
        fitted: list[str] = []
        nbytes = snapshot.nbytes
        for fit, use in zip(snapshot.fit_activations, snapshot.uses, strict=True):
            need = needs[use.name]
            estimate[use.name] = need
            if need is not None and budget is not None:
                room = budget - sum(nbytes.get(c) or 0 for c in use.components)
                estimate[use.name] = fit(need, room)
                if estimate[use.name] < need:
                    fitted.append(
                        f"'{use.name}' works in pieces to fit: "
                        f"{format_bytes(estimate[use.name])} of activations, not {format_bytes(need)}"
                    )
        if all(value is None for value in estimate.values()) or note == NO_PROFILE:
            note = _unknown_activations(snapshot.device)
        elif not note:
            note = "activations: measured in this process"
        if bounded:
            fitted.append(
                "counted at most what their peaks, under an earlier one, allow: "
                + ", ".join(f"'{stage}' {format_bytes(b)}" for stage, b in bounded.items())
            )
        for purpose, reserves in added:
            if reserves:
                fitted.append(
                    f"more reserve {purpose}: "
                    + ", ".join(f"'{stage}' +{format_bytes(n)}" for stage, n in reserves.items())
                )
        return estimate, "\n".join([note, *fitted])


class EagerPolicy(Policy):
    """Load every component up front and keep it, like a plain loader."""

    name = "eager"
    plan_name = "eager"
    loads_up_front = True

    def attached(self, snapshot: Snapshot) -> Steps:
        return Steps(load=tuple(snapshot.nbytes))

    def before_run(self, snapshot: Snapshot) -> Steps:
        return Steps(load=tuple(snapshot.nbytes))


class ReleasePolicy(Policy):
    """Load on first use, free after the last stage that holds the component.

    With ``prefetch_next_run`` (the default), the last stage also starts loading the
    next run's first components in the background, in turn order, as many as fit beside
    it (and beside the next run's stages before their turn) without raising the run's
    peak above its largest stage's (weights and measured activations;
    nothing is loaded early while an activation is unknown). They then stay resident
    between runs (the run returns once they are in); ``release_all()`` frees them.
    """

    name = "release"
    plan_name = "release"

    def recover_from_oom(self, snapshot: Snapshot, index: int) -> Steps | None:
        """Out of memory: free what the stage does not hold (the next run's components
        loaded early by the last stage), then retry once."""
        return free_for_stage(snapshot, index)

    def __init__(self, *, prefetch_next_run: bool = True):
        super().__init__()
        self.prefetch_next_run = prefetch_next_run

    def before_stage(self, snapshot: Snapshot, index: int) -> Steps:
        last = index == len(snapshot.uses) - 1 and index > 0
        if last and self.prefetch_next_run and snapshot.more_runs:
            names = self._next_run_fits(snapshot)
            if names:
                # The stage's own components first: loading both at once would share
                # the disk and the copy engine with the loads the stage waits for.
                own = tuple(snapshot.uses[index].components) if snapshot.needs_components else ()
                return Steps(load=own, prefetch_next_run=names)
        return NOTHING

    def _next_run_fits(self, snapshot: Snapshot) -> tuple[str, ...]:
        """The next run's first components, in the order its stages use them, as many as
        can load now without raising the run's peak: beside this last stage, and beside
        each early stage of the next run until its own turn comes."""
        uses = snapshot.uses
        activation, _ = self.activation_estimate(snapshot)
        if any(activation.get(use.name) is None for use in uses):
            return ()
        nbytes = snapshot.component_bytes()
        residency = release_residency(uses)
        peaks = [
            sum(nbytes.get(c, 0) for c in held) + activation[use.name]
            for use, held in zip(uses, residency, strict=True)
        ]
        limit = max(peaks)
        chosen: list[str] = []
        for stage, use in enumerate(uses[:-1]):
            adding = [c for c in use.components if c not in snapshot.resident and c not in chosen]
            early = set(chosen + adding)
            # Held early, they sit beside the last stage and beside every next-run stage
            # before the one that uses them.
            fits = peaks[-1] + sum(nbytes.get(c, 0) for c in early) <= limit and all(
                sum(nbytes.get(c, 0) for c in residency[before] | early)
                + activation[uses[before].name]
                <= limit
                for before in range(stage + 1)
            )
            if not fits:
                break
            chosen += adding
        return tuple(chosen)

    def after_stage(self, snapshot: Snapshot, index: int, *, failed: bool) -> Steps:
        """Release what no later stage of the run holds: the residency the plan
        simulates (``release_residency``), left after its last holder."""
        residency = release_residency(snapshot.uses)
        later = residency[index + 1] if index + 1 < len(residency) else frozenset()
        return Steps(release=_in_order(snapshot.uses, residency[index] - later))


class BudgetPolicy(Policy):
    """Keep components resident across runs while they fit ``budget`` bytes.

    When a load would overflow, the resident component whose next use is farthest
    away goes first. With ``prefetch``, the next stage's components load on a
    background thread while the current stage computes; after the last stage, the next
    run's first ones. Small components are not loaded early, nor kept idle, where that
    would raise the run's peak (``plan.budget_step``). With ``streaming`` (on by
    default; a ``StreamOptions`` tunes it), a stage too large for the budget keeps what
    fits of its largest component's repeated blocks on the device and streams the rest
    from pinned host memory, or from the files where their pinned copies do not fit the
    host budget (``ondeck.streaming``); not on unified memory, where it would free
    nothing. Once a run has counted each component's calls, a plan that would reload
    components every run may instead stream the least-called ones so that every component
    stays resident (``plan_resident_streaming``).
    """

    name = "budget"
    plan_name = "budget"
    budget_note = ""  # where the budget comes from, said beside it in a BudgetError

    def __init__(
        self,
        budget: int | str,
        *,
        prefetch: bool = True,
        streaming: bool | StreamOptions = True,
    ):
        super().__init__()
        if budget is None:
            raise ValueError("BudgetPolicy needs a budget: bytes, or a size such as '24GiB'")
        self.budget_bytes = positive_bytes(budget, "a budget")
        self.prefetch = prefetch
        self.streaming: BlockStreaming | None = None
        if streaming:
            options = streaming if isinstance(streaming, StreamOptions) else None
            self.streaming = BlockStreaming(options)
        self._skipped: set[int] = set()

    def streaming_inputs(self, snapshot: Snapshot) -> StreamingInputs | None:
        return self.streaming.inputs(snapshot) if self.streaming is not None else None

    def before_run(self, snapshot: Snapshot) -> Steps:
        self._skipped = set()
        self.distrust_stored = False
        self.skip_retry_reserve = self.skip_limit_reserve = False
        plan = self.plan_for(snapshot, self.budget_bytes)
        # The run's stages decide as its plan did.
        self.skip_retry_reserve = plan.retry_reserve_dropped
        self.skip_limit_reserve = plan.limit_reserve_dropped
        if plan.profile_set_aside:
            self.distrust_stored = True  # the run decides as its plan did, and re-measures
            warnings.warn(
                _set_aside_note(dict(snapshot.stored_activation), " in this run"), stacklevel=4
            )
        overflow = plan.overflow()
        if overflow is not None:
            stage, short = overflow
            short = plan.streaming_short.get(stage, short)  # what streaming leaves it short
            raise BudgetError(
                f"stage '{stage}' needs {format_bytes(short)} more than the budget of "
                f"{format_bytes(self.budget_bytes)}{self.budget_note} even streaming what can "
                f"stream; nothing was loaded. {OVER_BUDGET_HINT}\n"
                + (f"({self.reason})\n" if self.reason.startswith("auto") else "")
                + f"{plan}",
                plan=plan,
            )
        if self.streaming is not None:
            self.streaming.count_run(plan, snapshot.runs_completed)
            return Steps(streaming=(self.streaming, plan))
        return NOTHING

    def plan_for(self, source: Any, budget: int | None = None) -> Plan:
        """The plan. Where the reserves for the allocator (stages whose allocator retried,
        upcast copies of stored layers) make it overflow, the plan without them
        (``retry_reserve_dropped``: a slower run beats a refused one). Where stored
        activation peaks alone still make it overflow, the plan without them
        (``profile_set_aside``): a stored value may come from another card, an older
        version or damage, and must not block a run that fits without it. Leaves the
        policy as it found it: ``before_run`` acts on the flags."""
        snapshot = _view(source)
        plan = super().plan_for(snapshot, budget)
        if plan.overflow() is None or self.distrust_stored:
            return plan
        limit = bool(snapshot.limit_stages) and not self.skip_limit_reserve
        if limit:
            without = self._relaxed(snapshot, budget, "skip_limit_reserve")
            if without.overflow() is None:
                without.limit_reserve_dropped = True
                return without
        reserved = snapshot.retried_stages or snapshot.upcast_bytes or limit
        if reserved and not self.skip_retry_reserve:
            without = self._relaxed(snapshot, budget, "skip_limit_reserve", "skip_retry_reserve")
            if without.overflow() is None:
                without.retry_reserve_dropped = True
                without.limit_reserve_dropped = limit
                return without
        stored = dict(snapshot.stored_activation)
        if not stored:
            return plan
        relaxed = self._relaxed(snapshot, budget, "distrust_stored")
        if relaxed.overflow() is not None:
            return plan
        relaxed.profile_set_aside = True
        relaxed.activation_note += "\n" + _set_aside_note(stored, "")
        return relaxed

    def _relaxed(self, snapshot: Snapshot, budget: int | None, *flags: str) -> Plan:
        """The plan with ``flags`` (attributes of this policy) set, then restored."""
        before = {flag: getattr(self, flag) for flag in flags}
        for flag in flags:
            setattr(self, flag, True)
        try:
            return super().plan_for(snapshot, budget)
        finally:
            for flag, value in before.items():
                setattr(self, flag, value)

    def before_stage(self, snapshot: Snapshot, index: int) -> Steps:
        uses = list(snapshot.uses)
        if not snapshot.needs_components:
            self._skipped.add(index)
        # A stage that did without its components this run (a cached prompt) is taken
        # to do so next run too: nothing is loaded or kept for it.
        uses = [replace(u, components=()) if i in self._skipped else u for i, u in enumerate(uses)]
        for later in snapshot.later_unneeded:
            # Nothing is prefetched or kept for a later stage that will not use it.
            uses[later] = replace(uses[later], components=())
        activation, _ = self.activation_estimate(snapshot, self.budget_bytes)
        if self.streaming is not None:
            activation = self.streaming.with_reserved(activation)
        try:
            step = budget_step(
                snapshot.in_flight,
                index,
                uses=uses,
                nbytes=snapshot.device_bytes(),
                budget=self.budget_bytes,
                activation=activation,
                prefetch=self.prefetch,
                next_run=snapshot.more_runs,
            )
        except ValueError as error:
            raise BudgetError(f"{error}; nothing more was loaded") from error
        return Steps(
            release=step.evict,
            load=step.load,
            prefetch_release=step.prefetch_evict,
            prefetch=step.prefetch,
            keep=tuple(sorted((snapshot.in_flight - set(step.evict)) | set(step.load))),
        )

    def before_load(self, snapshot: Snapshot, name: str) -> Steps:
        """A load outside the plan (an unexpected access): make room for it first."""
        if snapshot.index is None:
            return NOTHING
        nbytes = snapshot.device_bytes()
        resident = set(snapshot.resident)
        if sum(nbytes[c] for c in resident | {name}) <= self.budget_bytes:
            return NOTHING
        index = snapshot.index
        uses = snapshot.stage_uses()
        keep = set(uses[index].components) | {name}
        victims = choose_evictions(
            resident,
            keep,
            [name],
            uses=uses,
            index=index,
            nbytes=nbytes,
            limit=self.budget_bytes,
        )
        return Steps(release=tuple(victims or ()))

    def recover_from_oom(self, snapshot: Snapshot, index: int) -> Steps | None:
        return free_for_stage(snapshot, index)


def free_for_stage(snapshot: Snapshot, index: int) -> Steps | None:
    """Out of memory inside stage ``index``: free every component the stage does not
    hold, then retry once (None where that frees nothing)."""
    keep = set(snapshot.uses[index].components)
    freed = tuple(n for n in snapshot.nbytes if n in snapshot.resident and n not in keep)
    return Steps(release=freed, keep=tuple(keep)) if freed else None


def _set_aside_note(stored: dict[str, int], when: str) -> str:
    peaks = ", ".join(f"{stage}: {format_bytes(n)}" for stage, n in stored.items())
    return (
        f"stored activation peaks ({peaks}, in {profiles_path()}) would not fit; they are "
        f"set aside{when} and measured again (`ondeck profiles --clear` deletes them)"
    )


def auto_budget_bytes(device: Any, host_memory: int | None = None) -> tuple[int, bool]:
    """The budget ``auto`` plans against while activations are estimated, and whether
    the device is unified memory.

    ``ondeck.memory.device_facts`` is the one seam that says what the device has. On
    unified memory the device's bytes are the host's, so the host budget bounds them too:
    ``host_memory`` where given, else the machine's and its cgroup's
    (``memory.host_facts``), less what the process holds already.
    """
    facts = memory.device_facts(device)
    headroom = max(AUTO_HEADROOM_MIN_BYTES, int(facts.total_bytes * AUTO_HEADROOM_FRACTION))
    available = max(0, facts.available_bytes - headroom)
    if facts.unified:
        host = memory.host_facts()
        budget = host.budget_bytes if host_memory is None else host_memory
        available = min(available, max(0, budget - host.process_bytes))
    return available, facts.unified


def device_budget_bytes(device: Any) -> int:
    """What ``device`` has free as a budget (``auto_budget_bytes``), at least one byte: a
    device with nothing free still plans, and a plan against it refuses its runs."""
    return max(auto_budget_bytes(device)[0], 1)


def measured_headroom_relief(device: Any) -> int:
    """Bytes ``auto``'s budget grows by once every stage's activations are measured: the
    estimate's reserve less the measured one (0 on unified memory)."""
    facts = memory.device_facts(device)
    if facts.unified:
        return 0
    estimated = max(AUTO_HEADROOM_MIN_BYTES, int(facts.total_bytes * AUTO_HEADROOM_FRACTION))
    measured = max(
        AUTO_MEASURED_HEADROOM_MIN_BYTES, int(facts.total_bytes * AUTO_MEASURED_HEADROOM_FRACTION)
    )
    return max(0, estimated - measured)


class AutoBudgetPolicy(BudgetPolicy):
    """``budget`` as ``auto`` chose it: each run plans against ``measured_budget`` once
    every stage's activations are measured (``plan.planning_budget``), else ``budget``.
    A process's first run keeps ``budget`` even where a stored profile measured every
    stage: what its first calls allocate beside the stages' peaks (the libraries'
    workspaces, the allocator's first segments) is in no stored peak, and running out of
    memory there runs the whole call again."""

    def __init__(self, budget: int, *, measured_budget: int, prefetch: bool = True):
        # A device with nothing free still plans, and its run refuses with a BudgetError.
        super().__init__(max(budget, 1), prefetch=prefetch)
        self.estimated_budget_bytes = self.budget_bytes
        self.measured_budget_bytes = max(measured_budget, self.budget_bytes)

    def current_budget(self, source: Any) -> int:
        """The budget the next run plans against (``_budget_for``). Where the first run's
        reserve alone would make the run refuse, or set its stored profile aside, the
        first run plans against the measured budget instead: a run that may have to
        start again beats one refused, or one guessing what is stored."""
        snapshot = _view(source)
        needs, _ = self.activation_needs(snapshot)
        budget = self._budget_for(needs, snapshot)
        measured = self._measured_for(needs)
        if budget < measured and not self._plans_within(snapshot, budget):
            if self._plans_within(snapshot, measured):
                return measured
        return budget

    def _measured_for(self, needs: Mapping[str, int | None]) -> int:
        return planning_budget(
            needs, estimated=self.estimated_budget_bytes, measured=self.measured_budget_bytes
        )

    def _budget_for(self, needs: Mapping[str, int | None], snapshot: Snapshot) -> int:
        if not snapshot.runs_completed:
            return self.estimated_budget_bytes
        return self._measured_for(needs)

    def _plans_within(self, snapshot: Snapshot, budget: int) -> bool:
        """Whether the plan against ``budget`` fits with what is stored counted."""
        plan = super().plan_for(snapshot, budget)
        return plan.overflow() is None and not plan.profile_set_aside

    def before_run(self, snapshot: Snapshot) -> Steps:
        self.budget_bytes = self.current_budget(snapshot)
        return super().before_run(snapshot)

    def usable_bounds(self, snapshot: Snapshot) -> dict[str, int]:
        """Bounds that count as measured: each at most what the estimate keeps for the
        stage beyond the measured budget's reserve, with its guessed share of the budget
        where one of its components streams, so that no stage plans with less room than
        before. Without the caller's peak counters reset, a stage whose peak stays under
        an earlier stage's is never measured exactly (an 8B transformer streaming on an
        8 GiB card, under its text encoders' peak); its bound lets runs plan against
        ``measured_budget`` instead of guessing for ever."""
        relief = self.measured_budget_bytes - self.estimated_budget_bytes
        options = self.streaming.options if self.streaming is not None else None
        fraction = options.unmeasured_activation_fraction if options is not None else 0.0
        guess = int(self.estimated_budget_bytes * fraction)
        streamed = set(snapshot.streamed_bytes)
        bounds = {}
        for use in snapshot.uses:
            bound = snapshot.activation_bounds.get(use.name)
            limit = relief + (guess if streamed.intersection(use.components) else 0)
            if bound is not None and bound <= limit:
                bounds[use.name] = bound
        return bounds

    def allocator_reserves(
        self, snapshot: Snapshot, needs: Mapping[str, int | None]
    ) -> list[tuple[str, dict[str, int]]]:
        """Also, once runs plan against ``measured_budget``: a stage whose allocator
        retried in some run (``Snapshot.limit_stages``) reached the device's limit, so
        what the plan does not count (fragmentation, workspaces, tensors outside the
        components) filled the estimate's reserve; it keeps that reserve. Counting its
        peak against the measured budget instead runs it out of memory, and the call
        starts again. Where it would make the plan overflow, it goes first
        (``skip_limit_reserve``), before the other reserves."""
        reserves = super().allocator_reserves(snapshot, needs)
        relief = self.measured_budget_bytes - self.estimated_budget_bytes
        measured = self._budget_for(needs, snapshot) > self.estimated_budget_bytes
        if measured and not self.skip_limit_reserve:
            kept = {
                stage: relief for stage in snapshot.limit_stages if needs.get(stage) is not None
            }
            reserves.append(("where the allocator reached the device's limit", kept))
        return reserves

    def plan_for(self, source: Any, budget: int | None = None) -> Plan:
        snapshot = _view(source)
        return super().plan_for(
            snapshot, budget if budget is not None else self.current_budget(snapshot)
        )


def _unknown_activations(device: Any) -> str:
    """The plan's note where no stage's activations are known: a CUDA run measures them,
    a run elsewhere has no peak counter to measure them with."""
    where = getattr(device, "type", None) if device is not None else None
    if where is not None and where != "cuda":
        return f"activations: unknown (not measured on {where})"
    return NO_PROFILE


def choose_auto(pipeline: Snapshot | Any, *, prefetch: bool = True) -> Policy:
    """The policy ``auto`` runs with: never one whose plan does not fit the device.

    Everything fits: ``budget`` keeps it all. The largest stage fits: ``budget`` (kept
    across runs by next use, next component prefetched) or ``release``, whichever the
    plan says loads fewer bytes per run. A component too large for its stage: ``budget``
    streams its blocks. Not even that fits: ``budget`` all the same, whose first run
    refuses with a ``BudgetError`` before a byte is read (the plan says why).
    """
    available, unified = auto_budget_bytes(pipeline.device, pipeline.host_memory)
    where = str(pipeline.device)
    if unified:
        where = "the host" if getattr(pipeline.device, "type", None) == "cpu" else "unified memory"
    sizes = pipeline.component_bytes()
    total = sum(size or 0 for size in sizes.values())
    if None in sizes.values():
        chosen: Policy = ReleasePolicy(prefetch_next_run=prefetch)
        chosen.reason = (
            f"auto chose 'release': some components have unknown sizes, so no budget "
            f"can be planned for the {format_bytes(available)} {where} has free"
        )
        return chosen
    relief = measured_headroom_relief(pipeline.device)
    budget = AutoBudgetPolicy(available, measured_budget=available + relief, prefetch=prefetch)
    host = memory.host_facts() if unified and pipeline.host_memory is not None else None
    if host is not None and pipeline.host_memory - host.process_bytes <= available:
        budget.budget_note = (  # the host budget given is what bounds it
            f" (the host memory given, {format_bytes(pipeline.host_memory)}, less the "
            f"{format_bytes(host.process_bytes)} this process holds)"
        )
    plan = budget.plan_for(pipeline)
    has = f"the {format_bytes(available)} {where} has free"
    overflow = plan.overflow()
    held = {component for use in plan.uses for component in use.components}
    if overflow is not None:
        budget.reason = (
            f"auto chose 'budget', and stage '{overflow[0]}' does not fit {has} even "
            f"streaming blocks (short by {format_bytes(overflow[1])}): a run will refuse "
            "before loading anything"
        )
    elif plan.streamed:
        streamed = ", ".join(
            f"{name} keeps {len(layout.resident)} of {layout.block_count} blocks"
            for name, layout in plan.streamed.items()
        )
        budget.reason = (
            f"auto chose 'budget' with block streaming: components ({format_bytes(total)}) "
            f"do not fit {has}, and a stage's component does not fit whole ({streamed})"
        )
    elif all(set(resident) == held for _, resident, _ in plan.stages):
        budget.reason = f"auto chose 'budget': components ({format_bytes(total)}) fit {has}"
    else:
        release_plan = build_plan(
            pipeline.stage_uses(),
            {name: size or 0 for name, size in sizes.items()},
            policy="release",
        )
        by_budget, by_release = bytes_loaded_per_run(plan), bytes_loaded_per_run(release_plan)
        per_run = (
            f"components ({format_bytes(total)}) do not fit {has}, the largest stage does; "
            f"budget loads {format_bytes(by_budget)} per run, release {format_bytes(by_release)}"
        )
        if by_release < by_budget:
            chosen = ReleasePolicy(prefetch_next_run=prefetch)
            chosen.reason = f"auto chose 'release': {per_run}"
            return chosen
        budget.reason = f"auto chose 'budget' with prefetch: {per_run}"
    if relief:
        budget.reason += (
            f"; once every stage's activations are measured, runs after the process's "
            f"first plan against "
            f"{format_bytes(budget.measured_budget_bytes)} (a reserve of "
            f"max({format_bytes(AUTO_MEASURED_HEADROOM_MIN_BYTES)}, "
            f"{AUTO_MEASURED_HEADROOM_FRACTION:.0%}) instead of "
            f"max({format_bytes(AUTO_HEADROOM_MIN_BYTES)}, {AUTO_HEADROOM_FRACTION:.0%}))"
        )
    return budget


def make_policy(
    policy: Any,
    *,
    budget: Any = None,
    prefetch: bool = True,
    device: Any = None,
) -> Policy:
    """Turn ``policy=`` (a name or a Policy) into a policy object. ``auto`` with a
    budget is ``budget``; without one, the pipeline chooses (``choose_auto``)."""
    if isinstance(policy, Policy):
        # A policy object carries its own budget and prefetch: one given beside it would
        # be ignored without a word.
        if budget is not None or not prefetch:
            given = "budget=" if budget is not None else "prefetch=False"
            raise ValueError(
                f"{given} is for a policy given by name; a {type(policy).__name__} object "
                "carries its own (BudgetPolicy(budget, prefetch=...))"
            )
        return policy
    budget = positive_bytes(budget, "a budget")
    if policy == "auto":
        if budget is None:
            raise ValueError("auto without a budget is chosen by choose_auto(pipeline)")
        chosen: Policy = BudgetPolicy(budget, prefetch=prefetch)
        chosen.reason = "auto chose 'budget': a budget was given"
        return chosen
    if policy in ("eager", "release") and budget is not None:
        raise ValueError(f"policy {policy!r} does not use a budget; give 'budget' or 'auto'")
    if policy == "eager":
        return EagerPolicy()
    if policy == "release":
        return ReleasePolicy(prefetch_next_run=prefetch)
    if policy == "budget":
        if budget is None:
            budget = device_budget_bytes(device)
        return BudgetPolicy(budget, prefetch=prefetch)
    raise ValueError(f"unknown policy {policy!r}; choose auto, eager, release or budget")
