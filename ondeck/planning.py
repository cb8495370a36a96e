"""Predicted residency, from specs alone: which component is where, stage by stage.

Everything here is a pure function of names, bytes and which stage holds what. The
budget policy makes its decisions with the same functions the plan simulates, so the
predicted peak is the peak the run will have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .host_pool import HostPlan
from .memory import format_bytes, parse_bytes
from .stage_steps import StageUse, budget_step, total_bytes
from .streaming.file_reads import (
    DEFAULT_READ_BYTES_PER_SECOND,
    SLOW_FILE_READS,
    FileReads,
    plan_file_reads,
)
from .streaming.layout import (
    StreamingChoice,
    StreamingInputs,
    StreamLayout,
    plan_resident_streaming,
    plan_streaming,
    switch_cost,
)

__all__ = ["HostPlan", "Plan", "StageUse", "release_schedule"]

# Streaming the least-called components to keep every component resident replaces a
# plan that reloads only when it costs at most this share of that plan's per run (the
# copies compute does not hide where calls are timed, else the bytes moved): a clear
# gain, so that two plans close in cost do not alternate from run to run.
RESIDENT_STREAMING_GAIN = 0.8


def release_schedule(uses: Sequence[StageUse]) -> dict[str, list[str]]:
    """``{stage: [components whose last holder it is]}``, in stage order."""
    last_holder: dict[str, int] = {}
    for index, use in enumerate(uses):
        for component in use.components:
            last_holder[component] = index
    schedule: dict[str, list[str]] = {use.name: [] for use in uses}
    for component, index in last_holder.items():
        schedule[uses[index].name].append(component)
    return schedule


def release_residency(uses: Sequence[StageUse]) -> list[frozenset[str]]:
    """Resident set per stage when each component loads at first use, frees after last."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, use in enumerate(uses):
        for component in use.components:
            first.setdefault(component, index)
            last[component] = index
    return [
        frozenset(c for c in first if first[c] <= index <= last[c]) for index in range(len(uses))
    ]


def _known(values: Mapping[str, int | None]) -> dict[str, int]:
    return {key: value for key, value in values.items() if value is not None}


def planning_budget(activation: Mapping[str, int | None], *, estimated: int, measured: int) -> int:
    """The budget a run plans against: ``measured`` once every stage's activations are
    measured (``activation`` holds none unknown), else ``estimated``.

    ``estimated`` keeps a reserve for activations a plan can only guess; a measured peak
    needs a margin only for the allocator, so the larger ``measured`` budget applies.
    All stages or none: a stage's components may be held through the others (prefetched,
    or kept across runs), so one unmeasured stage keeps the whole plan's reserve, and the
    first run of a shape plans as it always did.
    """
    if activation and all(value is not None for value in activation.values()):
        return max(estimated, measured)
    return estimated


@dataclass(frozen=True)
class PlannedStage:
    run: int
    name: str
    resident: tuple[str, ...]
    resident_bytes: int
    activation_bytes: int | None


