"""Pipelines built on ondeck stages, and the choice of one for a model folder."""

from __future__ import annotations

import os
from typing import Any

from ..loading import ModelFolder


def read_model_index(path: str | os.PathLike) -> dict[str, Any]:
    """The folder's model_index.json, checked as ModelFolder checks it: a JSON object of
    UTF-8 text whose component names stay inside the folder; else one LoadError."""
    return ModelFolder.open(path).model_index


def pipeline_for_folder(path: str | os.PathLike, **options: Any) -> Any:
    """The ondeck pipeline for a folder: Wan's own stages, else the diffusers integration."""
    from ..hub import resolve_model
    from .wan import WanTextToVideo, is_wan_folder

    path = resolve_model(path)  # a Hub repo id becomes its snapshot folder
    model_index = read_model_index(path)
    if is_wan_folder(model_index):
        return WanTextToVideo.from_folder(path, **options)
    from ..integrations.diffusers import from_pretrained

    return from_pretrained(path, **options).ondeck
