"""The arithmetic of block streaming, from sizes alone: which blocks stay resident,
what a component then takes on the device, and how many bytes cross per forward pass.

Pure functions of bytes and stage uses (no torch): the plan and the budget policy
decide with them, so the plan predicts exactly what the run will hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..memory import format_bytes, packed_offsets

__all__ = [
    "BlockSizes",
    "StreamLayout",
    "StreamingChoice",
    "StreamingInputs",
    "Switch",
    "evenly_spaced",
    "packed_offsets",
    "plan_resident_streaming",
    "plan_streaming",
    "stream_layout",
    "streamed_blocks",
    "switch_cost",
]

DEFAULT_SLOTS = 2
# Pinned host-to-device copy bandwidth on an H200 (PCIe Gen5 x16), measured with
# benchmarks/load_throughput.py. Used where nothing better is known (no CUDA device).
DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND = 55e9
DEFAULT_BANDWIDTH_SOURCE = "default: pinned host to H200"
# Activations of a stage that has not run yet are unknown; a streamed component would
# otherwise take every byte of the budget. This share of the budget stays free for them.
UNMEASURED_ACTIVATION_FRACTION = 0.10
# How fast fresh host memory becomes a streamed block's pinned copy: its pages touched on
# eight threads, then registered (about 15 GB/s on an H200 host, measured with
# benchmarks/experiments/pinning.py), before the block is read into it.
PAGE_LOCK_BYTES_PER_SECOND = 15e9


@dataclass(frozen=True)
class BlockSizes:
    """A component's repeated blocks, known from its meta skeleton: what streaming needs."""

    path: str  # the ModuleList, e.g. "blocks"; several joined by "+"
    block_bytes: tuple[int, ...]  # each block's tensors, exactly
    packed_bytes: tuple[int, ...]  # each block packed in one buffer (a slot, a host copy)
    other_bytes: int  # everything outside the blocks: always resident
    # Blocks per list where a component has several (double- then single-stream), in
    # the joint numbering; empty for one list.
    list_counts: tuple[int, ...] = ()

    @property
    def block_count(self) -> int:
        return len(self.block_bytes)

    def groups(self) -> list[range]:
        """Each list's blocks in the joint numbering."""
        counts = self.list_counts or (self.block_count,)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + sum(self.block_bytes)

    def usable_slots(self, slots: int) -> int:
        """The slots of a ring of ``slots`` these blocks can fill: no more than there are."""
        return max(1, min(slots, self.block_count))

    def least_device_bytes(self, slots: int) -> int:
        """Device bytes with every block streamed: the non-block parts and a full ring."""
        return self.other_bytes + self.usable_slots(slots) * max(self.packed_bytes)


