"""Which stored activation profile a diffusers call's peaks belong to.

A stage's activation peak depends on the model as loaded (its dtypes, its stored
weights), the device, and the call: frame size, frames, batch, and the settings that
change what each component computes (guidance that doubles a batch, a longer text
sequence). ``profile_identity`` names the model; ``call_profile_shape`` keys one call by
its sizes and a digest of its other settings. A stage that finishes stores its peak
under both (``ondeck.profiles``), so the first call of a later process plans with
measured peaks instead of a guess, as every call after the first does.

Before any call of a model is measured, ``token_activations`` estimates what a
transformer's pass takes from the tokens the call's latents make.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ...arguments import shape_rule
from ...memory import device_name
from ...profiles import plausible_shape
from ...token_room import feed_forward_width, token_bytes
from .turns import call_signature

__all__ = [
    "call_batch",
    "call_profile_shape",
    "call_sizes",
    "profile_identity",
    "token_activations",
]

# Arguments that never change a component's activations: how many steps, the noise's
# source, what the output is returned as, what runs between steps.
_UNSIZED = frozenset(
    {
        "num_inference_steps",
        "timesteps",
        "sigmas",
        "generator",
        "output_type",
        "return_dict",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
    }
)
# The call arguments that size a decode; nothing else of a call is kept past it.
_SIZE_ARGUMENTS = (
    "height",
    "width",
    "num_frames",
    "num_videos_per_prompt",
    "num_images_per_prompt",
)
_SIZES = (("height", "height"), ("width", "width"), ("frames", "num_frames"))
_PER_PROMPT = ("num_videos_per_prompt", "num_images_per_prompt")


def call_sizes(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The plain numbers of ``arguments`` that size the decode, and the prompt count: a
    tensor passed to the call (prompt embeddings, an image) is never held after it."""
    sizes = {
        key: arguments[key]
        for key in _SIZE_ARGUMENTS
        if isinstance(arguments.get(key), int) and not isinstance(arguments.get(key), bool)
    }
    prompt = arguments.get("prompt")
    if isinstance(prompt, list) and all(isinstance(item, str) for item in prompt):
        sizes["prompt"] = [""] * len(prompt)
    return sizes


def call_batch(sizes: Mapping[str, Any]) -> int:
    """The outputs a call makes, from its arguments or their ``call_sizes``: its prompts
    (one where it gives no list of them) times the outputs per prompt it asks for."""
    prompt = sizes.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt else 1
    for argument in _PER_PROMPT:
        value = sizes.get(argument)
        batch *= value if isinstance(value, int) and value > 0 else 1
    return batch


def profile_identity(
    pipeline_class: type,
    path: str | os.PathLike,
    dtype: Any,
    *,
    storage: Any = None,
    components: Mapping[str, Any] | None = None,
    given: Sequence[str] = (),
    loras: Sequence[Any] = (),
    parallel_degree: int | None = None,
) -> str:
    """The model a diffusers pipeline's profiles are stored under: its class and folder,
    the dtypes it computes in, and whatever changes what its components hold (weights
    stored in fp8, single files, components passed in ready-made, LoRA files, a
    context-parallel degree: each rank's activations are its slice's)."""
    parts = [pipeline_class.__name__, os.path.realpath(path), _described(dtype)]
    if storage:
        parts.append(f"stored={_described(storage)}")
    if components:
        files = ",".join(f"{n}={os.path.realpath(p)}" for n, p in sorted(components.items()))
        parts.append(f"files={files}")
    if given:
        parts.append(f"given={','.join(sorted(given))}")
    if loras:
        parts.append(f"loras={list(loras)}")
    if parallel_degree:
        parts.append(f"context_parallel={parallel_degree}")
    return ":".join(parts)


def _described(value: Any) -> str:
    """A dtype, or dtypes by component name in a stable order."""
    if isinstance(value, Mapping):
        return ",".join(f"{name}={value[name]}" for name in sorted(value))
    return str(value)


def call_profile_shape(
    args: tuple, kwargs: Mapping[str, Any], sizes: Mapping[str, Any], device: Any
) -> dict[str, Any] | None:
    """The profile shape of one call: ``sizes`` (the call's frame size, frames and prompt
    count, with the pipeline's own defaults for those it leaves out), the batch they
    make, the device, and a digest of every other setting of the call but those that
    never size an activation (``_UNSIZED``). None where a size is out of what a profile
    may hold (nothing is stored or looked up for that call)."""
    shape: dict[str, Any] = {}
    for key, argument in _SIZES:
        value = sizes.get(argument)
        if isinstance(value, int) and not isinstance(value, bool):
            shape[key] = value
    shape["batch"] = call_batch(sizes)
    settings = call_signature(args, {k: v for k, v in kwargs.items() if k not in _UNSIZED})
    shape["call"] = hashlib.sha256(repr(settings).encode()).hexdigest()[:16]
    shape["device"] = device_name(device)
    return shape if plausible_shape(shape) else None


def token_activations(pipe: Any, config: Any, sizes: Mapping[str, Any], dtype: Any) -> int | None:
    """Device bytes a transformer (``config``, computing in ``dtype``) of ``pipe`` takes
    beside its weights in a pass over the call ``sizes`` asks for (``token_room.token_bytes``): its tokens (the
    latents' sides over the VAE's scale times the patch, ``shape_rule``; the latent
    frames; the batch) and its feed-forward width. None where the call's size, the
    pipeline's scales or the width are not known: a UNet, a text encoder, a VAE."""
    width = feed_forward_width(config)
    height, side = sizes.get("height"), sizes.get("width")
    if width is None or not (isinstance(height, int) and isinstance(side, int)):
        return None
    rule = shape_rule(pipe)
    if rule.height_step <= 1 or rule.width_step <= 1:
        return None  # no scale known: the pixels would be counted as tokens
    tokens = (height // rule.height_step) * (side // rule.width_step)
    frames = sizes.get("num_frames")
    if rule.takes_frames and isinstance(frames, int) and frames > 0:
        if rule.frame_step is None:
            return None  # a pipeline taking any count: its latent frames are not known here
        tokens *= (frames - 1) // rule.frame_step + 1
    return token_bytes(tokens * call_batch(sizes), width, dtype)
