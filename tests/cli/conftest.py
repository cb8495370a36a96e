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
