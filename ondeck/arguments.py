"""What a generation may be asked for: the one check that ``generate()`` and the
command line both call, so neither rounds what the other refuses.

The shape rules come from the pipeline's configs (never its weights): Wan's stages
carry a geometry, a diffusers pipeline its VAE's scale factors and its transformer's
patch size. Every value that sizes an allocation (sides, frames, steps, images per
prompt, the prompt's padded length) is bounded.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ArgumentError",
    "ShapeRule",
    "check_generate_arguments",
    "frame_count_argument",
    "input_image_argument",
    "own_call_sizes",
    "own_size",
    "shape_rule",
]

# Far beyond any model's trained shape, and small enough that the latents and the
# scheduler's tables they imply are allocations a machine can make.
MAX_SIDE = 16_384
MAX_FRAMES = 4_097
MAX_STEPS = 10_000
MAX_SEED = 2**64 - 1
# Images (or videos) per prompt are a batch: the latents, embeddings and decode grow with
# it as they do with frames.
MAX_BATCH = 4_096
# Prompts are padded to this many tokens (512 for Wan, Flux and most others; diffusers'
# own pipelines refuse more than 1,024 where they check).
MAX_SEQUENCE_LENGTH = 4_096


class ArgumentError(ValueError):
    """An argument of ``generate()`` the model cannot take; ``argument`` names it."""

    def __init__(self, argument: str, problem: str):
        super().__init__(f"{argument}: {problem}")
        self.argument = argument
        self.problem = problem


@dataclass(frozen=True)
class ShapeRule:
    """Sides in multiples of ``height_step``/``width_step``; frames ``frame_step``·k+1
    (``frame_step`` None: any count; ``takes_frames`` False: an image model)."""

    height_step: int = 1
    width_step: int = 1
    frame_step: int | None = None
    takes_frames: bool = True


# Names pipelines give their call's frame count: ``num_frames`` (most), ``video_length``
# (Latte, TextToVideoZero), ``frames`` (SanaVideo).
_FRAME_COUNTS = ("num_frames", "video_length", "frames")
# Names they give the input image: ``image``, else a ControlNet's ``control_image``.
_INPUT_IMAGES = ("image", "control_image")


def frame_count_argument(parameters: Mapping[str, Any]) -> str | None:
    """The call argument (of ``inspect.signature(...).parameters``) that counts a video's
    frames; None for a pipeline that makes images. Besides ``num_frames``, a name counts
    where its default is a whole number (an input called ``frames`` is no count)."""
    for name in _FRAME_COUNTS:
        parameter = parameters.get(name)
        if parameter is None:
            continue
        default = getattr(parameter, "default", None)
        if name == "num_frames" or (isinstance(default, int) and not isinstance(default, bool)):
            return name
    return None


def input_image_argument(parameters: Mapping[str, Any]) -> str | None:
    """The call argument that takes the input image, or None."""
    return next((name for name in _INPUT_IMAGES if name in parameters), None)


def check_generate_arguments(
    pipeline: Any,
    *,
    height: Any = None,
    width: Any = None,
    num_frames: Any = None,
    num_inference_steps: Any = None,
    guidance_scale: Any = None,
    seed: Any = None,
    num_images_per_prompt: Any = None,
    num_videos_per_prompt: Any = None,
    max_sequence_length: Any = None,
) -> None:
    """Raise :class:`ArgumentError` for the first argument ``pipeline`` cannot take.

    None means "the pipeline's default" and is not checked. Nothing is rounded.
    """
    rule = shape_rule(pipeline)
    for name, value, step in (
        ("height", height, rule.height_step),
        ("width", width, rule.width_step),
    ):
        if value is None:
            continue
        _whole(name, value, 1, MAX_SIDE)
        if value % step:
            below = value // step * step
            raise ArgumentError(
                name,
                f"must be a multiple of {step} for this model, got {value} "
                f"(try {_either(below, below + step)})",
            )
    if num_frames is not None:
        _whole("num_frames", num_frames, 1, MAX_FRAMES)
        step = rule.frame_step
        if step and num_frames % step != 1 % step:
            below = (num_frames - 1) // step * step + 1
            raise ArgumentError(
                "num_frames",
                f"must be {step}k+1 for this model (1, {step + 1}, {2 * step + 1}, ...), got "
                f"{num_frames} (try {_either(below, below + step)})",
            )
    if num_inference_steps is not None:
        _whole("num_inference_steps", num_inference_steps, 1, MAX_STEPS)
    if guidance_scale is not None:
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
            raise ArgumentError("guidance_scale", f"expected a number, got {guidance_scale!r}")
        if not math.isfinite(guidance_scale):
            raise ArgumentError("guidance_scale", f"must be a finite number, got {guidance_scale}")
    if seed is not None:
        _whole("seed", seed, 0, MAX_SEED)
    for name, value, high in (
        ("num_images_per_prompt", num_images_per_prompt, MAX_BATCH),
        ("num_videos_per_prompt", num_videos_per_prompt, MAX_BATCH),
        ("max_sequence_length", max_sequence_length, MAX_SEQUENCE_LENGTH),
    ):
        if value is not None:
            _whole(name, value, 1, high)
    geometry = getattr(pipeline, "geometry", None)
    beyond = getattr(geometry, "beyond_positions", None)
    if beyond is not None:
        names = {"height": "height", "width": "width", "frames": "num_frames"}
        for side, value, why in beyond(height, width, num_frames):
            raise ArgumentError(names[side], f"{value} is too large for this model: {why}")
    most = _embedded_positions_side(pipeline)
    for name, value in (("height", height), ("width", width)):
        if most is not None and value is not None and value > most[0]:
            raise ArgumentError(name, f"{value} is too large for this model: {most[1]}")
    given = {"height": height, "width": width, "num_frames": num_frames}
    for name, most, why in _rotary_limits(pipeline) if geometry is None else ():
        if given[name] is not None and given[name] > most:
            raise ArgumentError(name, f"{given[name]} is too large for this model: {why}")
    for name, fits, why in _tiles(pipeline) if geometry is None else ():
        if given[name] is not None and not fits(given[name]):
            below = next((v for v in range(given[name] - 1, 0, -1) if fits(v)), 0)
            above = next(v for v in range(given[name] + 1, 2 * given[name] + 10**4) if fits(v))
            raise ArgumentError(name, f"{given[name]} {why} (try {_either(below, above)})")


def _tiles(pipeline: Any) -> list[tuple[str, Callable[[int], bool], str]]:
    """``(argument, fits, why)`` per dimension of a VAE that decodes only in fixed
    tiles (Allegro's: ``kernel`` a tile, ``stride`` between tiles, in pixels and frames):
    latents past the last whole tile are never decoded, and the video comes out grey
    there. Frames map to latent frames as Allegro's ``prepare_latents`` maps them."""
    pipe = getattr(pipeline, "pipe", pipeline)
    vae = getattr(pipe, "vae", None)
    config = getattr(vae, "config", None)
    name = getattr(config, "_class_name", None) or type(vae).__name__
    if name != "AutoencoderKLAllegro":
        return []
    if type(vae).__name__ != name:  # deferred: its tiles from a skeleton, nothing loads
        vae = _skeleton_from_config(name, config)
    kernel, stride = getattr(vae, "kernel", None), getattr(vae, "stride", None)
    spatial = _first_int(pipe, ("vae_scale_factor_spatial",))
    temporal = _first_int(pipe, ("vae_scale_factor_temporal",))
    if not (_ints(kernel, 3) and _ints(stride, 3) and spatial and temporal):
        return []

    if any(stride[axis] // scale < 1 for axis, scale in enumerate((temporal, spatial, spatial))):
        return []  # tiles under a latent apart: no count fits, none to suggest

    def whole_tiles(latent: int, axis: int, scale: int) -> bool:
        tile, step = kernel[axis] // scale, stride[axis] // scale
        return latent >= tile and (latent - tile) % step == 0

    def frames_fit(frames: int) -> bool:
        latent = -(-frames // temporal) if frames % 2 == 0 else -(-(frames - 1) // temporal) + 1
        return whole_tiles(latent, 0, temporal)

    def why(axis: int, unit: str) -> str:
        return (
            f"leaves part of the video undecoded: this model's VAE decodes only whole "
            f"tiles of {kernel[axis]} {unit}, {stride[axis]} apart"
        )

    return [
        ("num_frames", frames_fit, why(0, "frames")),
        ("height", lambda v: v % spatial == 0 and whole_tiles(v // spatial, 1, spatial),
         why(1, "pixels")),
        ("width", lambda v: v % spatial == 0 and whole_tiles(v // spatial, 2, spatial),
         why(2, "pixels")),
    ]  # fmt: skip


def _skeleton_from_config(class_name: str, config: Any) -> Any:
    """diffusers' ``class_name`` built from ``config`` on the meta device (no memory, no
    weights), or None where it cannot be."""
    import torch

    try:
        import diffusers

        with torch.device("meta"):
            return getattr(diffusers, class_name).from_config(dict(config))
    except Exception:  # an older diffusers, a config it does not take: no check
        return None


def _ints(value: Any, count: int) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == count
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    )


def _rotary_limits(pipeline: Any) -> list[tuple[str, int, str]]:
    """``(argument, most, why)`` per side of a diffusers pipeline whose transformer has
    a fixed count of rotary positions per axis (Wan's ``rope_max_seq_len``, every Wan
    family): a side past it fails diffusers' forward once every component loaded."""
    pipe = getattr(pipeline, "pipe", pipeline)
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    limit = getattr(config, "rope_max_seq_len", None) if config is not None else None
    patch = getattr(config, "patch_size", None) if config is not None else None
    spatial = _first_int(pipe, ("vae_scale_factor_spatial",))
    temporal = _first_int(pipe, ("vae_scale_factor_temporal",))
    if not isinstance(limit, int) or not isinstance(patch, (list, tuple)) or len(patch) != 3:
        return []
    if spatial is None or temporal is None:
        return []
    time_patch, height_patch, width_patch = (int(size) for size in patch)
    why = f"more patches than the transformer's {limit} rotary positions (its rope_max_seq_len)"
    sides = [
        ("height", limit * height_patch * spatial),
        ("width", limit * width_patch * spatial),
        ("num_frames", (limit * time_patch - 1) * temporal + 1),
    ]
    return [(name, most, f"{why}; at most {most}") for name, most in sides]


def _whole(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(name, f"expected a whole number, got {value!r}")
    if not low <= value <= high:
        raise ArgumentError(name, f"must be from {low} to {high}, got {value}")


def _either(below: int, above: int) -> str:
    return f"{below} or {above}" if below > 0 else str(above)


def shape_rule(pipeline: Any) -> ShapeRule:
    """The rule for ondeck's Wan stages (their geometry) or a diffusers pipeline (the
    runtime's ``pipe``): read from attributes and configs, so nothing loads."""
    geometry = getattr(pipeline, "geometry", None)
    if geometry is not None:
        _, height_patch, width_patch = geometry.patch_size
        return ShapeRule(
            height_step=geometry.scale_spatial * height_patch,
            width_step=geometry.scale_spatial * width_patch,
            frame_step=geometry.scale_temporal,
        )
    pipe = getattr(pipeline, "pipe", pipeline)
    return _diffusers_rule(pipe)


def _diffusers_rule(pipe: Any) -> ShapeRule:
    import inspect

    try:
        parameters = inspect.signature(type(pipe).__call__).parameters
    except (TypeError, ValueError):
        return ShapeRule()
    takes_frames = "num_frames" in parameters
    spatial = _first_int(
        pipe,
        (
            "vae_scale_factor_spatial",
            "vae_spatial_compression_ratio",
            "vae_spatial_scale_factor",  # Mochi
            "vae_scale_factor",
        ),
    )
    if spatial is None:
        return ShapeRule(takes_frames=takes_frames)
    # Pipelines that pack 2x2 latent patches into tokens themselves (Flux, Chroma,
    # QwenImage) need sides in twice the VAE's scale; the others the transformer's patch.
    patch = 2 if hasattr(type(pipe), "_pack_latents") else _transformer_patch(pipe)
    temporal = None
    if takes_frames:
        temporal = _first_int(
            pipe,
            (
                "vae_scale_factor_temporal",
                "vae_temporal_compression_ratio",
                "vae_temporal_scale_factor",
            ),
        )
        # Frames k·t+1 only where the pipeline's own default count is one (Wan 81, LTX
        # 161): Allegro's 88 shows a pipeline that takes any count.
        if temporal:
            own = _own_frames(pipe, parameters["num_frames"].default, temporal)
            if not any(n % temporal == 1 % temporal for n in own):
                temporal = None
    step = spatial * patch
    return ShapeRule(step, step, temporal if temporal and temporal > 1 else None, takes_frames)


def _own_frames(pipe: Any, default: Any, temporal: int) -> tuple[int, ...]:
    """The frame counts the pipeline's call makes when given none: its signature's
    ``default``, else what its transformer's ``sample_frames`` makes, in latent frames
    (Allegro's 22, 88 frames) or in frames (CogVideoX's 49). Both where not known:
    ``(1,)``, so that the k·t+1 rule holds."""
    if isinstance(default, int) and not isinstance(default, bool):
        return (default,)
    model = getattr(pipe, "transformer", None)  # a deferred component answers .config
    config = getattr(model, "config", None)
    sample = getattr(config, "sample_frames", None) if config is not None else None
    if isinstance(sample, int) and not isinstance(sample, bool) and sample > 0:
        return (sample, sample * temporal)
    return (1,)


def _embedded_positions_side(pipeline: Any) -> tuple[int, str] | None:
    """The longest side in pixels an SD3-style transformer has learned positions for
    (its ``pos_embed_max_size`` patches a side; AuraFlow's, the side of a square grid of
    that many), and why; None where there is no such limit. diffusers' forward would fail
    on a longer side once every component loaded."""
    pipe = getattr(pipeline, "pipe", pipeline)
    model = getattr(pipe, "transformer", None)
    config = getattr(model, "config", None)
    positions = getattr(config, "pos_embed_max_size", None) if config is not None else None
    class_name = str(getattr(config, "_class_name", "") or type(model).__name__)
    spatial = _first_int(pipe, ("vae_scale_factor",))
    if not isinstance(positions, int) or spatial is None:
        return None
    counted = "its pos_embed_max_size"
    if class_name.startswith("AuraFlow"):
        # Its pos_embed_max_size counts a whole square grid's positions, not a side's.
        positions, counted = math.isqrt(positions), f"the side of its {positions}-position grid"
    elif not class_name.startswith("SD3"):
        return None
    patch = _transformer_patch(pipe)
    most = positions * patch * spatial
    return most, (
        f"more than the transformer's {positions} positions a side ({counted}) "
        f"of {patch * spatial}-pixel patches; at most {most}"
    )


def _first_int(pipe: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(pipe, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _transformer_patch(pipe: Any) -> int:
    # A deferred component answers ``.config`` from its spec, without loading.
    model = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    config = getattr(model, "config", None)
    patch = getattr(config, "patch_size", None) if config is not None else None
    if isinstance(patch, (list, tuple)) and patch:
        patch = patch[-1]
    return patch if isinstance(patch, int) and not isinstance(patch, bool) and patch > 0 else 1


def warn_if_cut(tokenizer: Any, prompt: str, limit: int, reader: str) -> None:
    """Warn when ``prompt`` has more tokens than the ``limit`` its text encoder reads
    (``max_sequence_length``): the tokenizer cuts the rest without a word."""
    if len(prompt) + 2 <= limit:  # a token is a character or more: nothing to count
        return
    count = len(tokenizer(prompt, truncation=False, verbose=False).input_ids)
    if count > limit:
        warnings.warn(
            f"the prompt is {count} tokens and {reader} reads the first {limit} "
            "(max_sequence_length); the rest is left out",
            stacklevel=3,
        )


def own_call_sizes(pipe: Any) -> dict[str, int]:
    """The ``height``, ``width`` and ``num_frames`` a diffusers pipeline's call makes when
    given none: its signature's defaults, else the size it computes (``own_size``). What
    it computes otherwise (CogVideoX's frame count) is left out."""
    try:
        parameters = inspect.signature(type(pipe).__call__).parameters
    except (TypeError, ValueError):
        return {}
    sizes = {
        name: parameters[name].default
        for name in ("height", "width", "num_frames")
        if name in parameters and _is_side(parameters[name].default)
    }
    if "height" in parameters and not {"height", "width"} <= sizes.keys():
        computed = own_size(pipe)
        if computed is not None:
            sizes = {"height": computed[0], "width": computed[1], **sizes}
    return sizes


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
