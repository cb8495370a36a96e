"""The shape a run asks for where its caller names none: the pipeline's own.

``ondeck generate`` and ``ondeck serve`` ask the same. A value the call's signature
defaults to is asked as it is (Wan's 480x832 and 81 frames, LTX's 512x704 and 161,
Mochi's 64 steps, SD3's 28). Where the call computes its own (an image pipeline's size
from its sample size and VAE scale, Mochi's 480x848, CogVideoX's frame count), a local
run passes None; the server, which checks a request against its limits before it waits,
reads the size from the built pipeline as the call would compute it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .media import Media


@dataclass
class Shape:
    height: int | None
    width: int | None
    frames: int | None
    steps: int | None


# The embedded default's random weights make noise at any size: a small one, quickly.
EMBEDDED_SHAPE = Shape(height=192, width=320, frames=17, steps=6)


def own_shape(media: Media, pipeline: Any = None) -> Shape:
    """The pipeline's own shape, from its call's signature (``media``); a size the call
    computes is read from the built ``pipeline`` where one is given and it can be read
    (``own_size``), else None. An image pipeline has no frame count."""
    height, width = media.default_height, media.default_width
    if (height is None or width is None) and pipeline is not None:
        height, width = own_size(pipeline) or (height, width)
    frames = media.default_frames if media.video else None
    return Shape(height, width, frames, media.default_steps)


def asked_shape(own: Shape, height: Any, width: Any, frames: Any, steps: Any) -> Shape:
    """Each value as given, else the pipeline's own (``own``)."""
    # `is None`, not `or`: a 0 is refused by the parser, never replaced by a default.
    return Shape(
        own.height if height is None else height,
        own.width if width is None else width,
        own.frames if frames is None else frames,
        own.steps if steps is None else steps,
    )


def own_size(pipeline: Any) -> tuple[int, int] | None:
    """(height, width) a diffusers pipeline's call makes when given none, read as the
    calls compute it: ``default_height`` and ``default_width`` (Mochi); the sample size
    times the VAE's scale, the sample size being ``default_sample_size`` (SD3, Flux,
    SDXL) or the UNet's or transformer's ``sample_size`` (Stable Diffusion 1.x, PixArt);
    the transformer's ``sample_height`` and ``sample_width`` times the VAE's spatial
    scale (CogVideoX). None where it has none of these (ondeck's own Wan stages: their
    call's signature gives the size)."""
    pipe = getattr(pipeline, "pipe", pipeline)  # ondeck's wrapper holds diffusers' pipeline
    pair = (getattr(pipe, "default_height", None), getattr(pipe, "default_width", None))
    if _is_side(pair[0]) and _is_side(pair[1]):
        return pair
    scale = getattr(pipe, "vae_scale_factor", None)
    sample = getattr(pipe, "default_sample_size", None)
    for part in ("unet", "transformer"):
        if sample is None:
            sample = _config_value(pipe, part, "sample_size")
    sides = tuple(sample) if isinstance(sample, (list, tuple)) else (sample, sample)
    if _is_side(scale) and len(sides) == 2 and all(_is_side(side) for side in sides):
        return sides[0] * scale, sides[1] * scale
    spatial = getattr(pipe, "vae_scale_factor_spatial", None)
    sides = tuple(_config_value(pipe, "transformer", k) for k in ("sample_height", "sample_width"))
    if _is_side(spatial) and all(_is_side(side) for side in sides):
        return sides[0] * spatial, sides[1] * spatial
    return None


def _config_value(pipe: Any, part: str, key: str) -> Any:
    config = getattr(getattr(pipe, part, None), "config", None)
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


def _is_side(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
