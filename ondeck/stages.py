"""Stages, pipelines, and the release schedule derived from which stage holds what."""

from __future__ import annotations

import copy
import threading
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from . import memory
from .errors import ConcurrentRunError
from .executor import Executor
from .host_pool import HostMemory
from .lazy import (
    LazyModule,
    component_name,
    is_lazy,
    is_loaded,
    is_loading,
    is_out_of_memory,
    loader_of,
    pinned,
)
from .loader import as_loader
from .loading.options import DeviceChoice
from .memory import local_ranks, positive_bytes, resolve_device
from .planning import HostPlan, Plan, StageUse, release_schedule
from .policy import RETRY_RESERVE_MIN_RETRIES, Policy, choose_auto, make_policy
from .snapshot import Snapshot, Steps
from .tracker import CallTimer, MemoryTracker, StageRecord

__all__ = ["Stage", "Pipeline", "held_components"]

_CONTAINERS = (list, tuple, set, frozenset)


def held_components(holder: Any) -> list[LazyModule]:
    """Every proxy reachable from ``holder`` through stage attributes and containers.

    Never loads: values are tested with ``is_lazy`` before anything else, because
    ``isinstance`` on a proxy answers for the declared class.
    """
    found: list[LazyModule] = []
    seen: set[int] = set()

    def walk(value: Any) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if is_lazy(value):
            found.append(value)
        elif isinstance(value, Stage) or type(value) is types.SimpleNamespace:
            for attribute, item in vars(value).items():
                if not attribute.startswith("_ondeck_"):
                    walk(item)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, _CONTAINERS):
            for item in value:
                walk(item)

    walk(holder)
    return found