@dataclass(frozen=True)
class StreamLayout:
    """Which blocks of a component stay on the device and which are streamed each pass."""

    path: str
    block_count: int
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    slot_count: int
    slot_bytes: int
    device_bytes: int  # non-block parts + resident blocks + slots
    bytes_per_pass: int  # copied host to device per forward pass (= host copy bytes)

    def transfer_seconds(self, bytes_per_second: float) -> float:
        return self.bytes_per_pass / bytes_per_second if bytes_per_second > 0 else float("inf")

    def describe(
        self, component: str, bytes_per_second: float, source: str, pinned_bytes: int | None = None
    ) -> list[str]:
        return [
            f"  {component}.{self.path}: {len(self.resident)} of {self.block_count} blocks "
            f"resident (evenly spaced), {len(self.streamed)} streamed through "
            f"{self.slot_count} slots of {format_bytes(self.slot_bytes)}",
            f"    {format_bytes(self.bytes_per_pass)} host to device per forward pass, "
            f"{_seconds(self.transfer_seconds(bytes_per_second))} per pass at "
            f"{bytes_per_second / 1e9:.1f} GB/s ({source})",
            f"    on the device {format_bytes(self.device_bytes)}; pinned host copies "
            f"{format_bytes(self.bytes_per_pass if pinned_bytes is None else pinned_bytes)}; "
            f"streamed blocks {list(self.streamed)}",
        ]


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def evenly_spaced(count: int, chosen: int) -> tuple[int, ...]:
    """``chosen`` indices of ``range(count)`` spread evenly (28 of 40 leave gaps of 1 or 2)."""
    if chosen <= 0:
        return ()
    chosen = min(chosen, count)
    return tuple((2 * i + 1) * count // (2 * chosen) for i in range(chosen))


def streamed_blocks(count: int, streamed: int, previous: Sequence[int] = ()) -> tuple[int, ...]:
    """Which ``streamed`` of ``count`` blocks to stream: spread evenly between resident
    ones; with ``previous`` (the blocks streamed now, whose host copies are held), a subset
    of them when streaming fewer and a superset when streaming more, so a new layout reads
    no host copy it already has."""
    held = sorted({block for block in previous if 0 <= block < count})
    if not held:
        keep = set(evenly_spaced(count, count - streamed))
        return tuple(i for i in range(count) if i not in keep)
    if streamed <= len(held):
        return tuple(held[j] for j in evenly_spaced(len(held), streamed))
    rest = [i for i in range(count) if i not in set(held)]
    extra = [rest[j] for j in evenly_spaced(len(rest), streamed - len(held))]
    return tuple(sorted({*held, *extra}))


def stream_layout(
    sizes: BlockSizes,
    available_bytes: int,
    *,
    slots: int = DEFAULT_SLOTS,
    previous: Sequence[int] = (),
) -> StreamLayout | None:
    """The most resident blocks that fit ``available_bytes`` with the slots streaming needs.

    Everything resident when the whole component fits. None when even streaming every
    block does not fit (the non-block parts and the slots alone are too large).
    ``previous``: the blocks streamed now (``streamed_blocks``). With several lists of
    blocks of different sizes, the layout that copies the fewest bytes per pass wins:
    streaming only the smaller blocks keeps the slots small (see ``_choices``).
    """
    count = sizes.block_count
    if sizes.total_bytes <= available_bytes:
        return StreamLayout(sizes.path, count, tuple(range(count)), (), 0, 0, sizes.total_bytes, 0)
    best: StreamLayout | None = None
    for streamed in _choices(sizes, previous):
        layout = _layout_of(sizes, streamed, slots)
        if layout.device_bytes > available_bytes:
            continue
        if best is None or (layout.bytes_per_pass, len(layout.streamed)) < (
            best.bytes_per_pass,
            len(best.streamed),
        ):
            best = layout
        if len(sizes.groups()) == 1:
            break  # one list: the first that fits streams the fewest blocks
    return best


def _layout_of(sizes: BlockSizes, streamed: tuple[int, ...], slots: int) -> StreamLayout:
    count = sizes.block_count
    resident = tuple(i for i in range(count) if i not in set(streamed))
    slot_count = max(1, min(slots, len(streamed)))
    slot_bytes = max(sizes.packed_bytes[i] for i in streamed)
    device = sizes.other_bytes + sum(sizes.block_bytes[i] for i in resident)
    return StreamLayout(
        sizes.path,
        count,
        resident,
        streamed,
        slot_count,
        slot_bytes,
        device + slot_count * slot_bytes,
        sum(sizes.packed_bytes[i] for i in streamed),
    )


def _choices(sizes: BlockSizes, previous: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Candidate sets of streamed blocks, each list's share spread evenly within it.

    One list: one block more each time. Several: for each slot size a list's blocks need,
    the lists whose blocks fit that slot stream, those with the largest blocks first
    (fewest copies for the bytes), so the caller can pick the fewest bytes per pass.
    """
    groups = sizes.groups()
    held = set(previous)
    if len(groups) == 1:
        for streamed in range(1, sizes.block_count + 1):
            yield streamed_blocks(sizes.block_count, streamed, previous)
        return
    largest = [max(sizes.packed_bytes[i] for i in group) for group in groups]
    for slot_bytes in sorted(set(largest)):
        eligible = sorted(
            (g for g in range(len(groups)) if largest[g] <= slot_bytes),
            key=lambda g: -largest[g],
        )
        counts = [0] * len(groups)
        for g in eligible:
            group = groups[g]
            earlier = [i - group.start for i in group if i in held]
            for streamed in range(1, len(group) + 1):
                counts[g] = streamed
                chosen = []
                for other, group_other in enumerate(groups):
                    if not counts[other]:
                        continue
                    local_held = [i - group_other.start for i in group_other if i in held]
                    chosen.extend(
                        group_other.start + i
                        for i in streamed_blocks(
                            len(group_other),
                            counts[other],
                            local_held if other != g else earlier,
                        )
                    )
                yield tuple(sorted(chosen))


@dataclass(frozen=True)
class StreamingInputs:
    """What the planner may stream: per component, its blocks; and how fast copies go."""

    candidates: Mapping[str, BlockSizes] = field(default_factory=dict)
    slots: int = DEFAULT_SLOTS
    bytes_per_second: float = DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND
    bandwidth_source: str = DEFAULT_BANDWIDTH_SOURCE
    unmeasured_activation_fraction: float = UNMEASURED_ACTIVATION_FRACTION
    unavailable: str | None = None  # why nothing can stream here (unified memory)
    # Per component, the blocks streamed now whose host copies are held: a new layout
    # keeps to them where it can.
    previous: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Measures the copy bandwidth; called only when something streams.
    measure: Callable[[], tuple[float, str]] | None = None
    # Per component, its calls (forward passes) in the last run; empty before a run.
    calls: Mapping[str, int] = field(default_factory=dict)
    # Per component, its quickest call's device seconds in that run; empty where untimed.
    seconds_per_call: Mapping[str, float] = field(default_factory=dict)
    # Per component loaded in that run, the rate its load reached.
    load_bytes_per_second: Mapping[str, float] = field(default_factory=dict)
    # The host memory streamed blocks may take (``file_reads.HostRoom``); None: unknown,
    # every streamed block keeps a pinned host copy.
    host: Any = None
    # Seconds the runs so far lost by not switching to a plan that keeps every
    # component resident, while it waits to repay its one-time cost.
    declined_seconds: float = 0.0
    # The last run was on such a plan: a new layout of it pays its new copies at once,
    # where going back to reloading would pay the reloads every run.
    staying: bool = False

    def bandwidth(self) -> tuple[float, str]:
        if self.measure is not None:
            return self.measure()
        return self.bytes_per_second, self.bandwidth_source


@dataclass(frozen=True)
class StreamingChoice:
    """What the planner decided: layouts, activation bytes kept free, notes for people."""

    layouts: dict[str, StreamLayout] = field(default_factory=dict)
    # Stages holding a streamed component whose activations are not measured yet: the
    # bytes kept free for them, in the layout and in every residency decision.
    reserved: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Stages that do not fit even streaming every block: the bytes they lack then.
    short: dict[str, int] = field(default_factory=dict)


def plan_streaming(
    uses: Sequence[Any],
    nbytes: Mapping[str, int],
    *,
    budget: int,
    activation: Mapping[str, int | None],
    inputs: StreamingInputs,
) -> StreamingChoice:
    """Which components to stream, and how, so that every stage fits ``budget``.

    ``uses`` are the stages (``name``, ``components``) in order. A stage whose components
    and activations overflow streams its largest component with repeated blocks, and the
    next largest too while streaming every block of those chosen would not be enough
    (two transformers in one stage, a text encoder beside one). Each chosen component
    gets, in the tightest stage holding it, its share by size of what the components not
    streamed there leave free.
    """
    choice = StreamingChoice()
    notes = choice.notes
    chosen: list[str] = []
    for use in uses:
        held = set(use.components)
        required = sum(nbytes[c] for c in held) + (activation.get(use.name) or 0)
        if required <= budget:
            continue
        if inputs.unavailable:
            note = f"streaming blocks cannot help: {inputs.unavailable}"
            if note not in notes:
                notes.append(note)
            continue
        streamable = [c for c in use.components if c in inputs.candidates]
        if not streamable:
            notes.append(
                f"stage '{use.name}': none of its components "
                f"({', '.join(use.components) or 'none'}) has repeated blocks to stream"
            )
            continue
        for pick in _streamed_in_stage(use, streamable, nbytes, budget, activation, inputs):
            if pick not in chosen:
                chosen.append(pick)

    guess = int(budget * inputs.unmeasured_activation_fraction)
    for component in chosen:
        sizes = inputs.candidates[component]
        available, tightest, guessed = _room_for(
            component, chosen, uses, nbytes, budget, activation, guess
        )
        layout = stream_layout(
            sizes, available, slots=inputs.slots, previous=inputs.previous.get(component, ())
        )
        if layout is None:
            stage, others, headroom = tightest
            slots = sizes.usable_slots(inputs.slots)
            smallest = sizes.least_device_bytes(inputs.slots)
            lack = smallest - max(0, available)
            choice.short[stage] = max(choice.short.get(stage, 0), lack)
            notes.append(
                f"stage '{stage}': even streaming every block, '{component}' needs "
                f"{format_bytes(smallest)} on the device (its non-block parts and "
                f"{slots} slot{'s' if slots > 1 else ''}), and only "
                f"{format_bytes(max(0, available))} is left "
                f"beside {format_bytes(others)} of other components and "
                f"{format_bytes(headroom)} of activations"
            )
            continue
        if not layout.streamed:
            continue
        choice.layouts[component] = layout
        for stage in guessed:
            if guess and stage not in choice.reserved:
                choice.reserved[stage] = guess
                notes.append(
                    f"activations of '{stage}' not measured yet: {format_bytes(guess)} "
                    f"({inputs.unmeasured_activation_fraction:.0%} of the budget) kept free "
                    "for them while its component streams"
                )
    return choice


def _room_for(
    component: str,
    chosen: list[str],
    uses: Sequence[Any],
    nbytes: Mapping[str, int],
    budget: int,
    activation: Mapping[str, int | None],
    guess: int,
) -> tuple[int, tuple[str, int, int], list[str]]:
    """What the tightest stage holding ``component`` leaves it: its share by size of
    the room beside the components not streamed there and the activations; that stage
    (name, the other components' bytes, the activations); and the stages whose
    activations are ``guess``ed."""
    available, tightest, guessed = None, None, []
    for use in uses:
        if component not in use.components:
            continue
        headroom = activation.get(use.name)
        if headroom is None:
            headroom = guess
            guessed.append(use.name)
        streamed_here = [c for c in set(use.components) if c in chosen]
        others = sum(nbytes[c] for c in set(use.components) if c not in streamed_here)
        share = nbytes[component] / max(1, sum(nbytes[c] for c in streamed_here))
        room = int((budget - headroom - others) * share)
        others += sum(nbytes[c] for c in streamed_here if c != component)
        if available is None or room < available:
            available, tightest = room, (use.name, others, headroom)
    return available, tightest, guessed


def _streamed_in_stage(
    use: Any,
    streamable: list[str],
    nbytes: Mapping[str, int],
    budget: int,
    activation: Mapping[str, int | None],
    inputs: StreamingInputs,
) -> list[str]:
    """The components ``use`` streams: the largest first, then the next while what
    the chosen ones need at least (non-block parts and slots) still leaves too little."""
    held = set(use.components)
    headroom = activation.get(use.name)
    if headroom is None:
        headroom = int(budget * inputs.unmeasured_activation_fraction)
    picked: list[str] = []
    for pick in sorted(streamable, key=lambda c: (-nbytes[c], c)):
        picked.append(pick)
        least = sum(inputs.candidates[c].least_device_bytes(inputs.slots) for c in picked)
        rest = sum(nbytes[c] for c in held if c not in picked)
        if rest + least + headroom <= budget:
            return picked
    return picked


def plan_resident_streaming(
    uses: Sequence[Any],
    nbytes: Mapping[str, int],
    *,
    budget: int,
    activation: Mapping[str, int | None],
    inputs: StreamingInputs,
) -> StreamingChoice | None:
    """Streaming that keeps every component on the device from stage to stage, so that
    no stage reloads one: the components called least often in a run stream (a text
    encoder called twice, beside a transformer called every step), the most called keep
    the most blocks; a stage's activations not measured yet get the same share of the
    budget as in :func:`plan_streaming`. None while the components' calls are not known
    (before a run completes), when everything fits whole, or when no such layout fits
    ``budget``; the plan compares what it moves with what reloading moves.
    """
    components = list(dict.fromkeys(c for use in uses for c in use.components))
    holding = [use for use in uses if use.components]
    if not components:
        return None
    guess = int(budget * inputs.unmeasured_activation_fraction)
    guessed = {use.name: guess for use in holding if activation.get(use.name) is None}
    headroom = max((activation.get(use.name) or guess for use in holding), default=0)
    if sum(nbytes[c] for c in components) + headroom <= budget:
        return None
    calls = inputs.calls
    streamable = sorted(
        (c for c in components if c in inputs.candidates and calls.get(c)),
        key=lambda c: (calls[c], -nbytes[c], c),
    )
    # What each takes on the device streaming every block: its non-block parts and slots.
    least = {
        c: _layout_of(
            inputs.candidates[c], tuple(range(inputs.candidates[c].block_count)), inputs.slots
        ).device_bytes
        for c in streamable
    }
    streamed: list[str] = []

    def need() -> int:
        whole = sum(nbytes[c] for c in components if c not in streamed)
        return whole + sum(least[c] for c in streamed) + headroom

    for component in streamable:
        if need() <= budget:
            break
        streamed.append(component)
    if not streamed or need() > budget:
        return None
    room = budget - headroom - sum(nbytes[c] for c in components if c not in streamed)
    still_least = sum(least[c] for c in streamed)
    layouts: dict[str, StreamLayout] = {}
    for component in sorted(streamed, key=lambda c: (-calls[c], c)):
        still_least -= least[component]
        layout = stream_layout(
            inputs.candidates[component],
            room - still_least,
            slots=inputs.slots,
            previous=inputs.previous.get(component, ()),
        )
        if layout is None:
            return None
        room -= layout.device_bytes
        if layout.streamed:
            layouts[component] = layout
    return StreamingChoice(layouts=layouts, reserved=guessed) if layouts else None


@dataclass(frozen=True)
class Switch:
    """What switching to a plan that keeps every component resident makes once: the
    bytes of the streamed blocks that need a new pinned host copy, and the seconds it
    takes to page-lock and read them."""

    nbytes: int
    seconds: float

    def waits(self, gain: float, declined: float) -> bool:
        """Whether to wait although the switch saves ``gain`` seconds a run: until the
        runs on the other plan have lost (``declined``) what it costs once. Switching at
        once would put that cost in the very next run; waiting, a few calls take no
        longer than they would have, and a long series loses at most that cost again."""
        return declined + gain < self.seconds

    def note(self, names: Iterable[str], gain: float, declined: float) -> str:
        return (
            f"keeping every component on the device, streaming {', '.join(names)}, would "
            f"save {gain:.2f} s a run after {format_bytes(self.nbytes)} of new pinned host "
            f"copies (about {self.seconds:.2f} s, once): it is taken once the runs on this "
            f"plan have lost that much ({declined:.2f} s so far)"
        )


def switch_cost(
    resident: Any,
    reloading: Any,
    inputs: StreamingInputs,
    once: Mapping[str, int],
    read_rate: float,
) -> Switch:
    """What switching from the plan ``reloading`` to ``resident`` (plans: their
    ``streamed`` layouts and ``file_reads``) costs once: the pinned host copies
    ``resident`` makes that neither ``reloading`` (which makes its own anyway) nor the
    pinned copies held now have, each page-locked fresh and read; and the bytes of
    components loaded again to stream (``once``), read. Reads go at the rate the
    component last loaded, else as its files read (``inputs.host``), else ``read_rate``.
    Page-locking the copies beside the runs while the switch waits made those runs slower
    than it saved (an SD3.5-shaped pipeline's loads at 16 GiB waited 1.4 s more): the
    switch makes them."""

    def from_files(plan: Any, name: str) -> tuple[int, ...]:
        reads = plan.file_reads.get(name)
        return reads.from_files if reads is not None else ()

    held = inputs.host.held if inputs.host is not None else inputs.previous
    nbytes, seconds = 0, 0.0
    for name, layout in resident.streamed.items():
        rate = inputs.load_bytes_per_second.get(name) or (
            inputs.host.read_rate(name)[0] if inputs.host is not None else read_rate
        )
        skip = set(held.get(name, ())) | set(from_files(resident, name))
        if name in reloading.streamed:
            read_each_pass = from_files(reloading, name)
            skip.update(b for b in reloading.streamed[name].streamed if b not in read_each_pass)
        sizes = inputs.candidates[name].packed_bytes
        new = sum(sizes[block] for block in layout.streamed if block not in skip)
        nbytes += new
        seconds += new / PAGE_LOCK_BYTES_PER_SECOND + (new + once.get(name, 0)) / rate
    return Switch(nbytes, seconds)
