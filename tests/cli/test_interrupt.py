"""A real Ctrl-C (SIGINT) in `python -m ondeck generate`: one line, status 130, nothing lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .helpers import listing

ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_during_a_run_prints_one_line_exits_130_and_keeps_the_previous_results(
    tiny_model, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "video.mp4").write_bytes(b"previous complete video")
    (out / "report.json").write_text('{"previous": "run"}')
    command = [sys.executable, "-m", "ondeck", "generate", str(tiny_model), "--device", "cpu"]
    command += ["--height", "32", "--width", "32", "--frames", "5", "--steps", "10000"]
    command += ["--policy", "release", "--output", str(out)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    environment["ONDECK_CACHE"] = str(tmp_path / "cache")
    process = subprocess.Popen(
        command,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell running tests in the background ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in process.stdout:  # the plan is printed just before the run starts
            if line.startswith("predicted component peak"):
                break
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert [line for line in err.splitlines() if line.strip()] == ["ondeck: interrupted"]
    assert (out / "video.mp4").read_bytes() == b"previous complete video"
    assert listing(out) == {"video.mp4", "report.json"}
