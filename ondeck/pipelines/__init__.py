"""Pipelines built on ondeck stages, and the choice of one for a model folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import LoadError


def read_model_index(path: str | os.PathLike) -> dict[str, Any]:
    index = Path(path) / "model_index.json"
    if not Path(path).is_dir():
        raise LoadError(f"model folder {path} does not exist", path=str(path))
    if not index.is_file():
        raise LoadError(
            f"{index}: missing; a diffusers-format model folder has a model_index.json",
            path=str(index),
        )
    try:
        return json.loads(index.read_text())
    except json.JSONDecodeError as error:
        raise LoadError(f"{index}: not valid JSON ({error})", path=str(index)) from error


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