def simulate(
    uses: Sequence[StageUse],
    nbytes: Mapping[str, int],
    *,
    policy: str,
    budget: int | None = None,
    activation: Mapping[str, int | None] | None = None,
    prefetch: bool = True,
    runs: int = 2,
    start: Iterable[str] = (),
) -> list[PlannedStage]:
    """Resident components during each stage over ``runs`` consecutive runs, ``start``
    resident as the first begins (what an earlier job left; the budget policy keeps it
    where it fits)."""
    activation = activation or {}
    planned: list[PlannedStage] = []
    everything = {c for use in uses for c in use.components}
    if policy == "eager":
        sets = [frozenset(everything)] * len(uses)
        per_run = [sets] * runs
    elif policy == "release":
        per_run = [release_residency(uses)] * runs
    elif policy == "budget":
        if budget is None:
            raise ValueError("the budget policy needs a budget")
        per_run = []
        resident: set[str] = set(start) & everything
        for _ in range(runs):
            sets = []
            for index in range(len(uses)):
                step = budget_step(
                    resident,
                    index,
                    uses=uses,
                    nbytes=nbytes,
                    budget=budget,
                    activation=activation,
                    prefetch=prefetch,
                )
                resident = (resident - set(step.evict)) | set(step.load)
                resident = (resident - set(step.prefetch_evict)) | set(step.prefetch)
                sets.append(frozenset(resident))
            per_run.append(sets)
    else:
        raise ValueError(f"unknown policy {policy!r}")
    for run, sets in enumerate(per_run, start=1):
        for use, resident_set in zip(uses, sets, strict=True):
            planned.append(
                PlannedStage(
                    run=run,
                    name=use.name,
                    resident=tuple(sorted(resident_set)),
                    resident_bytes=total_bytes(resident_set, nbytes),
                    activation_bytes=activation.get(use.name),
                )
            )
    return planned


