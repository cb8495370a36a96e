"""Decoding in tiles, from sizes alone: the fewest overlapping tiles whose area is at
most a share of the frame, with whole-latent-pixel strides.

Pure arithmetic (no torch): the Wan stages and the diffusers integration both size
their VAE's tiles with it, and hand the result to the VAE's own tiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "MAX_TILES_PER_SIDE",
    "RETRY_AREA",
    "TILE_OVERLAP",
    "TILE_SAFETY",
    "Tiles",
    "decode_tiles",
    "smallest_tiles",
    "tiles_for",
]

# Decoding in tiles: what is kept free for allocations the estimate does not see, the
# overlap blended between tiles (pixels), the most tiles along either side, and the
# largest tile area a retry after running out of memory tries, as a share of the area
# that ran out (the fewest tiles at most that large).
TILE_SAFETY = 0.85
TILE_OVERLAP = 64
MAX_TILES_PER_SIDE = 8
RETRY_AREA = 0.7


@dataclass(frozen=True)
class Tiles:
    """A tiled decode's tile and stride, in pixels; ``area`` is one tile's share of a frame."""

    height: int
    width: int
    stride_height: int
    stride_width: int
    count: int
    area: float


def decode_tiles(height: int, width: int, fraction: float, *, scale: int = 8) -> Tiles | None:
    """The fewest tiles whose area is at most ``fraction`` of a ``height`` x ``width``
    frame; None when no split down to ``MAX_TILES_PER_SIDE`` per side is that small.

    Strides are whole latent pixels (``scale``); neighbouring tiles overlap by
    ``TILE_OVERLAP`` pixels (less on small frames), blended so that no seam shows.
    """
    # Fewest tiles first; among as many, the squarest.
    splits = sorted(
        (rows * cols, abs(height / rows - width / cols), rows, cols)
        for rows in range(1, MAX_TILES_PER_SIDE + 1)
        for cols in range(1, MAX_TILES_PER_SIDE + 1)
        if rows * cols > 1
    )
    for count, _, rows, cols in splits:
        stride_height, tile_height = _tile_side(height, rows, scale)
        stride_width, tile_width = _tile_side(width, cols, scale)
        area = min(tile_height, height) * min(tile_width, width) / (height * width)
        if area <= fraction:
            return Tiles(tile_height, tile_width, stride_height, stride_width, count, area)
    return None


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _tile_side(length: int, pieces: int, scale: int) -> tuple[int, int]:
    if pieces == 1:
        whole = _round_up(length, scale)
        return whole, whole
    stride = _round_up(math.ceil(length / pieces), scale)
    return stride, stride + min(TILE_OVERLAP, stride // 2 // scale * scale)


def tiles_for(
    height: int, width: int, need: int | None, room: int | None, *, scale: int = 8
) -> Tiles | None:
    """Tiles for a decode whose whole frames take ``need`` bytes when ``room`` is left;
    None for whole frames (they fit, or nothing is known)."""
    if need is None or room is None or need <= room:
        return None
    tiles = decode_tiles(height, width, TILE_SAFETY * max(room, 0) / need, scale=scale)
    return tiles if tiles is not None else smallest_tiles(height, width, scale=scale)


def smallest_tiles(height: int, width: int, *, scale: int = 8) -> Tiles | None:
    """The most tiles ``decode_tiles`` makes of a frame: a need far above the room
    still tries them (running out of memory there says no tiling fits)."""
    rows = min(MAX_TILES_PER_SIDE, max(1, height // (2 * scale)))
    cols = min(MAX_TILES_PER_SIDE, max(1, width // (2 * scale)))
    if rows * cols <= 1:
        return None
    stride_height, tile_height = _tile_side(height, rows, scale)
    stride_width, tile_width = _tile_side(width, cols, scale)
    area = min(tile_height, height) * min(tile_width, width) / (height * width)
    return Tiles(tile_height, tile_width, stride_height, stride_width, rows * cols, area)
