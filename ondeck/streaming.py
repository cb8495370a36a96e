"""Block streaming: run a component whose repeated blocks do not all fit the device.

A denoising step calls a transformer's blocks in the same order every time. When a
stage cannot hold its component, the blocks that fit stay resident, evenly spaced
along the list, and the others wait in pinned host memory (read once from the file)
and are copied into a few device slots: the next streamed block on a side stream
while the current one computes.

The layout arithmetic at the top is pure (bytes from the meta skeleton in, indices
and bytes out); the plan and the budget policy decide with it. The runtime below
places weights during a load, binds streamed blocks to slots with forward hooks, and
gives slots and hooks back on release.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .memory import format_bytes

__all__ = [
    "BlockSizes",
    "BlockStreamer",
    "BlockStreaming",
    "StreamLayout",
    "StreamOptions",
    "StreamingInputs",
    "evenly_spaced",
    "find_blocks",
    "plan_streaming",
    "stream_layout",
]

# Offsets of tensors packed in one buffer: enough for vectorised kernels on any dtype.
ALIGNMENT_BYTES = 256
DEFAULT_SLOTS = 2
# Pinned host-to-device copy bandwidth on an H200 (PCIe Gen5 x16), measured with
# benchmarks/load_throughput.py. Used where nothing better is known (no CUDA device).
DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND = 55e9
DEFAULT_BANDWIDTH_SOURCE = "default: pinned host to H200"
# Activations of a stage that has not run yet are unknown; a streamed component would
# otherwise take every byte of the budget. This share of the budget stays free for them.
UNMEASURED_ACTIVATION_FRACTION = 0.10


# -- pure layout arithmetic ----------------------------------------------------------------


def aligned(nbytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def packed_offsets(sizes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Offsets of tensors of ``sizes`` bytes laid out back to back at aligned offsets."""
    offsets, end = [], 0
    for nbytes in sizes:
        offsets.append(end)
        end += aligned(nbytes)
    return tuple(offsets), end