@dataclass
class Plan:
    """The predicted residency of a pipeline, before a byte is loaded."""

    policy: str
    budget: int | None
    component_bytes: dict[str, int]
    stages: list[tuple[str, list[str], int]]
    peak_bytes: int
    activation_bytes: dict[str, int | None]
    uses: list[StageUse] = field(default_factory=list)
    activation_note: str = ""
    runs: list[PlannedStage] = field(default_factory=list)
    # Components whose blocks stream because their stage cannot hold them whole.
    streamed: dict[str, StreamLayout] = field(default_factory=dict)
    streaming_notes: list[str] = field(default_factory=list)
    # Stages that do not fit even streaming every block, and the bytes they lack then.
    streaming_short: dict[str, int] = field(default_factory=dict)
    # Activations kept free for stages that stream before their activations are measured.
    reserved_activation_bytes: dict[str, int] = field(default_factory=dict)
    transfer_bytes_per_second: float | None = None
    transfer_source: str = ""
    # True when stored activation peaks were set aside because they alone overflowed.
    profile_set_aside: bool = False
    # True when the reserves for the allocator (stages whose allocator retried, upcast
    # copies of stored layers) were left out because they alone overflowed.
    retry_reserve_dropped: bool = False
    # True when the reserve kept for stages that reached the device's limit
    # (``Snapshot.limit_stages``) was left out because it overflowed; the others are
    # dropped only where the plan overflows without it too.
    limit_reserve_dropped: bool = False
    # Seconds a run that a plan keeping every component resident would save, where it
    # waits until the runs on this plan have lost its one-time cost (``_waits``).
    resident_gain: float | None = None
    keeps_resident: bool = False  # the plan streams so that every component stays
    # Per streamed component, its forward passes per call so far (steps, ×2 with guidance).
    passes_per_call: dict[str, float] = field(default_factory=dict)
    # The host pool beside the device's (None where the plan was made without it).
    host: HostPlan | None = None
    # Per streamed component whose pinned host copies do not all fit the host budget:
    # the blocks read from the files each pass, and the rate those reads are taken at
    # (bytes per second, where the figure comes from).
    file_reads: dict[str, FileReads] = field(default_factory=dict)
    read_rates: dict[str, tuple[float, str]] = field(default_factory=dict)
    # False when even reading every streamed block from the files, the rings do not fit.
    file_reads_fit: bool = True

    @property
    def pinned_host_bytes(self) -> int:
        """The pinned host copies of streamed blocks the plan keeps."""
        return sum(
            layout.bytes_per_pass
            - (self.file_reads[name].file_bytes_per_pass if name in self.file_reads else 0)
            for name, layout in self.streamed.items()
        )

    @property
    def ring_bytes(self) -> int:
        """The rings that blocks read from the files each pass go through."""
        return sum(reads.ring_bytes for reads in self.file_reads.values())

    def file_read_notes(self) -> list[str]:
        """What would do better where blocks are read from the files: where the rings do
        not fit at all, or where reading makes a pass much slower than pinned copies."""
        if not self.file_reads:
            return []
        if not self.file_reads_fit:
            return [
                f"host: even reading every streamed block from the files, their rings "
                f"({format_bytes(self.ring_bytes)}) do not fit the host budget beside the "
                "process and the host cache. What would fit: fp8 storage (--weights fp8) "
                "halves the blocks and their rings, a lower resolution keeps more blocks on "
                "the device, a larger host budget (--host-memory) or a smaller --host-cache"
            ]
        notes = []
        copy_rate = self.transfer_bytes_per_second or 0
        for name, reads in self.file_reads.items():
            slowdown = reads.slowdown(self.streamed[name], copy_rate, self.read_rates[name][0])
            if slowdown > SLOW_FILE_READS:
                notes.append(
                    f"{name}: reading blocks from the files makes a pass {slowdown:.1f}x as "
                    "slow as pinned copies would. What would be faster: fp8 storage "
                    "(--weights fp8) halves the bytes read, a lower resolution keeps more "
                    "blocks on the device, a larger host budget (--host-memory) or a smaller "
                    "--host-cache keeps more pinned copies"
                )
        return notes

    def call_transfer_seconds(self, name: str) -> float | None:
        """The transfer floor of the blocks ``name`` streams in one call: its bytes a
        pass times its passes a call, at the plan's copy rate; None before a call."""
        layout, passes = self.streamed.get(name), self.passes_per_call.get(name)
        if layout is None or not passes:
            return None
        rate = self.transfer_bytes_per_second or 0
        return layout.bytes_per_pass * passes / rate if rate > 0 else float("inf")

    def _per_call(self, name: str, layout: StreamLayout, rate: float) -> str:
        """The bytes ``name`` streams per call and their transfer floor at ``rate``."""
        passes = self.passes_per_call.get(name)
        floor = self.call_transfer_seconds(name)
        if not passes or floor is None:
            return (
                "    per call: the per-pass figures times its forward passes (known after a call)"
            )
        nbytes = layout.bytes_per_pass * passes
        return (
            f"    per call: {format_bytes(int(nbytes))} in {passes:g} passes, a transfer floor "
            f"of {floor:.2f} s at {rate / 1e9:.1f} GB/s"
        )

    @property
    def device_bytes(self) -> dict[str, int]:
        """Bytes each component takes on the device; for a streamed one, its non-block
        parts, resident blocks and slots."""
        sizes = dict(self.component_bytes)
        for name, layout in self.streamed.items():
            sizes[name] = layout.device_bytes
        return sizes

    @property
    def headroom_bytes(self) -> dict[str, int | None]:
        """Activation bytes each stage keeps free: measured, or reserved while streaming."""
        return {**self.reserved_activation_bytes, **_known(self.activation_bytes)}

    def stage_requirements(self) -> list[tuple[str, int]]:
        """Bytes each stage needs by itself: its own components plus activations."""
        sizes, headroom = self.device_bytes, self.headroom_bytes
        return [
            (use.name, total_bytes(use.components, sizes) + (headroom.get(use.name) or 0))
            for use in self.uses
        ]

    def overflow(self, budget: int | str | None = None) -> tuple[str, int] | None:
        """The stage that overflows ``budget`` the most, and by how many bytes."""
        budget = parse_bytes(budget) if budget is not None else self.budget
        if budget is None:
            return None
        worst = max(self.stage_requirements(), key=lambda item: item[1], default=None)
        if worst is None or worst[1] <= budget:
            return None
        return worst[0], worst[1] - budget

    def fits(self, budget: int | str | None = None) -> bool:
        """Whether every stage's own components and known activations fit ``budget``."""
        budget = parse_bytes(budget) if budget is not None else self.budget
        if budget is None:
            return True
        return self.overflow(budget) is None

    def fit_summary(self) -> str:
        """One line: whether the plan fits its budget, and what streams to make it fit."""
        overflow = self.overflow()
        if overflow is not None:
            return f"does not fit: stage '{overflow[0]}' overflows by {format_bytes(overflow[1])}"
        if self.streamed:
            return "; ".join(
                f"streams {len(layout.streamed)} of {layout.block_count} {name} blocks"
                + (
                    f", {len(self.file_reads[name].from_files)} read from the files each pass"
                    if name in self.file_reads
                    else ""
                )
                for name, layout in self.streamed.items()
            )
        largest = max(self.component_bytes, key=self.component_bytes.get, default=None)
        whole = f"keeps the {largest} whole" if largest else "fits"
        return f"{whole}, nothing streamed (peak {format_bytes(self.peak_bytes)})"

    @property
    def sum_bytes(self) -> int:
        return sum(self.component_bytes.values())

    def __str__(self) -> str:
        lines = [
            f"policy: {self.policy}"
            + (f", budget {format_bytes(self.budget)}" if self.budget is not None else ""),
            "components:",
        ]
        for name, nbytes in self.component_bytes.items():
            lines.append(f"  {name:<24} {format_bytes(nbytes):>12}")
        lines.append(f"  {'sum':<24} {format_bytes(self.sum_bytes):>12}")
        lines.append("stages:")
        lines.append(f"  {'stage':<24} {'resident':>12} {'activations':>12}  components")
        for name, resident, nbytes in self.stages:
            activation = self.activation_bytes.get(name)
            shown = format_bytes(activation) if activation is not None else "unknown"
            if activation is None and name in self.reserved_activation_bytes:
                shown = f"~{format_bytes(self.reserved_activation_bytes[name])}"
            lines.append(
                f"  {name:<24} {format_bytes(nbytes):>12} {shown:>12}  {', '.join(resident)}"
            )
        lines.append(f"predicted component peak: {format_bytes(self.peak_bytes)}")
        if self.activation_note:
            lines.append(self.activation_note)
        if self.streamed:
            lines.append(
                "streaming (blocks that do not fit come from pinned host memory"
                + (
                    ", or from the files where their pinned copies do not fit the host budget"
                    if self.file_reads
                    else ""
                )
                + "):"
            )
            rate = self.transfer_bytes_per_second or 0
            for name, layout in self.streamed.items():
                reads = self.file_reads.get(name)
                pinned = layout.bytes_per_pass - (reads.file_bytes_per_pass if reads else 0)
                lines.extend(layout.describe(name, rate, self.transfer_source, pinned))
                if reads is not None:
                    lines.extend(reads.describe(layout, rate, *self.read_rates[name]))
                lines.append(self._per_call(name, layout, rate))
        lines.extend(self.streaming_notes)
        if self.host is not None:
            lines.extend(self.host.describe())
        if self.budget is not None:
            overflow = self.overflow()
            if overflow is None:
                lines.append(f"fits {format_bytes(self.budget)}")
            else:
                lines.append(
                    f"does not fit {format_bytes(self.budget)}: stage '{overflow[0]}' "
                    f"overflows by {format_bytes(overflow[1])}"
                )
        return "\n".join(lines)


