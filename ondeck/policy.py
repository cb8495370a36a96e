"""Residency policies: what to load, prefetch, keep or release at stage boundaries.

A policy is an object the pipeline consults at each boundary; decisions about
budgets come from the pure functions in ``plan.py``, so the plan predicts them.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import memory
from .errors import BudgetError
from .lazy import is_loaded, wait_filled
from .memory import format_bytes, free_cached_memory, parse_bytes
from .plan import budget_step, build_plan, planning_budget, release_residency
from .profiles import profiles_path

if TYPE_CHECKING:
    from .memory import StageRecord
    from .plan import Plan
    from .stages import Pipeline
    from .streaming import StreamingInputs, StreamOptions

__all__ = ["Policy", "EagerPolicy", "ReleasePolicy", "BudgetPolicy", "make_policy"]

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


class Policy:
    """The base policy: loads on first use and never releases on its own."""

    name = "base"
    plan_name = "release"
    prefetch = False

    def __init__(self) -> None:
        self.pipeline: Pipeline | None = None
        self.budget_bytes: int | None = None
        self.reason = f"policy '{self.name}' was asked for"
        self.activation: dict[str, int] = {}
        # Set when a stored activation profile would make a run refuse that fits without
        # it: the run measures again instead (see BudgetPolicy.before_run).
        self.distrust_stored = False

    def attach(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def before_run(self) -> None:
        pass

    def before_stage(self, index: int, state: Any = None) -> None:
        pass

    def after_stage(self, index: int, *, failed: bool) -> None:
        pass

    def after_run(self) -> None:
        pass

    def before_load(self, name: str) -> None:
        pass

    def recover_from_oom(self, index: int) -> bool:
        return False

    def cancel_prefetch(self) -> None:
        pass

    def close(self) -> None:
        """Stop and join every thread the policy started (it may start new ones later)."""
        self.cancel_prefetch()

    def in_prefetch_thread(self) -> bool:
        return False

    def streaming_inputs(self, pipeline: Pipeline) -> StreamingInputs | None:
        """What the plan may stream (only the budget policy streams blocks)."""
        return None

    def stage_measured(self, index: int, record: StageRecord) -> None:
        """Keep the largest activation peak measured per stage (device bytes)."""
        if record.activation_bytes is None:
            return
        previous = self.activation.get(record.stage, 0)
        self.activation[record.stage] = max(previous, record.activation_bytes)
        self.pipeline.record_activation(record.stage, record.activation_bytes)

    def plan_for(self, pipeline: Pipeline, budget: int | None = None) -> Plan:
        """The plan this policy runs ``pipeline`` by (under ``budget`` when given)."""
        budget = budget if budget is not None else self.budget_bytes
        nbytes = {name: value or 0 for name, value in pipeline.component_bytes().items()}
        activation, note = self.activation_estimate(pipeline, budget)
        return build_plan(
            pipeline.stage_uses(),
            nbytes,
            policy="budget" if budget is not None else self.plan_name,
            budget=budget,
            activation=activation,
            activation_note=note,
            prefetch=self.prefetch,
            streaming=self.streaming_inputs(pipeline),
        )

    def activation_needs(self, pipeline: Pipeline) -> tuple[dict[str, int | None], str]:
        """The largest activation peak measured per stage, with room to spare: from the
        profile of this model and shape when the pipeline knows its shape, else as
        measured in this process; and a note on where they come from."""
        stored, note = pipeline.activation_profile()
        if self.distrust_stored:
            stored, note = {}, "activations: stored profile set aside, measuring again"
        measured = {} if note else self.activation
        needs = {
            use.name: stored.get(use.name, measured.get(use.name)) for use in pipeline.stage_uses()
        }
        return needs, note

    def activation_estimate(
        self, pipeline: Pipeline, budget: int | None = None
    ) -> tuple[dict[str, int | None], str]:
        """Activation peaks per stage (``activation_needs``). Under a ``budget``, a stage
        that can work in pieces (a tiled decode) is counted at what it will take in the
        room its components leave it."""
        needs, note = self.activation_needs(pipeline)
        estimate: dict[str, int | None] = {}
        fitted: list[str] = []
        nbytes = pipeline.component_bytes()
        for stage, use in zip(pipeline.stages, pipeline.stage_uses(), strict=True):
            need = needs[use.name]
            estimate[use.name] = need
            if need is not None and budget is not None:
                room = budget - sum(nbytes.get(c) or 0 for c in use.components)
                estimate[use.name] = stage.fit_activations(need, room)
                if estimate[use.name] < need:
                    fitted.append(
                        f"'{use.name}' works in pieces to fit: "
                        f"{format_bytes(estimate[use.name])} of activations, not {format_bytes(need)}"
                    )
        if all(value is None for value in estimate.values()):
            note = "activations: unknown (no profile yet; run once to measure them)"
        elif not note:
            note = "activations: measured in this process"
        return estimate, "\n".join([note, *fitted])


class EagerPolicy(Policy):
    """Load every component up front and keep it, like a plain loader."""

    name = "eager"
    plan_name = "eager"

    def attach(self, pipeline: Pipeline) -> None:
        super().attach(pipeline)
        for proxy in pipeline.deferred.values():
            proxy.materialize()

    def before_run(self) -> None:
        for proxy in self.pipeline.deferred.values():
            proxy.materialize()


class ReleasePolicy(Policy):
    """Load on first use, free after the last stage that holds the component.

    With ``prefetch_next_run`` (the default), the last stage also starts loading the
    next run's first components in the background, when they fit beside it without
    raising the run's peak above its largest stage's (weights and measured activations;
    nothing is loaded early while an activation is unknown). They then stay resident
    between runs (the run returns once they are in); ``release_all()`` frees them.
    """

    name = "release"
    plan_name = "release"

    def __init__(self, *, prefetch_next_run: bool = True):
        super().__init__()
        self.prefetch_next_run = prefetch_next_run
        self._next_run: threading.Thread | None = None
        self._next_run_names: tuple[str, ...] = ()
        self._next_run_error: BaseException | None = None
        self._local = threading.local()

    def before_stage(self, index: int, state: Any = None) -> None:
        if index == len(self.pipeline.stages) - 1 and index > 0 and self.prefetch_next_run:
            names = self._next_run_fits()
            if names:
                pipeline = self.pipeline
                own = ()
                if pipeline.stages[index].needs_components(state):
                    own = tuple(pipeline.stage_uses()[index].components)
                self._start_next_run(names, after=own)

    def _next_run_fits(self) -> tuple[str, ...]:
        """The next run's first components, if loading them now keeps this run's peak."""
        pipeline = self.pipeline
        uses = pipeline.stage_uses()
        first = tuple(n for n in uses[0].components if not is_loaded(pipeline.deferred[n]))
        if not first:
            return ()
        activation, _ = self.activation_estimate(pipeline)
        if any(activation.get(use.name) is None for use in uses):
            return ()
        nbytes = pipeline.component_bytes()
        residency = release_residency(uses)
        peaks = [
            sum(nbytes.get(c, 0) for c in held) + activation[use.name]
            for use, held in zip(uses, residency, strict=True)
        ]
        last = peaks[-1] + sum(nbytes.get(c, 0) for c in first)
        return first if last <= max(peaks) else ()

    def _start_next_run(self, names: tuple[str, ...], after: tuple[str, ...] = ()) -> None:
        """Load ``names`` on a thread of their own, once the stage's own components
        (``after``) are in: their reads would otherwise share the disk and the copy
        engine with the loads the stage is waiting for."""
        own = [self.pipeline.deferred[name] for name in after]
        for proxy in own:
            proxy.materialize(complete=False)  # as the stage's first call would
        proxies = [self.pipeline.deferred[name] for name in names]

        def load() -> None:
            self._local.prefetching = True
            try:
                for proxy in own:
                    wait_filled(proxy)  # the rest of a pipelined load, if one runs
                for proxy in proxies:
                    proxy.materialize(complete=False)
            except BaseException as error:  # the next run's own access retries and reports
                self._next_run_error = error
            finally:
                self._local.prefetching = False

        self._next_run_names, self._next_run_error = names, None
        self._next_run = threading.Thread(target=load, name="ondeck-next-run", daemon=True)
        self._next_run.start()

    def _join_next_run(self, *, report: bool = False) -> None:
        thread, self._next_run = self._next_run, None
        if thread is None:
            return
        started = time.perf_counter()
        thread.join()
        waited = time.perf_counter() - started
        if report and waited > 1e-4 and self._next_run_names:
            # One wait, charged once, to the first of the components it was for.
            self.pipeline.tracker.waited(self._next_run_names[0], waited)
        if report and self._next_run_error is not None:
            warnings.warn(
                f"loading {list(self._next_run_names)} ahead of the run failed: "
                f"{self._next_run_error!r}",
                stacklevel=3,
            )

    def after_run(self) -> None:
        # Usually done long before: the last stage computes for longer than it loads.
        self._join_next_run(report=True)

    def in_prefetch_thread(self) -> bool:
        return getattr(self._local, "prefetching", False)

    def cancel_prefetch(self) -> None:
        self._join_next_run()

    def after_stage(self, index: int, *, failed: bool) -> None:
        pipeline = self.pipeline
        stage = pipeline.stages[index]
        first_error: Exception | None = None
        for name in pipeline.schedule.get(stage.name, ()):
            try:
                pipeline.deferred[name].release()
            except Exception as error:  # release the others before reporting
                first_error = first_error or error
        if first_error is not None:
            raise first_error


class BudgetPolicy(Policy):
    """Keep components resident across runs while they fit ``budget`` bytes.

    When a load would overflow, the resident component whose next use is farthest
    away goes first. With ``prefetch``, the next stage's components load on a
    background thread while the current stage computes; after the last stage, the next
    run's first ones. Small components are not loaded early, nor kept idle, where that
    would raise the run's peak (``plan.budget_step``). With ``streaming`` (on by
    default; a ``StreamOptions`` tunes it), a stage too large for the budget keeps what
    fits of its largest component's repeated blocks on the device and streams the rest
    from pinned host memory (``ondeck.streaming``); not on unified memory, where it
    would free nothing.
    """

    name = "budget"
    plan_name = "budget"

    def __init__(
        self,
        budget: int | str,
        *,
        prefetch: bool = True,
        streaming: bool | StreamOptions = True,
    ):
        from .streaming import BlockStreaming, StreamOptions

        super().__init__()
        self.budget_bytes = parse_bytes(budget)
        self.prefetch = prefetch
        self.streaming: BlockStreaming | None = None
        if streaming:
            options = streaming if isinstance(streaming, StreamOptions) else None
            self.streaming = BlockStreaming(options)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._skipped: set[int] = set()
        self._local = threading.local()

    def _nbytes(self) -> dict[str, int]:
        nbytes = {name: value or 0 for name, value in self.pipeline.component_bytes().items()}
        if self.streaming is not None:
            nbytes.update(self.streaming.device_bytes())
        return nbytes

    def streaming_inputs(self, pipeline: Pipeline) -> StreamingInputs | None:
        return self.streaming.inputs(pipeline) if self.streaming is not None else None

    def _resident(self) -> set[str]:
        return set(self.pipeline.resident()) | set(self._pending)

    def before_run(self) -> None:
        self._skipped = set()
        self.distrust_stored = False
        plan = self.pipeline.plan(self.budget_bytes)
        if plan.profile_set_aside:
            self.distrust_stored = True  # the run decides as its plan did, and re-measures
            stored, _ = self.pipeline.activation_profile()
            warnings.warn(_set_aside_note(stored, " in this run"), stacklevel=3)
        overflow = plan.overflow()
        if overflow is not None:
            stage, short = overflow
            raise BudgetError(
                f"stage '{stage}' needs {format_bytes(short)} more than the budget of "
                f"{format_bytes(self.budget_bytes)} even streaming what can stream; nothing "
                "was loaded. Try a lower resolution, fewer frames, or a larger budget.\n"
                + (f"({self.reason})\n" if self.reason.startswith("auto") else "")
                + f"{plan}",
                plan=plan,
            )
        if self.streaming is not None:
            self.streaming.apply(self.pipeline, plan)

    def plan_for(self, pipeline: Pipeline, budget: int | None = None) -> Plan:
        """The plan; where stored activation peaks alone make it overflow, the plan
        without them (``profile_set_aside``): a stored value may come from another card,
        an older version or damage, and must not block a run that fits without it."""
        plan = super().plan_for(pipeline, budget)
        if plan.overflow() is None or self.distrust_stored:
            return plan
        stored, _ = pipeline.activation_profile()
        if not stored:
            return plan
        self.distrust_stored = True
        try:
            relaxed = super().plan_for(pipeline, budget)
        finally:
            self.distrust_stored = False
        if relaxed.overflow() is not None:
            return plan
        relaxed.profile_set_aside = True
        relaxed.activation_note += "\n" + _set_aside_note(stored, "")
        return relaxed

    def before_stage(self, index: int, state: Any = None) -> None:
        pipeline = self.pipeline
        uses = pipeline.stage_uses()
        self._wait_for(uses[index].components)
        if not pipeline.stages[index].needs_components(state):
            self._skipped.add(index)
        # A stage that did without its components this run (a cached prompt) is taken
        # to do so next run too: nothing is loaded or kept for it.
        uses = [replace(u, components=()) if i in self._skipped else u for i, u in enumerate(uses)]
        activation, _ = self.activation_estimate(pipeline, self.budget_bytes)
        if self.streaming is not None:
            activation = self.streaming.with_reserved(activation)
        try:
            step = budget_step(
                self._resident(),
                index,
                uses=uses,
                nbytes=self._nbytes(),
                budget=self.budget_bytes,
                activation=activation,
                prefetch=self.prefetch,
            )
        except ValueError as error:
            raise BudgetError(f"{error}; nothing more was loaded") from error
        for name in step.evict:
            self._evict(name)
        for name in step.load:
            # The stage may start computing while the component's blocks arrive.
            pipeline.deferred[name].materialize(complete=False)
        for name in step.prefetch_evict:
            self._evict(name)
        for name in step.prefetch:
            self._start_prefetch(name)

    def _evict(self, name: str) -> None:
        self._wait_for((name,))
        self.pipeline.deferred[name].release()

    def _start_prefetch(self, name: str) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ondeck-prefetch")
        proxy = self.pipeline.deferred[name]

        def load() -> None:
            self._local.prefetching = True
            try:
                proxy.materialize(complete=False)
            finally:
                self._local.prefetching = False

        self._pending[name] = self._executor.submit(load)

    def _wait_for(self, names: Any) -> None:
        for name in names:
            future = self._pending.pop(name, None)
            if future is None:
                continue
            started = time.perf_counter()
            try:
                future.result()
            except Exception as error:
                # The stage's own access retries the load and reports the error itself.
                warnings.warn(f"prefetching '{name}' failed: {error!r}", stacklevel=3)
            waited = time.perf_counter() - started
            if waited > 1e-4:
                self.pipeline.tracker.waited(name, waited)

    def in_prefetch_thread(self) -> bool:
        return getattr(self._local, "prefetching", False)

    def cancel_prefetch(self) -> None:
        """Drop prefetches not started yet; wait for those already loading."""
        for name, future in list(self._pending.items()):
            if future.cancel():
                self._pending.pop(name, None)
        for name in list(self._pending):
            self._wait_for((name,))

    def close(self) -> None:
        self.cancel_prefetch()
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def after_run(self) -> None:
        self.cancel_prefetch()

    def before_load(self, name: str) -> None:
        """A load outside the plan (an unexpected access): make room for it first."""
        if self.in_prefetch_thread() or self.pipeline.current_stage_index is None:
            return
        nbytes = self._nbytes()
        resident = set(self.pipeline.resident())
        if sum(nbytes[c] for c in resident | {name}) <= self.budget_bytes:
            return
        from .plan import choose_evictions

        index = self.pipeline.current_stage_index
        uses = self.pipeline.stage_uses()
        keep = set(uses[index].components) | {name}
        for victim in (
            choose_evictions(
                resident,
                keep,
                [name],
                uses=uses,
                index=index,
                nbytes=nbytes,
                limit=self.budget_bytes,
            )
            or ()
        ):
            self.pipeline.deferred[victim].release()

    def recover_from_oom(self, index: int) -> bool:
        """Out of memory inside a stage: free everything it does not hold, retry once."""
        pipeline = self.pipeline
        self.cancel_prefetch()
        keep = set(pipeline.stage_uses()[index].components)
        freed = [name for name in list(pipeline.resident()) if name not in keep]
        for name in freed:
            pipeline.deferred[name].release()
        free_cached_memory()
        return bool(freed)


def _set_aside_note(stored: dict[str, int], when: str) -> str:
    peaks = ", ".join(f"{stage}: {format_bytes(n)}" for stage, n in stored.items())
    return (
        f"stored activation peaks ({peaks}, in {profiles_path()}) would not fit; they are "
        f"set aside{when} and measured again (`ondeck profiles --clear` deletes them)"
    )


def auto_budget_bytes(device: Any) -> tuple[int, bool]:
    """The budget ``auto`` plans against while activations are estimated, and whether
    the device is unified memory.

    ``ondeck.memory.device_facts`` is the one seam that says what the device has.
    """
    facts = memory.device_facts(device)
    headroom = max(AUTO_HEADROOM_MIN_BYTES, int(facts.total_bytes * AUTO_HEADROOM_FRACTION))
    return max(0, facts.available_bytes - headroom), facts.unified


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
    every stage's activations are measured (``plan.planning_budget``), else ``budget``."""

    def __init__(self, budget: int, *, measured_budget: int, prefetch: bool = True):
        super().__init__(budget, prefetch=prefetch)
        self.estimated_budget_bytes = self.budget_bytes
        self.measured_budget_bytes = max(measured_budget, self.budget_bytes)

    def current_budget(self, pipeline: Pipeline) -> int:
        needs, _ = self.activation_needs(pipeline)
        return planning_budget(
            needs, estimated=self.estimated_budget_bytes, measured=self.measured_budget_bytes
        )

    def before_run(self) -> None:
        self.budget_bytes = self.current_budget(self.pipeline)
        super().before_run()

    def plan_for(self, pipeline: Pipeline, budget: int | None = None) -> Plan:
        return super().plan_for(
            pipeline, budget if budget is not None else self.current_budget(pipeline)
        )


