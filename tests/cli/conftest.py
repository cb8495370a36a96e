from __future__ import annotations

from pathlib import Path

import pytest

from ondeck.embedded import build_wan_folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny Wan folder, built once and never changed."""
    return build_wan_folder(tmp_path_factory.mktemp("cli") / "tiny", preset="tiny")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private ondeck cache folder (embedded default, profiles), not yet created."""
    folder = tmp_path / "ondeck-cache"
    monkeypatch.setenv("ONDECK_CACHE", str(folder))
    return folder


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """A tiny folder of each family in ``integrations.breadth_pipelines``, built once."""
    from tests.integrations.breadth_pipelines import ALL_FAMILIES

    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("families")

    def folder(name: str) -> Path:
        if name not in built:
            ALL_FAMILIES[name].build(root / name)
            built[name] = root / name
        return built[name]

    return folder


@pytest.fixture
def input_image(tmp_path) -> Path:
    from PIL import Image

    path = tmp_path / "input.png"
    Image.new("RGB", (16, 16), (90, 140, 200)).save(path)
    return path