def build_plan(
    uses: Sequence[StageUse],
    component_bytes: Mapping[str, int],
    *,
    policy: str,
    budget: int | None = None,
    activation: Mapping[str, int | None] | None = None,
    activation_note: str = "",
    prefetch: bool = True,
    streaming: StreamingInputs | None = None,
) -> Plan:
    """The plan; under a budget, with ``streaming``, a stage too large for it streams the
    repeated blocks of its largest component (``Plan.streamed``)."""
    activation = dict(activation or {use.name: None for use in uses})
    component_bytes = dict(component_bytes)
    choice = StreamingChoice()
    kept: StreamingChoice | None = None
    if policy == "budget" and budget is not None and streaming is not None:
        for name, blocks in streaming.candidates.items():
            if name in component_bytes:  # the whole component, even while loaded streamed
                component_bytes[name] = blocks.total_bytes
        choice = plan_streaming(
            uses, component_bytes, budget=budget, activation=activation, inputs=streaming
        )
        if streaming.calls:
            kept = plan_resident_streaming(
                uses, component_bytes, budget=budget, activation=activation, inputs=streaming
            )

    def planned_with(streamed: StreamingChoice) -> Plan:
        return _planned(
            uses,
            component_bytes,
            streamed,
            streaming,
            policy,
            budget,
            activation,
            activation_note,
            prefetch,
        )

    planned = planned_with(choice)
    if kept is None:
        return planned
    resident = planned_with(kept)
    if resident.overflow() is not None:
        return planned
    rate = resident.transfer_bytes_per_second or streaming.bytes_per_second
    times = [exposed_per_run(plan, streaming, rate) for plan in (planned, resident)]
    if None not in times:
        reloading, staying = times
        note = (
            f"{staying:.2f} s a run of copies that compute does not hide, against "
            f"{reloading:.2f} s reloading (calls timed, copies at {rate / 1e9:.1f} GB/s)"
        )
    else:
        reloading, staying = (moved_per_run(plan, streaming.calls) for plan in (planned, resident))
        note = (
            f"{format_bytes(staying)} cross per run, against {format_bytes(reloading)} "
            "reloading and streaming would move"
        )
    if staying >= RESIDENT_STREAMING_GAIN * reloading:
        return planned
    if None not in times and _waits(planned, resident, streaming, reloading - staying):
        return planned
    names = ", ".join(
        f"{name} (called {streaming.calls[name]} times a run)" for name in resident.streamed
    )
    resident.streaming_notes.append(
        f"streaming {names} keeps every component on the device from stage to stage: {note}"
    )
    resident.keeps_resident = True
    return resident


