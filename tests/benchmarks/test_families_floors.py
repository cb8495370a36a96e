"""benchmarks/families.py's two floors: the transfer floor of the streamed blocks, and
the one that also counts the resident parts a run loads again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GB = 10**9


@pytest.fixture
def families(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for name in ("common", "policies", "families"):
        sys.modules.pop(name, None)
    import families

    yield families
    for name in ("common", "policies", "families"):
        sys.modules.pop(name, None)


def run(seconds: float, stages=(), loads=()) -> dict:
    return {
        "seconds": seconds,
        "stages": [[name, compute, 0.0, 0] for name, compute in stages],
        "events": [[0.0, "load", name, nbytes, 0.1] for name, nbytes in loads],
        "call_transfer_seconds": {"transformer": 1.5},
    }


def test_the_all_bytes_floor_counts_what_each_run_loads_again(families):
    eager = {"runs": [run(1.6, [("encoder", 0.2), ("transformer", 1.4)])] * 3}
    # Streamed blocks: 10 GB a pass at 50 GB/s. Each run loads 5 GB of the encoder
    # (0.1 s: over its 0.2 s of compute by nothing) and 10 GB of the transformer (0.2 s).
    ondeck = {
        "planned_streaming": {
            "transformer": {"bytes_per_pass": 10 * GB, "predicted_seconds_per_pass": 0.2}
        },
        "runs": [run(3.0, loads=[("encoder", 5 * GB), ("transformer", 10 * GB)])] * 3,
    }

    # Eager's later runs take 1.6 s; the transformer's turn is 1.5 s of streamed blocks,
    # over its 1.4 s of compute by 0.1, and 1.7 s with its reload, over it by 0.3.
    assert families.floor_ratio(ondeck, eager) == f"{3.0 / 1.7:.3f}"
    assert families.all_bytes_floor_ratio(ondeck, eager) == f"{3.0 / 1.9:.3f}"


def test_rows_whose_eager_runs_kept_no_stages_have_no_floors(families):
    """Wan's modes keep no stages: its table shows no floor rather than failing."""
    eager = {"runs": [{"seconds": 9.6}] * 3}
    ondeck = {
        "planned_streaming": {
            "transformer": {"bytes_per_pass": 10 * GB, "predicted_seconds_per_pass": 0.2}
        },
        "runs": [run(10.3, loads=[("transformer", 6 * GB)])] * 3,
    }
    assert families.floor_ratio(ondeck, eager) == "-"
    assert families.all_bytes_floor_ratio(ondeck, eager) == "-"


def test_the_collectors_full_passes_after_run_1_are_summed(families):
    passes = [{"full_seconds": 0.9}, {"full_seconds": 0.32}, {"full_seconds": 0.0}]
    row = {"runs": [{"seconds": 2.0, "gc": gc} for gc in passes]}
    assert families.collector_seconds(row) == "0.32"  # run 1's pass is not counted
    del row["runs"][2]["gc"]  # a run that did not record it: nothing to say
    assert families.collector_seconds(row) == "-"
