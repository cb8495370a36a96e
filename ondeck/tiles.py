"""Decoding in tiles, from sizes alone: what whole frames take before a decode is
measured (from the VAE's config), and the fewest overlapping tiles whose area is at most
a share of the frame, with whole-latent-pixel strides.

Pure arithmetic (no torch): the Wan stages and the diffusers integration both size
their VAE's tiles with it, and hand the result to the VAE's own tiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "FRAMES_IN_FLIGHT",
    "MAX_TILES_PER_SIDE",
    "MIN_TILE_STRIDE_LATENTS",
    "RETRY_AREA",
    "TILE_OVERLAP",
    "TILE_SAFETY",
    "Tiles",
    "decode_tiles",
    "estimated_need",
    "output_elements",
    "output_frames",
    "smallest_tiles",
    "spatial_scale",
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
# The fewest latent pixels a tile advances by along a side it splits: a side shorter
# than twice this is not split. A tile one latent pixel wide gives the VAE's attention a
# sequence of one, which CUDA's fused attention kernels refuse.
MIN_TILE_STRIDE_LATENTS = 2


# Device bytes a decode takes, before any is measured, per output element (pixel of one
# frame in flight) per channel of the VAE's widest level: the feature map, the
# convolution's output and the temporaries beside them. Meant to err low: an estimate
# above the need tiles a decode that would have fitted, and tiles change the pixels a
# little; one below it costs one attempt that runs out of memory. HunyuanVideo's VAE,
# counted a chunk of 17 frames at a time, measured 22.5 GiB against 26.4 estimated
# (480x848, 33 frames): its first decode tiles a little finer than it needs to.
ESTIMATE_BYTES_PER_ELEMENT_CHANNEL = 4
# Frames of output a video VAE holds at once while decoding (it decodes latent frame
# by latent frame with a cache of the previous ones). A VAE that decodes in chunks of
# frames of its own (``use_framewise_decoding``, HunyuanVideo's) holds a chunk and the
# frame it overlaps the next by (the diffusers integration's ``frames_in_flight``).
FRAMES_IN_FLIGHT = 4


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
        for rows in range(1, _most_pieces(height, scale) + 1)
        for cols in range(1, _most_pieces(width, scale) + 1)
        if rows * cols > 1
    )
    for count, _, rows, cols in splits:
        stride_height, tile_height = _tile_side(height, rows, scale)
        stride_width, tile_width = _tile_side(width, cols, scale)
        area = min(tile_height, height) * min(tile_width, width) / (height * width)
        if area <= fraction:
            return Tiles(tile_height, tile_width, stride_height, stride_width, count, area)
    return None


def _most_pieces(length: int, scale: int) -> int:
    """The most tiles a side of ``length`` pixels is split into (``MAX_TILES_PER_SIDE``,
    each at least ``MIN_TILE_STRIDE_LATENTS`` latent pixels)."""
    return min(MAX_TILES_PER_SIDE, max(1, length // (MIN_TILE_STRIDE_LATENTS * scale)))


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
    rows, cols = _most_pieces(height, scale), _most_pieces(width, scale)
    if rows * cols <= 1:
        return None
    stride_height, tile_height = _tile_side(height, rows, scale)
    stride_width, tile_width = _tile_side(width, cols, scale)
    area = min(tile_height, height) * min(tile_width, width) / (height * width)
    return Tiles(tile_height, tile_width, stride_height, stride_width, rows * cols, area)


# -- what whole frames take, before a decode is measured ---------------------------------


def spatial_scale(config: object) -> int:
    """Pixels per latent pixel along a side, from the VAE's config."""
    get = config.get if hasattr(config, "get") else lambda key, default=None: default
    for key in ("spatial_compression_ratio", "scale_factor_spatial"):
        value = get(key)
        if isinstance(value, int) and value > 0:
            return value
    downsample = get("temperal_downsample")  # Wan's VAE
    if isinstance(downsample, (list, tuple)):
        return 2 ** len(downsample)
    channels = get("block_out_channels")
    if isinstance(channels, (list, tuple)) and channels:
        return 2 ** (len(channels) - 1)
    return 8


def widest_channels(config: object) -> int:
    """Channels of the VAE's widest level, from its config."""
    get = config.get if hasattr(config, "get") else lambda key, default=None: default
    channels = get("decoder_block_out_channels") or get("block_out_channels")
    if isinstance(channels, (list, tuple)) and channels:
        return max(int(c) for c in channels)
    base, multipliers = get("base_dim"), get("dim_mult")  # Wan's VAE
    if isinstance(base, int) and isinstance(multipliers, (list, tuple)) and multipliers:
        return base * max(int(m) for m in multipliers)
    return 512


def output_frames(latent_frames: int) -> int:
    """Frames a video VAE decodes from ``latent_frames`` (the first alone, then four each)."""
    return 1 + 4 * (latent_frames - 1)


def output_elements(
    batch: int, height: int, width: int, frames: int | None, in_flight: int = FRAMES_IN_FLIGHT
) -> int:
    """Output pixels a decode holds at once: every image of the batch, and of a video
    (``frames``) the frames in flight; what a decode's need is counted per."""
    return batch * height * width * (min(in_flight, frames) if frames else 1)


def estimated_need(
    config: object,
    latent_shape: tuple[int, ...],
    element_bytes: int,
    in_flight: int = FRAMES_IN_FLIGHT,
) -> int:
    """Device bytes a whole-frame decode of ``latent_shape`` takes, from the config alone
    (and ``in_flight``, the frames the VAE's class holds at once: the diffusers
    integration reads them from the class)."""
    scale = spatial_scale(config)
    batch = latent_shape[0] if latent_shape else 1
    frames = output_frames(latent_shape[2]) if len(latent_shape) == 5 else None
    height, width = latent_shape[-2] * scale, latent_shape[-1] * scale
    elements = output_elements(batch, height, width, frames, in_flight)
    channels = widest_channels(config)
    return elements * channels * element_bytes * ESTIMATE_BYTES_PER_ELEMENT_CHANNEL
