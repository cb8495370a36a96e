"""Wan's decode stage: latents to frames with the VAE, whole or in tiles that fit, on
one rank or split over several; and the frames handed to the host as diffusers'
``postprocess_video`` gives them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .. import distributed
from ..errors import LoadError
from ..lazy import is_out_of_memory
from ..memory import free_cached_memory
from ..stages import Stage
from ..tiles import (
    MAX_TILES_PER_SIDE,
    RETRY_AREA,
    TILE_SAFETY,
    Tiles,
    decode_tiles,
    estimated_need,
)
from .split_decode import decoder_margin, plan_slab, split_decode

if TYPE_CHECKING:
    from .wan import WanGeometry

__all__ = ["Decode", "host_frames"]


def host_frames(video: torch.Tensor) -> Any:
    """Decoded ``video`` (batch, channels, frames, height, width, in [-1, 1]) as diffusers'
    ``postprocess_video(video, "np")`` gives it: (batch, frames, height, width, channels),
    float32 in [0, 1], equal bit for bit, with one copy in host memory where diffusers'
    holds two (each batch's frames, then their stack: 0.3 GiB at 480x832 and 33 frames,
    1.7 GiB at 1280x720 and 81, which a unified-memory machine pays out of the memory the
    model runs in). ``video`` is denormalised in place, by the arithmetic of diffusers'
    ``VaeImageProcessor.denormalize``, and the host receives the finished array."""
    video.mul_(0.5).add_(0.5).clamp_(0, 1)
    frames = video.permute(0, 2, 3, 4, 1)
    host = torch.empty(frames.shape, dtype=torch.float32)
    host.copy_(frames)
    return host.numpy()


class Decode(Stage):
    """Latents to frames with the VAE.

    When the activations a whole-frame decode needs (measured at this shape, else
    estimated from the VAE's config, as the diffusers integration estimates them) do not
    fit the room the budget or the device leaves, the VAE decodes in overlapping tiles
    sized to fit; a whole-frame decode that runs out of memory is retried in tiles. ``tiling``
    False always decodes whole frames, True as needed (the default).
    """

    def __init__(self, vae: Any, geometry: WanGeometry, *, tiling: bool = True):
        super().__init__()
        self.vae = vae
        self.geometry = geometry
        self.tiling = tiling
        self.last_tiles: Tiles | None = None  # the last run's tiles; None: whole frames
        self.last_retries = 0  # the last run's decodes that ran out of memory and were retried
        self.last_split = None  # the last run's slab when the ranks split the decode
        self._decoded = False  # whether the last run decoded here (its peak is a decode's)
        self._need_at_least: int | None = None  # whole frames' need, after running out
        # Latent shape (frames, height, width) -> (the tile area that decoded after a
        # planned one ran out of memory, the room then): later runs of that shape with no
        # more room start there instead of failing the same way each time.
        self._tile_area_cap: dict[tuple[int, ...], tuple[float, int | None]] = {}

    def needs_components(self, state: dict) -> bool:
        # Latents out (the ranks that do not write the video): the VAE is never touched,
        # so no policy should load it for this stage; under context parallelism such a
        # rank still decodes its share of the frames for the others.
        return state.get("output_type") != "latent" or self._parallel() is not None

    def _parallel(self) -> Any:
        pipeline = self._ondeck_pipeline
        parallel = getattr(pipeline, "parallel", None) if pipeline is not None else None
        return parallel if parallel is not None and distributed.is_active() else None

    def whole_activations(self, measured: int) -> int | None:
        # A tiled or split decode measured one piece: what whole frames would take is
        # about that over the piece's share of the frame. A run with a decode that ran out
        # of memory measured the failed attempt too: what it proves is a lower bound (see
        # _decode_fitting). A run that did not decode here measured no decode.
        if not self._decoded:
            return None
        if self.last_retries:
            return self._need_at_least or None
        if self.last_tiles is not None:
            return int(measured / self.last_tiles.area)
        slab = self.last_split
        if slab is not None:
            return int(measured / slab.share)
        return measured

    def fit_activations(self, need: int, room: int) -> int:
        pipeline = self._ondeck_pipeline
        shape = (pipeline.run_shape or {}) if pipeline is not None else {}
        if not shape.get("height") or not shape.get("width"):
            return need
        tiles = self._tiles(shape["height"], shape["width"], need, room)
        return need if tiles is None else int(need * tiles.area)

    def _planned_tiles(
        self, height: int, width: int, latent_shape: tuple, need: int | None, room: int | None
    ) -> Tiles | None:
        """The tiles to start with: as ``need`` and ``room`` ask (``_room``, ``_need``),
        no larger than a size that ran out of memory before with as little room."""
        if self._ondeck_pipeline is None:
            return None
        tiles = self._tiles(height, width, need, room)
        cap, cap_room = self._tile_area_cap.get(latent_shape, (None, None))
        if need is not None and room is not None and cap_room is not None and room > cap_room:
            cap = None  # more room than when that size was needed: the need decides
        return self._capped(height, width, tiles, cap)

    def _capped(self, height: int, width: int, tiles: Tiles | None, cap: float | None):
        """``tiles``, or smaller ones where they are larger than ``cap`` (a tile area)."""
        if self.tiling and cap is not None and (tiles is None or tiles.area > cap):
            return decode_tiles(height, width, cap, scale=self.geometry.scale_spatial)
        return tiles

    def _room(self) -> int | None:
        pipeline = self._ondeck_pipeline
        return pipeline.activation_room() if pipeline is not None else None

    def _make_room(self) -> bool:
        pipeline = self._ondeck_pipeline
        return pipeline.make_room() if pipeline is not None else False

    def _need(self) -> int | None:
        """Whole frames' need as measured (or stored) at this shape, if it is."""
        pipeline = self._ondeck_pipeline
        return pipeline.activation_need(self.name) if pipeline is not None else None

    def _need_or_estimate(self, known: int | None, latent_shape: tuple[int, ...]) -> int | None:
        """``known`` (``_need``), else whole frames' need for ``latent_shape`` estimated
        from the VAE's config: a first decode at the device's limit tiles at once instead
        of running out of memory first."""
        if known is not None or self._ondeck_pipeline is None:
            return known
        return estimated_need(self.vae.config, latent_shape, self.vae.dtype.itemsize)

    def _tiles(self, height: int, width: int, need: int | None, room: int | None) -> Tiles | None:
        """Tiles for a decode whose whole frames take ``need`` bytes when ``room`` is left;
        None for whole frames (they fit, nothing is known, or tiling is off)."""
        if not self.tiling or need is None or room is None or need <= room:
            return None
        fraction = TILE_SAFETY * max(room, 0) / need
        return decode_tiles(height, width, fraction, scale=self.geometry.scale_spatial)

    @torch.no_grad()
    def forward(self, state: dict) -> dict:
        object.__setattr__(self, "last_tiles", None)  # this run's, once it has decoded
        object.__setattr__(self, "last_retries", 0)
        object.__setattr__(self, "last_split", None)
        object.__setattr__(self, "_decoded", False)
        object.__setattr__(self, "_need_at_least", None)
        wants_frames = state.get("output_type") != "latent"
        if self._parallel() is not None:
            return self._forward_split(state, wants_frames)
        if not wants_frames:
            state["frames"] = state["latents"]
            return state
        latents = self._unscaled(state["latents"])
        video = self._decode_fitting(latents)
        return self._frames(state, video)

    def _unscaled(self, latents: torch.Tensor) -> torch.Tensor:
        """The latents as the VAE takes them: on its device, mean and std put back."""
        latents = latents.to(self.vae.device, dtype=self.vae.dtype)
        view = (1, self.geometry.z_dim, 1, 1, 1)
        mean = torch.tensor(self.geometry.latents_mean).view(view).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(self.geometry.latents_std).view(view).to(
            latents.device, latents.dtype
        )
        return latents / inverse_std + mean

    def _frames(self, state: dict, video: torch.Tensor) -> dict:
        output_type = state.get("output_type", "np")
        if output_type == "np":
            state["frames"] = host_frames(video)
            return state
        from diffusers.video_processor import VideoProcessor

        processor = VideoProcessor(vae_scale_factor=self.geometry.scale_spatial)
        state["frames"] = processor.postprocess_video(video, output_type=output_type)
        return state

    def _forward_split(self, state: dict, wants_frames: bool) -> dict:
        """Under context parallelism: every rank decodes a slab of the frames when all of
        them can (its slab's share of whole frames' need fits its room, the frame is wide
        enough to be worth it), and the video is gathered on every rank. Otherwise each
        rank that wants frames decodes them alone. Collective: every rank agrees first."""
        latents = state["latents"]
        scale = self.geometry.scale_spatial
        margin = decoder_margin(self.vae)
        slab = None
        if margin is not None:
            slab = plan_slab(
                latents.shape[-2],
                latents.shape[-1],
                distributed.rank(),
                distributed.world_size(),
                margin,
            )
        fits = False
        if slab is not None:
            need = self._need_or_estimate(self._need(), tuple(latents.shape))
            height, width = latents.shape[-2] * scale, latents.shape[-1] * scale
            slab_need = None if need is None else math.ceil(need * slab.share)
            tiles = self._planned_tiles(
                height, width, tuple(latents.shape[2:]), slab_need, self._room()
            )
            fits = tiles is None
        video = None
        if all(distributed.gather_all(fits)):
            video = split_decode(self.vae, self._unscaled(latents), slab)
            object.__setattr__(self, "last_split", slab)
            object.__setattr__(self, "_decoded", True)
        elif wants_frames:
            video = self._decode_fitting(self._unscaled(latents))
        if not wants_frames:
            state["frames"] = latents
            return state
        return self._frames(state, video)

    def _decode_fitting(self, latents: torch.Tensor) -> torch.Tensor:
        """The decode in whole frames, or in tiles where they would not fit; a decode
        that runs out of memory is retried in smaller tiles."""
        scale = self.geometry.scale_spatial
        height, width = latents.shape[-2] * scale, latents.shape[-1] * scale
        latent_shape = tuple(latents.shape[2:])
        known, room = self._need(), self._room()
        need = self._need_or_estimate(known, tuple(latents.shape))
        tiles = self._planned_tiles(height, width, latent_shape, need, room)
        retries = 0
        made_room = cured = False  # cured: the same tiles tried again once room was made
        # What running out of memory proves starts from what was measured, not estimated.
        object.__setattr__(self, "_need_at_least", known)
        while True:
            try:
                video = self._decode(latents, tiles)
                break
            except Exception as error:
                # A load that ran out of memory is the policy's to handle, not tiling's.
                if not self.tiling or isinstance(error, LoadError) or not is_out_of_memory(error):
                    raise
            # Out of memory (the traceback is gone with the except block).
            retries += 1
            failed_area = tiles.area if tiles is not None else 1.0
            if room is not None:
                # Whole frames need more than the room over the area that failed; stored
                # as the need that plans the area a retry in smaller tiles tries.
                at_least = int(TILE_SAFETY * max(room, 0) / (failed_area * RETRY_AREA))
                at_least = max(at_least, self._need_at_least or 0)
                object.__setattr__(self, "_need_at_least", at_least)
            if not made_room:
                # First what the policy lets go (the next run's components loading
                # beside, or kept for later; the allocator's cache goes with them), then
                # the same tiles again.
                made_room = True
                if self._make_room():
                    room, cured = self._room(), True
                    continue
            cured = False
            free_cached_memory()
            # Then the fewest tiles at most RETRY_AREA of the area that ran out.
            tiles = decode_tiles(height, width, failed_area * RETRY_AREA, scale=scale)
            if tiles is None:
                raise torch.OutOfMemoryError(
                    f"decoding {height}x{width} frames ran out of memory even in "
                    f"{MAX_TILES_PER_SIDE}x{MAX_TILES_PER_SIDE} tiles"
                )
        if tiles is not None and latents.is_cuda:
            # Tiles mean the device is tight: the tiles' blocks go back to the device
            # rather than stay cached, split to sizes the next stages do not ask for.
            torch.cuda.empty_cache()
        if cured and tiles is not None and room is not None:
            # What the policy kept crowded these tiles, not the decode's need: they fitted
            # the room made. Stored is the need that plans there these tiles, or the
            # coarser ones a retry from whole frames tries (what a first decode without
            # the estimate stored), not finer ones from the room the failed attempt had.
            fitted = int(TILE_SAFETY * max(room, 0) / max(tiles.area, RETRY_AREA))
            object.__setattr__(self, "_need_at_least", max(fitted, known or 0))
        object.__setattr__(self, "last_tiles", tiles)  # not a schedule change
        object.__setattr__(self, "last_retries", retries)
        object.__setattr__(self, "_decoded", True)
        if tiles is None:
            self._tile_area_cap.pop(latent_shape, None)  # whole frames decoded
        elif retries:
            self._tile_area_cap[latent_shape] = (tiles.area, room)
        return video

    def _decode(self, latents: torch.Tensor, tiles: Tiles | None) -> torch.Tensor:
        if tiles is None:
            return self.vae.decode(latents, return_dict=False)[0]
        vae = self.vae
        names = (
            "use_tiling",
            "tile_sample_min_height",
            "tile_sample_min_width",
            "tile_sample_stride_height",
            "tile_sample_stride_width",
        )
        saved = {name: getattr(vae, name) for name in names}
        try:
            vae.enable_tiling(
                tile_sample_min_height=tiles.height,
                tile_sample_min_width=tiles.width,
                tile_sample_stride_height=tiles.stride_height,
                tile_sample_stride_width=tiles.stride_width,
            )
            return vae.decode(latents, return_dict=False)[0]
        finally:
            for name, value in saved.items():
                setattr(vae, name, value)
