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
    for name in ("common", "wan_suite", "streaming", "vs_mmgp"):
        sys.modules.pop(name, None)
    import streaming
    import vs_mmgp
    import wan_suite

    commands: list[list[str]] = []
    clock = {"now": 0.0}

    def run_child(command, timeout):
        commands.append(command)
        mode = command[command.index("--mode") + 1]
        clock["now"] += {"diffusers-eager": 60, "mmgp-1": 80}.get(mode, 50)
        run = {"seconds": 10.0, "bytes_streamed": 0}
        return {"runs": [run, run], "peak_allocated_bytes": 2**30, "peak_rss_bytes": 2**30}

    monkeypatch.setattr(wan_suite, "ready_wan14b_folder", lambda folder: (folder, {"vae": 1}))
    monkeypatch.setattr(wan_suite, "run_child", run_child)
    monkeypatch.setattr(wan_suite.time, "perf_counter", lambda: clock["now"])
    yield streaming, vs_mmgp, commands
    for name in ("common", "wan_suite", "streaming", "vs_mmgp"):
        sys.modules.pop(name, None)


def mode_of(command: list[str]) -> str:
    return command[command.index("--mode") + 1]


def test_modes_run_in_order_with_their_device_and_are_skipped_past_the_deadline(
    scripts, monkeypatch, capsys
):
    streaming, _, commands = scripts
    monkeypatch.setattr(
        sys,
        "argv",
        ["streaming.py", "--modes", "eager,stream-24,model-offload", "--deadline-s", "200"],
    )
    streaming.main()
    # eager (60 s) and stream-24 (50 s) fit; model-offload needs ~165 s of the 90 left.
    assert [mode_of(c) for c in commands] == ["diffusers-eager", "ondeck-stream"]
    assert commands[1][commands[1].index("--memory-gib") + 1] == "24"
    assert "--memory-gib" not in commands[0]
    out = capsys.readouterr().out
    assert "model-offload: skipped" in out
    assert "--modes model-offload" in out


def test_mmgp_modes_that_cannot_import_are_rows_with_the_reason(scripts, monkeypatch):
    _, vs_mmgp, commands = scripts
    monkeypatch.setattr(vs_mmgp, "importable", lambda name: name != "mmgp")
    monkeypatch.setattr(
        sys, "argv", ["vs_mmgp.py", "--modes", "mmgp-1,budget-32", "--mmgp-vae-bf16"]
    )
    vs_mmgp.main()
    assert [mode_of(c) for c in commands] == ["ondeck-budget-prefetch"]
    assert commands[0][-6:-4] == ["--host-cache-gib", "64"]
    assert "--mmgp-vae-bf16" not in commands[0]


def test_the_mmgp_flag_reaches_only_mmgp_modes(scripts, monkeypatch):
    _, vs_mmgp, commands = scripts
    monkeypatch.setattr(vs_mmgp, "importable", lambda name: True)
    monkeypatch.setattr(sys, "argv", ["vs_mmgp.py", "--modes", "mmgp-1,eager", "--mmgp-vae-bf16"])
    vs_mmgp.main()
    assert [mode_of(c) for c in commands] == ["mmgp-1", "diffusers-eager"]
    assert "--mmgp-vae-bf16" in commands[0] and "--mmgp-vae-bf16" not in commands[1]


def test_results_are_written_with_the_rows_and_the_skipped_modes(scripts, monkeypatch, tmp_path):
    import json

    streaming, vs_mmgp, _ = scripts
    monkeypatch.setattr(
        sys, "argv", ["streaming.py", "--modes", "eager,model-offload", "--deadline-s", "100"]
    )
    streaming.main()
    written = json.loads((tmp_path / "streaming.json").read_text())
    assert [row["name"] for row in written["rows"]] == ["eager"]
    assert written["skipped"] == ["model-offload"] and written["folder_bytes"] == {"vae": 1}
    monkeypatch.setattr(vs_mmgp, "importable", lambda name: True)
    monkeypatch.setattr(sys, "argv", ["vs_mmgp.py", "--modes", "eager", "--mmgp-vae-bf16"])
    vs_mmgp.main()
    written = json.loads((tmp_path / "vs_mmgp.json").read_text())
    assert [row["name"] for row in written["rows"]] == ["eager"]
    assert written["mmgp_vae"] == "bfloat16 (mmgp default)" and "targets" in written
