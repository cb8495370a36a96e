"""Leaving the process group and ending a torchrun worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .test_sharded import HERE, needs_gloo, torchrun


@needs_gloo
def test_ranks_leave_the_process_group_together(tmp_path):
    # Rank 0 arrives late; rank 1's shutdown returns only once it has.
    torchrun(str(HERE / "shutdown_worker.py"), str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "rank1-saw").read_text() == "yes"


ENDS = """
import atexit, sys
from pathlib import Path
from ondeck import distributed

atexit.register(lambda: Path(sys.argv[1]).write_text("exit handlers ran"))
print("unflushed line", end="")
distributed.end_process(3)
print("never printed")
"""


def test_end_process_runs_the_exit_handlers_flushes_and_keeps_the_status(tmp_path: Path):
    # It skips the interpreter's teardown (where gloo's threads abort a torchrun worker),
    # and nothing else a normal exit does.
    marker = tmp_path / "marker.txt"
    done = subprocess.run(
        [sys.executable, "-c", ENDS, str(marker)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed line"
    assert marker.read_text() == "exit handlers ran"


def test_the_command_ends_a_torchrun_worker_with_end_process(monkeypatch):
    from ondeck import cli, distributed

    ended: list[int] = []
    monkeypatch.setattr(cli, "PROCESS_DEFAULTS", {})  # leaves this process's environment be
    monkeypatch.setattr(cli, "main", lambda: 4)
    monkeypatch.setattr(distributed, "end_process", ended.append)
    assert cli.console() == 4  # not a worker: returns, and sys.exit ends as usual
    assert ended == []
    monkeypatch.setitem(distributed._state, "joined", True)
    cli.console()
    assert ended == [4]
