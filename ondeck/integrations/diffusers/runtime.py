"""The runtime behind ``pipe.ondeck``: a diffusers call modelled as ondeck stages, one
per component, in the order the call first touches them."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import memory
from ...arguments import (
    check_generate_arguments,
    frame_count_argument,
    own_call_sizes,
)
from ...errors import OndeckError
from ...host_pool import output_host_bytes
from ...lazy import LazyModule, is_lazy, is_out_of_memory, loader_of
from ...loading.options import DeviceChoice
from ...memory import format_bytes, resolve_device
from ...policy import AutoBudgetPolicy, Policy
from ...stages import Pipeline, Stage
from ...token_room import CountsTokens, TokenRoom
from .call_shape import call_batch, call_profile_shape, call_sizes, token_activations
from .calls import (
    CHECKED_KEYWORDS,
    INPUT_ARGUMENTS,
    call_with_progress,
    check_prompt_cleaning,
    frames_of,
    generator_states,
    restore_generators,
    warn_if_truncated,
)
from .component import PipelineComponent, owned_elsewhere
from .decode import FittingDecode, is_vae
from .transforms import FirstApplied
from .turns import (
    CallRecord,
    ComponentTurn,
    TurnEnds,
    call_signature,
    usable_turns,
    with_untouched,
)

# A call whose component ran out of memory runs again at most this many times, each
# keeping twice the room for that turn's activations, the first a tenth of the budget.
OOM_RETRIES = 2
OOM_FIRST_ROOM_FRACTION = 0.1


class DiffusersRuntime(CountsTokens, Pipeline):
    """ondeck's runtime for one diffusers pipeline: available as ``pipe.ondeck``.

    Each component's turn is a stage; ``plan()``, ``report()``, ``tracker``,
    ``policy``, ``release_all()`` and ``schedule`` work as for any ondeck pipeline.
    """

    def __init__(
        self,
        pipe: Any,
        components: dict[str, PipelineComponent],
        *,
        policy: str | Policy = "auto",
        budget: int | str | None = None,
        device: DeviceChoice = None,
        prefetch: bool = True,
        containers: tuple[str, ...] = (),
        host_memory: int | str | None = None,
        profile_model: str | None = None,
    ):
        self.pipe = pipe
        # The model its activation profiles are stored under (``call_shape``); None
        # stores and looks up none.
        self.profile_model = profile_model
        # Pipeline attributes that hold deferred models without being one themselves
        # (a MultiControlNetModel): hidden from diffusers code that would walk them.
        self.containers = containers
        self.lazy_components = tuple(components)
        sequence = [
            name
            for name in (type(pipe).model_cpu_offload_seq or "").split("->")
            if name in components
        ]
        order = sequence + [name for name in components if name not in sequence]
        # Components the pipeline's sequence does not list (ControlNets, a prior): their
        # seeded turns, placed last, are a guess until a call shows the order.
        self._unlisted = frozenset(order[len(sequence) :]) if sequence else frozenset()
        self._turns: list[tuple[str, tuple[str, ...]]] = [(name, (name,)) for name in order]
        self._seeded_order = tuple(order)
        self._learned_from: set[str] | None = None
        # Turns passed in a call whose order is not learned yet, under ``release``: their
        # components may be touched again in the same call, so they are freed only when a
        # load needs the room, or when the call ends (see ``_hold_back``).
        self._held_back: list[int] = []
        self._record: CallRecord | None = None
        self._acting = 0
        self._in_calls = 0  # calls of components under way (``component_called``)
        self._turn_ends = TurnEnds()  # learned from the last complete call
        self._signature: tuple = ()  # ``call_signature`` of the call in progress
        # Each VAE's decode, sized to fit (see ``fitting_decode``).
        self.decoders: dict[str, FittingDecode] = {}
        # The arguments of the call in progress, else of the last one: the decode's need
        # before it decodes comes from the frame size they give.
        self._call_arguments: dict[str, Any] = {}
        self._input_given = False  # it has an input its VAE encodes (``INPUT_ARGUMENTS``)
        self._own_sizes: dict[str, int] | None = None  # read at the first call
        # Room kept for a turn's activations since it ran out of memory (a floor).
        self._oom_room: dict[str, int] = {}
        self._events_at_compute = 0  # the tracker's events when the turn began computing
        self.token_room = TokenRoom()  # turns never measured, counted by their tokens
        for name, proxy in components.items():
            self._add_decoder(name, proxy)
        super().__init__(
            components,
            policy=policy,
            budget=budget,
            device=device,
            prefetch=prefetch,
            host_memory=host_memory,
        )
        for proxy in components.values():
            proxy.belong_to(self)

    # -- stages -------------------------------------------------------------------------

    def create_stages(self) -> list[Stage]:
        return [
            ComponentTurn(name, [self.components[held] for held in holding])
            for name, holding in self._turns
        ]

    @property
    def loaders(self) -> dict[str, Any]:
        """Each deferred component's loader, by name (a report reads what each has read)."""
        return {name: loader_of(proxy) for name, proxy in self.components.items()}

    @property
    def order(self) -> list[str]:
        """The components' turns, in the order a call starts them."""
        return [name for name, _ in self._turns]

    def held_by_another_turn(self, name: str) -> bool:
        """Whether a turn not ``name``'s holds component ``name`` (an image-to-video VAE,
        whose turn encodes and whose decode runs in the transformer's)."""
        return any(name in held for turn, held in self._turns if turn != name)

    def _turn_index(self, name: str) -> int | None:
        return next((i for i, stage in enumerate(self.stages) if stage.name == name), None)

    def deferred_name(self, proxy: Any) -> str | None:
        """The name of ``proxy`` among the deferred components, by identity; None for a
        proxy that is not one of them (one this pipeline replaced)."""
        for name, value in self.deferred.items():
            if value is proxy:
                return name
        return None

    def _add_decoder(self, name: str, value: Any) -> None:
        if issubclass(type(value), PipelineComponent) and is_vae(value.spec.cls):
            self.decoders[name] = FittingDecode(value, self, name)

    def fitting_decode(self, proxy: PipelineComponent) -> FittingDecode | None:
        """``proxy.decode`` that decodes in tiles when whole frames would not fit; None
        for a proxy that is not one of this pipeline's deferred components."""
        name = self.deferred_name(proxy)
        if name is None:
            return None
        decoder = self.decoders.get(name)
        if decoder is None or decoder.proxy is not proxy:
            decoder = self.decoders[name] = FittingDecode(proxy, self, name)
        return decoder

    # -- calls --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the diffusers pipeline."""
        return self.pipe(*args, **kwargs)

    @property
    def running(self) -> bool:
        """Whether a call of the pipeline is under way."""
        return self._running_thread is not None

    def run(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one call of the pipeline (``call(*args, **kwargs)``) under the policy."""
        me = threading.get_ident()
        if self._running_thread == me:  # a pipeline calling itself: part of the outer call
            return call(*args, **kwargs)
        # Concurrent calls from other threads queue here and run one after another.
        with self._run_lock, memory.collector_paused():
            self._running_thread = me
            self._take_call(args, kwargs)
            self._signature = call_signature(args, kwargs)
            self._watch_host()
            try:
                self._begin_call()
                result = self._call_making_room(call, args, kwargs)
                self._end_call()
                return result
            finally:
                self._unwatch_host()
                self._record = None
                self._current_index = None
                self._running_thread = None

    def _take_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Plan for the call ``args``/``kwargs`` from now on: its sizes (what it leaves
        out is what it makes: the decode is sized for it) and its profile's shape."""
        self._call_arguments = {**self._own_call_sizes(), **call_sizes(kwargs)}
        self._input_given = any(kwargs.get(key) is not None for key in INPUT_ARGUMENTS)
        if self.profile_model is not None:
            self._profile_shape = call_profile_shape(
                args, kwargs, self._call_arguments, self.device
            )

    def _adopt_stored_turns(self) -> None:
        """Until a call shows the order, the turns stored for one like it (``_adopt_turns``)."""
        if self._learned_from is None:
            self._adopt_turns(usable_turns(self.executor.stored_turns(), self._seeded_order))

    def _call_making_room(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The call, run again from its start when a component's turn ran out of memory
        and the plan, keeping more room for that turn's activations, places the
        components otherwise (streams more blocks, keeps less beside them). Random
        generators are set back first: the retry draws the same noise."""
        states = generator_states(kwargs)
        for attempt in range(OOM_RETRIES + 1):
            try:
                return call(*args, **kwargs)
            except BaseException as error:
                failed = self._current_index
                self._abort_call()
                if attempt == OOM_RETRIES or not self._more_room_after(error, failed):
                    raise
            restore_generators(states)
            self._record, self._current_index, self._in_calls = CallRecord(), None, 0
            self.tracker.restore_calls({})  # the attempt that failed counts for nothing
            with self._deciding():
                self._before_run()
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def _more_room_after(self, error: BaseException, index: int | None) -> bool:
        """After ``error`` in turn ``index``: when it is out of memory, keep twice the
        room for that turn's activations (at first a tenth of the budget); whether the
        plan now places anything otherwise."""
        budget = getattr(self.policy, "budget_bytes", None)
        if index is None or budget is None or not is_out_of_memory(error):
            return False
        stage = self.stages[index].name
        before = self.plan()
        snapshot = self.snapshot()
        known = max(
            snapshot.measured_activation.get(stage) or 0,
            snapshot.stored_activation.get(stage) or 0,
        )
        kept = self._oom_room.get(stage)
        self._oom_room[stage] = max(2 * known, int(budget * OOM_FIRST_ROOM_FRACTION))
        if isinstance(self.policy, AutoBudgetPolicy) and snapshot.runs_completed:
            # What ran out was planned against the measured budget (a process's first run
            # never is): later runs keep the first run's reserve.
            self.policy.measured_budget_bytes = self.policy.estimated_budget_bytes
        after = self.plan()
        if after.streamed == before.streamed and after.stages == before.stages:
            return False
        if after.overflow() is not None:  # the next attempt would refuse: this error stands,
            self._oom_room.pop(stage)  # and no later call plans with that room
            if kept is not None:
                self._oom_room[stage] = kept
            return False
        warnings.warn(
            f"{stage} ran out of memory; running the call again keeping "
            f"{format_bytes(self._oom_room[stage])} for its activations",
            stacklevel=4,
        )
        return True

    def snapshot(self, **options: Any) -> Any:
        """The pipeline's snapshot, with each VAE's decode need where none is measured:
        from the call's frame size, so the plan holds room for it (or for its tiles)
        before the first decode, and prefetches beside it only what fits. A turn that ran
        out of memory counts at least the room kept for it since. Peaks stored for the
        call's shape (``call_shape``) count beside those measured in this process."""
        snapshot = super().snapshot(**options)
        known, stored = snapshot.measured_activation, snapshot.stored_activation
        expected = {
            stage: room for stage, room in self._oom_room.items() if room > (known.get(stage) or 0)
        }
        for name, decoder in self.decoders.items():
            if name in known or name in stored or self._turn_index(name) is None:
                continue
            if decoder.style is None and decoder.bytes_per_element is None:
                continue  # an estimate alone never refuses a VAE that cannot tile
            need = decoder.expected_need(self._call_arguments)
            if need:
                expected[name] = max(need, expected.get(name, 0))
        # The room kept since a turn ran out of memory is a floor for a stored peak too.
        floored = {stage: max(n, self._oom_room.get(stage, 0)) for stage, n in stored.items()}
        return dataclasses.replace(
            snapshot,
            measured_activation={**known, **expected},
            stored_activation=floored,
            measured_beside_stored=True,
        )

    def _token_estimates(self) -> dict[str, int | None]:
        """Each transformer's ``token_activations`` for the call (``CountsTokens``)."""
        estimates = {}
        for name, proxy in self.deferred.items():
            spec = proxy.spec
            arguments = self._call_arguments
            estimates[name] = token_activations(self.pipe, spec.config, arguments, spec.dtype)
        return estimates

    def output_host_bytes(self) -> int:
        """The call's decoded output in host memory, from the frame size, frames and
        count its arguments give (the last call's before a call is made)."""
        arguments = self._call_arguments
        height, width = arguments.get("height"), arguments.get("width")
        if not (isinstance(height, int) and isinstance(width, int)):
            return super().output_host_bytes()
        return output_host_bytes(height, width, arguments.get("num_frames"), call_batch(arguments))

    @contextlib.contextmanager
    def _deciding(self) -> Iterator[None]:
        """Loads the policy makes are the policy's, not touches by the call."""
        self._acting += 1
        try:
            yield
        finally:
            self._acting -= 1

    def _begin_call(self) -> None:
        self._adopt_stored_turns()
        self.stage_uses()
        self._current_index = None
        self._in_calls = 0
        with self._deciding():
            self._before_run()
        self.tracker.run_started()
        self._record = CallRecord()

    def _adopt_turns(self, turns: list[tuple[str, tuple[str, ...]]] | None) -> None:
        """Plan with ``turns`` (an earlier process's call showed them) where the plan fits
        with them: a command that fits as each turn alone is never refused for them."""
        if turns is None or turns == self._turns:
            return
        seeded, self._turns = self._turns, turns
        self._rebuild_stages()
        if self.plan().overflow() is not None:
            self._turns = seeded
            self._rebuild_stages()

    def component_touched(self, proxy: PipelineComponent) -> None:
        """A call used ``proxy``: start its turn if that turn lies ahead."""
        if (
            self._record is None
            or self._acting
            or threading.get_ident() != self._running_thread
            or self.executor.in_prefetch_thread()
        ):
            return
        name = self.deferred_name(proxy)
        if name is None:
            return
        self._record.touched(name)
        self._record.used(name)  # a call's own touch is followed by its end (``called``)
        index = self._turn_index(name)
        if index is None or (self._current_index is not None and index <= self._current_index):
            return  # used again after its turn: it loads if it has to, and goes later
        if self._learned_from is None and (
            name in self._unlisted
            or (name in self.decoders and self._input_given and self._passes_untouched(index))
        ):
            # Before the order is learned, a component outside the sequence, or a VAE
            # encoding the call's input, joins the turn in progress rather than jumping to
            # its guessed turn: that would pass the turns of components the call still
            # uses (the UNet a ControlNet works beside; the transformer after the VAE's
            # encode), which would load again moments later, or outside any turn.
            return
        with self._deciding():
            self._advance_to(index)

    def component_called(self, proxy: LazyModule) -> None:
        super().component_called(proxy)
        if self._record is not None and threading.get_ident() == self._running_thread:
            self._in_calls += 1

    def call_ended(self, proxy: PipelineComponent, *, computed: bool = True) -> None:
        """A call of ``proxy`` returned (its answer kept, where answers are), or was
        answered from what it answered before (``computed`` False): where it was the last
        call its turn makes in a run, the next turn starts now instead of at its
        component's first touch."""
        if self._record is None or threading.get_ident() != self._running_thread:
            return
        if computed and self._in_calls:
            self._in_calls -= 1
        name = self.deferred_name(proxy)
        self._record.called(name)
        if self._turn_done(name):
            index = self._current_index + 1
            with self._deciding():
                self._advance_to(index)
                # As its first touch would: the turn's own component, not those it holds.
                self.components[self.stages[index].name].materialize(complete=False)

    @property
    def call_arguments(self) -> dict[str, Any]:
        """The sizes of the call under way (or planned): the pipeline's own, then given."""
        return self._call_arguments

    def turn_needed(self, name: str) -> bool:
        """Whether the call under way will touch turn ``name``'s component: not where the
        last complete call of its kind did not (``TurnEnds.untouched``)."""
        record = self._record
        if record is None or name in record.held:
            return True
        return not self._turn_ends.untouched(name, self._signature)

    def _passes_untouched(self, index: int) -> bool:
        """Whether starting turn ``index`` now passes a turn this call has not touched."""
        start = 0 if self._current_index is None else self._current_index + 1
        return any(stage.name not in self._record.held for stage in self.stages[start:index])

    def _turn_done(self, name: str | None) -> bool:
        """Whether the call of ``name`` that just ended was the last the turn in progress
        makes in the run, by what the last complete call showed (``TurnEnds``), with no
        call under way and a turn to follow. A guess that proves wrong (a call calls more
        often than the last one of its kind) loads the component again for the extra
        call, as any use after its turn does."""
        index = self._current_index
        if (
            index is None
            or self._record is None
            or self._acting
            or self._in_calls
            or self._learned_from is None
            or index + 1 >= len(self.stages)
            or self.executor.in_prefetch_thread()
        ):
            return False
        held = [self.deferred_name(component) for component in self.stages[index].components]
        if name not in held:
            return False
        following = self.stages[index + 1].name
        return self._turn_ends.ends(self._record, self._signature, held, following)

    def _advance_to(self, index: int) -> None:
        self.check_host_memory()
        previous = self._current_index
        if previous is not None:
            self._finish_turn(previous)
        # Whatever only earlier turns hold is not needed again in this call.
        for earlier in range(index):
            if earlier != previous:
                self._after_stage(earlier, failed=False)
        self._current_index = index
        self.tracker.stage_started(self.stages[index].name)
        self._before_stage(index)
        # The turn's activations are measured from here, against the weights resident
        # now: what the step before it released (the last turn's components) is not.
        self.tracker.compute_started()
        self._events_at_compute = len(self.tracker.events)
        if (decoder := self.decoders.get(self.stages[index].name)) is not None:
            decoder.decoded = False

    def _finish_turn(self, index: int) -> None:
        loading = self._loading_bytes()
        record = self.tracker.stage_finished(self.stages[index].name, loading)
        if (decoder := self.decoders.get(self.stages[index].name)) is not None:
            decoder.loaded_beside_bytes = loading + self._loaded_beside(index)
        self._stage_measured(index, record)
        self._after_stage(index, failed=False)

    def _loaded_beside(self, index: int) -> int:
        """Bytes of other turns' components that arrived while turn ``index`` computed
        (the next call's, loaded ahead), those released again before it ended included:
        counted as weights, they may have come after its peak."""
        own = {self.deferred_name(component) for component in self.stages[index].components}
        events = self.tracker.events[self._events_at_compute :]
        return sum(e.nbytes for e in events if e.kind == "load" and e.name not in own)

    def _hold_back(self) -> bool:
        """Passed turns keep their components under ``release`` until the call order is
        learned (the first call): one touched again after its turn is not loaded twice."""
        return self._learned_from is None and self.policy.name == "release"

    def _after_stage(self, index: int, failed: bool) -> None:
        if not failed and self._record is not None and self._hold_back():
            if index not in self._held_back:
                self._held_back.append(index)
            return
        super()._after_stage(index, failed)

    def _release_held_back(self, needed_bytes: int) -> None:
        """Free held-back turns, oldest first, until ``needed_bytes`` fit beside them."""
        while self._held_back and not self._room_for(needed_bytes):
            super()._after_stage(self._held_back.pop(0), failed=False)

    def _room_for(self, nbytes: int) -> bool:
        """Held-back components may stay beside a load of ``nbytes`` while together they
        take no more than the largest component (the peak ``release`` promises) and the
        device has that room."""
        largest = max((size or 0 for size in self.component_bytes().values()), default=0)
        if self.tracker.resident_bytes + nbytes > largest:
            return False
        room = self.activation_room()
        if room is None:
            room = memory.device_facts(self.device).available_bytes
        return nbytes <= room

    def before_load(self, proxy: Any) -> None:
        if self._held_back:
            self._release_held_back(proxy.spec.nbytes or 0)
        super().before_load(proxy)

    def _end_call(self) -> None:
        with self._deciding():
            if self._current_index is not None:
                self._finish_turn(self._current_index)
                self._current_index = None
            # Components touched outside their turns go too, where the policy frees;
            # not those the last turn is loading for the next call.
            self._held_back = []
            ahead = self.executor.loading_ahead
            for index in range(len(self.stages)):
                super()._after_stage(index, failed=False, keep=ahead)
            self._after_run()
        self.tracker.run_finished()
        # A call stopped early (its callback set ``_interrupt``) teaches no turns.
        if getattr(self.pipe, "_interrupt", False) is True:
            return
        if self._record is not None:
            self._turn_ends.learn(self._record, self._signature)
        self._learn(self._record)

    def _abort_call(self) -> None:
        """After a call raised: everything goes, unless the call used no component (its
        arguments were refused): then what is loaded stays, whole (loads under way end)."""
        self._held_back = []
        untouched = self._record is not None and not self._record.first_touch
        with self._deciding():
            if self._current_index is not None:
                self.tracker.stage_finished(self.stages[self._current_index].name)
            try:
                self.executor.cancel_prefetch()
            finally:
                if untouched:
                    self._forget_what_is_not_loaded()
                else:
                    self._release_deferred_quietly()

    def _learn(self, record: CallRecord | None) -> None:
        """Take the turns a complete call showed as the model for the next calls.

        A call that skipped components (prompt embeddings passed in, say) teaches
        nothing: its turns would drop stages the next full call needs.
        """
        if record is None or not record.first_touch:
            return
        touched = set(record.first_touch)
        if self._learned_from is not None and not touched >= self._learned_from:
            return
        turns = with_untouched(record.turns(), self._seeded_order, touched)
        if turns != self._turns:
            seeded, self._turns = self._turns, turns
            self._rebuild_stages()
            if self.plan().overflow() is not None:
                # Held in one turn (an input's VAE in the transformer's) they do not fit
                # where each turn alone did: the next call plans as this one did.
                self._turns = seeded
                self._rebuild_stages()
                return
        self._learned_from = touched
        self.executor.write_turns(turns)  # a later process's first call plans with them

    def _own_call_sizes(self) -> dict[str, int]:
        """The sizes the pipeline's call makes where it is given none (read once)."""
        if self._own_sizes is None:
            self._own_sizes = own_call_sizes(self.pipe)
        return self._own_sizes

    def set_plan_shape(
        self, *, height: int | None = None, width: int | None = None, frames: int | None = None
    ) -> None:
        """The call ``plan()`` plans for before one is made (``ondeck plan``): the
        pipeline's own sizes but those given (frames only for a video pipeline). Its
        activations are the nearest stored call's of this model, scaled to its size."""
        sizes = dict(self._own_call_sizes())
        parameters = inspect.signature(type(self.pipe).__call__).parameters
        given = {"height": height, "width": width}
        if frame_count_argument(parameters):
            given["num_frames"] = frames
        sizes.update({key: value for key, value in given.items() if value})
        self._call_arguments = sizes
        if self.profile_model is not None:
            self._profile_shape = call_profile_shape((), {}, sizes, self.device)

    # -- what the call is about to see --------------------------------------------------

    def place(self, device: Any = None, dtype: torch.dtype | None = None) -> None:
        """Load every deferred component onto ``device`` in ``dtype`` from now on,
        and move those already loaded."""
        for proxy in self.deferred.values():
            proxy.retarget(device, dtype, move=lambda module: module.to(device=device, dtype=dtype))
        if device is not None and resolve_device(device) != self.device:
            self.device = resolve_device(device)
            self.tracker.device = str(self.device)
            self._choose_policy()

    def choose_again(self) -> None:
        """``auto`` without a budget chooses again, against the sizes known now (a LoRA's
        layers given after the pipeline was made); any other policy stays."""
        policy, budget, _ = self._requested_policy
        if policy == "auto" and budget is None:
            self._choose_policy()

    def _choose_policy(self) -> None:
        if getattr(self, "policy", None) is not None:
            self.cancel_prefetch_quietly()
        super()._choose_policy()

    def check_assignment(self, name: str, value: Any) -> None:
        """``OndeckError`` when ``pipe.<name> = value`` cannot be made: a deferred
        component replaced while a call runs, or a component of another ondeck pipeline
        (its runtime plans its loads and releases, and a proxy reports to one runtime)."""
        if name in self.components and self.components[name] is not value:
            if self._running_thread is not None:
                raise OndeckError(f"component '{name}' cannot be replaced while a call runs")
        if (error := owned_elsewhere(name, value, self)) is not None:
            raise error

    def forget_measured(self, name: str) -> None:
        for stage in self.stages_holding(name):
            self._oom_room.pop(stage, None)
        super().forget_measured(name)

    def swap(self, name: str, value: Any) -> None:
        """``pipe.<name> = value`` after loading (checked with ``check_assignment``): the
        old proxy is released and leaves the pipeline (its touches, loads and decodes no
        longer reach this runtime), and the new value takes its turn; a VAE proxy gets
        its own fitting decode, and a module given ready-made is no longer deferred."""
        old = self.components.get(name)
        if old is value:
            return
        self.check_assignment(name, value)
        self.cancel_prefetch_quietly()
        self.profile_model = None  # the peaks stored under its name were the old one's
        self._turn_ends = TurnEnds()  # so were the calls it made
        self.components[name] = value  # releases the old proxy and stops observing it
        self.decoders.pop(name, None)
        if issubclass(type(old), PipelineComponent) and old.ondeck_runtime is self:
            old.belong_to(None)
        if issubclass(type(value), PipelineComponent):
            value.belong_to(self)
            self._add_decoder(name, value)

    # -- transforms ---------------------------------------------------------------------

    def add_transform(self, name: str, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn(module) -> module`` to component ``name`` now and after every load
        (an ``fn`` that returns None changed the module in place).

        A component passed in ready-made is never released, so ``fn`` runs on it once.
        One not loaded yet is given ``fn`` at its next load, and where it raises there
        it is not kept, as it would not be on a loaded one.
        """
        component = getattr(self.pipe, name)
        if is_lazy(component):
            component.add_transform(FirstApplied(fn, component))
            return
        transformed = fn(component)
        if transformed is not None:
            setattr(self.pipe, name, transformed)

    def close(self) -> None:
        """Pipeline.close, and each component's fused-LoRA recipe is dropped: the next
        load replays the LoRA calls in full."""
        super().close()
        for component in self.components.values():
            if issubclass(type(component), PipelineComponent):
                component.forget_fused_lora()

    # -- generating ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        *,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        negative_prompt: str | None = None,
        progress: Any = None,
        **kwargs: Any,
    ) -> Any:
        """One call of the pipeline, seeded on the CPU; returns its frames as numpy.

        Arguments the pipeline does not take (``num_frames`` for an image pipeline)
        are left out. Video pipelines return ``frames`` (B×F×H×W×C); image pipelines
        return their images as one-frame videos (B×1×H×W×C), so callers can treat
        both alike. ``progress`` (a tqdm bar) advances once per denoising step.
        An argument the model cannot take (a side not a multiple of its VAE's scale and
        patch, frames not k·t+1 where the pipeline counts them so, a guidance that is not
        finite) raises ``ValueError`` naming it, the same check as the command line's.
        """
        parameters = inspect.signature(type(self.pipe).__call__).parameters
        frames_argument = frame_count_argument(parameters)  # video_length for Latte
        check_generate_arguments(
            self,
            height=height,
            width=width,
            num_frames=num_frames if frames_argument else None,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            **{key: kwargs[key] for key in CHECKED_KEYWORDS if key in kwargs},
        )
        self.check_requirements()
        warn_if_truncated(self.pipe, prompt, parameters, kwargs)
        arguments = self._generate_arguments(
            prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            negative_prompt=negative_prompt,
        )
        return frames_of(call_with_progress(self.pipe, arguments, parameters, progress, kwargs))

    def check_requirements(self) -> None:
        """``OndeckError`` now for a package every call needs and this host lacks (the
        ftfy a few pipelines clean their prompts with), before a weight loads."""
        check_prompt_cleaning(type(self.pipe))

    def _generate_arguments(self, prompt: str, *, seed: int | None, **given: Any) -> dict:
        """The pipeline's call arguments for ``generate``'s (those it takes, the frame
        count under its own name, a CPU generator for ``seed``, numpy output). An empty
        negative prompt is none: the pipeline's own default (QwenImage's "" would turn
        on its true classifier-free guidance)."""
        parameters = inspect.signature(type(self.pipe).__call__).parameters
        frames_argument = frame_count_argument(parameters)  # video_length for Latte
        given[frames_argument or "num_frames"] = given.pop("num_frames", None)
        given["negative_prompt"] = given.get("negative_prompt") or None
        wanted = {"prompt": prompt, **given}
        arguments = {k: v for k, v in wanted.items() if v is not None and k in parameters}
        if seed is not None:
            arguments["generator"] = torch.Generator("cpu").manual_seed(seed)
        if "output_type" in parameters:
            arguments["output_type"] = "np"
        return arguments

    def plan_call(self, prompt: str, *, seed: int | None = None, **options: Any) -> Any:
        """The plan of ``generate(prompt, **options)`` before it runs (``ondeck generate``
        prints it): at the call's size, with the activations and the turns stored for a
        call like it (an earlier process's call showed them), as its first run plans."""
        options.pop("progress", None)
        known = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")
        named = {key: options.pop(key, None) for key in (*known, "negative_prompt")}
        arguments = {**self._generate_arguments(prompt, seed=seed, **named), **options}
        self._take_call((self.pipe,), arguments)  # the pipeline's call is given it first
        self._adopt_stored_turns()
        return self.plan()

    # -- reporting ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        report = super().report()
        report["pipeline"] = type(self.pipe).__name__
        report["turns"] = {name: list(holding) for name, holding in self._turns}
        report["prompt_cache"] = {
            name: {"hits": answers.hits, "misses": answers.misses, "kept": len(answers)}
            for name, proxy in self.components.items()
            if isinstance(proxy, PipelineComponent) and (answers := proxy.answers) is not None
        }
        return report

    def __repr__(self) -> str:
        return f"<ondeck runtime of {type(self.pipe).__name__}: policy {self.policy.name}>"
