"""benchmarks/fp8.py with its GPU children faked: which modes run with which arguments,
and the comparison it prints and writes (per-frame latent differences, ratios)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GiB = 2**30


@pytest.fixture
def fp8_script(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    for name in ("common", "wan_modes", "fp8"):
        sys.modules.pop(name, None)
    import fp8

    yield fp8
    for name in ("common", "wan_modes", "fp8"):
        sys.modules.pop(name, None)


def fake_child(commands: list):
    reference = torch.zeros(1, 16, 3, 4, 4)

    def run_child(command, timeout):
        commands.append(command)
        mode = command[command.index("--child") + 1]
        if mode == "reload":
            rate = {"file_bytes": 10 * GiB, "stored_bytes": 5 * GiB, "file_gb_per_second": 20.0}
            return {"reload": {"transformer bf16": rate, "transformer fp8": rate}}
        latents = reference.clone()
        if mode.startswith("fp8"):
            latents[0, :, 1] += 0.5  # the second latent frame differs by 0.5
        path = command[command.index("--latents") + 1]
        torch.save([latents] * 3, path)
        seconds = 10.0 if mode == "bf16-eager" else 11.0
        row = {
            "runs": [{"seconds": seconds, "bytes_streamed": 0}] * 3,
            "latents_file": path,
            "resident_bytes": {"text_encoder": 10 * GiB, "transformer": 26 * GiB},
        }
        if mode.startswith("fp8"):
            row["resident_bytes"] = {"text_encoder": 6 * GiB, "transformer": 13 * GiB}
            row["plan_summary"] = "keeps the transformer whole"
        return row

    return run_child


def test_every_mode_runs_in_its_own_process_and_the_comparison_is_written(
    fp8_script, monkeypatch, tmp_path, capsys
):
    commands: list = []
    monkeypatch.setattr(fp8_script, "ready_wan14b_folder", lambda folder: (folder, {"vae": 1}))
    monkeypatch.setattr(fp8_script, "run_child", fake_child(commands))
    fp8_script.main(["--folder", str(tmp_path / "wan")])

    modes = [command[command.index("--child") + 1] for command in commands]
    assert modes == ["bf16-eager", "fp8-full", "fp8-16", "fp8-8", "reload"]
    memory = {
        mode: command[command.index("--memory-gib") + 1] if "--memory-gib" in command else None
        for mode, command in zip(modes, commands, strict=True)
    }
    assert memory == {
        "bf16-eager": None,
        "fp8-full": None,
        "fp8-16": "16",
        "fp8-8": "8",
        "reload": None,
    }

    document = json.loads((tmp_path / "out" / "fp8.json").read_text())
    summary = document["summary"]
    assert summary["resident_bytes"]["ratio"] == pytest.approx(19 / 36)
    assert summary["fp8-16"]["vs_eager"] == pytest.approx(1.1)
    difference = summary["fp8-8"]["latent_difference"][0]
    assert difference["max_abs"] == [0.0, 0.5, 0.0]
    assert difference["mean_abs"] == [0.0, 0.5, 0.0]
    assert summary["fp8-8"]["latents_equal_fp8_full"] == [True, True, True]

    table = capsys.readouterr().out.split("fp8 storage (float8_e4m3fn")[-1]
    assert "resident text encoder + transformer: bf16 36.00 GiB, fp8 19.00 GiB (0.528x)" in table
    assert "fp8-16" in table and "transformer fp8" in table


def test_the_arguments_parse_without_a_gpu(fp8_script):
    args = fp8_script.build_parser().parse_args(["--modes", "fp8-16,reload", "--runs", "2"])
    assert (args.modes, args.runs, args.child) == ("fp8-16,reload", 2, None)
    with pytest.raises(SystemExit):
        fp8_script.main(["--modes", "fp8-4"])
