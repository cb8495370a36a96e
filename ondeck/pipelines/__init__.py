"""Pipelines built on ondeck stages (the choice of one for a folder: ``ondeck.folder_pipelines``)."""

from __future__ import annotations

import os
from typing import Any

from ..loading import ModelFolder


def read_model_index(path: str | os.PathLike) -> dict[str, Any]:
    """The folder's model_index.json, checked as ModelFolder checks it: a JSON object of
    UTF-8 text whose component names stay inside the folder; else one LoadError."""
    return ModelFolder.open(path).model_index
