"""Block streaming for a pipeline's components, as the budget policy uses it.

``BlockStreaming.inputs`` tells the planner which components have repeated blocks (and
their sizes, from the meta skeleton); ``apply`` gives each component's loader the plan's
layout before anything loads.
"""

from __future__ import annotations

import atexit
import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import memory
from ..lazy import is_loaded
from ..loading.folder_loader import FolderLoader
from .file_reads import (
    DEFAULT_READ_BYTES_PER_SECOND,
    DEFAULT_READ_SOURCE,
    DEFAULT_RING_BUFFERS,
    HostRoom,
)
from .host import host_to_device_bytes_per_second
from .layout import (
    DEFAULT_BANDWIDTH_SOURCE,
    DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND,
    DEFAULT_SLOTS,
    UNMEASURED_ACTIVATION_FRACTION,
    BlockSizes,
    StreamingInputs,
    StreamLayout,
)
from .packing import describe_blocks
from .streamer import BlockStreamer, find_block_lists

__all__ = ["BlockStreaming", "StreamOptions"]


@dataclass(frozen=True)
class StreamOptions:
    """How the budget policy streams blocks.

    ``unified``: None asks the device; False treats it as a discrete device (the CPU
    then emulates one: the tests run the streaming path that way). ``keep_host_copies``
    keeps streamed blocks' host copies across releases, so a reload reads only the
    resident part from the files; ``BlockStreaming.drop_host_copies()`` frees them.
    ``prepare_host_copies``: allocate those copies on a thread as soon as a plan gives
    the layouts, in the order the stages use the components, instead of in each first
    load (None: where they are page-locked, which is what costs).
    Where the pinned copies do not fit the host budget, the blocks that do not fit are
    read from the files each pass through a ring of ``file_ring_buffers`` pinned buffers;
    ``read_bytes_per_second`` is the rate the plan assumes for those reads (None: as
    measured, else a default).
    """

    slots: int = DEFAULT_SLOTS
    bytes_per_second: float | None = None  # None: measured once on CUDA, else the default
    unified: bool | None = None
    unmeasured_activation_fraction: float = UNMEASURED_ACTIVATION_FRACTION
    keep_host_copies: bool = True
    file_ring_buffers: int = DEFAULT_RING_BUFFERS
    read_bytes_per_second: float | None = None
    prepare_host_copies: bool | None = None


class Timing:
    """The pipeline's tracker, once it is attached: its call timer is what a streamer
    tells each wait for a block's copy to (held apart, so a streamer refers to this and
    not back to the ``BlockStreaming`` that holds it)."""

    def __init__(self) -> None:
        self.tracker: Any = None

    def call_timer(self) -> Any:
        """The pipeline's call timer (``MemoryTracker.call_timer``), if it has one."""
        return getattr(self.tracker, "call_timer", None)


