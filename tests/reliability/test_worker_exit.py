"""torchrun workers that used DTensor's collectives end with status 0, every time.

Ending as a script usually ends, gloo's threads can free their last collective's tensors
after Python began to shut down, and the process aborts (SIGABRT, "terminate called
without an active exception"); ``ondeck.distributed.end_process`` skips that teardown.
The plain ending's aborts are counted and printed (they come and go with the machine's
load), the ``end_process`` ending's must be none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ATTEMPTS = 40


def _launch(end: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(HERE / "exit_worker.py"), end]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=120
    )


@pytest.mark.soak
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch has no gloo backend",
)
def test_workers_that_end_through_end_process_never_abort(tmp_path):
    aborted = {"return": 0, "end_process": 0}
    for _ in range(ATTEMPTS):
        for end in aborted:
            done = _launch(end, tmp_path)
            if done.returncode != 0:
                assert "terminate called" in done.stderr, done.stderr[-3000:]
                aborted[end] += 1
    print(f"\nworkers aborted at exit, of {ATTEMPTS} launches each: {aborted}")
    assert aborted["end_process"] == 0