@dataclass(frozen=True)
class BlockSizes:
    """A component's repeated blocks, known from its meta skeleton: what streaming needs."""

    path: str  # the ModuleList, e.g. "blocks"
    block_bytes: tuple[int, ...]  # each block's tensors, exactly
    packed_bytes: tuple[int, ...]  # each block packed in one buffer (a slot, a host copy)
    other_bytes: int  # everything outside the blocks: always resident

    @property
    def block_count(self) -> int:
        return len(self.block_bytes)

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + sum(self.block_bytes)


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

    def describe(self, component: str, bytes_per_second: float, source: str) -> list[str]:
        return [
            f"  {component}.{self.path}: {len(self.resident)} of {self.block_count} blocks "
            f"resident (evenly spaced), {len(self.streamed)} streamed through "
            f"{self.slot_count} slots of {format_bytes(self.slot_bytes)}",
            f"    {format_bytes(self.bytes_per_pass)} host to device per forward pass, "
            f"{_seconds(self.transfer_seconds(bytes_per_second))} per pass at "
            f"{bytes_per_second / 1e9:.1f} GB/s ({source})",
            f"    on the device {format_bytes(self.device_bytes)}; pinned host copies "
            f"{format_bytes(self.bytes_per_pass)}; streamed blocks {list(self.streamed)}",
        ]


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def evenly_spaced(count: int, chosen: int) -> tuple[int, ...]:
    """``chosen`` indices of ``range(count)`` spread evenly (28 of 40 leave gaps of 1 or 2)."""
    if chosen <= 0:
        return ()
    chosen = min(chosen, count)
    return tuple((2 * i + 1) * count // (2 * chosen) for i in range(chosen))


def stream_layout(
    sizes: BlockSizes, available_bytes: int, *, slots: int = DEFAULT_SLOTS
) -> StreamLayout | None:
    """The most resident blocks that fit ``available_bytes`` with the slots streaming needs.

    Everything resident when the whole component fits. None when even streaming every
    block does not fit (the non-block parts and the slots alone are too large).
    """
    count = sizes.block_count
    if sizes.total_bytes <= available_bytes:
        return StreamLayout(sizes.path, count, tuple(range(count)), (), 0, 0, sizes.total_bytes, 0)
    for kept in range(count - 1, -1, -1):
        resident = evenly_spaced(count, kept)
        keep = set(resident)
        streamed = tuple(i for i in range(count) if i not in keep)
        slot_count = max(1, min(slots, len(streamed)))
        slot_bytes = max(sizes.packed_bytes[i] for i in streamed)
        device = (
            sizes.other_bytes
            + sum(sizes.block_bytes[i] for i in resident)
            + slot_count * slot_bytes
        )
        if device <= available_bytes:
            return StreamLayout(
                sizes.path,
                count,
                resident,
                streamed,
                slot_count,
                slot_bytes,
                device,
                sum(sizes.packed_bytes[i] for i in streamed),
            )
    return None


@dataclass(frozen=True)
class StreamingInputs:
    """What the planner may stream: per component, its blocks; and how fast copies go."""

    candidates: Mapping[str, BlockSizes] = field(default_factory=dict)
    slots: int = DEFAULT_SLOTS
    bytes_per_second: float = DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND
    bandwidth_source: str = DEFAULT_BANDWIDTH_SOURCE
    unmeasured_activation_fraction: float = UNMEASURED_ACTIVATION_FRACTION
    unavailable: str | None = None  # why nothing can stream here (unified memory)
    # Measures the copy bandwidth; called only when something streams.
    measure: Callable[[], tuple[float, str]] | None = None

    def bandwidth(self) -> tuple[float, str]:
        if self.measure is not None:
            return self.measure()
        return self.bytes_per_second, self.bandwidth_source


def plan_streaming(
    uses: Sequence[Any],
    nbytes: Mapping[str, int],
    *,
    budget: int,
    activation: Mapping[str, int | None],
    inputs: StreamingInputs,
) -> tuple[dict[str, StreamLayout], list[str]]:
    """Which components to stream, and how, so that every stage fits ``budget``.

    ``uses`` are the stages (``name``, ``components``) in order. A stage whose components
    and activations overflow streams its largest component with repeated blocks; that
    component gets what the tightest stage holding it leaves free. Returns the layouts
    and notes a person can read (why something could not stream, what was assumed).
    """
    notes: list[str] = []
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
        pick = max(streamable, key=lambda c: (nbytes[c], c))
        if pick not in chosen:
            chosen.append(pick)

    layouts: dict[str, StreamLayout] = {}
    guessed: list[str] = []
    for component in chosen:
        sizes = inputs.candidates[component]
        available, tightest = None, None
        for use in uses:
            if component not in use.components:
                continue
            measured = activation.get(use.name)
            headroom = measured
            if measured is None:
                headroom = int(budget * inputs.unmeasured_activation_fraction)
                if headroom and use.name not in guessed:
                    guessed.append(use.name)
            others = sum(nbytes[c] for c in set(use.components) if c != component)
            room = budget - headroom - others
            if available is None or room < available:
                available, tightest = room, (use.name, others, headroom)
        layout = stream_layout(sizes, available, slots=inputs.slots)
        if layout is None:
            stage, others, headroom = tightest
            smallest = sizes.other_bytes + max(1, min(inputs.slots, sizes.block_count)) * max(
                sizes.packed_bytes
            )
            notes.append(
                f"stage '{stage}': even streaming every block, '{component}' needs "
                f"{format_bytes(smallest)} on the device (its non-block parts and "
                f"{inputs.slots} slots), and only {format_bytes(max(0, available))} is left "
                f"beside {format_bytes(others)} of other components and "
                f"{format_bytes(headroom)} of activations"
            )
            continue
        if layout.streamed:
            layouts[component] = layout
    for stage in guessed:
        notes.append(
            f"activations of '{stage}' not measured yet: "
            f"{format_bytes(int(budget * inputs.unmeasured_activation_fraction))} "
            f"({inputs.unmeasured_activation_fraction:.0%} of the budget) kept free for them "
            "while its component streams"
        )
    return layouts, notes


# -- what a component's skeleton says ------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a block: where it sits in the block's packed buffer."""

    names: tuple[str, ...]  # full names in the component; several when tied
    offset: int
    nbytes: int
    dtype: Any
    shape: tuple[int, ...]
    is_parameter: bool
    requires_grad: bool


def find_blocks(module: Any, path: str | None = None) -> str | None:
    """The ModuleList of repeated blocks: ``path`` if given, else the largest ModuleList
    (by parameter bytes) of two or more children that all share one class."""
    import torch

    if path:
        found = module.get_submodule(path)
        if not isinstance(found, torch.nn.ModuleList) or len(found) == 0:
            raise ValueError(f"'{path}' is not a non-empty ModuleList")
        return path
    best: tuple[int, str] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in child.parameters())
        if nbytes and (best is None or nbytes > best[0]):
            best = (nbytes, name)
    return best[1] if best else None


