"""float8 and fp8_scaled single files: stored as they are, computed as their format says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ondeck.errors import LoadError
from ondeck.loading import HostCache

from .conftest import (
    FP8,
    float8_file,
    fp8_scaled_file,
    frames,
    load,
    original_name,
    reference_frames,
    streamed_passes,
)

POLICIES = ["eager", "release", "budget", "streaming"]


def loaded_transformer(pipe):
    return pipe.transformer.materialize()


@pytest.fixture(scope="module")
def float8_reference(float8):
    return reference_frames(float8[1])


@pytest.fixture(scope="module")
def scaled_reference(fp8_scaled):
    return reference_frames(fp8_scaled[1])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_float8_file_stays_float8_and_computes_the_upcast_weights(
    base, float8, float8_reference, policy
):
    pipe = load(base, policy, components={"transformer": float8[0]})

    assert np.array_equal(frames(pipe), float8_reference)
    assert np.array_equal(frames(pipe), float8_reference)
    if policy == "streaming":
        assert streamed_passes(pipe) > 0
    weight = loaded_transformer(pipe).blocks[0].attn1.to_q.weight
    assert weight.dtype == FP8, "kept as stored: one byte a weight"


@pytest.fixture(scope="module")
def e5m2(weights, base, tmp_path_factory):
    """The float8_e5m2 file, its reference folder and that folder's frames."""
    path, folder = float8_file(weights, base, tmp_path_factory.mktemp("e5m2"), torch.float8_e5m2)
    return path, reference_frames(folder)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_float8_e5m2_file_stays_e5m2_and_computes_the_upcast_weights(base, e5m2, policy):
    path, expected = e5m2
    pipe = load(base, policy, components={"transformer": path})

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    if policy == "streaming":
        assert streamed_passes(pipe) > 0
    transformer = loaded_transformer(pipe)
    assert transformer.blocks[0].attn1.to_q.weight.dtype == torch.float8_e5m2
    assert transformer.blocks[0].attn1.to_q.bias.dtype == torch.float32, "wider stays wide"


@pytest.mark.parametrize("policy", POLICIES)
def test_an_fp8_scaled_file_computes_each_weight_times_its_scale(
    base, fp8_scaled, scaled_reference, float8_reference, policy
):
    pipe = load(base, policy, components={"transformer": fp8_scaled[0]})

    output = frames(pipe)
    assert np.array_equal(output, scaled_reference)
    assert np.array_equal(frames(pipe), scaled_reference)
    assert not np.array_equal(output, float8_reference)
    transformer = loaded_transformer(pipe)
    assert transformer.blocks[0].attn1.to_q.weight.dtype == FP8
    assert not hasattr(transformer.blocks[0].attn1.to_q, "scale_weight"), "no stray tensor"


def test_the_scales_are_applied_once_however_often_the_layer_runs(base, fp8_scaled):
    pipe = load(base, "release", components={"transformer": fp8_scaled[0]})
    transformer = loaded_transformer(pipe)
    layer = transformer.blocks[1].ffn.net[2]
    stored = layer.weight.detach().clone()
    inputs = torch.randn(3, layer.in_features)

    first, second = layer(inputs), layer(inputs)

    assert torch.equal(first, second)
    assert torch.equal(layer.weight, stored), "the stored weight is put back as it was"
    assert layer.weight.dtype == FP8