def _waits(planned: Plan, resident: Plan, streaming: StreamingInputs, gain: float) -> bool:
    """Whether ``planned`` stays while ``resident`` saves ``gain`` s a run: until the runs
    on it lose the switch's one-time cost (``Switch.waits``); never once they stay resident."""
    declined = math.inf if streaming.staying else streaming.declined_seconds
    reloaded = loaded_per_run(planned)
    once = {  # kept loaded from run to run now, loaded again at the switch to stream
        name: layout.device_bytes
        for name, layout in resident.streamed.items()
        if name not in reloaded and planned.streamed.get(name) != layout
    }
    switch = switch_cost(resident, planned, streaming, once, DEFAULT_READ_BYTES_PER_SECOND)
    if planned.overflow() is not None or not switch.waits(gain, declined):
        return False
    planned.resident_gain = gain
    planned.streaming_notes.append(switch.note(resident.streamed, gain, declined))
    return True


def exposed_per_run(plan: Plan, streaming: StreamingInputs, rate: float) -> float | None:
    """Seconds of copies compute does not hide in a run of ``plan`` from run 2 on: each
    load at the rate it last reached, less one call (compute starts while it arrives),
    and each streamed call beyond its quickest timed call. None where a call is untimed."""
    timed = streaming.seconds_per_call
    if not rate or any(name not in timed for name in plan.streamed):
        return None
    seconds = 0.0
    for name, nbytes in loaded_per_run(plan).items():  # untimed (a VAE's decode): no call
        load_rate = streaming.load_bytes_per_second.get(name, rate)
        seconds += max(0.0, nbytes / load_rate - timed.get(name, 0.0))
    for name, layout in plan.streamed.items():
        beyond = layout.bytes_per_pass / rate - timed[name]
        seconds += streaming.calls.get(name, 1) * max(0.0, beyond)
    return seconds


