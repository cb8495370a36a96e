"""The command line's --transformer, --component and --lora."""

from __future__ import annotations

import json

import pytest
import torch
from cli.helpers import FAST, run

from ondeck.cli import UsageError, build_parser
from ondeck.loading import reads as reader


def test_the_flags_parse_into_files_and_scales():
    args = build_parser().parse_args(
        [
            "generate",
            "base",
            "--transformer",
            "t.safetensors",
            "--component",
            "text_encoder=te.gguf",
            "--lora",
            "a.safetensors:0.5",
            "--lora",
            "b.safetensors",
        ]
    )
    assert args.transformer == "t.safetensors"
    assert args.component == [("text_encoder", "te.gguf")]
    assert args.lora == [("a.safetensors", 0.5), ("b.safetensors", 1.0)]


def test_a_component_without_a_name_is_a_usage_error():
    with pytest.raises(UsageError, match="--component: expected NAME=FILE"):
        build_parser().parse_args(["generate", "base", "--component", "file.safetensors"])


def test_generate_with_an_original_key_transformer_and_a_lora(
    capsys, base, original_file, lora_files, tmp_path
):
    out = tmp_path / "out"
    code, _, err = run(
        capsys,
        "generate",
        base,
        "--transformer",
        original_file,
        "--lora",
        f"{lora_files['musubi']}:0.7",
        "--policy",
        "release",
        "--output",
        out,
        *FAST,
    )

    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["pipeline"] == "WanPipeline", "through diffusers' own pipeline and LoRA loading"
    assert report["component_bytes"]["transformer"] > 0
    assert (out / "video.mp4").is_file()
    assert report["files"] == {
        "components": {"transformer": str(original_file)},
        "loras": [[str(lora_files["musubi"]), 0.7]],
    }


def test_plan_with_a_single_file_reads_no_weights(capsys, base, original_file, monkeypatch):
    monkeypatch.setattr(reader, "read_into", lambda *a, **k: pytest.fail("a weight was read"))

    code, out, err = run(capsys, "plan", base, "--transformer", original_file, "--device", "cpu")

    assert code in (0, 1), err
    assert "transformer" in out


def test_sharding_with_a_single_file_is_refused_before_anything_loads(base, original_file):
    from ondeck.errors import LoadError
    from ondeck.folder_pipelines import pipeline_for_folder

    with pytest.raises(LoadError, match="a single-file component or a LoRA .* cannot be sharded"):
        pipeline_for_folder(base, components={"transformer": original_file}, shard=("transformer",))


def test_inspect_with_single_files_reads_no_weights_and_shows_them_as_they_load(
    capsys, base, float8, text_encoder_gguf, monkeypatch
):
    from ondeck.loading import QuantizedComponentLoader
    from ondeck.memory import format_bytes

    from .conftest import load

    files = {"transformer": float8[0], "text_encoder": text_encoder_gguf}
    planned = load(base, "release", components=files).ondeck.plan().component_bytes
    monkeypatch.setattr(reader, "read_into", lambda *a, **k: pytest.fail("a weight was read"))
    monkeypatch.setattr(QuantizedComponentLoader, "_load", lambda self: pytest.fail("loaded"))

    code, out, err = run(
        capsys,
        "inspect",
        base,
        "--transformer",
        float8[0],
        "--component",
        f"text_encoder={text_encoder_gguf}",
    )

    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "float8_e4m3fn" in rows["transformer"], "stored as the file holds it"
    assert format_bytes(planned["transformer"]) in rows["transformer"]
    assert rows["transformer"].endswith(f"from {float8[0]}")
    assert "gguf" in rows["text_encoder"]
    assert format_bytes(planned["text_encoder"]) in rows["text_encoder"]


def test_a_lora_scale_that_is_not_a_number_is_a_usage_error(capsys, base, tmp_path):
    """``--lora style.safetensors:abc`` with style.safetensors present is a typo for a
    scale: one line naming it, status 2, before anything loads (before, the whole text was
    taken for a file name that did not exist)."""
    from cli.helpers import error_lines
    from safetensors.torch import save_file

    lora = tmp_path / "style.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 48)}, str(lora))
    for scale in ("abc", "nan"):
        code, _, err = run(capsys, "generate", base, "--lora", f"{lora}:{scale}", *FAST)
        assert code == 2, err
        (line,) = error_lines(err)
        assert "the scale after ':'" in line and scale in line


@pytest.mark.parametrize("command", ["generate", "plan"])
@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--transformer", "{missing}", "--transformer"),
        ("--component", "text_encoder={missing}", "--component"),
        ("--lora", "{missing}", "--lora"),
        ("--lora", "{missing}:0.5", "--lora"),
        ("--transformer", "{folder}", "--transformer"),
    ],
)
def test_a_weight_file_that_is_not_there_is_the_flags_error(
    capsys, base, tmp_path, monkeypatch, command, flag, value, named
):
    """A path typed wrong is a wrong argument (status 2), found before a base is built or
    downloaded, not a failed load after it."""
    from cli.helpers import error_lines

    from ondeck.cli import commands

    monkeypatch.setattr(commands, "resolve_model", lambda *a: pytest.fail("resolved the base"))
    missing, folder = tmp_path / "absent.safetensors", tmp_path
    given = value.format(missing=missing, folder=folder)
    argv = [command, base, flag, given, "--device", "cpu"]
    if command == "generate":
        argv += ["--output", tmp_path / "out"]
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    (line,) = error_lines(err)
    assert line.startswith(f"ondeck: error: argument {named}: ")
    assert line.endswith("does not exist" if "absent" in given else "is not a file")
