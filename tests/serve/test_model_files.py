"""``ondeck serve``'s single files and LoRAs, each given for one served model by name
(``--transformer MODEL=FILE``, ``--component MODEL:NAME=FILE``, ``--lora
MODEL=FILE[:SCALE]``), as ``ondeck generate`` takes them for its one model."""

from __future__ import annotations

import base64
import re

import pytest
import torch

from tests.cli.helpers import run

from .inprocess import call, make_server

IMAGES = "/v1/images/generations"


@pytest.fixture(scope="module")
def sd3_lora(models, tmp_path_factory):
    """A LoRA on every attention projection of the tiny SD3 transformer, in diffusers'
    layout, large enough to change its image."""
    from safetensors.torch import load_file, save_file

    (weights,) = (models["sd3"] / "transformer").glob("*.safetensors")
    generator = torch.Generator().manual_seed(3)
    layers = {}
    for key, tensor in load_file(str(weights)).items():
        if re.search(r"\.attn\.to_(q|k|v)\.weight$", key):
            layer = key.removesuffix(".weight")
            layers[f"transformer.{layer}.lora_A.weight"] = torch.randn(
                4, tensor.shape[1], generator=generator
            )
            layers[f"transformer.{layer}.lora_B.weight"] = torch.randn(
                tensor.shape[0], 4, generator=generator
            )
    path = tmp_path_factory.mktemp("serve-lora") / "style.safetensors"
    save_file(layers, str(path))
    return path


def image(models, tmp_path, **config) -> tuple[bytes, object]:
    server = make_server(models, tmp_path, names=("sd3",), **config)
    try:
        response = call(
            server, "POST", IMAGES, json={"model": "sd3", "prompt": "a fox", "size": "32x32"}
        )
        assert response.status_code == 200, response.text
        return base64.b64decode(response.json()["data"][0]["b64_json"]), server
    finally:
        server.stop()


def test_a_lora_given_for_a_served_model_is_on_its_pipeline(models, sd3_lora, tmp_path):
    plain, plain_server = image(models, tmp_path / "plain")
    brought = {"sd3": {"loras": [(str(sd3_lora), 0.8)]}}
    styled, server = image(models, tmp_path / "styled", brought=brought)
    runtime = server.models["sd3"].pipeline
    assert any("style" in name for name in runtime.pipe.get_active_adapters())
    sizes, plain_sizes = runtime.component_bytes(), plain_server.models["sd3"].pipeline
    assert sizes["transformer"] > plain_sizes.component_bytes()["transformer"]
    assert styled != plain


def test_serve_names_the_model_each_file_is_for(capsys, models, sd3_lora, tmp_path):
    base = ["serve", "--model", f"sd3={models['sd3']}", "--device", "cpu", "--plan"]
    code, out, err = run(capsys, *base, "--lora", f"sd3={sd3_lora}:0.8")
    assert code == 0, err
    code, _, err = run(capsys, *base, "--lora", f"wan={sd3_lora}")
    assert code == 2
    assert "argument --lora: no model named 'wan' is served (sd3)" in err
    code, _, err = run(capsys, *base, "--transformer", f"sd3={tmp_path / 'absent.safetensors'}")
    assert code == 2
    assert "absent.safetensors does not exist" in err
    code, _, err = run(capsys, *base, "--component", f"sd3=oops={sd3_lora}")
    assert code == 2
    assert "expected MODEL:NAME=FILE" in err
    code, _, err = run(capsys, *base, "--lora", f"sd3={models['sd3'] / 'model_index.json'}")
    assert code == 1
    assert "LoRA " in err and "model 'sd3'" in err