def test_a_scaled_layers_unscaled_float8_tensors_are_upcast_for_its_forward(
    base, fp8_scaled, tmp_path
):
    """A layer whose weight has a scale and whose bias is float8 as well, with none: the
    forward computes with the weight times its scale and the bias upcast."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(fp8_scaled[0]))
    bias_key = next(key for key in tensors if key.endswith("blocks.1.ffn.2.bias"))
    tensors[bias_key] = tensors[bias_key].to(FP8)
    path = tmp_path / "fp8_bias.safetensors"
    save_file(tensors, str(path))
    pipe = load(base, "release", components={"transformer": path})
    layer = loaded_transformer(pipe).blocks[1].ffn.net[2]
    assert layer.bias.dtype == FP8
    scale = tensors[bias_key.removesuffix(".bias") + ".scale_weight"]
    inputs = torch.randn(3, layer.in_features)

    expected = torch.nn.functional.linear(
        inputs, layer.weight.float() * scale, tensors[bias_key].float()
    )
    assert torch.equal(layer(inputs), expected)
    assert layer.bias.dtype == FP8, "the stored bias is put back"


@pytest.fixture
def cache_on_cpu(monkeypatch):
    """Let the host cache serve CPU loads, which it normally refuses, so its path runs."""
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    return HostCache(budget_bytes=2**30, pin=False)


@pytest.mark.parametrize("kind", ["original", "fp8_scaled"])
def test_a_single_file_reloads_from_the_host_cache_with_the_same_frames(
    base, original_file, fp8_scaled, reference, scaled_reference, cache_on_cpu, kind
):
    path, expected = (
        (original_file, reference) if kind == "original" else (fp8_scaled[0], scaled_reference)
    )
    pipe = load(base, "release", components={"transformer": path}, host_cache=cache_on_cpu)
    loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")

    assert np.array_equal(frames(pipe), expected)
    assert loader.last_source != "host cache"
    assert np.array_equal(frames(pipe), expected)
    assert loader.last_source == "host cache"


@pytest.mark.parametrize("policy", ["release", "streaming"])
def test_an_fp8_scaled_file_with_weight_scale_names_computes_each_weight_times_its_scale(
    weights, base, tmp_path_factory, policy
):
    """The newer naming: ``weight_scale`` beside each weight, and no ``scaled_fp8``."""
    root = tmp_path_factory.mktemp("weight-scale")
    path, folder = fp8_scaled_file(weights, base, root, suffix=".weight_scale")
    pipe = load(base, policy, components={"transformer": path})

    expected = reference_frames(folder)
    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    assert loaded_transformer(pipe).blocks[0].attn1.to_q.weight.dtype == FP8


def _resolved(base, path, dtype=None):
    """(compute dtype, storage dtype) ondeck takes for ``path`` as the transformer."""
    from ondeck.loading import ModelFolder
    from ondeck.loading.fp8 import resolve
    from ondeck.loading.single_file import SingleFileFolder

    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": path})
    return resolve(folder, "transformer", dtype, None, torch.device("cpu"))


def _file_of(tensors, path):
    from safetensors.torch import save_file

    save_file({original_name(key): tensor for key, tensor in tensors.items()}, str(path))
    return path


def test_a_float8_file_given_no_dtype_computes_in_the_dtype_of_its_other_tensors(
    base, float8, weights, tmp_path
):
    assert _resolved(base, float8[0]) == (torch.float32, FP8), "its biases and norms: float32"
    every = {key: t.to(FP8) if t.is_floating_point() else t for key, t in weights.items()}
    everything_float8 = _file_of(every, tmp_path / "all_fp8.safetensors")
    assert _resolved(base, everything_float8) == (torch.bfloat16, FP8), "none wider: bf16"


def test_a_file_mixing_float8_dtypes_is_stored_in_the_one_holding_most_bytes(
    base, weights, tmp_path
):
    mixed = {}
    for key, tensor in weights.items():
        if key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2:
            mixed[key] = tensor.to(FP8)
        else:
            mixed[key] = tensor
    smallest = min((k for k, t in mixed.items() if t.dtype == FP8), key=lambda k: mixed[k].numel())
    mixed[smallest] = weights[smallest].to(torch.float8_e5m2)
    path = _file_of(mixed, tmp_path / "mixed.safetensors")
    assert _resolved(base, path, torch.float32) == (torch.float32, FP8)


def test_an_fp8_scaled_file_with_a_scale_of_several_values_is_refused(base, fp8_scaled, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(fp8_scaled[0]))
    key = next(key for key in tensors if key.endswith(".scale_weight"))
    tensors[key] = tensors[key].reshape(1).repeat(4)  # one scale per row: not this format
    path = tmp_path / "per_row.safetensors"
    save_file(tensors, str(path))

    with pytest.raises(LoadError, match=rf"scale '{key}' holds 4 values; ondeck applies one"):
        load(base, "release", components={"transformer": path}).transformer.materialize()


def test_a_tensor_joined_from_weights_of_two_scales_is_refused(base, fp8_scaled, monkeypatch):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from ondeck.loading import single_file

    def joining(checkpoint, **kwargs):
        converted = convert_wan_transformer_to_diffusers(checkpoint, **kwargs)
        q, k = converted["blocks.0.attn1.to_q.weight"], converted["blocks.0.attn1.to_k.weight"]
        half = q.shape[0] // 2
        converted["blocks.0.attn1.to_q.weight"] = torch.cat([q[:half], k[half:]])
        return converted

    monkeypatch.setattr(single_file, "conversion_for", lambda cls: joining)
    with pytest.raises(LoadError, match="'blocks.0.attn1.to_q.weight' joins weights with diff"):
        load(base, "release", components={"transformer": fp8_scaled[0]}).transformer.materialize()
