"""fp8_scaled files as trainers and ComfyUI write them: the marker under the model's
prefix, and conversions that pick the tensors they change by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import (
    FP8,
    _is_stored,
    fp8_scaled_file,
    frames,
    load,
    original_name,
    reference_frames,
    with_transformer,
)


def test_an_fp8_scaled_file_whose_marker_carries_the_model_prefix(base, weights, tmp_path):
    """A checkpoint whose keys carry ``model.diffusion_model.`` carries it on its marker
    too: the marker is the format's, not a tensor of the model, under either name."""
    path, folder = fp8_scaled_file(weights, base, tmp_path)
    tensors = load_file(str(path))
    tensors["model.diffusion_model.scaled_fp8"] = tensors.pop("scaled_fp8")
    prefixed = tmp_path / "wan_fp8_scaled_prefixed.safetensors"
    save_file(tensors, str(prefixed))

    pipe = load(base, "release", components={"transformer": prefixed})

    assert np.array_equal(frames(pipe), reference_frames(folder))


# The original names of the tensors the conversion below swaps the halves of, the way
# diffusers' HunyuanVideo conversion treats every key containing
# "final_layer.adaLN_modulation.1" (remap_norm_scale_shift_) or "img_attn_qkv"
# (remap_img_attn_qkv_), and its Wan-Animate conversion every key containing ".linear1_kv.".
SWAPPED = ".ffn.2."


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    shift, scale = tensor.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


@pytest.fixture
def name_matching_conversion(monkeypatch):
    """diffusers' Wan conversion, after a handler applied to every key that contains
    ``SWAPPED``, as diffusers' own conversions pick the tensors they split or swap."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from ondeck.loading import single_file

    def convert(checkpoint, **kwargs):
        for key in [key for key in checkpoint if SWAPPED in key]:
            checkpoint[key] = _swap_halves(checkpoint.pop(key))
        return convert_wan_transformer_to_diffusers(checkpoint, **kwargs)

    monkeypatch.setattr(single_file, "conversion_for", lambda cls: convert)


@pytest.fixture(scope="module")
def swapped_fp8_scaled(weights, base, tmp_path_factory):
    """An fp8_scaled file (ComfyUI's ``scale_weight`` beside each float8 matrix) whose
    ``ffn.2`` weights and biases are stored with their halves swapped; the folder of the
    weights it stands for."""
    root = tmp_path_factory.mktemp("swapped-scaled")
    stored, exact = {"scaled_fp8": torch.empty(0, dtype=FP8)}, {}
    for key, tensor in weights.items():
        name = original_name(key)
        if _is_stored(key, tensor):
            scale = (tensor.abs().max() / torch.finfo(FP8).max).to(torch.float32)
            weight = (tensor / scale).to(FP8)
            exact[key] = weight.to(torch.float32) * scale
            stored[name] = weight
            stored[name.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        else:
            stored[name] = exact[key] = tensor
        if SWAPPED in name:  # stored swapped; the conversion swaps it back
            stored[name] = _swap_halves(stored[name])
    path = root / "wan_swapped_fp8_scaled.safetensors"
    save_file(stored, str(path))
    return path, with_transformer(base, root / "reference", exact)


def test_an_fp8_scaled_file_through_a_conversion_that_picks_tensors_by_name(
    base, swapped_fp8_scaled, name_matching_conversion
):
    """A conversion that splits or swaps every tensor whose name holds a pattern (as
    HunyuanVideo's and Wan-Animate's do) never meets the scales: each follows the file
    weight beside it, so a scalar ``x.scale_weight`` is not split."""
    path, folder = swapped_fp8_scaled
    pipe = load(base, "release", components={"transformer": path})

    assert np.array_equal(frames(pipe), reference_frames(folder))


@pytest.mark.parametrize("policy", ["release", None])
def test_a_scaled_embedding_a_t5_shares_computes_scaled_under_both_names(base, tmp_path, policy):
    """A UMT5 fp8_scaled file whose ``shared.weight`` has its scale: the encoder looks its
    tokens up through ``encoder.embed_tokens``, the same tensor under another name,
    which computes scaled too. The prompt's encoding equals diffusers' over the weights
    the file stands for."""
    from diffusers import WanPipeline

    import ondeck.diffusers

    tensors = load_file(str(base / "text_encoder" / "model.safetensors"))
    stored, exact = {"scaled_fp8": torch.empty(0, dtype=FP8)}, {}
    for key, tensor in tensors.items():
        if key.endswith(".weight") and tensor.dim() == 2:
            scale = (tensor.abs().max() / torch.finfo(FP8).max).float()
            stored[key] = (tensor / scale).to(FP8)
            stored[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
            exact[key] = stored[key].float() * scale
        else:
            stored[key] = exact[key] = tensor
    assert "shared.weight" in exact and "shared.scale_weight" in stored
    path = tmp_path / "umt5_fp8_scaled.safetensors"
    save_file(stored, str(path))
    folder = tmp_path / "exact"
    shutil.copytree(base, folder)
    save_file(exact, str(folder / "text_encoder" / "model.safetensors"))

    def encoded(pipe):
        return pipe.encode_prompt("a fox", negative_prompt="blurry", max_sequence_length=16)

    expected = encoded(WanPipeline.from_pretrained(folder, dtype=torch.float32))
    options = {} if policy is None else {"policy": policy}
    pipe = ondeck.diffusers.from_pretrained(
        base, dtype=torch.float32, device="cpu", components={"text_encoder": path}, **options
    )
    for got, want in zip(encoded(pipe), expected, strict=True):
        assert torch.equal(got, want)
