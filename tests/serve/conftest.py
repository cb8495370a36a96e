from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="ondeck serve's extra is not installed: pip install -e '.[serve]'"
)

from .helpers import ROOT, LiveServer, ServerProcess, build_models  # noqa: E402
from .inprocess import make_server  # noqa: E402

# Two tiny Wan models fit together (2 x 505 KiB); the SD3 model (1.53 MiB) fits beside
# a part of one, never beside a whole one: every switch to or from it evicts.
BUDGET = "1800KiB"


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="session")
def server(models, tmp_path_factory):
    """One server for the session's tests: all four models under one small budget."""
    process = ServerProcess(
        models, "--budget", BUDGET, "--steps", "2", tmp=tmp_path_factory.mktemp("serve")
    )
    yield process
    code = process.stop()
    assert code == 0, process.output()


@pytest.fixture(scope="session")
def ltx_folder(tmp_path_factory):
    """A tiny LTX folder: a diffusers video pipeline whose own size (512x704), frame rate
    (25) and frame count (161) are not Wan's."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    import tiny_pipelines

    folder = tmp_path_factory.mktemp("ltx") / "ltx"
    tiny_pipelines.build_ltx(folder)
    return folder


@pytest.fixture
def live_server(models, tmp_path):
    """Starts a server over the named models, served on a port of this process; with no
    ``steps``, a request that names none gets the models' own, as `ondeck serve` does
    without --steps."""
    started = []

    def start(names=("wan", "sd3"), **config):
        config.setdefault("steps", None)
        live = LiveServer(make_server(models, tmp_path, names=names, **config))
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def gate(monkeypatch):
    """Holds the writer thread inside write_job_files until released (a real video of
    a real model takes seconds to encode and write; this widens that window)."""
    import threading

    import ondeck.serve.server as server_module

    entered, release = threading.Event(), threading.Event()
    real = server_module.write_job_files

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(server_module, "write_job_files", held)
    yield entered, release
    release.set()