def _block_index(names: Iterable[str], prefix: str) -> int | None:
    index = None
    for name in names:
        if not name.startswith(prefix):
            return None
        head = name[len(prefix) :].split(".", 1)[0]
        if not head.isdigit() or (index is not None and int(head) != index):
            return None
        index = int(head)
    return index


def describe_blocks(skeleton: Any, path: str) -> tuple[BlockSizes, tuple[tuple[_Tensor, ...], ...]]:
    """Bytes per block and each block's packed tensor layout, from a meta skeleton."""
    count = len(skeleton.module.get_submodule(path))
    members: list[list[Any]] = [[] for _ in range(count)]
    for slot in skeleton.slots:
        index = _block_index(slot.names, f"{path}.")
        if index is not None:
            members[index].append(slot)
    tensors, block_bytes, packed = [], [], []
    for slots in members:
        offsets, end = packed_offsets([slot.nbytes for slot in slots])
        tensors.append(
            tuple(
                _Tensor(
                    tuple(slot.names),
                    offset,
                    slot.nbytes,
                    slot.dtype,
                    tuple(slot.shape),
                    slot.is_parameter,
                    slot.requires_grad,
                )
                for slot, offset in zip(slots, offsets, strict=True)
            )
        )
        block_bytes.append(sum(slot.nbytes for slot in slots))
        packed.append(end)
    other = skeleton.nbytes - sum(block_bytes)
    return BlockSizes(path, tuple(block_bytes), tuple(packed), other), tuple(tensors)


# -- options and the per-pipeline manager --------------------------------------------------


@dataclass(frozen=True)
class StreamOptions:
    """How the budget policy streams blocks.

    ``unified``: None asks the device; False treats it as a discrete device (the CPU
    then emulates one: the tests run the streaming path that way). ``keep_host_copies``
    keeps streamed blocks' host copies across releases, so a reload reads only the
    resident part from the files; ``BlockStreaming.drop_host_copies()`` frees them.
    """

    slots: int = DEFAULT_SLOTS
    bytes_per_second: float | None = None  # None: measured once on CUDA, else the default
    unified: bool | None = None
    unmeasured_activation_fraction: float = UNMEASURED_ACTIVATION_FRACTION
    keep_host_copies: bool = True


@dataclass
class StreamStats:
    passes: int = 0  # forward passes of the component
    copies: int = 0  # block copies host to device
    bytes_copied: int = 0
    host_bytes_read: int = 0  # read from files into host copies