class BlockStreaming:
    """Block streaming for one pipeline's components, driven by the budget policy.

    ``inputs`` tells the planner what could stream; ``apply`` puts the plan's layouts on
    the components' loaders (placements), releasing a component loaded another way.
    """

    def __init__(self, options: StreamOptions | None = None):
        self.options = options or StreamOptions()
        self.streamers: dict[str, BlockStreamer] = {}
        self._candidates: dict[str, tuple[Any, BlockStreamer | None]] = {}
        self.reserved: dict[str, int] = {}
        self._lock = threading.Lock()
        self._preparing: _Preparing | None = None
        # What the runs so far lost waiting to switch to a plan that keeps every
        # component resident (``planning._waits``); counted by ``count_run``, once a run.
        self.declined_seconds = 0.0
        self.staying = False  # the last run counted was on such a plan
        self._counted_run: int | None = None
        # Where the streamers find the pipeline's call timer, to tell their waits to.
        self.timing = Timing()

    def inputs(self, snapshot: Any) -> StreamingInputs:
        """From a pipeline's ``Snapshot``: its device, loaders and block hints."""
        options = self.options
        unified = options.unified
        if unified is None:
            unified = memory.device_facts(snapshot.device).unified
        if unified:
            return StreamingInputs(
                slots=options.slots,
                unavailable=(
                    f"{snapshot.device} is unified memory: host and device are one pool, so "
                    "moving blocks to host memory frees nothing"
                ),
            )
        hints = snapshot.streamable_blocks
        candidates: dict[str, BlockSizes] = {}
        previous: dict[str, tuple[int, ...]] = {}
        for name, loader in snapshot.loaders.items():
            if name in hints and not hints[name]:
                continue
            streamer = self._streamer_for(name, loader, hints.get(name))
            if streamer is not None:
                candidates[name] = streamer.sizes
                if streamer.layout is not None and streamer.host_bytes:
                    previous[name] = tuple(streamer.layout.streamed)
        measure = None
        if options.bytes_per_second:
            bandwidth, source = options.bytes_per_second, "given"
        else:
            bandwidth, source = DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND, DEFAULT_BANDWIDTH_SOURCE
            measure = functools.partial(host_to_device_bytes_per_second, snapshot.device)
        return StreamingInputs(
            candidates=candidates,
            slots=options.slots,
            bytes_per_second=bandwidth,
            bandwidth_source=source,
            unmeasured_activation_fraction=options.unmeasured_activation_fraction,
            measure=measure,
            previous=previous,
            calls={name: calls for name, calls in snapshot.calls_per_run.items() if calls > 0},
            seconds_per_call=dict(snapshot.seconds_per_call),
            # What reloading costs: the rates of the runs after a process's first
            # (``MemoryTracker.later_load_bytes_per_second``). Its first run's, taken as
            # that, made an SD3.5-shaped pipeline at 8 GiB switch to staying resident
            # (3.5 s a run reloading, it said): 4.1 s a run where reloading took 2.6.
            load_bytes_per_second=dict(snapshot.load_bytes_per_second),
            host=self._host_room(snapshot),
            declined_seconds=self.declined_seconds,
            staying=self.staying,
        )

    def count_run(self, plan: Any, completed: int) -> None:
        """A run starts on ``plan`` after ``completed`` runs: what it declines to save
        (``Plan.resident_gain``) adds to what the runs have lost so far, once a run (a
        call that starts again after running out of memory is counted once); the switch
        to staying resident (``Plan.keeps_resident``) starts the count over. A run that
        neither waits nor switches (a cached prompt, timings close to the line) leaves
        the count as it is. ``staying``: whether this run keeps every component resident."""
        if completed == self._counted_run:
            return
        self._counted_run = completed
        self.staying = bool(getattr(plan, "keeps_resident", False))
        if getattr(plan, "resident_gain", None):
            self.declined_seconds += plan.resident_gain
        elif getattr(plan, "keeps_resident", False):
            self.declined_seconds = 0.0

    def _host_room(self, snapshot: Any) -> HostRoom | None:
        room = getattr(snapshot, "host_room_bytes", None)
        if room is None:
            return None
        held = {}
        for name, streamer in self.streamers.items():
            if streamer.layout is not None and streamer.host_bytes:
                held[name] = tuple(
                    b for b in streamer.layout.streamed if b not in streamer.from_files
                )
        return HostRoom(room, self.options.file_ring_buffers, held, self.read_rate)

    def read_rate(self, name: str) -> tuple[float, str]:
        """How fast ``name``'s files read: given, else as its reads each pass measured,
        else as its last load from the files did, else a default."""
        if self.options.read_bytes_per_second:
            return self.options.read_bytes_per_second, "given"
        streamer = self.streamers.get(name)
        if streamer is not None and streamer.stats.file_read_seconds > 0:
            stats = streamer.stats
            return stats.file_bytes_read / stats.file_read_seconds, "measured: its reads each pass"
        loader = self._candidates.get(name, (None, None))[0]
        if isinstance(loader, FolderLoader):
            seconds, nbytes = loader.last_read_seconds, loader.last_load_bytes
            source = loader.last_source or ""
            if seconds > 0 and nbytes and "host cache" not in source:
                return nbytes / seconds, f"measured: its last load, from {source}"
        return DEFAULT_READ_BYTES_PER_SECOND, DEFAULT_READ_SOURCE

    def _streamer_for(self, name: str, loader: Any, hint: str | None) -> BlockStreamer | None:
        if not (isinstance(loader, FolderLoader) and loader.places_blocks):
            return None  # only a loader taking a placement can put weights in host memory
        with self._lock:
            known = self._candidates.get(name)
            if known is not None and known[0] is loader:
                return known[1]
            streamer = None
            try:
                skeleton = loader.template  # as loaded: stored (fp8) tensors in fp8
                lists = find_block_lists(skeleton.module, hint)
                sizes, tensors = describe_blocks(skeleton, lists) if lists else (None, None)
                # A loader that loads a share of the component (one rank's shards) does
                # not stream: its blocks are not whole on this device.
                if sizes is not None and loader.spec.nbytes == sizes.total_bytes:
                    streamer = BlockStreamer(
                        name,
                        sizes,
                        tensors,
                        loader.device,
                        keep_host_copies=self.options.keep_host_copies,
                        lists=lists,
                        timer=self.timing.call_timer,
                    )
            except Exception:
                streamer = None  # the load itself reports what is wrong with the folder
            self._candidates[name] = (loader, streamer)
            return streamer

    def apply(self, pipeline: Any, plan: Any) -> None:
        """Give each component's loader the plan's layout (or none) before anything loads,
        and keep the activation bytes the plan reserves for streaming stages."""
        self._stop_preparing()  # it would page-lock copies this plan drops or resizes
        layouts: Mapping[str, StreamLayout] = plan.streamed
        file_reads = getattr(plan, "file_reads", {})
        self.reserved = dict(plan.reserved_activation_bytes)
        keep_rings = self.keeps_rings(pipeline, plan)
        for name, proxy in pipeline.deferred.items():
            known = self._candidates.get(name)
            if known is None:
                continue
            loader, streamer = known
            if streamer is None:
                continue
            streamer.hold_ring(keep_rings)
            layout = layouts.get(name)
            from_files = file_reads.get(name) if layout is not None else None
            if (
                loader.placement is streamer
                and streamer.layout == layout
                and streamer.file_reads == from_files
            ):
                continue
            if loader.placement is None and layout is None:
                continue
            # Loaded another way: release it, the next load places it the new way.
            if is_loaded(proxy):
                proxy.release()
            if layout is None:
                loader.placement = None
                streamer.drop_host_copies()
                self.streamers.pop(name, None)
            else:
                streamer.use_layout(layout, from_files)
                loader.placement = streamer
                self.streamers[name] = streamer
        self._prepare_host_copies(pipeline)

    def _prepare_host_copies(self, pipeline: Any) -> None:
        """Allocate the streamed components' host copies on a thread, in the order the
        stages use them (see ``_stage_order``). A first load of streamed blocks otherwise
        spends most of its wait page-locking fresh memory (about 15 GB/s): this way the
        transformer's copies are made while the text encoder computes. The load asks for
        any region not allocated yet itself, so nothing waits for this thread, and a
        failure here (no host memory to lock) is left for the load to report."""
        self._stop_preparing()
        wanted = self.options.prepare_host_copies
        if not self.options.keep_host_copies or wanted is False:
            return
        streamers = [
            self.streamers[name]
            for name in _stage_order(pipeline, self.streamers)
            if wanted or self.streamers[name].pinned
        ]
        if streamers:
            self._preparing = _Preparing(streamers)

    def _stop_preparing(self) -> None:
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            preparing.stop()

    @staticmethod
    def keeps_rings(pipeline: Any, plan: Any) -> bool:
        """Whether the rings' pinned buffers stay across releases: where the host plan
        holds them beside a reserve for the process's growth that a run measured. Before
        that, the reserve is a guess, and freeing the rings at each release leaves slack."""
        growth = getattr(pipeline, "host_growth", None)
        measured = growth is not None and growth().measured
        return measured and getattr(plan, "file_reads_fit", True)

    def with_reserved(self, activation: Mapping[str, int | None]) -> dict[str, int | None]:
        """Activation estimates, with the reserve for streaming stages not yet measured."""
        merged = dict(activation)
        for stage, nbytes in self.reserved.items():
            if merged.get(stage) is None:
                merged[stage] = nbytes
        return merged

    def device_bytes(self) -> dict[str, int]:
        """What each streamed component takes on the device under its layout."""
        return {
            name: streamer.layout.device_bytes
            for name, streamer in list(self.streamers.items())
            if streamer.layout is not None
        }

    def stats(self) -> dict[str, dict[str, Any]]:
        result = {}
        for name, streamer in list(self.streamers.items()):
            layout = streamer.layout
            result[name] = {
                "path": streamer.path,
                "resident_blocks": list(layout.resident) if layout else [],
                "streamed_blocks": list(layout.streamed) if layout else [],
                "bytes_per_pass": layout.bytes_per_pass if layout else 0,
                "device_bytes": layout.device_bytes if layout else 0,
                "host_copy_bytes": streamer.host_bytes,
                "passes": streamer.stats.passes,
                "copies": streamer.stats.copies,
                "bytes_copied": streamer.stats.bytes_copied,
                "host_bytes_read": streamer.stats.host_bytes_read,
                "from_files_blocks": sorted(streamer.from_files),
                "ring_bytes": streamer.ring_bytes,
                "file_bytes_read": streamer.stats.file_bytes_read,
                "file_read_seconds": streamer.stats.file_read_seconds,
                "host_fill_seconds": streamer.stats.host_fill_seconds,
                "host_fill_wait_seconds": streamer.stats.host_fill_wait_seconds,
            }
        return result

    def host_bytes(self) -> int:
        """Host memory the streamers hold now: pinned copies and rings. Read from the host
        watch's thread, while ``apply`` may change which streamers there are."""
        return sum(s.host_bytes + s.ring_bytes for s in list(self.streamers.values()))

    def drop_host_copies(self) -> int:
        """Free host copies of components not loaded now; returns the bytes freed. Host
        copies being prepared stop first: they would page-lock what this frees again."""
        self._stop_preparing()
        return sum(streamer.drop_host_copies() for streamer in list(self.streamers.values()))


