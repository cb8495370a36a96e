"""The runtime of block streaming for one component.

During a load, ``BlockStreamer`` (the loader's placement) puts streamed blocks' tensors
in host memory. Once loaded, the module is armed: a few device slots, forward hooks on
the streamed blocks, and their parameters bound to views of a slot. A block's pre-hook
waits for its copy and binds it; it also starts copying the next streamed block into a
slot whose block has finished, on a side CUDA stream. A slot is rewritten only after an
event says the compute that read it is done. Release removes hooks and slots.

Where the host budget holds no pinned copy of some streamed blocks (``FileReads``),
those are read from the files on every pass into a small ring of pinned buffers
(``file_ring``), ahead of need, and copied to a slot from there.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..loading import reads
from ..loading.blocks import BlockLists, find_block_lists, find_blocks
from .file_reads import FileReads
from .file_ring import FileRing
from .host import HostCopies
from .host_fill import HostFill
from .layout import BlockSizes, StreamLayout
from .packing import PackedTensor, packed_view

__all__ = ["BlockStreamer", "StreamStats", "find_block_lists", "find_blocks"]


@dataclass
class StreamStats:
    passes: int = 0  # forward passes of the component
    copies: int = 0  # block copies host to device
    bytes_copied: int = 0
    host_bytes_read: int = 0  # read from files into host copies
    file_bytes_read: int = 0  # read from the files each pass (blocks without a host copy)
    file_read_seconds: float = 0.0  # the time those reads took
    host_fill_seconds: float = 0.0  # filling host copies behind a first pass (``HostFill``)
    host_fill_wait_seconds: float = 0.0  # the time passes waited for those fills


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
        tensors: tuple[tuple[PackedTensor, ...], ...],
        device: Any,
        *,
        keep_host_copies: bool = True,
        lists: BlockLists | None = None,
        timer: Callable[[], Any] = lambda: None,
    ):
        import torch

        self.component = component
        # The pipeline's call timer (``tracker.CallTimer``), None where calls are not
        # timed: each block's wait for its copy is told to it, so the component's timed
        # calls are its compute alone.
        self.timer = timer
        self.sizes = sizes
        self.path = sizes.path
        self.lists = lists or BlockLists((sizes.path,), (sizes.block_count,))
        self.device = torch.device(device)
        self.keep_host_copies = keep_host_copies
        self.layout: StreamLayout | None = None
        self.file_reads: FileReads | None = None
        self.stats = StreamStats()
        self._tensors = tensors
        self._by_name = {
            tensor.names[0]: (block, tensor)
            for block, block_tensors in enumerate(tensors)
            for tensor in block_tensors
        }
        self._streamed: frozenset[int] = frozenset()
        self._from_files: frozenset[int] = frozenset()
        # Per block read from the files: for each of its tensors, the reads that fill a
        # destination of its shape (as the loader reads it, casts included).
        self._file_sources: dict[int, dict[str, Callable[[Any], list[reads.ReadJob]]]] = {}
        self._ring: FileRing | None = None
        self._ring_allocating = 0  # counted from before its pages are touched, as host copies
        # The pinned buffers of the last ring, kept across releases as the host copies
        # are: page-locking them again on every load costs more than reading a block.
        # ``keep_ring``: whether the host plan holds them between loads.
        self._ring_memory: list[Any] = []
        self.keep_ring = True
        self._placeholders: dict[int, list[Any]] = {}
        self._host = HostCopies(pinned=self.device.type == "cuda")
        self._armed: _Armed | None = None
        # Set by each release: events the copies it left in flight end with. The host
        # copies they read from are not freed or changed before them (``_await_copies``).
        self._copies_pending: list[Any] = []
        # From a load's first destination to its finish or abort: the host copies it
        # reads into (and arms the module on) must not be dropped meanwhile.
        self._loading = False
        self._reading = 0
        # ``fill_later``: the next load leaves the streamed blocks' unfilled host copies
        # to a ``HostFill`` started once the module is armed. ``_deferred``: the blocks
        # that load left; ``_stand_in``: memory their tensors view until the arming.
        self._fill_later = False
        self._deferred: set[int] = set()
        self._stand_in: Any = None
        self._host_fill: HostFill | None = None
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

    @property
    def ring_bytes(self) -> int:
        if self._ring is not None:
            return self._ring.nbytes
        return self._kept_ring_bytes + self._ring_allocating

    @property
    def _kept_ring_bytes(self) -> int:
        return sum(memory.numel() for memory in self._ring_memory)

    def use_layout(self, layout: StreamLayout, file_reads: FileReads | None = None) -> None:
        """Stream by ``layout`` from the next load on, the blocks ``file_reads`` names read
        from the files each pass. The component must not be loaded."""
        with self._lock:
            if self._armed is not None:
                raise RuntimeError(
                    f"component '{self.component}' is loaded; release it before changing "
                    "which blocks stream"
                )
            self._await_copies()
            self.layout = layout
            self.file_reads = file_reads
            self._streamed = frozenset(layout.streamed)
            self._from_files = frozenset(file_reads.from_files if file_reads else ())
            buffer_bytes = file_reads.ring_buffer_bytes if file_reads else None
            if not self._from_files or any(m.numel() != buffer_bytes for m in self._ring_memory):
                self._ring_memory = []
            self._host.keep_only(
                {
                    b: self.sizes.packed_bytes[b]
                    for b in layout.streamed
                    if b not in self._from_files
                }
            )

    def _left_in_flight(self, event: Any) -> None:
        """A release left copies in flight that end with ``event`` (None: none); those
        that have ended since earlier releases are forgotten."""
        self._copies_pending = [e for e in self._copies_pending if not e.query()]
        if event is not None:
            self._copies_pending.append(event)

    def _await_copies(self) -> None:
        pending, self._copies_pending = self._copies_pending, []
        for event in pending:
            event.synchronize()

    def prepare_host_copies(self, stop: threading.Event) -> int:
        """Allocate the host copies the layout plans, before the load that fills them
        (``HostCopies.prepare``); returns the bytes allocated."""
        return self._host.prepare(stop)

    @property
    def pinned(self) -> bool:
        """Whether the host copies are page-locked (the device is a CUDA GPU)."""
        return self._host.pinned

    def hold_ring(self, keep: bool) -> None:
        """Whether the ring's buffers stay between loads (the host plan holds them); when
        not, buffers kept from an earlier load go now, or with the component's release."""
        with self._lock:
            self.keep_ring = keep
            if not keep:
                self._ring_memory = []

    def drop_host_copies(self) -> int:
        """Free the host copies and the ring's kept buffers (not while the component is
        loaded); returns the bytes."""
        with self._lock:
            if self._armed is not None or self._loading:
                return 0
            self._await_copies()
            ring_bytes = self._kept_ring_bytes
            self._ring_memory = []
            return self._host.clear() + ring_bytes

    # -- placement protocol (called by ComponentLoader) ------------------------------------

    @property
    def cache_tag(self) -> tuple:
        """Distinguishes host-cache entries of differently placed loads of one component."""
        return ("streamed blocks", self.path, self.layout.streamed if self.layout else ())

    def fill_later(self) -> None:
        """Let the next load hand the module over before the streamed blocks' host copies
        hold their weights: once it is armed, a thread fills them in the order they stream
        (``HostFill``), and each block's first copy to the device waits for its own. For a
        pipelined load, whose compute starts while the rest arrives."""
        with self._lock:
            self._fill_later = True

    def destination(self, slot: Any) -> tuple[Any, bool] | None:
        """Where a tensor of a streamed block goes (a host view), and whether it is there
        already; None for every other tensor (it goes to the device as usual). Under the
        lock ``drop_host_copies`` checks and clears under: relief from the host watch's
        thread either comes before the load takes its regions, or finds it loading."""
        with self._lock:
            self._loading = True
            found = self._by_name.get(slot.names[0])
            if found is None or found[0] not in self._streamed:
                return None
            block, tensor = found
            if block in self._from_files:
                # Read each pass, never at the load: until the module is armed its tensors
                # view the ring (then they view the device slots, as every streamed block).
                return packed_view(self._file_ring().stand_in(), tensor), True
            filled = block in self._host.filled
            if self._fill_later and not filled:
                # Filled after the arming; never computed on before (as above).
                self._deferred.add(block)
                return packed_view(self._stand_in_memory(), tensor), True
            view = packed_view(self._host.region(block), tensor)
            if not filled:
                self._reading += tensor.nbytes
            return view, filled

    def file_source(self, slot: Any, jobs_for: Callable[[Any], list[reads.ReadJob]]) -> None:
        """How the loader reads ``slot``'s tensor from the files into a destination of its
        shape and dtype: kept for the blocks read from the files each pass."""
        found = self._by_name.get(slot.names[0])
        if found is not None and (found[0] in self._from_files or found[0] in self._deferred):
            self._file_sources.setdefault(found[0], {})[slot.names[0]] = jobs_for

    def read_block(self, block: int, buffer: Any) -> int:
        """Read ``block`` from the files into ``buffer``, packed as in a slot."""
        sources = self._file_sources[block]
        jobs = [
            job
            for tensor in self._tensors[block]
            for job in sources[tensor.names[0]](packed_view(buffer, tensor))
        ]
        return reads.read_into(jobs, progress=False, component=self.component).nbytes

    def _stand_in_memory(self) -> Any:
        import torch

        if self._stand_in is None:
            # Never written or read: its pages are not touched, so it takes no memory.
            nbytes = max(self.sizes.packed_bytes[b] for b in self._streamed)
            self._stand_in = torch.empty(nbytes, dtype=torch.uint8)
        return self._stand_in

    def _fill_block(self, block: int) -> None:
        """Read one deferred block into its host copy (``HostFill``'s thread)."""
        started = time.perf_counter()
        nbytes = self.read_block(block, self._host.region(block))
        self._host.filled.add(block)
        self.stats.host_bytes_read += nbytes
        self.stats.host_fill_seconds += time.perf_counter() - started

    def region_ready(self, block: int) -> bool:
        """Whether the block's host copy holds its weights (its fill may be under way)."""
        if block not in self._deferred:
            return True
        fill = self._host_fill
        return fill is not None and fill.ready(block)

    def filled_region(self, block: int) -> Any:
        """The block's host copy, once it holds its weights."""
        fill = self._host_fill
        if fill is not None and block in self._deferred and not fill.ready(block):
            started = time.perf_counter()
            fill.wait(block)
            self.stats.host_fill_wait_seconds += time.perf_counter() - started
        return self._host.region(block)

    def _end_fill(self, *, stop: bool) -> None:
        """Wait for the host copies' filling to end (never under the lock: it waits for
        the filling's thread); ``stop``: after the block in flight, leaving the blocks it
        did not reach unfilled."""
        fill, self._host_fill = self._host_fill, None
        if fill is not None and stop:
            fill.stop()
        elif fill is not None:
            fill.join()
        with self._lock:
            self._deferred.clear()
            self._file_sources = {
                b: sources for b, sources in self._file_sources.items() if b in self._from_files
            }

    def _file_ring(self) -> FileRing:
        if self._ring is None:
            planned = self.file_reads
            count = planned.ring_count if planned else 1
            nbytes = (
                planned.ring_buffer_bytes
                if planned
                else max(self.sizes.packed_bytes[b] for b in self._from_files)
            )
            kept, self._ring_memory = self._ring_memory, []
            self._ring_allocating = count * nbytes  # the kept buffers among them
            try:
                self._ring = FileRing(
                    count,
                    nbytes,
                    pinned=self._host.pinned,
                    read=self.read_block,
                    on_read=self._count_read,
                    memory=kept,
                )
            finally:
                self._ring_allocating = 0
        return self._ring

    def _count_read(self, nbytes: int, seconds: float) -> None:
        self.stats.file_bytes_read += nbytes
        self.stats.file_read_seconds += seconds

    def _close_ring(self, *, keep_memory: bool = False) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
            if keep_memory:
                self._ring_memory = ring.memory()
        self._file_sources.clear()

    def finish(self, module: Any) -> None:
        """The load succeeded: arm the module for streaming."""
        with self._lock:
            if self._armed is not None:
                self._left_in_flight(self._armed.detach())
            self._fill_later, self._stand_in = False, None
            self._armed = _Armed(self, module)
            self._loading = False
            # Blocks read from the files each pass have no host copy to fill.
            self._host.filled.update(self._streamed - self._from_files - self._deferred)
            self.stats.host_bytes_read += self._reading
            self._reading = 0
            deferred = [b for b in self.layout.streamed if b in self._deferred]
            if deferred:  # started last: its thread adds to the counts above
                self._host_fill = HostFill(self.component, deferred, self._fill_block)

    def abort(self) -> None:
        """The load failed: forget host regions it left half filled."""
        self._end_fill(stop=True)
        with self._lock:
            self._loading = False
            self._reading = 0
            self._fill_later, self._stand_in = False, None
            self._host.drop_unfilled()
            self._close_ring()

    def unload(self, module: Any) -> None:
        """The component is being released: slots and hooks go; host copies stay if kept
        (a filling still under way ends first)."""
        self._end_fill(stop=not self.keep_host_copies)
        with self._lock:
            armed, self._armed = self._armed, None
            if armed is not None:
                self._left_in_flight(armed.detach())
            # The ring's few pinned buffers stay with the host copies, for the next load,
            # where the host plan holds them.
            self._close_ring(keep_memory=self.keep_host_copies and self.keep_ring)
            if not self.keep_host_copies:
                self._await_copies()
                self._host.clear()

    # -- used by the armed module ----------------------------------------------------------

    def host_region(self, block: int) -> Any:
        return self._host.region(block)

    @property
    def from_files(self) -> frozenset[int]:
        return self._from_files

    def ring(self) -> FileRing:
        return self._file_ring()

    def placeholders(self, block: int) -> list[Any]:
        """Meta tensors standing for ``block``'s streamed tensors once the module is
        released (shape and dtype only), one per tensor name; made once, shared by
        every load's module, as they hold nothing."""
        import torch

        made = self._placeholders.get(block)
        if made is None:
            made = []
            with torch.inference_mode(False):
                for tensor in self._tensors[block]:
                    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    if tensor.wrap is not None:
                        meta = tensor.wrap(meta)
                    elif tensor.is_parameter:
                        meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
                    made.extend([meta] * len(tensor.names))
            self._placeholders[block] = made
        return made

    def block_tensors(self, block: int) -> tuple[PackedTensor, ...]:
        return self._tensors[block]


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

    def copied(self) -> Any:
        """An event the copies issued so far end with."""
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()

    def retire(self) -> Any:
        """The slots (allocated on ``allocation_stream``) are about to be freed: that
        stream waits, on the device, for the copies issued so far, so whatever it is
        given their memory for next runs after them. The allocator may hand the memory
        out at once (a deferred free would leave the next component's load short of room
        at the card's limit). Returns an event the copies end with."""
        self.allocation_stream.wait_stream(self.stream)
        return self.copied()


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

    def copied(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def retire(self) -> None:
        return None


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
        # The order the first pass runs the streamed blocks in, which prefetching follows
        # from the second pass on: lists numbered one after the other may interleave.
        self.first_pass: list[int] | None = []
        self.passes = 0
        self.clock = 0
        blocks = streamer.lists.modules(module)
        self.targets: dict[int, list[tuple[Any, str, bool]]] = {}
        self.from_files = streamer.from_files
        # A block whose host copy is still being filled gets its source at its first copy.
        self.sources = {
            block: streamer.host_region(block)
            for block in self.order
            if block not in self.from_files and streamer.region_ready(block)
        }
        self.ring = streamer.ring() if self.from_files else None
        if self.ring is not None:
            self.ring.start()
        self.nbytes = {block: streamer.sizes.packed_bytes[block] for block in self.order}
        # Looked up once: get_submodule per tensor walks from the root each time (the
        # arming is on the load's path, before the stage can start).
        from ..loading.skeleton import module_paths

        modules = module_paths(module)
        for block in self.order:
            self.targets[block] = [
                (modules[owner], attribute, tensor.is_parameter)
                for tensor in streamer.block_tensors(block)
                for owner, _, attribute in (name.rpartition(".") for name in tensor.names)
            ]
            # Until the block first runs, its tensors view slot 0: right shape, dtype and
            # device (so .device, .dtype and .to() behave), never computed on unbound.
            # The other slots' views are made when the block first lands in one.
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
        self.passes += 1
        if self.passes > 1 and self.first_pass is not None:
            if self.first_pass:
                self._follow(self.first_pass)
            self.first_pass = None
        for slot in self.slots:
            if slot.busy:  # a pass that raised never reached the block's end hook
                self.copies.record(slot.free)
                slot.busy = False
        if self.ring is not None and self.passes == 1:
            # Later passes' first blocks are asked for by the last copies of the pass before.
            self.ring.want(self._upcoming_from_files(-1))
        self._prefetch(0, len(self.slots))

    def _upcoming_from_files(self, position: int) -> list[int]:
        """The blocks read from the files that run after ``position`` in the order, as
        many as the ring holds (into the next pass: its first blocks are read during the
        last ones of this pass)."""
        upcoming: list[int] = []
        for step in range(1, len(self.order) + 1):
            block = self.order[(position + step) % len(self.order)]
            if block in self.from_files and block not in upcoming:
                upcoming.append(block)
                if len(upcoming) == len(self.ring.buffers):
                    break
        return upcoming

    def _follow(self, seen: list[int]) -> None:
        """Prefetch in the order ``seen``, then any streamed block it did not reach."""
        order = list(dict.fromkeys(seen))
        order += [block for block in self.order if block not in set(order)]
        self.order = tuple(order)
        self.position = {block: index for index, block in enumerate(self.order)}

    def _block_starts(self, block: int, module: Any, args: Any) -> None:
        timer = self.streamer.timer()
        since = timer.mark() if timer is not None else None
        if self.first_pass is not None:
            self.first_pass.append(block)
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
        if since is not None:
            timer.stalled(self.streamer.component, since)
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
        """Copy the next ``count`` streamed blocks from ``start`` into free slots. A block
        read from the files whose read is not done yet stops it: waiting here would hold
        back the block about to compute, whose kernels are not queued yet. That block's
        own pre-hook waits for it, while the GPU still runs the blocks queued before."""
        streamed = len(self.order)
        for step in range(min(count, streamed)):
            upcoming = self.order[(start + step) % streamed]
            if self._holding(upcoming) is not None:
                continue
            if upcoming in self.from_files and not self.ring.ready(upcoming):
                return
            if upcoming not in self.sources and not self.streamer.region_ready(upcoming):
                return  # its host copy is still being filled: as for the files' reads
            slot = self._free_slot()
            if slot is None:
                return
            self._issue(upcoming, slot)

    def _issue(self, block: int, slot: _Slot) -> None:
        nbytes = self.nbytes[block]
        source = self.sources.get(block)
        if source is None and block not in self.from_files:
            source = self.sources[block] = self.streamer.filled_region(block)
        if source is None:  # read from the files: its bytes come through the ring
            source = self.ring.take(block)  # raises what a read raised: the slot stays as it was
            slot.block, slot.used = block, False
            self.copies.copy(
                slot.buffer[:nbytes], source[:nbytes], after=slot.free, done=slot.ready
            )
            self.ring.give_back(block, self.copies.copied())
            self.ring.want(self._upcoming_from_files(self.position[block]))
        else:
            slot.block, slot.used = block, False
            self.copies.copy(slot.buffer[:nbytes], source, after=slot.free, done=slot.ready)
        self.stats.copies += 1
        self.stats.bytes_copied += nbytes

    def _views(self, block: int, slot: _Slot) -> list[Any]:
        """The parameters and buffers of ``block`` viewing ``slot``, made once per slot.
        Made outside any inference mode (a hook may run inside one): they stay the
        module's tensors, usable as any other parameter after the forward."""
        import torch

        values = slot.bound.get(block)
        if values is not None:
            return values
        values = []
        with torch.inference_mode(False):
            for tensor in self.streamer.block_tensors(block):
                view = packed_view(slot.buffer, tensor)
                if tensor.wrap is not None:
                    view = tensor.wrap(view)
                elif tensor.is_parameter:
                    view = torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
                values.extend([view] * len(tensor.names))
        slot.bound[block] = values
        return values

    def _bind(self, block: int, slot: _Slot) -> None:
        self._put(block, self._views(block, slot))

    def _put(self, block: int, values: list[Any]) -> None:
        """Make ``values`` the module's tensors of ``block``, in ``targets`` order."""
        for (owner, attribute, is_parameter), value in zip(
            self.targets[block], values, strict=True
        ):
            if is_parameter:
                owner._parameters[attribute] = value
            else:
                owner._buffers[attribute] = value

    def detach(self) -> Any:
        """Remove hooks and slots; streamed tensors become meta placeholders. Returns an
        event the copies still in flight end with (None where copies are immediate)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        # A prefetch may still be copying into a slot: whatever the slots' memory goes
        # to next runs after it ends, and the host copies it reads from stay until then
        # (``BlockStreamer._await_copies``). The host does not wait here, so the next
        # stage's work is queued while the device finishes this one's.
        pending = self.copies.retire()
        self.ring = None  # the streamer closes it (``unload``)
        for block in self.targets:
            self._put(block, self.streamer.placeholders(block))
        for name in self.slot_names:
            self.module._buffers.pop(name, None)
        for slot in self.slots:
            slot.bound.clear()
        self.slots.clear()
        self.targets.clear()
        self.sources.clear()
        self.module = None
        return pending
