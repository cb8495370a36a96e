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
    "check_prompt_cleaning",
    "generator_states",
    "restore_generators",
    "warn_if_truncated",
]

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
