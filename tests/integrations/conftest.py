"""Tiny pipeline folders, each built once per session, and diffusers' own outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from references import in_fresh_tensors

from .breadth_pipelines import ALL_FAMILIES as FAMILIES
from .tiny_pipelines import run


class Folders:
    """Builds a family's folder on first use; later tests reuse it."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._built:
            path = self.root / name
            FAMILIES[name].build(path)
            self._built[name] = path
        return self._built[name]


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    return Folders(tmp_path_factory.mktemp("pipelines"))


class References:
    """Calls of each family through plain ``<cls>.from_pretrained``: ``references[name]``,
    two consecutive calls with its weights copied into fresh tensors (what ondeck must
    match bit for bit); ``references.plain(name)``, one call as loaded (what ondeck must
    come close to)."""

    def __init__(self, folders: Folders):
        self.folders = folders
        self._plain: dict[str, Any] = {}
        self._fresh: dict[str, list] = {}

    def _compute(self, name: str) -> None:
        if name not in self._fresh:
            family = FAMILIES[name]
            pipe = family.pipeline_type().from_pretrained(self.folders[name])
            pipe.set_progress_bar_config(disable=True)
            self._plain[name] = run(pipe, family)
            in_fresh_tensors(pipe)
            self._fresh[name] = [run(pipe, family), run(pipe, family)]

    def __getitem__(self, name: str) -> list:
        self._compute(name)
        return self._fresh[name]

    def plain(self, name: str) -> Any:
        self._compute(name)
        return self._plain[name]


@pytest.fixture(scope="session")
def references(folders: Folders) -> References:
    return References(folders)
