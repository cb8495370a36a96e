from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="ondeck serve's extra is not installed: pip install 'ondeck[serve]'"
)

from .helpers import ServerProcess, build_models  # noqa: E402

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