def moved_per_run(plan: Plan, calls: Mapping[str, int]) -> int:
    """Bytes a plan moves to the device in a run, from run 2 on: what it loads, and what
    its streamed components copy in each of their calls."""
    streamed = sum(
        layout.bytes_per_pass * calls.get(name, 1) for name, layout in plan.streamed.items()
    )
    return bytes_loaded_per_run(plan) + streamed


def loads_from(plan: Plan, start: Iterable[str]) -> tuple[int, frozenset[str]]:
    """Bytes one run of ``plan`` loads when ``start`` is resident as it begins, and what
    stays resident after it (what a served model's job loads after a switch)."""
    policy = plan.policy
    if policy == "budget" and not plan.fits(plan.budget):
        policy = "release"
    sizes = plan.device_bytes
    stages = simulate(
        plan.uses,
        sizes,
        policy=policy,
        budget=plan.budget,
        activation=plan.headroom_bytes,
        runs=1,
        start=start,
    )
    resident, loaded = set(start), 0
    for stage in stages:
        loaded += sum(sizes.get(name, 0) for name in set(stage.resident) - resident)
        resident = set(stage.resident)
    return loaded, frozenset(resident)


def bytes_loaded_per_run(plan: Plan) -> int:
    """Bytes a plan loads in its last simulated run (the steady state: run 2 onwards)."""
    return sum(loaded_per_run(plan).values())


def loaded_per_run(plan: Plan) -> dict[str, int]:
    """Per component, the bytes a plan loads in its last simulated run."""
    runs = plan.runs
    if not runs:
        return {}
    last = runs[-1].run
    sizes = plan.device_bytes
    previous = [stage for stage in runs if stage.run == last - 1]
    resident = set(previous[-1].resident) if previous else set()
    loaded: dict[str, int] = {}
    for stage in (stage for stage in runs if stage.run == last):
        for name in set(stage.resident) - resident:
            loaded[name] = loaded.get(name, 0) + sizes.get(name, 0)
        resident = set(stage.resident)
    return loaded


def _planned(
    uses: Sequence[StageUse],
    component_bytes: dict[str, int],
    choice: StreamingChoice,
    streaming: StreamingInputs | None,
    policy: str,
    budget: int | None,
    activation: dict[str, int | None],
    activation_note: str,
    prefetch: bool,
) -> Plan:
    """The plan with ``choice``'s streaming, its runs simulated."""
    plan_ = Plan(
        policy=policy,
        budget=budget,
        component_bytes=component_bytes,
        stages=[],
        peak_bytes=0,
        activation_bytes=activation,
        uses=list(uses),
        activation_note=activation_note,
        streamed=choice.layouts,
        streaming_notes=list(choice.notes),
        streaming_short=dict(choice.short),
        reserved_activation_bytes=choice.reserved,
    )
    if choice.layouts and streaming is not None:
        plan_.transfer_bytes_per_second, plan_.transfer_source = streaming.bandwidth()
        host = streaming.host
        if host is not None:
            plan_.file_reads, plan_.file_reads_fit = plan_file_reads(
                choice.layouts,
                streaming.candidates,
                host.room_bytes,
                ring_count=host.ring_buffers,
                held=host.held,
            )
            plan_.read_rates = {name: host.read_rate(name) for name in plan_.file_reads}
            plan_.streaming_notes.extend(plan_.file_read_notes())
    if policy == "budget" and not plan_.fits(budget):
        policy = "release"  # what would run if the budget allowed; the overflow is reported
    runs = simulate(
        uses,
        plan_.device_bytes,
        policy=policy,
        budget=budget,
        activation=plan_.headroom_bytes,
        prefetch=prefetch,
    )
    last_run = [stage for stage in runs if stage.run == runs[-1].run]
    plan_.stages = [(s.name, list(s.resident), s.resident_bytes) for s in last_run]
    plan_.peak_bytes = max((s.resident_bytes for s in runs), default=0)
    plan_.runs = runs
    return plan_