def _stage_order(pipeline: Any, names: Mapping[str, Any]) -> list[str]:
    """``names`` in the order the pipeline's stages first use them, the rest after. The
    first stage's come first although its load, about to start, asks for the same
    regions: page-locking on two threads at once is slower than on one (the kernel locks
    the process's memory map for each), and a first load waiting on another component's
    page-locking costs more than it saves (on an H200 host, the text encoder's first
    load waited 2.3 s instead of 0.5 s)."""
    ordered: list[str] = []
    try:
        for use in pipeline.stage_uses():
            ordered.extend(n for n in use.components if n in names and n not in ordered)
    except Exception:
        pass  # no stages known yet: as given
    return ordered + [n for n in names if n not in ordered]


class _Preparing:
    """One thread allocating host copies for several streamers, one after another."""

    def __init__(self, streamers: list[BlockStreamer]):
        self._stop = threading.Event()
        self.allocated = 0
        self._thread = threading.Thread(
            target=self._run, args=(streamers,), name="ondeck-host-copies", daemon=True
        )
        _running.add(self)
        self._thread.start()

    def _run(self, streamers: list[BlockStreamer]) -> None:
        try:
            for streamer in streamers:
                if self._stop.is_set():
                    break
                self.allocated += streamer.prepare_host_copies(self._stop)
        except Exception:
            pass  # the load allocates what is missing, and reports its own failure
        finally:
            _running.discard(self)

    def stop(self) -> None:
        """Stop after the region being allocated, and wait for it."""
        self._stop.set()
        self._thread.join()


_running: set[_Preparing] = set()


@atexit.register
def _stop_preparing() -> None:
    """A thread page-locking memory as the interpreter exits could abort the exit."""
    for preparing in list(_running):
        preparing.stop()
