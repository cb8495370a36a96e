from __future__ import annotations

from pathlib import Path

import pytest

from ondeck.embedded import build_wan_folder

from .helpers import copy_folder


@pytest.fixture(scope="session")
def wan_template(tmp_path_factory) -> Path:
    """A tiny Wan folder built once; tests that change files use ``wan_folder``."""
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")


@pytest.fixture
def wan_folder(wan_template, tmp_path) -> Path:
    """A private copy of the tiny Wan folder, free to damage."""
    return copy_folder(wan_template, tmp_path / "wan")
