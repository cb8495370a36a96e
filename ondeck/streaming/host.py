"""Streamed blocks' weights in (pinned) host memory, and how fast they reach the device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..memory import packed_offsets, pinned_host_bytes
from .layout import DEFAULT_BANDWIDTH_SOURCE, DEFAULT_HOST_TO_DEVICE_BYTES_PER_SECOND

__all__ = ["HostCopies", "host_to_device_bytes_per_second", "pack_arenas"]


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
    """Streamed blocks' weights in host memory, each block packed in one region.

    Pinned arenas hold exactly their blocks' bytes (``memory.pinned_host_bytes``; torch's
    pinned allocator would round each up to a power of two). Arenas are planned when the
    layout is set and allocated when a load first needs them.
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
        for capacity, members in pack_arenas(new):
            self._arenas.append(None)
            self._capacity.append(capacity)
            self._members.append(set(members))
            for block, offset in members.items():
                self._where[block] = (len(self._arenas) - 1, offset, new[block])

    def region(self, block: int) -> Any:
        import torch

        arena, offset, nbytes = self._where[block]
        if self._arenas[arena] is None:
            capacity = self._capacity[arena]
            self._arenas[arena] = (
                pinned_host_bytes(capacity)
                if self.pinned
                else torch.empty(capacity, dtype=torch.uint8)
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


def pack_arenas(sizes: Mapping[int, int]) -> list[tuple[int, dict[int, int]]]:
    """Blocks (index -> bytes), in index order, in one arena of exactly their aligned
    bytes: ``[(arena bytes, {block: offset})]`` (none for no blocks)."""
    if not sizes:
        return []
    blocks = sorted(sizes)
    offsets, total = packed_offsets([sizes[b] for b in blocks])
    return [(total, dict(zip(blocks, offsets, strict=True)))]


def _empty_host_cache() -> None:
    """Return cached pinned blocks to the system, so freed host copies really leave."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        try:
            empty()
        except Exception:
            pass
