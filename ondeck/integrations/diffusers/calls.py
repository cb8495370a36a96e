"""What a diffusers call is checked for before it runs, and what it restores when the
runtime runs it again: its prompt (cleaning it needs ftfy; a prompt longer than its text
encoder reads), and its random generators' states."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...arguments import warn_if_cut
from ...errors import OndeckError

__all__ = [
    "CHECKED_KEYWORDS",
    "INPUT_ARGUMENTS",
    "call_with_progress",
    "check_prompt_cleaning",
    "frames_of",
    "generator_states",
    "restore_generators",
    "warn_if_truncated",
]

# A call's inputs a VAE encodes before the denoising loop (image-to-video, edits, img2img).
INPUT_ARGUMENTS = ("image", "video", "control_image")

# Keyword arguments of the call that the one check bounds, as it does the named ones.
CHECKED_KEYWORDS = ("num_images_per_prompt", "num_videos_per_prompt", "max_sequence_length")


def warn_if_truncated(pipe: Any, prompt: Any, parameters: Any, arguments: dict) -> None:
    """``warn_if_cut`` with the tokenizer of the pipeline's ``max_sequence_length``: its
    T5 or Llama one (CLIP's 77 are left to diffusers, which says so itself)."""
    if not isinstance(prompt, str) or "max_sequence_length" not in parameters:
        return
    limit = arguments.get("max_sequence_length", parameters["max_sequence_length"].default)
    if not isinstance(limit, int):
        return
    for name in ("tokenizer_3", "tokenizer_2", "tokenizer"):
        tokenizer = getattr(pipe, name, None)
        if tokenizer is not None and getattr(tokenizer, "model_max_length", 0) > 77:
            warn_if_cut(tokenizer, prompt, limit, type(pipe).__name__)
            return


def check_prompt_cleaning(pipeline_class: type) -> None:
    """``OndeckError`` before anything loads when the pipeline cleans its prompt with
    ftfy and ftfy is not installed: some diffusers pipelines (Wan's image-to-video, VACE,
    SkyReels-V2) call ``ftfy.fix_text`` whether or not it is there, and the call failed
    with ``NameError: name 'ftfy' is not defined``."""
    module = sys.modules.get(pipeline_class.__module__)
    code = getattr(getattr(module, "basic_clean", None), "__code__", None)
    if code is None or "ftfy" not in code.co_names or hasattr(module, "ftfy"):
        return
    if "is_ftfy_available" in code.co_names:
        return  # it asks first (Wan's text-to-video): no ftfy, no cleaning
    raise OndeckError(
        f"{pipeline_class.__name__} cleans each prompt with the ftfy package (diffusers "
        "calls ftfy.fix_text), which is not installed here: pip install ftfy"
    )


def generator_states(arguments: dict[str, Any]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Each ``torch.Generator`` the call was given, with its state now."""
    given = arguments.get("generator")
    generators = given if isinstance(given, (list, tuple)) else [given]
    return [(g, g.get_state()) for g in generators if isinstance(g, torch.Generator)]


def restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in states:
        generator.set_state(state)


def call_with_progress(
    pipe: Any, arguments: dict, parameters: Any, progress: Any, given: dict
) -> Any:
    """``pipe(**arguments, **given)`` with ``progress`` (a tqdm bar) advanced once per
    denoising step through the call's step callback (the caller's own still called), and
    the pipeline's own bar off meanwhile."""
    arguments = dict(arguments)
    given = dict(given)
    bar_config = None
    if progress is not None and "callback_on_step_end" in parameters:
        callback = given.pop("callback_on_step_end", None)

        def advance(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
            progress.update(1)
            return callback(pipe, step, timestep, tensors) if callback is not None else {}

        arguments["callback_on_step_end"] = advance
        bar_config = dict(getattr(pipe, "_progress_bar_config", {}))
        pipe.set_progress_bar_config(**{**bar_config, "disable": True})
    arguments.update(given)
    try:
        return pipe(**arguments)
    finally:
        if bar_config is not None:
            pipe._progress_bar_config = bar_config


def frames_of(output: Any) -> Any:
    """A call's ``frames``; images as one-frame videos (B×1×H×W×C)."""
    import numpy as np

    frames = getattr(output, "frames", None)
    if frames is not None:
        return frames
    images = np.asarray(output.images)
    return images[:, None] if images.ndim == 4 else images