class BlockStreaming:
    """Block streaming for one pipeline's components, driven by the budget policy.

    ``inputs`` tells the planner what could stream; ``apply`` puts the plan's layouts on
    the components' loaders (placements), releasing a component loaded another way.
    """

    def __init__(self, options: StreamOptions | None = None):
        self.options = options or StreamOptions()
        self.streamers: dict[str, BlockStreamer] = {}
        self._candidates: dict[str, tuple[Any, BlockStreamer | None]] = {}
        self._lock = threading.Lock()

    def inputs(self, pipeline: Any) -> StreamingInputs:
        from .memory import device_facts

        options = self.options
        unified = options.unified
        if unified is None:
            unified = device_facts(pipeline.device).unified
        if unified:
            return StreamingInputs(
                slots=options.slots,
                unavailable=(
                    f"{pipeline.device} is unified memory: host and device are one pool, so "
                    "moving blocks to host memory frees nothing"
                ),
            )
        hints = getattr(pipeline, "streamable_blocks", None) or {}
        candidates: dict[str, BlockSizes] = {}
        for name, proxy in pipeline.deferred.items():
            if name in hints and not hints[name]:
                continue
            streamer = self._streamer_for(name, proxy, hints.get(name))
            if streamer is not None:
                candidates[name] = streamer.sizes
        measure = None
        if options.bytes_per_second:
            bandwidth, source = options.bytes_per_second, "given"
        else:
            bandwidth, source = DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND, DEFAULT_BANDWIDTH_SOURCE
            measure = functools.partial(host_to_device_bytes_per_second, pipeline.device)
        return StreamingInputs(
            candidates=candidates,
            slots=options.slots,
            bytes_per_second=bandwidth,
            bandwidth_source=source,
            unmeasured_activation_fraction=options.unmeasured_activation_fraction,
            measure=measure,
        )

    def _streamer_for(self, name: str, proxy: Any, hint: str | None) -> BlockStreamer | None:
        loader = object.__getattribute__(proxy, "_ondeck_loader")
        if not hasattr(loader, "placement") or not hasattr(loader, "folder"):
            return None  # only ComponentLoader can place weights in host memory
        with self._lock:
            known = self._candidates.get(name)
            if known is not None and known[0] is loader:
                return known[1]
            streamer = None
            try:
                skeleton = loader.folder.template(loader.name, loader.dtype)
                path = find_blocks(skeleton.module, hint)
                if path is not None:
                    sizes, tensors = describe_blocks(skeleton, path)
                    streamer = BlockStreamer(
                        name,
                        sizes,
                        tensors,
                        loader.device,
                        keep_host_copies=self.options.keep_host_copies,
                    )
            except Exception:
                streamer = None  # the load itself reports what is wrong with the folder
            self._candidates[name] = (loader, streamer)
            return streamer

    def apply(self, pipeline: Any, layouts: Mapping[str, StreamLayout]) -> None:
        """Give each component's loader its layout (or none) before anything loads."""
        from .lazy import is_loaded

        for name, proxy in pipeline.deferred.items():
            known = self._candidates.get(name)
            if known is None:
                continue
            loader, streamer = known
            if streamer is None:
                continue
            layout = layouts.get(name)
            if loader.placement is streamer and streamer.layout == layout:
                continue
            if loader.placement is None and layout is None:
                continue
            # Loaded another way: release it, the next load places it the new way.
            if is_loaded(proxy):
                proxy.release()
            if layout is None:
                loader.placement = None
                streamer.clear_host_copies()
                self.streamers.pop(name, None)
            else:
                streamer.use_layout(layout)
                loader.placement = streamer
                self.streamers[name] = streamer

    def device_bytes(self) -> dict[str, int]:
        """What each streamed component takes on the device under its layout."""
        return {
            name: streamer.layout.device_bytes
            for name, streamer in self.streamers.items()
            if streamer.layout is not None
        }

    def stats(self) -> dict[str, dict[str, Any]]:
        result = {}
        for name, streamer in self.streamers.items():
            layout = streamer.layout
            result[name] = {
                "resident_blocks": list(layout.resident) if layout else [],
                "streamed_blocks": list(layout.streamed) if layout else [],
                "bytes_per_pass": layout.bytes_per_pass if layout else 0,
                "device_bytes": layout.device_bytes if layout else 0,
                "host_copy_bytes": streamer.host_bytes,
                "passes": streamer.stats.passes,
                "copies": streamer.stats.copies,
                "bytes_copied": streamer.stats.bytes_copied,
                "host_bytes_read": streamer.stats.host_bytes_read,
            }
        return result

    def drop_host_copies(self) -> int:
        """Free host copies of components not loaded now; returns the bytes freed."""
        return sum(streamer.drop_host_copies() for streamer in self.streamers.values())


# -- the runtime -----------------------------------------------------------------------------


_BANDWIDTH: dict[str, float] = {}


