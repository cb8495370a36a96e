"""Streamed blocks read from the files each pass, when their pinned host copies do not
fit the host budget: which ones, the ring they go through, and what that costs.

Pure arithmetic over layouts and bytes (no torch): the plan and the run decide with the
same function, so the plan predicts the host memory the run holds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..memory import format_bytes
from .layout import BlockSizes, StreamLayout

__all__ = [
    "DEFAULT_READ_BYTES_PER_SECOND",
    "DEFAULT_READ_SOURCE",
    "DEFAULT_RING_BUFFERS",
    "SLOW_FILE_READS",
    "FileReads",
    "HostRoom",
    "plan_file_reads",
    "spread_order",
]

# Pinned buffers of a file-backed component's ring: one being copied to the device while
# the next blocks are read into the others.
DEFAULT_RING_BUFFERS = 3
# A read of a 16 GiB DiT with the page cache dropped (BENCHMARKS.md, "Loading a 16 GiB DiT
# checkpoint"): where the pinned copies do not fit, the page cache rarely holds the files.
DEFAULT_READ_BYTES_PER_SECOND = 1.64e9
DEFAULT_READ_SOURCE = "default: a disk read with the page cache dropped"
# Past this many times the pinned path's transfer floor, the plan says what would be faster.
SLOW_FILE_READS = 3.0


@dataclass(frozen=True)
class HostRoom:
    """The host memory streamed blocks may take, and how fast their files read."""

    room_bytes: int  # the host budget less the process and the host cache's budget
    ring_buffers: int = DEFAULT_RING_BUFFERS
    # Per component, the streamed blocks whose pinned host copies are held now.
    held: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Per component, the rate its files read at and where that figure comes from.
    read_rate: Callable[[str], tuple[float, str]] = lambda name: (
        DEFAULT_READ_BYTES_PER_SECOND,
        DEFAULT_READ_SOURCE,
    )


@dataclass(frozen=True)
class FileReads:
    """One streamed component whose pinned host copies do not all fit the host budget:
    the streamed blocks that keep one (``pinned``) and those read from the files into a
    ring of pinned buffers on every forward pass (``from_files``)."""

    pinned: tuple[int, ...]
    from_files: tuple[int, ...]
    pinned_bytes: int  # the pinned host copies kept
    file_bytes_per_pass: int  # read from the files per forward pass
    ring_count: int
    ring_buffer_bytes: int  # each, sized as the device slots: for the largest streamed block

    @property
    def ring_bytes(self) -> int:
        return self.ring_count * self.ring_buffer_bytes

    def transfer_seconds(self, layout: StreamLayout, copy_rate: float, read_rate: float) -> float:
        """The least a pass spends moving its streamed blocks: reads from the files run on
        a thread of their own beside the copies to the device, so the slower of the two."""
        if copy_rate <= 0 or read_rate <= 0:
            return float("inf")
        return max(layout.bytes_per_pass / copy_rate, self.file_bytes_per_pass / read_rate)

    def slowdown(self, layout: StreamLayout, copy_rate: float, read_rate: float) -> float:
        """How many times the pinned path's transfer floor this pass's is."""
        pinned = layout.transfer_seconds(copy_rate)
        if pinned <= 0:
            return 1.0
        return self.transfer_seconds(layout, copy_rate, read_rate) / pinned

    def describe(
        self,
        layout: StreamLayout,
        copy_rate: float,
        read_rate: float,
        read_source: str,
    ) -> list[str]:
        seconds = self.transfer_seconds(layout, copy_rate, read_rate)
        return [
            f"    read from the files each pass: {len(self.from_files)} of "
            f"{len(layout.streamed)} streamed blocks, {format_bytes(self.file_bytes_per_pass)} "
            f"per pass through a ring of {self.ring_count} pinned buffers of "
            f"{format_bytes(self.ring_buffer_bytes)} (their pinned copies do not fit the "
            f"host budget); blocks {list(self.from_files)}",
            f"    reads at {read_rate / 1e9:.2f} GB/s ({read_source}): {_seconds(seconds)} "
            f"per pass, {self.slowdown(layout, copy_rate, read_rate):.1f}x the pinned path's "
            f"{_seconds(layout.transfer_seconds(copy_rate))}",
        ]


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def spread_order(count: int) -> list[int]:
    """The indices ``0 .. count-1`` in an order whose every prefix is spread evenly over
    them: the middle first, then always the middle of the longest gap left. Between the
    first ``k`` indices no gap is more than twice as long as an even spread's.

    The blocks kept pinned are taken from the front of this order. A pass then reads its
    blocks from the files between pinned ones, each read hidden behind its neighbours'
    compute; pinned copies taken in streamed order would leave the reads in one run at
    the pass's end, where a small ring cannot keep ahead of blocks that compute faster
    than they read."""
    order: list[int] = []
    gaps = [(-count, 0, count)]  # the longest gap first, then the leftmost
    while gaps:
        _, low, high = heapq.heappop(gaps)
        if low < high:
            middle = (low + high) // 2
            order.append(middle)
            heapq.heappush(gaps, (low - middle, low, middle))
            heapq.heappush(gaps, (middle + 1 - high, middle + 1, high))
    return order


def plan_file_reads(
    layouts: Mapping[str, StreamLayout],
    sizes: Mapping[str, BlockSizes],
    room_bytes: int,
    *,
    ring_count: int = DEFAULT_RING_BUFFERS,
    held: Mapping[str, Sequence[int]] | None = None,
) -> tuple[dict[str, FileReads], bool]:
    """Which streamed blocks are read from the files each pass so that the pinned host
    copies and rings fit ``room_bytes`` (the host budget less the process and the host
    cache), and whether they do.

    Nothing when every pinned copy fits. Otherwise every streamed component reads from the
    files: each gets its share, by its streamed bytes, of the room left beside all the
    rings, and keeps as many pinned copies as fit in it, the blocks whose copies are
    ``held`` now first (no block is read into a host copy twice), then blocks spread evenly
    over the pass (:func:`spread_order`), so that the blocks read from the files fall
    between pinned ones.
    When the rings alone do not fit, every streamed block is read from the files (the
    least host memory streaming can take) and the second value is False.
    """
    held = held or {}
    streamed = {name: layout for name, layout in layouts.items() if layout.streamed}
    total = sum(layout.bytes_per_pass for layout in streamed.values())
    if total <= room_bytes or not streamed:
        return {}, True
    count = max(1, ring_count)
    rings = {name: count * layout.slot_bytes for name, layout in streamed.items()}
    left = room_bytes - sum(rings.values())
    fits = left >= 0
    result: dict[str, FileReads] = {}
    for name, layout in streamed.items():
        packed = sizes[name].packed_bytes
        share = max(0, left) * layout.bytes_per_pass // total
        held_here = set(held.get(name, ()))
        kept_first = [b for b in layout.streamed if b in held_here]
        rest = [b for b in layout.streamed if b not in held_here]
        order = kept_first + [rest[i] for i in spread_order(len(rest))]
        pinned: list[int] = []
        for block in order:
            if packed[block] <= share:
                pinned.append(block)
                share -= packed[block]
        kept = set(pinned)
        from_files = tuple(b for b in layout.streamed if b not in kept)
        result[name] = FileReads(
            pinned=tuple(sorted(pinned)),
            from_files=from_files,
            pinned_bytes=sum(packed[b] for b in pinned),
            file_bytes_per_pass=sum(packed[b] for b in from_files),
            ring_count=count,
            ring_buffer_bytes=layout.slot_bytes,
        )
    return result, fits