class Stage:
    """One step of a pipeline. Subclass it and implement ``forward(state) -> state``.

    Calling a stage runs ``forward`` and then releases the components whose last
    holder it is, also when ``forward`` raised. The hook lives here, not in the
    pipeline's loop, so a pipeline that runs its stages its own way still frees.
    """

    _ondeck_pipeline: Pipeline | None = None
    _ondeck_stage_name: str | None = None

    def __init__(self) -> None:
        object.__setattr__(self, "_ondeck_pipeline", None)

    @property
    def name(self) -> str:
        return self._ondeck_stage_name or type(self).__name__

    @name.setter
    def name(self, value: str) -> None:
        object.__setattr__(self, "_ondeck_stage_name", value)

    def forward(self, state: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(state)")

    def fit_activations(self, need: int, room: int) -> int:
        """Activation bytes this stage takes when ``room`` is what is left for them and
        ``need`` what it measured with room to spare. A stage that can work in pieces
        (a tiled decode) answers less than ``need``; by default a stage cannot."""
        return need

    def whole_activations(self, measured: int) -> int | None:
        """What to remember of this run's measured activation peak: the bytes the stage
        would take doing its work at once. A stage that worked in pieces scales its
        piece's peak up; None remembers nothing (a measurement that says nothing about
        the need, e.g. one that includes an attempt that ran out of memory)."""
        return measured

    def needs_components(self, state: Any) -> bool:
        """Whether this run of the stage will touch its components (a cache may answer).

        Policies that load ahead of use skip a stage's components when this is False. It
        is also asked early, with the state an earlier stage receives, so that nothing is
        prefetched for a stage that will not use it; a stage that cannot tell from that
        state answers True.
        """
        return True

    def __setattr__(self, attribute: str, value: Any) -> None:
        object.__setattr__(self, attribute, value)
        pipeline = self._ondeck_pipeline
        if pipeline is not None and not attribute.startswith("_ondeck_"):
            pipeline.invalidate_schedule()

    def __call__(self, state: Any) -> Any:
        pipeline = self._ondeck_pipeline
        if pipeline is None:
            return self.forward(state)
        return pipeline._run_stage(self, state)

    def __repr__(self) -> str:
        return f"<Stage {self.name}>"


class _Components(dict):
    """The pipeline's component map; assigning a name wraps the value and rebuilds."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self._pipeline = pipeline

    def __setitem__(self, name: str, value: Any) -> None:
        old = self.get(name)
        if old is not None and is_lazy(old) and old is not value:
            old.release()
            old.remove_observer(self._pipeline)
        if old is not None and old is not value:
            self._pipeline.forget_measured(name)
        super().__setitem__(name, self._pipeline._wrap_component(name, value))
        if self._pipeline._stages_built:
            self._pipeline._rebuild_stages()


class Pipeline(HostMemory):
    """A sequence of stages over named components, some of them deferred.

    ``lazy_components`` lists the names that load on demand; ``create_stages`` returns
    the stages, reading components from ``self.components``. ``host_memory`` is the
    process's host budget (bytes or "32GiB"; default: what the machine and its cgroup
    leave, less a reserve): the plan shows the host pool against it, and a run that
    outgrows it drops the host cache, then stops with a ``HostMemoryError`` first.
    """

    lazy_components: tuple[str, ...] = ()
    # Names the model for activation profiles; pipelines that know their shape set it.
    profile_model: str | None = None

    def __init__(
        self,
        components: Mapping[str, Any],
        *,
        policy: str | Policy = "auto",
        budget: int | str | None = None,
        device: DeviceChoice = None,
        prefetch: bool = True,
        host_memory: int | str | None = None,
    ):
        self.device = resolve_device(device)
        self.init_host_memory(positive_bytes(host_memory, "host_memory"))
        timer = CallTimer.for_device(self.device)
        self.tracker = MemoryTracker(device=str(self.device), call_timer=timer)
        self.training = False
        # Whether another run is expected after this one: when False, the last stage loads
        # nothing ahead for a next run (a one-shot command's last run).
        self.more_runs = True
        self._run_lock = threading.Lock()
        self._running_thread: int | None = None
        self._schedule: dict[str, list[str]] | None = None
        self._uses: list[StageUse] | None = None
        self._warned_unheld: set[str] = set()
        self._stages_built = False
        self._extra_stages: list[Stage] = []
        self._current_index: int | None = None
        self._measured_bytes: dict[str, int] = {}
        self._profile_shape: dict[str, Any] | None = None
        self._measured_activation: dict[str, int] = {}
        self._retried_stages: dict[str, int] = {}
        self._limit_stages: set[str] = set()
        # Carries out every decision the policy makes; owns the threads that loads use.
        self.executor = Executor(self)
        self.components = _Components(self)
        for name, value in components.items():
            self.components[name] = value
        self._rebuild_stages()
        self._requested_policy = (policy, budget, prefetch)
        self._choose_policy()

    def _choose_policy(self) -> None:
        """Build the policy asked for at construction against what is known now."""
        policy, budget, prefetch = self._requested_policy
        self.policy = None
        # Peaks measured under another policy (or device) do not carry over.
        self._measured_activation = {}
        self.tracker.activation_bounds.clear()
        self._retried_stages = {}
        self._limit_stages = set()
        if policy == "auto" and budget is None:
            self.policy = choose_auto(self.snapshot(), prefetch=prefetch)
        else:
            self.policy = make_policy(policy, budget=budget, prefetch=prefetch, device=self.device)
        streaming = getattr(self.policy, "streaming", None)
        if streaming is not None:
            streaming.timing.tracker = self.tracker  # blocks' waits leave the timed calls
        if self.policy.loads_up_front:
            self.executor.attach(self.policy.attached(self.snapshot()))

    # -- components ---------------------------------------------------------------------

    def _wrap_component(self, name: str, value: Any) -> Any:
        if name in self.lazy_components:
            if _is_loader(value):
                value = LazyModule(name, value, spec=getattr(value, "spec", None))
            if is_lazy(value):
                value.add_observer(self)
            return value
        if is_lazy(value):
            value.materialize()
        elif _is_loader(value):
            value = value()
        return value

    @property
    def deferred(self) -> dict[str, LazyModule]:
        """The components that load on demand and can be released."""
        return {
            name: value
            for name, value in self.components.items()
            if name in self.lazy_components and is_lazy(value)
        }

    def create_stages(self) -> list[Stage]:
        raise NotImplementedError(f"{type(self).__name__} must implement create_stages()")

    def _rebuild_stages(self) -> None:
        stages = list(self.create_stages()) + self._extra_stages
        for stage in stages:
            if not isinstance(stage, Stage):
                raise TypeError(f"create_stages returned {stage!r}, which is not an ondeck.Stage")
            object.__setattr__(stage, "_ondeck_pipeline", self)
        self.stages = stages
        self._stages_built = True
        self.invalidate_schedule()

    def add_stage(self, stage: Stage) -> None:
        """Append a stage; the schedule is rebuilt on next use."""
        object.__setattr__(stage, "_ondeck_pipeline", self)
        self._extra_stages.append(stage)
        self.stages.append(stage)
        self.invalidate_schedule()

    def loaded_before(self, name: str) -> bool:
        """Whether component ``name`` (this one, not one it replaced) has been loaded."""
        return name in self._measured_bytes

    def stages_holding(self, name: str) -> set[str]:
        """The names of the stages holding component ``name`` (none before they are built)."""
        if not self._stages_built:
            return set()
        return {use.name for use in self.stage_uses() if name in use.components}

    def forget_measured(self, name: str) -> None:
        """Component ``name`` is being replaced: what the runs measured of it, and of the
        stages that hold it, was the old one's."""
        self._measured_bytes.pop(name, None)
        for stage in self.stages_holding(name):
            self._measured_activation.pop(stage, None)
            self.tracker.activation_bounds.pop(stage, None)
            self._retried_stages.pop(stage, None)
            self._limit_stages.discard(stage)

    # -- schedule -----------------------------------------------------------------------

    def invalidate_schedule(self) -> None:
        self._schedule = None
        self._uses = None

    def stage_uses(self) -> list[StageUse]:
        """Each top-level stage with the deferred components it holds. Never loads."""
        if self._uses is None:
            names = {id(proxy): name for name, proxy in self.deferred.items()}
            uses = []
            for stage in self.stages:
                held = [names[id(p)] for p in held_components(stage) if id(p) in names]
                uses.append(StageUse(stage.name, tuple(dict.fromkeys(held))))
            held_anywhere = {c for use in uses for c in use.components}
            for name in names.values():
                if name not in held_anywhere and name not in self._warned_unheld:
                    self._warned_unheld.add(name)
                    warnings.warn(
                        f"deferred component '{name}' is held by no stage, so it is never "
                        "released; give it to a stage or drop it from lazy_components",
                        stacklevel=2,
                    )
            self._uses = uses
        return self._uses

    @property
    def schedule(self) -> dict[str, list[str]]:
        """``{stage name: [components released after it]}``, computed without loading."""
        if self._schedule is None:
            self._schedule = release_schedule(self.stage_uses())
        return self._schedule

    def component_bytes(self) -> dict[str, int | None]:
        """Bytes per deferred component: measured once loaded, else from its spec."""
        known = dict(self.tracker.resident)
        result: dict[str, int | None] = {}
        for name, proxy in self.deferred.items():
            result[name] = known.get(name, proxy.spec.nbytes)
            if result[name] is None:
                result[name] = self._measured_bytes.get(name)
        return result

    def plan(self, budget: int | str | None = None) -> Plan:
        """Predicted residency under the policy this pipeline (or ``budget``) implies."""
        planned = self.policy.plan_for(self.snapshot(), positive_bytes(budget, "a budget"))
        streaming = getattr(self.policy, "streaming", None)
        runs = self.tracker.runs
        if streaming is not None and runs:
            calls = self.tracker.calls_per_run
            for name, stats in streaming.stats().items():
                if name in planned.streamed and (calls.get(name) or stats["passes"]):
                    # The last run's calls; where a stage runs the module itself, not
                    # through its proxy, the passes streamed so far over the runs.
                    planned.passes_per_call[name] = calls.get(name) or stats["passes"] / runs
        budget_bytes, source, process, cache = self.host_pool()
        growth = self.host_growth()
        caps, held = self.elastic_caches()
        planned.host = HostPlan(
            budget_bytes,
            source,
            process,
            planned.pinned_host_bytes,
            cache,
            planned.ring_bytes,
            growth_bytes=growth.nbytes,
            growth_source=growth.source,
            elastic_caps=caps,
            elastic_held=held,
            elastic_adding=self.more_runs,
            local_ranks=local_ranks(),
        )
        return planned

    def snapshot(
        self, *, needs_components: bool = True, later_unneeded: frozenset[int] = frozenset()
    ) -> Snapshot:
        """What a policy decides from, as things are now; never loads anything.

        ``needs_components``: whether the stage about to run will touch its components;
        ``later_unneeded``: the indices of later stages that, as far as one can tell now,
        will not.
        """
        uses = self.stage_uses()
        stored, note = self.activation_profile()
        evidence = self.executor.allocator_evidence()
        streaming = getattr(self.policy, "streaming", None)
        deferred = self.deferred
        loaders = {name: loader_of(proxy) for name, proxy in deferred.items()}
        return Snapshot(
            uses=tuple(uses),
            nbytes=self.component_bytes(),
            streamed_bytes=streaming.device_bytes() if streaming is not None else {},
            resident=frozenset(self.resident()),
            prefetching=self.executor.prefetching,
            index=self._current_index,
            run_shape=self._profile_shape,
            stored_activation=stored,
            stored_note=note,
            measured_activation=self._measured_activation,
            activation_bounds=self.tracker.activation_bounds,
            retried_stages=evidence.beside(self._retried_stages),
            limit_stages=evidence.limit | self._limit_stages,
            device=self.device,
            fit_activations=tuple(stage.fit_activations for stage in self.stages),
            needs_components=needs_components,
            later_unneeded=later_unneeded,
            loaders=loaders,
            streamable_blocks=getattr(self, "streamable_blocks", None) or {},
            upcast_bytes={
                name: upcast for name, loader in loaders.items() if (upcast := _upcast(loader))
            },
            calls_per_run=self.tracker.calls_per_run,
            seconds_per_call=self.tracker.seconds_per_call,
            load_bytes_per_second=self.tracker.later_load_bytes_per_second,
            host_room_bytes=self.host_room_bytes(),
            host_memory=self.host_memory,
            more_runs=self.more_runs,
            runs_completed=self.tracker.runs_completed,
        )

    # -- running ------------------------------------------------------------------------

    def __call__(self, state: Any = None) -> Any:
        me = threading.get_ident()
        if self._running_thread == me:
            raise ConcurrentRunError(
                f"{type(self).__name__} was called again from inside its own run"
            )
        # Concurrent calls from other threads queue here and run one after another.
        with self._run_lock, memory.collector_paused():
            self._running_thread = me
            try:
                return self._run(state)
            finally:
                self._running_thread = None

    def profile_shape(self, state: Any) -> dict[str, Any] | None:
        """The input shape activations depend on (height, width, frames...), if known."""
        return None

    def activation_profile(self) -> tuple[dict[str, int], str]:
        """Per-stage activation bytes measured earlier for this model and shape."""
        return self.executor.activation_profile()

    def activation_need(self, stage: str) -> int | None:
        """The largest activation peak measured for ``stage`` at this shape, if any."""
        needs, _ = self.policy.activation_needs(self.snapshot())
        return needs.get(stage)

    def make_room(self, keep: Iterable[str] = ()) -> bool:
        """Out of memory inside the running stage: free what the policy lets go (a
        prefetch, components kept for later stages) but ``keep``, the components the
        caller is computing with; whether anything was freed. For a stage that handles
        running out of memory itself, such as a decode that tiles, before it works in
        smaller pieces."""
        index = self._current_index
        return index is not None and self._recover_from_oom(index, keep=frozenset(keep))

    def room_to_make(self, keep: Iterable[str] = ()) -> tuple[int, float] | None:
        """What ``make_room(keep)`` would free now, in bytes, and the seconds loading it
        again under the same plan takes (``MemoryTracker.reload_cost``); None where it
        would free nothing, a rate is not known, or a load is under way."""
        index = self._current_index
        if index is None or self._loading_bytes():
            # A load under way: making room would wait for it, then free it too.
            return None
        steps = self._recovery(index, frozenset(keep))
        return self.tracker.reload_cost(steps.release) if steps and steps.release else None

    def activation_room(self) -> int | None:
        """Device bytes the running stage may still take for activations: the budget
        less what is resident, else what the device has left; None where unknown."""
        budget = self.policy.budget_bytes
        if budget is not None:
            return budget - self.tracker.resident_bytes
        if self.device is None or self.device.type != "cuda":
            return None
        facts = memory.device_facts(self.device)  # the one seam that says what it has
        if facts.unified:
            return None
        # Free on the device (within an emulated card's share), plus what the caching
        # allocator holds but no tensor uses.
        return (
            facts.available_bytes
            + torch.cuda.memory_reserved(self.device)
            - torch.cuda.memory_allocated(self.device)
        )

    def record_activation(self, stage: str, nbytes: int) -> None:
        self.executor.write_profile(stage, nbytes)

    def _stage_measured(self, index: int, record: StageRecord) -> None:
        """Keep the largest activation peak measured per stage (device bytes), and store
        it in the profile of this model and shape. Count the runs in which the stage's
        allocator kept retrying (``policy.RETRY_RESERVE_MIN_RETRIES``) without running out
        of memory (the plan gives it more reserve), and the stages whose allocator retried
        at all (``Snapshot.limit_stages``) but for one that fits its work to its room (a
        tiled decode); the profile keeps both for later processes (``AllocatorEvidence``)."""
        retries = record.allocator_retries
        pieces = _works_in_pieces(self.stages[index])
        limit = bool(retries) and not record.allocator_ooms and not pieces
        if limit:
            self._limit_stages.add(record.stage)
        # A stage that ran out of memory (a tiled decode finding its tiles) learns from
        # that instead. The counts are the device's: a load running beside the stage
        # (a prefetch, a fill) counts in them too, and shares the stage's room anyway.
        many = retries is not None and retries >= RETRY_RESERVE_MIN_RETRIES
        retried = many and not record.allocator_ooms
        if retried:
            self._retried_stages[record.stage] = self._retried_stages.get(record.stage, 0) + 1
        self.executor.write_allocator(record.stage, retried=retried, limit=limit)  # this shape's
        if record.activation_bytes is None:
            if not pieces:  # a decode in pieces plans from its own estimate of whole frames
                self.tracker.keep_bound(record)
            return
        nbytes = self.stages[index].whole_activations(record.activation_bytes)
        if nbytes is None:
            return
        previous = self._measured_activation.get(record.stage, 0)
        self._measured_activation[record.stage] = max(previous, nbytes)
        self.record_activation(record.stage, nbytes)

    def _before_run(self) -> None:
        steps = self.policy.before_run(self.snapshot())
        # Before the streamed blocks' copies are made: an elastic host cache gives way.
        self.fit_host_caches(steps.streaming[1] if steps.streaming is not None else None)
        self.executor.before_run(steps)

    def _before_stage(self, index: int, state: Any = None) -> None:
        """Wait for the stage's prefetched components, then act on the policy's steps."""
        self.check_host_memory()
        self.executor.wait_for(self.stage_uses()[index].components)
        needs = self.stages[index].needs_components(state)
        later = frozenset(
            later
            for later in range(index + 1, len(self.stages))
            if not self.stages[later].needs_components(state)
        )
        snapshot = self.snapshot(needs_components=needs, later_unneeded=later)
        steps = self.policy.before_stage(snapshot, index)
        self.executor.before_stage(steps)

    def _after_run(self) -> None:
        self.executor.finish_run()

    def _run(self, state: Any) -> Any:
        self._profile_shape = self.profile_shape(state) or self._profile_shape
        self.stage_uses()
        self.tracker.run_started()
        self._watch_host()
        try:
            self._before_run()
            try:
                for index, stage in enumerate(self.stages):
                    self._current_index = index
                    state = stage(state)
            except BaseException:
                self.cancel_prefetch_quietly()
                self._release_deferred_quietly()
                self._forget_what_is_not_loaded()
                raise
            finally:
                self._current_index = None
            self._after_run()
            self.tracker.run_finished()
        finally:
            self._unwatch_host()
        return state

    def _stage_index(self, stage: Stage) -> int | None:
        if self._current_index is not None and self.stages[self._current_index] is stage:
            return self._current_index
        for index, candidate in enumerate(self.stages):
            if candidate is stage:
                return index
        return None

    def _run_stage(self, stage: Stage, state: Any) -> Any:
        index = self._stage_index(stage)
        if index is None:  # a nested stage: its top-level stage owns the schedule
            return stage.forward(state)
        uses = self.stage_uses()[index]
        held = [self.deferred[name] for name in uses.components]
        self.tracker.stage_started(stage.name)
        failed = True
        try:
            self._before_stage(index, state)
            self.tracker.compute_started()
            with pinned(*held):
                state, _ = self._forward_with_recovery(stage, index, state)
            failed = False
        finally:
            record = self.tracker.stage_finished(stage.name, self._loading_bytes())
            # A stage that raised measured what it managed to allocate before failing,
            # not what it needs: that is never remembered. After an out-of-memory retry
            # the measurement is the retry's alone (see _forward_with_recovery).
            if not failed:
                self._stage_measured(index, record)
            self._after_stage(index, failed)
        return state

    def _forward_with_recovery(self, stage: Stage, index: int, state: Any) -> tuple[Any, bool]:
        """The stage's result, and whether it ran again after running out of memory."""
        calls = self.tracker.calls_so_far()
        given = copy.copy(state)  # what the attempt that fails may change in place
        try:
            return stage.forward(state), False
        except Exception as error:
            if not is_out_of_memory(error) or not self._recover_from_oom(index):
                raise
        self.tracker.restore_calls(calls)  # the calls of the attempt that failed do not count
        self.tracker.compute_started()  # measure the retry, not the attempt that failed
        return stage.forward(copy.copy(given)), True

    def _recover_from_oom(self, index: int, keep: frozenset[str] = frozenset()) -> bool:
        """Out of memory inside a stage: free what the policy lets go but ``keep``;
        whether to retry."""
        self.executor.cancel_prefetch()
        steps = self._recovery(index, keep)
        if steps is None:
            return False
        self.executor.recover(steps)
        return True

    def _recovery(self, index: int, keep: frozenset[str]) -> Steps | None:
        """The policy's steps out of memory in stage ``index``, but ``keep``'s releases;
        None where the policy has none, or where ``keep`` leaves them nothing to free."""
        steps = self.policy.recover_from_oom(self.snapshot(), index)
        if steps is None or not keep:
            return steps
        released = tuple(name for name in steps.release if name not in keep)
        return replace(steps, release=released) if released else None

    def _loading_bytes(self) -> int:
        """Bytes of the components loading right now (a prefetch in the background)."""
        return sum(proxy.spec.nbytes or 0 for proxy in self.deferred.values() if is_loading(proxy))

    def _after_stage(self, index: int, failed: bool, keep: frozenset[str] = frozenset()) -> None:
        """Release what the schedule says, but ``keep``; never let a release error mask
        the stage's."""
        if self.training:
            return
        try:
            steps = self.policy.after_stage(self.snapshot(), index, failed=failed)
            self.executor.release(name for name in steps.release if name not in keep)
        except Exception as error:
            if not failed:
                raise
            warnings.warn(f"releasing after a failed stage also failed: {error!r}", stacklevel=3)

    def cancel_prefetch_quietly(self) -> None:
        """Stop prefetches (none may load after an abort); a failure only warns."""
        try:
            self.executor.cancel_prefetch()
        except Exception as error:
            warnings.warn(f"stopping a prefetch failed: {error!r}", stacklevel=3)

    def _release_deferred_quietly(self) -> None:
        self.executor.release_all(quietly=True)

    def _forget_what_is_not_loaded(self) -> None:
        """After an abort the tracker lists only what is really loaded, whatever an
        interrupt cut short."""
        for name in list(self.tracker.resident):
            proxy = self.deferred.get(name)
            if proxy is not None and not is_loaded(proxy):
                self.tracker.released(name, 0)

    @property
    def current_stage_index(self) -> int | None:
        """The index of the top-level stage running now; None between runs."""
        return self._current_index

    @property
    def run_shape(self) -> dict[str, Any] | None:
        """The shape (``profile_shape``) of the run in progress, else of the last one."""
        return self._profile_shape

    def close(self) -> None:
        """Join the executor's threads, release every deferred component and free the
        host memory streaming keeps between loads (host copies, the rings' buffers). The
        pipeline stays usable: the next call loads again (and starts threads again)."""
        self.executor.close()
        self.release_all()
        streaming = getattr(self.policy, "streaming", None)
        if streaming is not None:
            streaming.drop_host_copies()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def release_all(self) -> int:
        """Release every deferred component; returns the bytes freed."""
        return self.executor.release_all()

    def train(self, mode: bool = True) -> Pipeline:
        """Training keeps every component resident: gradients need the weights."""
        if mode and self.deferred:
            warnings.warn(
                "training mode keeps every component resident; deferred components are "
                "not released until eval()",
                stacklevel=2,
            )
        self.training = mode
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    # -- observer of its proxies --------------------------------------------------------

    def _name_of(self, proxy: LazyModule) -> str:
        for name, value in self.deferred.items():
            if value is proxy:
                return name
        return component_name(proxy)

    def before_load(self, proxy: LazyModule) -> None:
        if self.executor.in_prefetch_thread():
            return
        self.executor.release(
            self.policy.before_load(self.snapshot(), self._name_of(proxy)).release
        )

    def after_load(self, proxy: LazyModule, nbytes: int, seconds: float) -> None:
        name = self._name_of(proxy)
        self._measured_bytes[name] = nbytes
        self.tracker.loaded(
            name,
            nbytes,
            seconds,
            exposed=not self.executor.in_prefetch_thread(),
            setup_seconds=as_loader(loader_of(proxy)).setup_seconds,
        )

    def component_called(self, proxy: LazyModule) -> None:
        """A call of a component (its forward), counted per run (``run_started`` drops
        the calls made between runs)."""
        self.tracker.called(self._name_of(proxy))

    def component_returned(self, proxy: LazyModule) -> None:
        self.tracker.returned(self._name_of(proxy))

    def after_wait(self, proxy: LazyModule, seconds: float) -> None:
        """A forward waited for a block that a pipelined load had not brought in yet."""
        self.tracker.waited(self._name_of(proxy), seconds)

    def after_fill(self, proxy: LazyModule, seconds: float) -> None:
        """A pipelined load's last weights are in place, ``seconds`` after it began."""
        self.tracker.filled(
            self._name_of(proxy), seconds, setup_seconds=as_loader(loader_of(proxy)).setup_seconds
        )

    def after_release(self, proxy: LazyModule, nbytes: int) -> None:
        self.tracker.released(self._name_of(proxy), nbytes)

    # -- reporting ----------------------------------------------------------------------

    def resident(self) -> Iterator[str]:
        return (name for name, proxy in self.deferred.items() if is_loaded(proxy))

    def report(self) -> dict[str, Any]:
        return {
            "pipeline": type(self).__name__,
            "policy": self.policy.name,
            "budget_bytes": self.policy.budget_bytes,
            # The host peak (``host_peak_bytes`` below) is read against this.
            "host_budget_bytes": self.host_watch.budget_bytes if self.host_watch else None,
            "schedule": self.schedule,
            "component_bytes": self.component_bytes(),
            **self.tracker.to_dict(),
        }


def _is_loader(value: Any) -> bool:
    """A zero-argument loader, as opposed to a component given already loaded.

    Modules, tensors and library objects such as tokenizers and schedulers are
    callable too, but they are the component itself.
    """
    if is_lazy(value) or not callable(value):
        return False
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return False
    return not (hasattr(value, "from_pretrained") or hasattr(value, "save_pretrained"))


def _upcast(loader: Any) -> int:
    """A loader's ``upcast_bytes`` (0 for a plain callable). A folder that cannot be
    read plans as if nothing were stored: its load reports what is wrong with it."""
    try:
        return int(as_loader(loader).upcast_bytes or 0)
    except Exception:
        return 0


def _works_in_pieces(stage: Stage) -> bool:
    """Whether the stage fits its activations to the room it has (``fit_activations``);
    False where asking raises."""
    need = 1 << 40
    try:
        return stage.fit_activations(need, need // 2) < need
    except Exception:
        return False