def host_to_device_bytes_per_second(device: Any) -> tuple[float, str]:
    """Pinned host-to-device copy bandwidth: measured once per CUDA device, else the default."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND, DEFAULT_BANDWIDTH_SOURCE
    key = str(device)
    if key not in _BANDWIDTH:
        try:
            _BANDWIDTH[key] = _measure_bandwidth(device)
        except Exception:
            return DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND, DEFAULT_BANDWIDTH_SOURCE
    return _BANDWIDTH[key], "measured"


def _measure_bandwidth(device: Any, nbytes: int = 128 * 2**20, repeats: int = 4) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        target.copy_(host, non_blocking=True)  # warm-up
        start.record(stream)
        for _ in range(repeats):
            target.copy_(host, non_blocking=True)
        end.record(stream)
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del target, host
    return nbytes * repeats / seconds


class _HostCopies:
    """Streamed blocks' weights in host memory, each block packed in one region.

    Pinned buffers come from torch's caching host allocator, which rounds every request
    up to a power of two; blocks are packed into power-of-two arenas so little is lost.
    Arenas are planned when the layout is set and allocated when a load first needs them.
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._arenas: list[Any] = []  # a tensor, or None until needed
        self._capacity: list[int] = []
        self._members: list[set[int]] = []
        self._where: dict[int, tuple[int, int, int]] = {}  # block -> arena, offset, bytes
        self.filled: set[int] = set()

    @property
    def nbytes(self) -> int:
        return sum(arena.numel() for arena in self._arenas if arena is not None)

    def keep_only(self, wanted: Mapping[int, int]) -> None:
        """Plan regions for exactly the blocks in ``wanted`` (block -> bytes); blocks
        already held keep their place and their contents."""
        for block in [b for b in self._where if b not in wanted]:
            arena, _, _ = self._where.pop(block)
            self.filled.discard(block)
            self._members[arena].discard(block)
            if not self._members[arena]:
                self._arenas[arena] = None
                self._capacity[arena] = 0
        new = {b: n for b, n in sorted(wanted.items()) if b not in self._where}
        for capacity, members in pack_arenas(new, round_to_power_of_two=self.pinned):
            self._arenas.append(None)
            self._capacity.append(capacity)
            self._members.append(set(members))
            for block, offset in members.items():
                self._where[block] = (len(self._arenas) - 1, offset, new[block])

    def region(self, block: int) -> Any:
        import torch

        arena, offset, nbytes = self._where[block]
        if self._arenas[arena] is None:
            self._arenas[arena] = torch.empty(
                self._capacity[arena], dtype=torch.uint8, pin_memory=self.pinned
            )
        return self._arenas[arena][offset : offset + nbytes]

    def drop_unfilled(self) -> None:
        """Free arenas none of whose blocks hold their weights (a load failed)."""
        for arena, members in enumerate(self._members):
            if self._arenas[arena] is not None and not members & self.filled:
                self._arenas[arena] = None

    def clear(self) -> int:
        """Free every arena, keeping the plan: a later load fills them again."""
        freed = self.nbytes
        self._arenas = [None] * len(self._arenas)
        self.filled.clear()
        if freed and self.pinned:
            _empty_host_cache()
        return freed


def _arena_capacity(used: int, round_to_power_of_two: bool) -> int:
    if not round_to_power_of_two or used <= 0:
        return used
    return 1 << (used - 1).bit_length()


def pack_arenas(
    sizes: Mapping[int, int], *, round_to_power_of_two: bool
) -> list[tuple[int, dict[int, int]]]:
    """Pack blocks (index -> bytes), in index order, into as few bytes of arenas as can be.

    Without rounding: one arena, exactly the blocks' bytes. With rounding (pinned memory),
    arenas of a power of two chosen to waste the least; the last one is sized to fit.
    """
    if not sizes:
        return []
    blocks = sorted(sizes)
    if not round_to_power_of_two:
        offsets, total = packed_offsets([sizes[b] for b in blocks])
        return [(total, dict(zip(blocks, offsets, strict=True)))]
    largest = _arena_capacity(max(aligned(n) for n in sizes.values()), True)
    best: list[tuple[int, dict[int, int]]] | None = None
    best_total = None
    for doubling in range(5):
        capacity = largest << doubling
        arenas: list[tuple[int, dict[int, int]]] = []
        used, members = 0, {}
        for block in blocks:
            nbytes = aligned(sizes[block])
            if used + nbytes > capacity:
                arenas.append((used, members))
                used, members = 0, {}
            members[block] = used
            used += nbytes
        arenas.append((used, members))
        sized = [(_arena_capacity(used, True), members) for used, members in arenas]
        total = sum(capacity for capacity, _ in sized)
        if best_total is None or total < best_total:
            best, best_total = sized, total
    return best


