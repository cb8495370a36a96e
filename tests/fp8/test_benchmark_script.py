"""benchmarks/fp8.py with its GPU children faked: which modes run with which arguments,
and the comparison it prints and writes (per-frame latent differences, ratios)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GiB = 2**30


@pytest.fixture
def fp8_script(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    # The script sets these for its children with setdefault: give them back after.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "ONDECK_PROGRESS", "ONDECK_RESET_PEAKS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
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
        runs = int(command[command.index("--runs") + 1])
        stages = [
            {
                "stage": "Denoise",
                "seconds": 8.0,
                "exposed_load_seconds": 0.25,
                "activation_bytes": GiB,
                "loaded_bytes": {"transformer": 13 * GiB},
                "streamed_bytes": {"transformer": 2 * GiB},
            }
        ]
        after = {"summary": "streams", "blocks": {"transformer": [12, 40]}}
        row = {
            "runs": [
                {
                    "seconds": seconds,
                    "bytes_streamed": 0,
                    "stages": stages,
                    "plan_after": after,
                    "budget_bytes": 15 * GiB,
                }
            ]
            * runs,
            "latents_file": path,
            "resident_bytes": {"text_encoder": 10 * GiB, "transformer": 26 * GiB},
        }
        if mode.startswith("fp8"):
            row["resident_bytes"] = {"text_encoder": 6 * GiB, "transformer": 13 * GiB}
            row["plan_summary"] = "keeps the transformer whole"
            row["planned_blocks_before_run_1"] = {}
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
    assert modes == [
        "bf16-eager",
        "fp8-full",
        "fp8-16",
        "fp8-8",
        "fp8-16-cache",
        "fp8-8-cache",
        "reload",
    ]
    memory = {
        mode: command[command.index("--memory-gib") + 1] if "--memory-gib" in command else None
        for mode, command in zip(modes, commands, strict=True)
    }
    assert memory == {
        "bf16-eager": None,
        "fp8-full": None,
        "fp8-16": "16",
        "fp8-8": "8",
        "fp8-16-cache": "16",
        "fp8-8-cache": "8",
        "reload": None,
    }
    cached = {
        mode for mode, command in zip(modes, commands, strict=True) if "--host-cache-gib" in command
    }
    assert cached == {"fp8-16-cache", "fp8-8-cache"}

    document = json.loads((tmp_path / "out" / "fp8.json").read_text())
    summary = document["summary"]
    assert summary["resident_bytes"]["ratio"] == pytest.approx(19 / 36)
    assert summary["fp8-16"]["vs_eager"] == pytest.approx(1.1)
    difference = summary["fp8-8"]["latent_difference"][0]
    assert difference["max_abs"] == [0.0, 0.5, 0.0]
    assert difference["mean_abs"] == [0.0, 0.5, 0.0]
    assert summary["fp8-8"]["latents_equal_fp8_full"] == [True, True, True]

    runs = {
        mode: command[command.index("--runs") + 1]
        for mode, command in zip(modes, commands, strict=True)
    }
    assert runs == {
        "bf16-eager": "3",
        "fp8-full": "1",
        "fp8-16": "3",
        "fp8-8": "3",
        "fp8-16-cache": "3",
        "fp8-8-cache": "3",
        "reload": "3",
    }

    table = capsys.readouterr().out.split("fp8 storage (float8_e4m3fn")[-1]
    assert "resident text encoder + transformer: bf16 36.00 GiB, fp8 19.00 GiB (0.528x)" in table
    assert "fp8-16" in table and "transformer fp8" in table
    lines = table.splitlines()
    assert (
        "fp8-16       2 Denoise            8.00    0.25    1.00       -  tr 13.00               tr 2.00"
        in lines
    )
    assert (
        "fp8-8 streamed blocks planned: before run 1 none; after run 1 transformer 12/40; "
        "after run 2 transformer 12/40; after run 3 transformer 12/40"
    ) in lines
    assert "fp8-8 budget per run (GiB): 15.00, 15.00, 15.00" in lines


def test_the_children_measure_peaks_per_stage(fp8_script, monkeypatch, tmp_path):
    monkeypatch.delenv("ONDECK_RESET_PEAKS", raising=False)
    seen = []

    def run_child(command, timeout):
        seen.append(os.environ.get("ONDECK_RESET_PEAKS"))
        return {"error": "faked"}

    monkeypatch.setattr(fp8_script, "ready_wan14b_folder", lambda folder: (folder, {"vae": 1}))
    monkeypatch.setattr(fp8_script, "run_child", run_child)
    fp8_script.main(["--folder", str(tmp_path / "wan"), "--modes", "fp8-16"])
    assert seen == ["1"]


def test_stage_rows_split_a_runs_loads_and_streams_by_stage(fp8_script):
    from ondeck.tracker import MemoryTracker

    tracker = MemoryTracker()
    for run in (1, 2):
        tracker.run_started()
        tracker.stage_started("Encode")
        if run == 1:
            tracker.loaded("text_encoder", 5 * GiB, 0.5)
        tracker.stage_finished("Encode")
        tracker.stage_started("Denoise")
        tracker.loaded("transformer", 13 * GiB, 0.0, exposed=False)
        tracker.waited("transformer", 0.75)
        tracker.stage_finished("Denoise")
        tracker.stage_started("Decode")
        tracker.loaded("text_encoder", 5 * GiB, 0.4, exposed=False)  # next run's, early
        tracker.stage_finished("Decode")
    rows = fp8_script.stage_rows(tracker, 2, {"transformer": 3 * GiB, "text_encoder": 0})
    assert [row["stage"] for row in rows] == ["Encode", "Denoise", "Decode"]
    assert [row["loaded_bytes"] for row in rows] == [
        {},
        {"transformer": 13 * GiB},
        {"text_encoder": 5 * GiB},
    ]
    assert [row["exposed_load_seconds"] for row in rows] == [0.0, 0.75, 0.0]
    assert [row["streamed_bytes"] for row in rows] == [{}, {"transformer": 3 * GiB}, {}]


def test_bf16_eagers_stages_are_timed_around_diffusers_calls(fp8_script):
    class Vae:
        def decode(self, latents):
            return latents

    class Processor:
        def postprocess_video(self, video, output_type="np"):
            time.sleep(0.01)
            return video

    class Pipe:
        vae = Vae()
        video_processor = Processor()

        def encode_prompt(self, prompt):
            return prompt

    pipe = Pipe()
    clock = fp8_script.StageClock(pipe)
    assert pipe.encode_prompt("a fox") == "a fox"
    assert pipe.vae.decode(3) == 3
    assert pipe.video_processor.postprocess_video(4, output_type="np") == 4
    # The frames' post-processing counts to Decode, as in ondeck's Decode stage.
    assert clock.seconds["Decode"] >= 0.01
    rows = clock.take(run_seconds=100.0)
    assert [row["stage"] for row in rows] == ["EncodePrompt", "Denoise", "Decode"]
    assert 99.0 < rows[1]["seconds"] <= 100.0
    assert sum(row["seconds"] for row in rows) == pytest.approx(100.0)
    assert clock.take(run_seconds=1.0)[1]["seconds"] == 1.0  # each run starts afresh


def test_the_arguments_parse_without_a_gpu(fp8_script):
    args = fp8_script.build_parser().parse_args(["--modes", "fp8-16,reload", "--runs", "2"])
    assert (args.modes, args.runs, args.child) == ("fp8-16,reload", 2, None)
    with pytest.raises(SystemExit):
        fp8_script.main(["--modes", "fp8-4"])
