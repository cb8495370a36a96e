from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from ondeck.embedded import build_wan_folder

from .helpers import generate, wan


@pytest.fixture(scope="session")
def tiny_template(tmp_path_factory) -> Path:
    """The tiny Wan folder, built once; never damaged (tests damage ``tiny_folder``)."""
    return build_wan_folder(tmp_path_factory.mktemp("reliability") / "tiny", preset="tiny")


@pytest.fixture
def tiny_folder(tiny_template, tmp_path) -> Path:
    """A private copy of the tiny Wan folder, free to damage."""
    return Path(shutil.copytree(tiny_template, tmp_path / "wan"))


@pytest.fixture(scope="session")
def default_template(tmp_path_factory) -> Path:
    """The embedded default preset (about 230 MB of weights): large enough for RSS to see."""
    return build_wan_folder(tmp_path_factory.mktemp("reliability") / "default", preset="default")


@pytest.fixture(scope="session")
def clean_frames(tiny_template):
    """Frames of an undisturbed run; also settles lazy imports before memory is measured."""
    return generate(wan(tiny_template))


@pytest.fixture(scope="session")
def clean_default_frames(default_template):
    return generate(wan(default_template))


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test.

    A process started in the background by a non-interactive shell inherits SIGINT
    ignored, and Python then leaves it ignored: Ctrl-C would not be simulated at all.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