def _empty_host_cache() -> None:
    """Return cached pinned blocks to the system, so freed host copies really leave."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        try:
            empty()
        except Exception:
            pass


class BlockStreamer:
    """Places one component's streamed blocks in host memory and streams them at run time.

    It is the ``placement`` of the component's ``ComponentLoader``: during a load it hands
    out host buffers for streamed blocks' tensors (``destination``), then arms the loaded
    module (``finish``): device slots, forward hooks, and streamed parameters bound to
    slot views. ``unload`` removes all of it when the component is released.
    """

    def __init__(
        self,
        component: str,
        sizes: BlockSizes,
        tensors: tuple[tuple[_Tensor, ...], ...],
        device: Any,
        *,
        keep_host_copies: bool = True,
    ):
        import torch

        self.component = component
        self.sizes = sizes
        self.path = sizes.path
        self.device = torch.device(device)
        self.keep_host_copies = keep_host_copies
        self.layout: StreamLayout | None = None
        self.stats = StreamStats()
        self._tensors = tensors
        self._by_name = {
            tensor.names[0]: (block, tensor)
            for block, block_tensors in enumerate(tensors)
            for tensor in block_tensors
        }
        self._streamed: frozenset[int] = frozenset()
        self._host = _HostCopies(pinned=self.device.type == "cuda")
        self._armed: _Armed | None = None
        self._reading = 0
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        layout = self.layout
        shown = f"{len(layout.streamed)} of {layout.block_count} streamed" if layout else "idle"
        return f"BlockStreamer({self.component!r}.{self.path}, {shown})"

    @property
    def host_bytes(self) -> int:
        return self._host.nbytes

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def use_layout(self, layout: StreamLayout) -> None:
        """Stream by ``layout`` from the next load on. The component must not be loaded."""
        with self._lock:
            if self._armed is not None:
                raise RuntimeError(
                    f"component '{self.component}' is loaded; release it before changing "
                    "which blocks stream"
                )
            self.layout = layout
            self._streamed = frozenset(layout.streamed)
            self._host.keep_only({b: self.sizes.packed_bytes[b] for b in layout.streamed})

    def clear_host_copies(self) -> int:
        with self._lock:
            if self._armed is not None:
                return 0
            return self._host.clear()

    def drop_host_copies(self) -> int:
        return self.clear_host_copies()

    # -- placement protocol (called by ComponentLoader) ------------------------------------

    @property
    def cache_tag(self) -> tuple:
        """Distinguishes host-cache entries of differently placed loads of one component."""
        return ("streamed blocks", self.path, self.layout.streamed if self.layout else ())

    def destination(self, slot: Any) -> tuple[Any, bool] | None:
        """Where a tensor of a streamed block goes (a host view), and whether it is there
        already; None for every other tensor (it goes to the device as usual)."""
        found = self._by_name.get(slot.names[0])
        if found is None or found[0] not in self._streamed:
            return None
        block, tensor = found
        view = _view(self._host.region(block), tensor)
        filled = block in self._host.filled
        if not filled:
            self._reading += tensor.nbytes
        return view, filled

    def finish(self, module: Any) -> None:
        """The load succeeded: arm the module for streaming."""
        with self._lock:
            if self._armed is not None:
                self._armed.detach()
            self._armed = _Armed(self, module)
            self._host.filled.update(self._streamed)
            self.stats.host_bytes_read += self._reading
            self._reading = 0

    def abort(self) -> None:
        """The load failed: forget host regions it left half filled."""
        with self._lock:
            self._reading = 0
            self._host.drop_unfilled()

    def unload(self, module: Any) -> None:
        """The component is being released: slots and hooks go; host copies stay if kept."""
        with self._lock:
            armed, self._armed = self._armed, None
            if armed is not None:
                armed.detach()
            if not self.keep_host_copies:
                self._host.clear()

    # -- used by the armed module ----------------------------------------------------------

    def host_region(self, block: int) -> Any:
        return self._host.region(block)

    def block_tensors(self, block: int) -> tuple[_Tensor, ...]:
        return self._tensors[block]


def _view(buffer: Any, tensor: _Tensor) -> Any:
    return (
        buffer[tensor.offset : tensor.offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
    )


class _DeviceCopies:
    """Copies on a side CUDA stream, ordered against the compute stream by events."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.allocation_stream = torch.cuda.current_stream(device)
        self._streams_seen = {self.allocation_stream}

    def event(self) -> Any:
        return self.torch.cuda.Event()

    def start_after_current(self) -> None:
        # Slots may reuse memory kernels queued on the current stream still read.
        self.stream.wait_stream(self.torch.cuda.current_stream(self.device))

    def copy(self, destination: Any, source: Any, *, after: Any, done: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            self.stream.wait_event(after)  # the compute that read this slot has finished
            destination.copy_(source, non_blocking=True)
            done.record(self.stream)

    def wait(self, event: Any, buffers: Sequence[Any]) -> None:
        current = self.torch.cuda.current_stream(self.device)
        if current not in self._streams_seen:
            # Computing on another stream than the slots were allocated on: tell the
            # allocator, so a release never hands their memory out under running kernels.
            self._streams_seen.add(current)
            for buffer in buffers:
                buffer.record_stream(current)
        current.wait_event(event)

    def record(self, event: Any) -> None:
        event.record(self.torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.stream.synchronize()


class _ImmediateCopies:
    """The host stands in for the device (tests): copies happen at once, events are None."""

    def event(self) -> None:
        return None

    def start_after_current(self) -> None:
        pass

    def copy(self, destination: Any, source: Any, *, after: Any, done: Any) -> None:
        destination.copy_(source)

    def wait(self, event: Any, buffers: Sequence[Any]) -> None:
        pass

    def record(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Slot:
    def __init__(self, buffer: Any, copies: Any):
        self.buffer = buffer
        self.ready = copies.event()  # recorded after the copy into the slot
        self.free = copies.event()  # recorded after the compute that read the slot
        self.block: int | None = None
        self.used = False  # its block has been bound for compute since the copy
        self.busy = False  # its block is computing (between the block's hooks)
        self.used_at = -1
        self.bound: dict[int, list[Any]] = {}  # block -> parameters viewing this slot


class _Armed:
    """One loaded module set up for streaming: slots, hooks and bindings."""

    def __init__(self, streamer: BlockStreamer, module: Any):
        import torch

        layout = streamer.layout
        self.streamer = streamer
        self.stats = streamer.stats
        self.module = module
        device = streamer.device
        self.copies = _DeviceCopies(device) if device.type == "cuda" else _ImmediateCopies()
        self.slots = [
            _Slot(torch.empty(layout.slot_bytes, dtype=torch.uint8, device=device), self.copies)
            for _ in range(layout.slot_count)
        ]
        self.copies.start_after_current()
        self.order = layout.streamed
        self.position = {block: index for index, block in enumerate(self.order)}
        self.clock = 0
        blocks = module.get_submodule(streamer.path)
        self.targets: dict[int, list[tuple[Any, str, bool]]] = {}
        self.placeholders: list[tuple[Any, str, bool, Any]] = []
        self.sources = {block: streamer.host_region(block) for block in self.order}
        self.nbytes = {block: streamer.sizes.packed_bytes[block] for block in self.order}
        for block in self.order:
            targets = []
            for tensor in streamer.block_tensors(block):
                for name in tensor.names:
                    owner_name, _, attribute = name.rpartition(".")
                    owner = module.get_submodule(owner_name)
                    targets.append((owner, attribute, tensor.is_parameter))
                    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    if tensor.is_parameter:
                        meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
                    self.placeholders.append((owner, attribute, tensor.is_parameter, meta))
            self.targets[block] = targets
            # Until the block first runs, its tensors view slot 0: right shape, dtype and
            # device (so .device, .dtype and .to() behave), never computed on unbound.
            self._bind(block, self.slots[0])
        # Registered as buffers, the slots count in the component's measured bytes.
        self.slot_names = []
        for index, slot in enumerate(self.slots):
            name = f"_ondeck_stream_slot{index}"
            module.register_buffer(name, slot.buffer, persistent=False)
            self.slot_names.append(name)
        self.handles = [module.register_forward_pre_hook(self._pass_starts)]
        for block in self.order:
            child = blocks[block]
            self.handles.append(
                child.register_forward_pre_hook(functools.partial(self._block_starts, block))
            )
            self.handles.append(
                child.register_forward_hook(functools.partial(self._block_ends, block))
            )

    # -- hooks -------------------------------------------------------------------------------

    def _pass_starts(self, module: Any, args: Any) -> None:
        self.stats.passes += 1
        for slot in self.slots:
            if slot.busy:  # a pass that raised never reached the block's end hook
                self.copies.record(slot.free)
                slot.busy = False
        self._prefetch(0, len(self.slots))

    def _block_starts(self, block: int, module: Any, args: Any) -> None:
        slot = self._holding(block)
        if slot is None:  # not prefetched (first pass, or blocks ran out of order)
            slot = self._free_slot() or self._idle_slot()
            if slot is None:
                raise RuntimeError(
                    f"component '{self.streamer.component}': all {len(self.slots)} streaming "
                    "slots hold blocks that are still computing (nested block calls?)"
                )
            self._issue(block, slot)
        self.copies.wait(slot.ready, [s.buffer for s in self.slots])
        self._bind(block, slot)
        slot.busy, slot.used = True, True
        self.clock += 1
        slot.used_at = self.clock
        self._prefetch(self.position[block] + 1, len(self.slots) - 1)

    def _block_ends(self, block: int, module: Any, args: Any, output: Any) -> None:
        slot = self._holding(block)
        if slot is not None and slot.busy:
            self.copies.record(slot.free)
            slot.busy = False

    # -- slots -------------------------------------------------------------------------------

    def _holding(self, block: int) -> _Slot | None:
        for slot in self.slots:
            if slot.block == block:
                return slot
        return None

    def _free_slot(self) -> _Slot | None:
        """An idle slot whose block has been used (or that holds none), least recent first."""
        free = [s for s in self.slots if not s.busy and (s.block is None or s.used)]
        return min(free, key=lambda s: s.used_at) if free else None

    def _idle_slot(self) -> _Slot | None:
        idle = [s for s in self.slots if not s.busy]
        return min(idle, key=lambda s: s.used_at) if idle else None

    def _prefetch(self, start: int, count: int) -> None:
        streamed = len(self.order)
        for step in range(min(count, streamed)):
            upcoming = self.order[(start + step) % streamed]
            if self._holding(upcoming) is not None:
                continue
            slot = self._free_slot()
            if slot is None:
                return
            self._issue(upcoming, slot)

    def _issue(self, block: int, slot: _Slot) -> None:
        nbytes = self.nbytes[block]
        slot.block, slot.used = block, False
        self.copies.copy(
            slot.buffer[:nbytes], self.sources[block], after=slot.free, done=slot.ready
        )
        self.stats.copies += 1
        self.stats.bytes_copied += nbytes

    def _bind(self, block: int, slot: _Slot) -> None:
        import torch

        values = slot.bound.get(block)
        if values is None:
            values = []
            for tensor in self.streamer.block_tensors(block):
                view = _view(slot.buffer, tensor)
                if tensor.is_parameter:
                    view = torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
                values.extend([view] * len(tensor.names))
            slot.bound[block] = values
        for (owner, attribute, is_parameter), value in zip(
            self.targets[block], values, strict=True
        ):
            if is_parameter:
                owner._parameters[attribute] = value
            else:
                owner._buffers[attribute] = value

    def detach(self) -> None:
        """Remove hooks and slots; streamed tensors become meta placeholders."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.copies.synchronize()  # a prefetch may still be writing into a slot
        for owner, attribute, is_parameter, placeholder in self.placeholders:
            if is_parameter:
                owner._parameters[attribute] = placeholder
            else:
                owner._buffers[attribute] = placeholder
        for name in self.slot_names:
            self.module._buffers.pop(name, None)
        for slot in self.slots:
            slot.bound.clear()
        self.slots.clear()
        self.placeholders.clear()
        self.targets.clear()
        self.sources.clear()
        self.module = None