def bytes_loaded_per_run(plan: Any) -> int:
    """Bytes a plan loads in its last simulated run (the steady state: run 2 onwards)."""
    runs = plan.runs
    if not runs:
        return 0
    last = runs[-1].run
    sizes = plan.device_bytes
    previous = [stage for stage in runs if stage.run == last - 1]
    resident = set(previous[-1].resident) if previous else set()
    loaded = 0
    for stage in (stage for stage in runs if stage.run == last):
        loaded += sum(sizes.get(name, 0) for name in set(stage.resident) - resident)
        resident = set(stage.resident)
    return loaded


def choose_auto(pipeline: Pipeline, *, prefetch: bool = True) -> Policy:
    """The policy ``auto`` runs with: never one whose plan does not fit the device.

    Everything fits: ``budget`` keeps it all. The largest stage fits: ``budget`` (kept
    across runs by next use, next component prefetched) or ``release``, whichever the
    plan says loads fewer bytes per run. A component too large for its stage: ``budget``
    streams its blocks. Not even that fits: ``budget`` all the same, whose first run
    refuses with a ``BudgetError`` before a byte is read (the plan says why).
    """
    available, unified = auto_budget_bytes(pipeline.device)
    where = "unified memory" if unified else str(pipeline.device)
    sizes = pipeline.component_bytes()
    total = sum(size or 0 for size in sizes.values())
    if None in sizes.values():
        chosen: Policy = ReleasePolicy()
        chosen.reason = (
            f"auto chose 'release': some components have unknown sizes, so no budget "
            f"can be planned for the {format_bytes(available)} {where} has free"
        )
        return chosen
    relief = measured_headroom_relief(pipeline.device)
    budget = AutoBudgetPolicy(available, measured_budget=available + relief, prefetch=prefetch)
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
            chosen = ReleasePolicy()
            chosen.reason = f"auto chose 'release': {per_run}"
            return chosen
        budget.reason = f"auto chose 'budget' with prefetch: {per_run}"
    if relief:
        budget.reason += (
            f"; once every stage's activations are measured, runs plan against "
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
        return policy
    budget = parse_bytes(budget)
    if policy == "auto":
        if budget is None:
            raise ValueError("auto without a budget is chosen by choose_auto(pipeline)")
        chosen: Policy = BudgetPolicy(budget, prefetch=prefetch)
        chosen.reason = "auto chose 'budget': a budget was given"
        return chosen
    if policy == "eager":
        return EagerPolicy()
    if policy == "release":
        return ReleasePolicy()
    if policy == "budget":
        if budget is None:
            budget, _ = auto_budget_bytes(device)
        return BudgetPolicy(budget, prefetch=prefetch)
    raise ValueError(f"unknown policy {policy!r}; choose auto, eager, release or budget")
