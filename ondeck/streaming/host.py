"""Streamed blocks' weights in (pinned) host memory, and how fast they reach the device."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..memory import FreshHostBytes, fresh_host_bytes, page_locked, pinned_host_bytes
from .layout import DEFAULT_BANDWIDTH_SOURCE, DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND

__all__ = ["HostCopies", "host_to_device_bytes_per_second"]


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


class HostCopies:
    """Streamed blocks' weights in host memory, one region per block.

    A region holds exactly its block's packed bytes (pinned: ``memory.pinned_host_bytes``;
    torch's pinned allocator would round each up to a power of two). Regions are planned
    when the layout is set, allocated when a load first needs them, and freed when their
    block stops streaming: a re-plan that keeps a block on the device leaves no host copy
    of it behind.
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._sizes: dict[int, int] = {}  # planned block -> bytes
        self._regions: dict[int, Any] = {}  # allocated block -> uint8 tensor
        self.filled: set[int] = set()
        # A region being allocated counts from before its pages are touched: the host
        # watch tells the process's own growth from what ondeck holds by these counts.
        self._allocating = 0
        # The next region ``prepare`` touches the pages of while this one is registered.
        self._ahead = 0
        # Allocating, and changing which regions exist: a load and ``prepare`` (on its
        # own thread) may ask for regions at once. Each change of the plan or of what is
        # held counts one more generation, which stops a ``prepare`` under way.
        self._lock = threading.Lock()
        self._generation = 0

    @property
    def nbytes(self) -> int:
        return self._allocated_bytes + self._allocating + self._ahead

    @property
    def _allocated_bytes(self) -> int:
        # A copy first: another thread may be adding a region (see ``prepare``).
        return sum(region.numel() for region in list(self._regions.values()))

    def keep_only(self, wanted: Mapping[int, int]) -> None:
        """Plan regions for exactly the blocks in ``wanted`` (block -> bytes); blocks
        already held keep their contents, the others' regions are freed."""
        with self._lock:
            self._generation += 1
            for block in [b for b in self._sizes if b not in wanted]:
                del self._sizes[block]
                self._regions.pop(block, None)
                self.filled.discard(block)
            for block, nbytes in wanted.items():
                self._sizes.setdefault(block, nbytes)
            self.filled.intersection_update(self._regions)  # only a region can be filled

    def region(self, block: int) -> Any:
        region = self._regions.get(block)  # held: no lock, as a streaming pass asks
        if region is not None:
            return region
        with self._lock:
            return self._allocate(block)

    def _allocate(self, block: int, fresh: FreshHostBytes | None = None) -> Any:
        """The block's region, allocated now if it has none: page-locking ``fresh`` (its
        pages touched already) where given and of the block's size."""
        import torch

        region = self._regions.get(block)
        if region is None:
            nbytes = self._sizes[block]
            self._allocating = nbytes
            try:
                if not self.pinned:
                    region = torch.empty(nbytes, dtype=torch.uint8)
                elif fresh is not None and fresh.nbytes == nbytes:
                    region = page_locked(fresh)
                else:
                    region = pinned_host_bytes(nbytes)
                self._regions[block] = region
            finally:
                self._allocating = 0
        return region

    def prepare(self, stop: threading.Event) -> int:
        """Allocate the planned regions not allocated yet, ahead of the load that fills
        them: page-locking fresh memory is most of what a first load of streamed blocks
        waits for. Pinned, the next region's pages are touched on a thread of their own
        while this one is registered, the two halves of page-locking side by side, and
        the lock a load waits on is held for the registering alone. Stops once ``stop``
        is set or the plan or the regions change (a re-plan, a release under host
        pressure, a failed load); returns the bytes it allocated."""
        with self._lock:
            generation = self._generation
            missing = [(b, self._sizes[b]) for b in sorted(self._sizes) if b not in self._regions]
        if not self.pinned or not missing:
            return self._prepare_each(missing, generation, stop, None)
        with ThreadPoolExecutor(1, thread_name_prefix="ondeck-touch-ahead") as ahead:
            return self._prepare_each(missing, generation, stop, ahead)

    def _prepare_each(self, missing, generation, stop, ahead) -> int:
        allocated = 0
        touching = None
        try:
            if ahead is not None:
                self._ahead = missing[0][1]  # counted before its pages are touched
                touching = ahead.submit(fresh_host_bytes, missing[0][1])
            for index, (block, _) in enumerate(missing):
                fresh = touching.result() if touching is not None else None
                following = missing[index + 1][1] if index + 1 < len(missing) else 0
                if ahead is not None and following and not stop.is_set():
                    self._ahead += following
                    touching = ahead.submit(fresh_host_bytes, following)
                else:
                    touching = None
                with self._lock:
                    if stop.is_set() or self._generation != generation:
                        break
                    if fresh is not None:
                        self._ahead -= fresh.nbytes  # ``_allocating`` counts it from here
                    if block not in self._regions:
                        allocated += self._allocate(block, fresh).numel()
                fresh = None  # a region the load made first: these pages go now
        finally:
            if touching is not None and not touching.cancel():
                # Its pages are being touched: they stay counted until it is done.
                with contextlib.suppress(BaseException):
                    touching.result()
            self._ahead = 0
        return allocated

    def drop_unfilled(self) -> None:
        """Free the regions of blocks that do not hold their weights (a load failed)."""
        with self._lock:
            self._generation += 1
            for block in [b for b in self._regions if b not in self.filled]:
                del self._regions[block]

    def clear(self) -> int:
        """Free every region, keeping the plan: a later load fills them again."""
        with self._lock:
            self._generation += 1
            freed = self._allocated_bytes
            self._regions.clear()
            self.filled.clear()
        if freed and self.pinned:
            _empty_host_cache()
        return freed


def _empty_host_cache() -> None:
    """Return cached pinned blocks to the system, so freed host copies really leave."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        try:
            empty()
        except Exception:
            pass
