"""A diffusers VAE's decode that always fits: whole frames where they fit what is left,
else the VAE's own tiling (``enable_tiling`` and its tile sizes, called, not copied),
and after running out of memory, first room made by the policy, then smaller tiles.

``pipe.vae.decode`` on a deferred VAE answers :class:`FittingDecode`; the pipeline calls
it as it would the VAE's own method, with the same arguments and result.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BudgetError, LoadError
from ...lazy import is_out_of_memory
from ...memory import allocator_counts, format_bytes, free_cached_memory
from ...profiles import MEASURED_AT_SHAPE
from ...tiles import (
    FRAMES_IN_FLIGHT,
    RETRY_AREA,
    TILE_SAFETY,
    Tiles,
    decode_tiles,
    estimated_need,
    output_elements,
    output_frames,
    smallest_tiles,
    spatial_scale,
    tiles_for,
)
from .call_shape import call_batch

__all__ = ["FittingDecode", "TilingStyle", "estimated_need", "is_vae", "tiling_style"]

# A decode during which the caching allocator gave back its cache and retried this many
# times fitted only by doing so, each time unmapping and mapping gigabytes again (half a
# second each on a 16 GiB share of an H200): it took all its room, and the next decode of
# that size tiles.
CROWDED_RETRIES = 2

# The three ways diffusers' VAEs take tile sizes.
STRIDES = "strides"  # enable_tiling(tile_sample_min_height=..., tile_sample_stride_height=...)
OVERLAP_FACTORS = "overlap factors"  # enable_tiling(tile_sample_min_height=..., tile_overlap_...)
SQUARE = "square"  # attributes tile_sample_min_size / tile_latent_min_size
# The overlap ondeck gives a VAE that takes a factor (see ``TilingStyle.usable``).
QUARTER = 0.25


@dataclass(frozen=True)
class TilingStyle:
    """How one VAE class tiles: ``kind`` is one of the styles above, or None when it
    tiles only at sizes of its own (``enable_tiling()`` with no sizes)."""

    kind: str | None
    names: tuple[str, ...]  # the attributes the style sets, saved and restored

    def usable(
        self, tiles: Tiles | None, height: int, width: int, scale: int, below: float = 1.0
    ) -> Tiles | None:
        """The tiles the VAE really decodes for ``tiles`` (None: whole frames), each of
        less than ``below`` of the frame; None where no tiles are that small. Strides
        pass as they are. A VAE that takes an overlap factor, or square tiles, reads its
        stride back from the factor through ``int()`` and crops each tile to the side
        less its overlap: both agree, and the tiles add up to the frame, for a quarter's
        overlap (``QUARTER``) on a side of a multiple of 4 latent pixels."""
        if tiles is None or self.kind not in (SQUARE, OVERLAP_FACTORS):
            return tiles if tiles is None or tiles.area < below else None
        latent = [-(-height // scale), -(-width // scale)]
        if self.kind == SQUARE:  # smaller than the longer side: else it decodes whole
            side = min(int(math.sqrt(tiles.area * height * width)) // scale, max(latent) - 1)
            sides = [max(4, side // 4 * 4)] * 2
        else:
            sides = [
                _quarter_side(tile // scale, lat, cut=tile < length)
                for tile, length, lat in zip(
                    (tiles.height, tiles.width), (height, width), latent, strict=True
                )
            ]
        while min(sides) >= 4 and (self.kind != SQUARE or sides[0] < max(latent)):
            made = _overlapped(sides, latent, (height, width), scale)
            if made.area < below and made.count > 1:
                return made
            if self.kind == SQUARE:
                sides = [sides[0] - 4] * 2
                continue
            # The side its tile covers most of gets smaller (one not cut yet, cut).
            axis = max((0, 1), key=lambda a: min(sides[a], latent[a]) / latent[a])
            whole = sides[axis] >= latent[axis]
            sides[axis] = (latent[axis] - 1) // 4 * 4 if whole else sides[axis] - 4
        return None

    def apply(self, module: Any, tiles: Tiles, scale: int) -> None:
        """Turn on the VAE's own tiling at ``tiles``'s sizes (``usable`` ones)."""
        if self.kind == SQUARE:
            module.tile_sample_min_size = tiles.height
            module.tile_latent_min_size = tiles.height // scale
            module.tile_overlap_factor = QUARTER
            module.enable_tiling()
        elif self.kind == OVERLAP_FACTORS:
            module.enable_tiling(
                tile_sample_min_height=tiles.height,
                tile_sample_min_width=tiles.width,
                tile_overlap_factor_height=QUARTER,
                tile_overlap_factor_width=QUARTER,
            )
        elif self.kind == STRIDES:
            module.enable_tiling(
                tile_sample_min_height=tiles.height,
                tile_sample_min_width=tiles.width,
                tile_sample_stride_height=tiles.stride_height,
                tile_sample_stride_width=tiles.stride_width,
            )
        else:
            module.enable_tiling()


def _quarter_side(tile: int, latent: int, *, cut: bool) -> int:
    """A side of a multiple of 4 latent pixels for a ``tile``-pixel-wide (latent) cut,
    or, for a side not cut, one whose tile, less its overlap, covers all of it."""
    if not cut:
        return 4 * -(-latent // 3)  # three quarters of it, the part kept, cover the side
    return max(4, tile // 4 * 4)


def _overlapped(sides: list[int], latent: list[int], frame: tuple[int, int], scale: int) -> Tiles:
    """Tiles of ``sides`` latent pixels overlapping by a quarter: their count, and one
    tile's share of the frame."""
    strides = [side * 3 // 4 for side in sides]
    count = math.prod(-(-lat // stride) for lat, stride in zip(latent, strides, strict=True))
    area = math.prod(
        min(side * scale, length) / length for side, length in zip(sides, frame, strict=True)
    )
    return Tiles(
        sides[0] * scale, sides[1] * scale, strides[0] * scale, strides[1] * scale, count, area
    )


def is_vae(cls: type | None) -> bool:
    """One of diffusers' autoencoders, whose ``decode`` ondeck sizes to fit."""
    return (
        cls is not None
        and cls.__module__.startswith("diffusers.models.autoencoders")
        and callable(getattr(cls, "decode", None))
    )


def tiling_style(cls: type) -> TilingStyle | None:
    """The tiling a VAE class offers; None when it has none."""
    enable = getattr(cls, "enable_tiling", None)
    if enable is None:
        return None
    parameters = set(inspect.signature(enable).parameters)
    if {"tile_sample_min_height", "tile_sample_stride_height"} <= parameters:
        names = (
            "use_tiling",
            "tile_sample_min_height",
            "tile_sample_min_width",
            "tile_sample_stride_height",
            "tile_sample_stride_width",
            # What some (AutoencoderDC) derive from those in enable_tiling.
            "tile_latent_min_height",
            "tile_latent_min_width",
            "tile_latent_stride_height",
            "tile_latent_stride_width",
        )
        return TilingStyle(STRIDES, names)
    if {"tile_sample_min_height", "tile_overlap_factor_height"} <= parameters:
        names = (
            "use_tiling",
            "tile_sample_min_height",
            "tile_sample_min_width",
            "tile_latent_min_height",
            "tile_latent_min_width",
            "tile_overlap_factor_height",
            "tile_overlap_factor_width",
        )
        return TilingStyle(OVERLAP_FACTORS, names)
    if "tile_sample_min_size" in parameters or _sets_attribute(cls, "tile_sample_min_size"):
        names = (
            "use_tiling",
            "tile_sample_min_size",
            "tile_latent_min_size",
            "tile_overlap_factor",
        )
        return TilingStyle(SQUARE, names)
    if _sets_attribute(cls, "use_tiling"):
        return TilingStyle(None, ("use_tiling",))
    return None


def _sets_attribute(cls: type, name: str) -> bool:
    return f"self.{name} =" in _init_source(cls)


def _init_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return ""


def frames_in_flight(cls: type | None) -> int:
    """Output frames a video VAE of class ``cls`` holds at once while decoding: a chunk
    of ``tile_sample_min_num_frames`` and the frame it overlaps the next by, where its
    constructor turns chunked decoding on (``use_framewise_decoding = True``), for
    whole frames and tiles alike; else ``FRAMES_IN_FLIGHT``."""
    source = _init_source(cls) if cls is not None else ""
    chunk = re.search(r"self\.tile_sample_min_num_frames = (\d+)\b", source)
    if chunk is None or "self.use_framewise_decoding = True" not in source:
        return FRAMES_IN_FLIGHT
    return int(chunk.group(1)) + 1


class FittingDecode:
    """``vae.decode`` for one deferred VAE of a diffusers pipeline run by ondeck.

    The need of a whole-frame decode comes from the last one measured, scaled to the
    latents' size, else from the config (:func:`estimated_need`); the room from the
    runtime (the budget, else the device, less what is resident). Tiles are diffusers'
    own, sized to fit; the VAE's settings are put back after the call.
    """

    def __init__(self, proxy: Any, runtime: Any, name: str):
        self.proxy = proxy
        self.runtime = runtime
        self.name = name
        spec = object.__getattribute__(proxy, "_ondeck_spec")
        self.style = tiling_style(spec.cls) if spec.cls is not None else None
        self.in_flight = frames_in_flight(spec.cls)
        self.config = spec.config or {}
        self.last_tiles: Tiles | None = None
        self.last_retries = 0
        # Images (or videos) of the batch the last decode took one at a time, through the
        # VAE's own ``enable_slicing``: 1 where it decoded the batch at once.
        self.last_slices = 1
        self.last_elements: int | None = None
        self.last_need: int | None = None  # the last decode's whole-frame need
        # Whole frames' bytes per output element, measured (or, after running out of
        # memory, at least this much).
        self.bytes_per_element: float | None = None
        # What running out of memory proved whole frames take at least, per element: a
        # later measurement (of tiles, which understate whole frames) never goes below.
        self.proven_bytes_per_element = 0.0
        # Whole frames' bytes per output element an earlier process stored for exactly
        # the call's shape: a floor over what this process's tiles measure (which
        # understate whole frames), never over a whole-frame measurement, never a refusal.
        self.stored_bytes_per_element = 0.0
        # Whether the turn in progress (or the last) decoded: a VAE turn that only
        # encodes (image to video) is measured as it is, not as a decode.
        self.decoded = False
        # Bytes of other turns' components that arrived beside the last decode (the next
        # call's, loaded ahead), counted as weights though they may have come after its
        # peak: its need lies between its measurement and that plus these.
        self.loaded_beside_bytes = 0
        # Whether a decode fitted only by the allocator retrying (``_crowded``): from then
        # on a decode that does not fit tiles within its room, keeping what the policy
        # keeps (freeing it would reload it in the next run, every run), unless the
        # tiles would cost more than that reload (``_room_pays``).
        self.crowded = False
        # Per decode size (output elements), the frame area of the tiles of the decode
        # that last raised the need for being crowded: a decode of that size in finer
        # tiles which still made the allocator retry was crowded by something other
        # than its size, and raises nothing (else each such decode would tile finer
        # than the last, run after run).
        self.crowded_areas: dict[int, float] = {}
        # The last decode that fitted without retries: its timing (start and end, CUDA
        # events or host clock readings) and the output pixels it computed (its pixels
        # times the frame area its tiles covered, overlaps counted each time). Read into
        # ``seconds_per_pixel`` once it has ended.
        self._timing: tuple[Any, Any, float] | None = None
        self.seconds_per_pixel: float | None = None

    # -- what the runtime asks ------------------------------------------------------------

    def whole_activations(self, measured: int) -> int | None:
        """A tiled decode measured one tile: whole frames take about that over its area,
        and at least what running out of memory proved they take (a tile's measurement
        understates whole frames; what is stored for later processes must not). Measured
        beside loads (``loaded_beside_bytes``), the need lies between the measurement and
        that plus their bytes: the need the decode was sized by, brought within."""
        if self.last_retries:
            return None
        slices, area = self.last_slices, 1.0  # one image at a time: the batch takes that each
        floor = self.proven_bytes_per_element
        if self.last_tiles is not None:
            area = self.last_tiles.area
            floor = max(floor, self.stored_bytes_per_element)
        lower = int(measured * slices / area)
        whole = max(lower, int(floor * (self.last_elements or 0)))
        if not self.loaded_beside_bytes:
            return whole
        upper = int((measured + self.loaded_beside_bytes) * slices / area)
        return max(whole, min(upper, self.last_need or 0))

    def measured(self, nbytes: int) -> None:
        """The turn's measured peak for whole frames, kept per output element."""
        if self.last_elements and nbytes:
            measured = nbytes / self.last_elements
            self.bytes_per_element = max(measured, self.proven_bytes_per_element)

    def expected_need(self, arguments: dict[str, Any]) -> int | None:
        """What a whole-frame decode of the call given ``arguments`` takes, known before
        the call decodes: measured per element, else estimated from the config; None
        when the arguments do not say the frame's size."""
        height, width = arguments.get("height"), arguments.get("width")
        if not isinstance(height, int) or not isinstance(width, int):
            return self.last_need
        frames = arguments.get("num_frames")
        frames = frames if isinstance(frames, int) and frames > 0 else None
        batch = call_batch(arguments)
        elements = output_elements(batch, height, width, frames, self.in_flight)
        if self.bytes_per_element is not None:
            return int(self.bytes_per_element * elements)
        scale = spatial_scale(self.config)
        side = (max(1, height // scale), max(1, width // scale))
        shape = (batch, 1, (frames - 1) // 4 + 1, *side) if frames else (batch, 1, *side)
        dtype = object.__getattribute__(self.proxy, "_ondeck_spec").dtype
        itemsize = dtype.itemsize if dtype is not None else 4
        return estimated_need(self.config, shape, itemsize, self.in_flight)

    def finest_area(self, arguments: dict[str, Any]) -> float | None:
        """The share of a frame the finest tiles this VAE decodes in take, for the call
        ``arguments`` size; None where that is not known (no size, sizes of its own)."""
        height, width = arguments.get("height"), arguments.get("width")
        if self.style is None or self.style.kind is None:
            return None
        if not isinstance(height, int) or not isinstance(width, int):
            return None
        scale = spatial_scale(self.config)
        finest = self.style.usable(smallest_tiles(height, width, scale=scale), height, width, scale)
        while finest is not None:  # as far as retries go
            finer = self.style.usable(finest, height, width, scale, below=finest.area)
            if finer is None:
                return finest.area
            finest = finer
        return 1.0

    # -- the call -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        latents = args[0] if args else kwargs.get("z", kwargs.get("latents"))
        if not isinstance(latents, torch.Tensor) or latents.dim() not in (4, 5):
            return self._module().decode(*args, **kwargs)
        scale = spatial_scale(self.config)
        height, width = latents.shape[-2] * scale, latents.shape[-1] * scale
        frames = output_frames(latents.shape[2]) if latents.dim() == 5 else None
        elements = output_elements(latents.shape[0], height, width, frames, self.in_flight)
        self.last_elements = elements
        need = self._need(latents, elements)
        self.last_need = need
        self._refuse_if_it_cannot_fit(need, height, width)
        module = self._module()
        self.decoded = True  # in the turn its touch began, if it began one
        if getattr(module, "use_tiling", False):
            self.last_tiles, self.last_retries, self.last_slices = None, 0, 1
            return module.decode(*args, **kwargs)  # tiling the caller chose
        room = self.runtime.activation_room()
        if need is not None and room is not None and need > room:
            tiles_within = self.crowded and self.style is not None
            if not tiles_within or self._room_pays(module, latents, need, room, scale):
                if self.runtime.make_room(keep=(self.name,)):
                    room = self.runtime.activation_room()
        # A batch that does not fit at once decodes an image at a time, then in tiles if
        # one image does not fit either.
        slices = latents.shape[0] if _slices(module, latents, need, room) else 1
        elements //= slices
        need = need // slices if need is not None else None
        tiles = self._first_tiles(height, width, need, room, scale)
        retries, made_room = 0, False
        while True:
            try:
                before = allocator_counts(latents.device)
                started = _clock(latents.device)
                result = self._decode(module, tiles, slices, scale, args, kwargs)
                ended = _clock(latents.device)
                crowded = self._crowded(
                    before, allocator_counts(latents.device), tiles, room, elements
                )
                if not crowded and not retries:
                    pixels = output_pixels(latents, scale) * covered_area(tiles)
                    self._timing = (started, ended, pixels)
                break
            except NotImplementedError:
                if tiles is not None or not hasattr(module, "enable_tiling"):
                    raise
                # A VAE that decodes only in tiles (Allegro's): at its own tile sizes.
                module.enable_tiling()
                result = module.decode(*args, **kwargs)
                break
            except Exception as error:
                if isinstance(error, LoadError) or not is_out_of_memory(error):
                    raise
            retries += 1
            failed_area = tiles.area if tiles is not None else 1.0
            if room is not None:
                at_least = TILE_SAFETY * max(room, 0) / (failed_area * RETRY_AREA) / elements
                self.proven_bytes_per_element = max(self.proven_bytes_per_element, at_least)
                self.bytes_per_element = max(self.bytes_per_element or 0, at_least)
            if not made_room:
                made_room = True
                if self.runtime.make_room(keep=(self.name,)):
                    room = self.runtime.activation_room()
                    continue
            free_cached_memory()
            if self.style is None:
                raise BudgetError(
                    f"component '{self.name}' ({type(module).__name__}): decoding "
                    f"{height}x{width} ran out of memory, and this VAE class cannot decode "
                    "in tiles; try a lower resolution or a larger budget"
                )
            tiles = self._finer_tiles(height, width, tiles, scale)
        if tiles is not None and latents.is_cuda:
            torch.cuda.empty_cache()  # tiles mean the device is tight
        self.last_tiles, self.last_retries, self.last_slices = tiles, retries, slices
        return result

    def _module(self) -> Any:
        return self.proxy.materialize()

    def _first_tiles(
        self, height: int, width: int, need: int | None, room: int | None, scale: int
    ) -> Tiles | None:
        """The tiles a decode needing ``need`` in ``room`` starts with (None: whole
        frames), as the VAE decodes them; the finest it decodes in where none fit."""
        if self.style is None:
            return None
        planned = tiles_for(height, width, need, room, scale=scale)
        tiles = self.style.usable(planned, height, width, scale)
        if planned is not None and tiles is None:
            tiles = self.style.usable(
                smallest_tiles(height, width, scale=scale), height, width, scale
            )
        return tiles

    def _finer_tiles(self, height: int, width: int, failed: Tiles | None, scale: int) -> Tiles:
        """Tiles smaller than ``failed`` (which ran out of memory), as the VAE decodes
        them; out of memory where it decodes in none."""
        area = failed.area if failed is not None else 1.0
        finer = decode_tiles(height, width, area * RETRY_AREA, scale=scale)
        finer = finer or smallest_tiles(height, width, scale=scale)
        finer = self.style.usable(finer, height, width, scale, below=area)
        if finer is None:
            split = f"{failed.count} tiles" if failed is not None else "whole frames"
            raise torch.OutOfMemoryError(
                f"component '{self.name}': decoding {height}x{width} ran out of memory "
                f"even in {split}, the finest this VAE decodes in"
            )
        return finer

    def _crowded(
        self,
        before: tuple[int, int] | None,
        after: tuple[int, int] | None,
        tiles: Tiles | None,
        room: int | None,
        elements: int,
    ) -> bool:
        """A decode that fitted only by the allocator retrying (``CROWDED_RETRIES``; the
        counts are ``memory.allocator_counts``) took at least all of ``room`` for its
        tiles: whole frames are counted as needing more than the room over the tiles'
        area, so that the next decode of this size tiles finer and leaves the share a
        decode keeps free; once only, where tiles already finer than the last such
        decode's were crowded all the same. Whether it was so crowded."""
        if before is None or after is None:
            return False
        if after[0] - before[0] < CROWDED_RETRIES:
            return False
        if room is None:
            return True
        self.crowded = True
        area = tiles.area if tiles is not None else 1.0
        if area < self.crowded_areas.get(elements, 0.0):
            return True
        self.crowded_areas[elements] = area
        at_least = max(room, 0) / (TILE_SAFETY * area) / elements
        self.proven_bytes_per_element = max(self.proven_bytes_per_element, at_least)
        self.bytes_per_element = max(self.bytes_per_element or 0, at_least)
        return True

    def _room_pays(
        self, module: Any, latents: torch.Tensor, need: int, room: int, scale: int
    ) -> bool:
        """Whether freeing what the policy keeps (``make_room``) costs less than tiling
        within the room: the pixels the tiles compute beyond what they would in the
        larger room (each decoding an image at a time where it would), at the seconds
        per pixel the last timed decode took, against loading the freed components
        again under the same plan (``room_to_make``). Unknown either way: no (a crowded
        decode tiles within its room)."""
        per_pixel = self._seconds_per_pixel()
        made = self.runtime.room_to_make(keep=(self.name,))
        if per_pixel is None or made is None:
            return False
        freed, reload_seconds = made
        height, width = latents.shape[-2] * scale, latents.shape[-1] * scale

        def covered(room: int) -> float:
            slices = latents.shape[0] if _slices(module, latents, need, room) else 1
            return covered_area(tiles_for(height, width, need // slices, room, scale=scale))

        extra = output_pixels(latents, scale) * (covered(room) - covered(room + freed))
        return per_pixel * extra > reload_seconds

    def _seconds_per_pixel(self) -> float | None:
        """Seconds a decode took per output pixel it computed, from the last that fitted
        without retries, once it has ended."""
        if self._timing is not None:
            seconds = _elapsed(*self._timing[:2])
            if seconds is not None:
                self.seconds_per_pixel = seconds / self._timing[2]
                self._timing = None
        return self.seconds_per_pixel

    def _need(self, latents: torch.Tensor, elements: int) -> int | None:
        """Whole frames' need: as measured in this process, else as an earlier one stored
        it for the call's shape (``_stored_need``), else estimated from the config. A
        need stored for exactly this shape is at least what running out of memory proved
        there: what this process's tiles measure, which understates whole frames, is held
        above it (``whole_activations``), so that neither this process's next decode nor
        the profile it stores goes below it; a whole-frame measurement replaces it."""
        stored, exact = self._stored_need()
        exact = exact and stored is not None and elements > 0
        self.stored_bytes_per_element = stored / elements if exact else 0.0  # this call's
        if self.bytes_per_element is not None:
            return int(self.bytes_per_element * elements)
        if stored is not None:
            return stored
        shape = tuple(latents.shape)
        return estimated_need(self.config, shape, latents.element_size(), self.in_flight)

    def _stored_need(self) -> tuple[int | None, bool]:
        """The whole-frame need stored in the activation profile of the call's shape
        (measured by an earlier process, or scaled from a stored call of another size):
        the first decode of a process tiles from it, as later ones tile from what they
        measure. It never refuses a decode (``_refuse_if_it_cannot_fit``). With whether it
        was stored for exactly this shape (not scaled from another)."""
        if self.runtime.held_by_another_turn(self.name):
            return None, False  # the peak stored for its turn is an encode's, not a decode's
        stored, note = self.runtime.activation_profile()
        need = stored.get(self.name)
        if not isinstance(need, int) or need <= 0:
            return None, False
        return need, note == MEASURED_AT_SHAPE

    def _refuse_if_it_cannot_fit(self, need: int | None, height: int, width: int) -> None:
        """A VAE that cannot tile, whose whole frames, as measured, cannot fit even with
        nothing else resident: a BudgetError before it loads (unless a prefetch loaded it
        already). An estimate alone refuses nothing: the decode is tried, and running
        out of memory is the BudgetError then."""
        if self.style is not None or need is None or self.bytes_per_element is None:
            return
        budget = self.runtime.policy.budget_bytes
        if budget is None:
            return
        weights = object.__getattribute__(self.proxy, "_ondeck_spec").nbytes or 0
        if weights + need > budget:
            raise BudgetError(
                f"component '{self.name}' ({self.proxy.__class__.__name__}): decoding "
                f"{height}x{width} needs about {format_bytes(need)} beside its "
                f"{format_bytes(weights)} of weights, more than the budget of "
                f"{format_bytes(budget)}, and this VAE class cannot decode in tiles; try a "
                "lower resolution or a larger budget"
            )

    def _decode(
        self, module: Any, tiles: Tiles | None, slices: int, scale: int, args: tuple, kwargs: dict
    ) -> Any:
        if tiles is None and slices == 1:
            return module.decode(*args, **kwargs)
        names = (*(self.style.names if tiles is not None else ()), "use_slicing")
        with _settings_kept(module, names):
            if slices > 1:
                module.enable_slicing()
            if tiles is not None:
                self.style.apply(module, tiles, scale)
            return module.decode(*args, **kwargs)


def output_pixels(latents: torch.Tensor, scale: int) -> int:
    """The pixels a decode of ``latents`` outputs: every image, and every frame of a video."""
    frames = output_frames(latents.shape[2]) if latents.dim() == 5 else 1
    return latents.shape[0] * frames * latents.shape[-2] * latents.shape[-1] * scale * scale


def covered_area(tiles: Tiles | None) -> float:
    """The frame area a decode computes, in frames: its tiles' areas summed (overlaps
    counted each time), 1 for whole frames."""
    return tiles.count * tiles.area if tiles is not None else 1.0


def _clock(device: torch.device) -> Any:
    """A mark in time: an event recorded on the device's stream (CUDA), else the host's
    clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def _elapsed(start: Any, end: Any) -> float | None:
    """Seconds from ``start`` to ``end`` (``_clock`` marks); None while the device has
    not reached ``end``."""
    if isinstance(start, float):
        return end - start
    if not end.query():
        return None
    return start.elapsed_time(end) / 1000


def _slices(module: Any, latents: torch.Tensor, need: int | None, room: int | None) -> bool:
    """Whether to decode a batch one image at a time: it does not fit at once, and the
    VAE decodes slices itself (diffusers' ``enable_slicing``)."""
    return (
        latents.shape[0] > 1
        and need is not None
        and room is not None
        and need > room
        and callable(getattr(module, "enable_slicing", None))
        and hasattr(module, "use_slicing")
    )


@contextlib.contextmanager
def _settings_kept(module: Any, names: tuple[str, ...]) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in names if hasattr(module, name)}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
