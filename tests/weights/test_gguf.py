"""A GGUF transformer file beside a diffusers base folder, through diffusers' GGUF support."""

from __future__ import annotations

import numpy as np
import pytest

import ondeck

from .conftest import frames, load, reference_frames

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_reference(gguf_base, gguf_file):
    """Plain diffusers with the transformer diffusers' own from_single_file loads."""
    return diffusers_gguf_frames(gguf_base, gguf_file[0])


def diffusers_gguf_frames(base, path, lora=None):
    import torch
    from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel
    from references import in_fresh_tensors

    transformer = WanTransformer3DModel.from_single_file(
        str(path),
        config=str(base / "transformer"),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
        local_files_only=True,
    )
    pipe = WanPipeline.from_pretrained(base, transformer=transformer, dtype=torch.float32)
    if lora is not None:
        pipe.load_lora_weights(str(lora), adapter_name="lora_0")
    pipe.set_progress_bar_config(disable=True)
    return frames(in_fresh_tensors(pipe))


def test_the_gguf_file_holds_the_weights_it_was_written_from(gguf_file, gguf_reference):
    assert np.allclose(reference_frames(gguf_file[1]), gguf_reference, atol=1e-5)


@pytest.mark.parametrize("policy", ["eager", "release", "budget"])
def test_a_gguf_file_gives_the_dequantized_weights_frames(
    gguf_base, gguf_file, gguf_reference, policy
):
    pipe = load(gguf_base, policy, components={"transformer": gguf_file[0]})
    assert ondeck.is_loaded(pipe.transformer) == (policy == "eager")

    assert np.array_equal(frames(pipe), gguf_reference)
    assert np.array_equal(frames(pipe), gguf_reference)
    if policy == "release":
        assert not ondeck.is_loaded(pipe.transformer), "released after its last stage"
        assert pipe.transformer.load_count == 2
    layer = pipe.transformer.materialize().blocks[0].attn1.to_q
    assert type(layer.weight).__name__ == "GGUFParameter", "stays quantized"


def test_the_plan_of_a_gguf_component_reads_no_weights(gguf_base, gguf_file, monkeypatch):
    from ondeck.loading import quantized

    monkeypatch.setattr(
        quantized.QuantizedComponentLoader, "_load", lambda self: pytest.fail("loaded")
    )
    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]})

    plan = pipe.ondeck.plan()

    assert plan.component_bytes["transformer"] > 0
    assert not ondeck.is_loaded(pipe.transformer)


def test_a_lora_on_a_gguf_transformer(gguf_base, gguf_file, tmp_path):
    from safetensors.torch import load_file, save_file

    from .conftest import lora_state, transformer_file

    layers = lora_state(load_file(str(transformer_file(gguf_base))))
    lora = tmp_path / "lora.safetensors"
    save_file(
        {
            f"transformer.{layer}.lora_{part}.weight": matrix
            for layer, (down, up) in layers.items()
            for part, matrix in (("A", down), ("B", up))
        },
        str(lora),
    )
    expected = diffusers_gguf_frames(gguf_base, gguf_file[0], lora)
    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]}, loras=[lora])

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)


def test_a_gguf_component_that_would_have_to_stream_says_so(gguf_base, gguf_file):
    from ondeck.policy import BudgetPolicy
    from ondeck.streaming import StreamOptions

    whole = load(gguf_base, "release", components={"transformer": gguf_file[0]})
    budget = whole.ondeck.plan().component_bytes["transformer"] // 2
    streaming = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
    policy = BudgetPolicy(budget, streaming=streaming)

    # GGUF tensors stay in diffusers' GGUFParameter, which block streaming does not move:
    # refused by the plan, before a byte is read.
    with pytest.raises(ondeck.BudgetError, match="nothing was loaded"):
        pipe = load(gguf_base, policy, components={"transformer": gguf_file[0]})
        frames(pipe)


def test_a_gguf_component_reloads_from_the_host_cache(
    gguf_base, gguf_file, gguf_reference, monkeypatch
):
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]}, host_cache=cache)
    loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")

    assert np.array_equal(frames(pipe), gguf_reference)
    assert loader.last_source == "file"
    assert np.array_equal(frames(pipe), gguf_reference)
    assert loader.last_source == "host cache"
    assert np.array_equal(frames(pipe), gguf_reference), "the entry outlives a release"


@pytest.mark.parametrize("policy", ["release", "budget"])
def test_a_gguf_text_encoder_loads_through_transformers(base, text_encoder_gguf, reference, policy):
    import torch
    from diffusers import WanPipeline
    from references import in_fresh_tensors
    from transformers import UMT5EncoderModel

    encoder = UMT5EncoderModel.from_pretrained(
        str(text_encoder_gguf.parent),
        gguf_file=str(text_encoder_gguf),
        config=UMT5EncoderModel.config_class.from_pretrained(base / "text_encoder"),
        torch_dtype=torch.float32,
    )
    plain = WanPipeline.from_pretrained(base, text_encoder=encoder, dtype=torch.float32)
    plain.set_progress_bar_config(disable=True)
    expected = frames(in_fresh_tensors(plain))
    assert not np.array_equal(expected, reference), "the Q8_0 encoder differs from the folder's"
    pipe = load(base, policy, components={"text_encoder": text_encoder_gguf})
    assert not ondeck.is_loaded(pipe.text_encoder)

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    assert pipe.ondeck.plan().component_bytes["text_encoder"] > 0
