"""benchmarks/experiments/feed_contention.py on the CPU, small: every row measured, and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "feed_contention.py"


def test_feed_contention_measures_every_row_and_writes_its_json(tmp_path):
    environment = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--mib", "64"],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads((tmp_path / "feed_contention.json").read_text())
    rows = document["rows"]
    assert [(row["beside"], row["slots"]) for row in rows] == [
        (beside, slots)
        for beside in ("alone", "torch ops", "pure Python", "pure Python, switch 0.5 ms")
        for slots in (24, 6)
    ]
    assert document["bytes"] == 64 * 2**20
    assert all(row["gb_per_second"] > 0 for row in rows)
    assert [row["of_alone"] for row in rows[:2]] == [1.0, 1.0]
    assert "of alone" in done.stdout
