"""storage_dtype through ondeck.diffusers.from_pretrained, and --weights fp8 in the CLI."""

from __future__ import annotations

import json

import numpy as np
import torch
from references import in_fresh_tensors

import ondeck
import ondeck.diffusers
from ondeck.cli import main

from .conftest import FP8

CALL = dict(
    prompt="a fox",
    negative_prompt="",
    num_inference_steps=2,
    output_type="np",
    height=32,
    width=32,
    num_frames=5,
    guidance_scale=5.0,
    max_sequence_length=16,
)


def run(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe(**CALL, generator=torch.Generator("cpu").manual_seed(0)).frames


def test_from_pretrained_fp8_transformer_equals_diffusers_layerwise_casting(wan_bf16):
    from diffusers import WanPipeline

    reference = in_fresh_tensors(WanPipeline.from_pretrained(wan_bf16, torch_dtype=torch.bfloat16))
    reference.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    expected = [run(reference), run(reference)]

    pipe = ondeck.diffusers.from_pretrained(
        wan_bf16,
        torch_dtype=torch.bfloat16,
        device="cpu",
        policy="release",
        storage_dtype={"transformer": "fp8"},
    )
    for call, frames in enumerate(expected):
        assert np.array_equal(run(pipe), frames), f"call {call + 1}"
        assert not ondeck.is_loaded(pipe.transformer)  # released, and reloaded in fp8


def test_from_pretrained_fp8_keeps_the_vae_and_computes_the_text_encoder_in_bf16(wan_bf16):
    pipe = ondeck.diffusers.from_pretrained(
        wan_bf16, torch_dtype=torch.bfloat16, device="cpu", policy="budget", storage_dtype="fp8"
    )
    plain = ondeck.diffusers.from_pretrained(
        wan_bf16, torch_dtype=torch.bfloat16, device="cpu", policy="budget"
    )
    frames = run(pipe)
    assert np.isfinite(frames).all()
    assert pipe.text_encoder.dtype == torch.bfloat16
    assert pipe.text_encoder.shared.weight.dtype == FP8
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == FP8
    assert {p.dtype for p in pipe.vae.parameters()} == {torch.bfloat16}
    ours, theirs = pipe.ondeck.plan().component_bytes, plain.ondeck.plan().component_bytes
    assert ours["transformer"] < theirs["transformer"]
    assert ours["text_encoder"] < theirs["text_encoder"]
    assert ours["vae"] == theirs["vae"]


def test_cli_plan_with_weights_fp8_counts_fp8_bytes_and_shows_both_choices(wan_bf16, capsys):
    code = main(["plan", str(wan_bf16), "--device", "cpu", "--dtype", "bf16", "--budget", "1GiB"])
    as_computed = capsys.readouterr().out
    assert code == 0
    code = main(
        ["plan", str(wan_bf16), "--device", "cpu", "--dtype", "bf16", "--weights", "fp8"]
        + ["--budget", "1GiB"]
    )
    in_fp8 = capsys.readouterr().out
    assert code == 0

    def transformer_line(text):
        return next(line for line in text.splitlines() if line.strip().startswith("transformer "))

    assert transformer_line(in_fp8) != transformer_line(as_computed)
    for text in (as_computed, in_fp8):
        assert "what fits 1.00 GiB, by how the weights are stored:" in text
        assert "  bfloat16: keeps the vae whole, nothing streamed" in text
        assert "  fp8 (text_encoder, transformer): keeps the vae whole, nothing streamed" in text


def test_cli_weights_names_components(wan_bf16, capsys):
    code = main(
        ["plan", str(wan_bf16), "--device", "cpu", "--dtype", "bf16"]
        + ["--weights", "transformer=fp8", "--budget", "1GiB"]
    )
    assert code == 0
    assert "  fp8 (text_encoder, transformer): " in capsys.readouterr().out


def test_cli_refuses_a_weights_choice_it_cannot_store(wan_bf16, capsys):
    code = main(["plan", str(wan_bf16), "--device", "cpu", "--weights", "int4"])
    error = capsys.readouterr().err.strip()
    assert code == 2
    assert error.startswith("ondeck: error: argument --weights: storage dtype 'int4' is not one")
    assert len(error.splitlines()) == 1


def test_cli_generate_with_weights_fp8_reports_fp8_bytes(wan_bf16, tmp_path, capsys):
    fast = ["--device", "cpu", "--dtype", "bf16", "--height", "16", "--width", "16"]
    fast += ["--frames", "5", "--steps", "1", "--policy", "release"]
    reports = {}
    for weights in (None, "fp8"):
        out = tmp_path / str(weights)
        extra = ["--weights", weights] if weights else []
        code = main(["generate", str(wan_bf16), *fast, "--output", str(out), *extra])
        assert code == 0, capsys.readouterr().err
        reports[weights] = json.loads((out / "report.json").read_text())
    assert reports["fp8"]["weights"] == "fp8"
    assert reports[None]["weights"] == "as computed"
    fp8_bytes, bf16_bytes = (reports[w]["component_bytes"] for w in ("fp8", None))
    assert fp8_bytes["transformer"] < bf16_bytes["transformer"]
    assert fp8_bytes["text_encoder"] < bf16_bytes["text_encoder"]
    assert fp8_bytes["vae"] == bf16_bytes["vae"]
