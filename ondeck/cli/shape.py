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

from ..arguments import own_size
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
