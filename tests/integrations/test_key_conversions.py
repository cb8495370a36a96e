"""Checkpoint keys diffusers converts while loading load through diffusers' own code."""

from __future__ import annotations

import shutil

import torch
from references import in_fresh_tensors

import ondeck.diffusers


def test_deprecated_attention_block_names_load_as_diffusers_loads_them(folders, tmp_path):
    """VAEs and UNets saved before diffusers renamed attention weights (query, key,
    value, proj_attn) load under today's names (to_q, to_k, to_v, to_out.0)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(folders["flux"], tmp_path / "flux")
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    old_names = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    renamed = {}
    for key, tensor in load_file(weights).items():
        for new, old in old_names.items():
            key = key.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
        renamed[key] = tensor
    assert "decoder.mid_block.attentions.0.query.weight" in renamed
    save_file(renamed, weights)

    expected = in_fresh_tensors(AutoencoderKL.from_pretrained(folder / "vae")).state_dict()
    pipe = ondeck.diffusers.from_pretrained(folder, device="cpu", policy="release")
    loaded = pipe.vae.materialize().state_dict()

    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_an_output_layer_tied_to_the_embeddings_loads_from_the_one_saved_tensor(tmp_path):
    """transformers saves a tied pair once (no lm_head.weight in the file) and ties the two
    names after loading; ondeck fills both from that one tensor."""
    import json

    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from ondeck.loading import ComponentLoader, ModelFolder

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=4,
        num_hidden_layers=1, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "text_encoder")
    index = {
        "_class_name": "HiDreamImagePipeline",
        "text_encoder": ["transformers", "LlamaForCausalLM"],
    }
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with safe_open(str(tmp_path / "text_encoder" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())

    loaded = ComponentLoader(ModelFolder.open(tmp_path), "text_encoder", dtype=torch.float32)()
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "text_encoder", dtype=torch.float32)

    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
