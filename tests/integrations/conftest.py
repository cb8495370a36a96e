"""Tiny pipeline folders, each built once per session, and diffusers' own outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tiny_pipelines import FAMILIES, run


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
    """Two consecutive calls of each family through plain ``<cls>.from_pretrained``."""

    def __init__(self, folders: Folders):
        self.folders = folders
        self._outputs: dict[str, list] = {}

    def __getitem__(self, name: str) -> list:
        if name not in self._outputs:
            family = FAMILIES[name]
            pipe = family.pipeline_type().from_pretrained(self.folders[name])
            pipe.set_progress_bar_config(disable=True)
            self._outputs[name] = [run(pipe, family), run(pipe, family)]
        return self._outputs[name]


@pytest.fixture(scope="session")
def references(folders: Folders) -> References:
    return References(folders)
