"""From a model folder to its pipeline, and its plan: the top of the library's layers.

Wan folders get ondeck's own stages; any other diffusers folder the diffusers
integration. Both sit below this module, so choosing between them imports neither
back into the layers they are built on.
"""

from __future__ import annotations

import os
from typing import Any

from .hub import resolve_model
from .integrations.diffusers import from_pretrained
from .pipelines import read_model_index
from .pipelines.wan import WanTextToVideo, is_wan_folder
from .planning import Plan

__all__ = ["check_requirements", "pipeline_for_folder", "plan"]


def pipeline_for_folder(
    path: str | os.PathLike, *, prompt_cache: bool = True, **options: Any
) -> Any:
    """The ondeck pipeline for a folder: Wan's own stages, else the diffusers integration.

    ``prompt_cache``: encoders answer a prompt they have encoded before without loading
    (Wan's stages always do)."""
    path = resolve_model(path)  # a Hub repo id becomes its snapshot folder
    model_index = read_model_index(path)
    # Single files and LoRAs go through diffusers' own key conversions and LoRA loading.
    brought = options.get("components") or options.get("loras")
    if is_wan_folder(model_index) and not brought:
        return WanTextToVideo.from_folder(path, **options)
    return from_pretrained(path, prompt_cache=prompt_cache, **options).ondeck


def check_requirements(pipeline: Any) -> None:
    """``OndeckError`` for a package every call of ``pipeline`` needs and this host lacks
    (the ftfy some diffusers pipelines clean their prompts with); Wan's stages need none."""
    if not isinstance(pipeline, WanTextToVideo):
        pipeline.check_requirements()


def plan(source: Any, budget: int | str | None = None, **options: Any) -> Plan:
    """Predict residency for a pipeline or a model folder without reading any weights."""
    if isinstance(source, (str, os.PathLike)):
        source = pipeline_for_folder(source, **options)
    return source.plan(budget=budget)
