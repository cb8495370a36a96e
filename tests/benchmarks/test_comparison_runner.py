"""The comparison scripts' shared runner, with the GPU parts faked: which modes run, in
what order, with which arguments, and which are skipped for time or cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def scripts(monkeypatch, tmp_path):
    """The benchmark modules, with the folder build and the child runs replaced."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OUT", str(tmp_path))
    for name in ("common", "compare"):
        sys.modules.pop(name, None)
    import common
    import compare

    commands: list[list[str]] = []
    clock = {"now": 0.0}

    def run_child(command, timeout):
        commands.append(command)
        mode = command[command.index("--mode") + 1]
        clock["now"] += {"diffusers-eager": 60, "mmgp-1": 80}.get(mode, 50)
        run = {"seconds": 10.0, "bytes_streamed": 0}
        return {"runs": [run, run], "peak_allocated_bytes": 2**30, "peak_rss_bytes": 2**30}

    monkeypatch.setattr(common, "ready_wan14b_folder", lambda folder: (folder, {"vae": 1}))
    monkeypatch.setattr(common, "run_child", run_child)
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["now"])
    yield compare, commands
    for name in ("common", "compare"):
        sys.modules.pop(name, None)


def mode_of(command: list[str]) -> str:
    return command[command.index("--mode") + 1]


def test_modes_run_in_order_with_their_device_and_are_skipped_past_the_deadline(
    scripts, monkeypatch, capsys
):
    compare, commands = scripts
    monkeypatch.setattr(
        sys,
        "argv",
        ["compare.py", "--modes", "eager,stream-24,model-offload", "--deadline-s", "200"],
    )
    compare.main()
    # eager (60 s) and stream-24 (50 s) fit; model-offload needs ~165 s of the 90 left.
    assert [mode_of(c) for c in commands] == ["diffusers-eager", "ondeck-stream"]
    assert commands[1][commands[1].index("--memory-gib") + 1] == "24"
    assert "--memory-gib" not in commands[0]
    out = capsys.readouterr().out
    assert "model-offload: skipped" in out
    assert "--modes model-offload" in out


def test_mmgp_modes_that_cannot_import_are_rows_with_the_reason(scripts, monkeypatch):
    compare, commands = scripts
    monkeypatch.setattr(compare, "importable", lambda name: name != "mmgp")
    monkeypatch.setattr(
        sys, "argv", ["compare.py", "--modes", "mmgp-1,budget-32", "--mmgp-vae-bf16"]
    )
    compare.main()
    assert [mode_of(c) for c in commands] == ["ondeck-budget-prefetch"]
    assert commands[0][-6:-4] == ["--host-cache-gib", "64"]
    assert "--mmgp-vae-bf16" not in commands[0]


def test_the_mmgp_flag_reaches_only_mmgp_modes(scripts, monkeypatch):
    compare, commands = scripts
    monkeypatch.setattr(compare, "importable", lambda name: True)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--modes", "mmgp-1,eager", "--mmgp-vae-bf16"])
    compare.main()
    assert [mode_of(c) for c in commands] == ["mmgp-1", "diffusers-eager"]
    assert "--mmgp-vae-bf16" in commands[0] and "--mmgp-vae-bf16" not in commands[1]


def test_results_are_written_with_the_rows_and_the_skipped_modes(scripts, monkeypatch, tmp_path):
    import json

    compare, _ = scripts
    monkeypatch.setattr(
        sys, "argv", ["compare.py", "--modes", "eager,model-offload", "--deadline-s", "100"]
    )
    compare.main()
    written = json.loads((tmp_path / "compare.json").read_text())
    assert [row["name"] for row in written["rows"]] == ["eager"]
    assert written["skipped"] == ["model-offload"] and written["folder_bytes"] == {"vae": 1}
    monkeypatch.setattr(compare, "importable", lambda name: True)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--modes", "eager", "--mmgp-vae-bf16"])
    compare.main()
    written = json.loads((tmp_path / "compare.json").read_text())
    assert [row["name"] for row in written["rows"]] == ["eager"]
    assert written["mmgp_vae"] == "bfloat16 (mmgp default)" and "targets" in written
