"""Checkpoints whose library renames keys at load time load through its own renames."""

from __future__ import annotations

import json

import pytest
import torch

from ondeck import LoadError
from ondeck.loading import ComponentLoader, ModelFolder


def _tiny_qwen_vl(path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            bos_token_id=0,
            eos_token_id=1,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=32,
            fullatt_block_indexes=[0],
        ),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path / "text_encoder")
    index = {
        "_class_name": "QwenImagePipeline",
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    }
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def test_renamed_checkpoint_keys_load_as_transformers_loads_them(tmp_path):
    from safetensors import safe_open
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = _tiny_qwen_vl(tmp_path)
    with safe_open(str(next((folder / "text_encoder").glob("*.safetensors"))), "pt") as f:
        saved = set(f.keys())
    # Saved under the checkpoint's names, which transformers renames while loading.
    assert "model.embed_tokens.weight" in saved

    loaded = ComponentLoader(ModelFolder.open(folder), "text_encoder", dtype=torch.float32)()
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder / "text_encoder", dtype=torch.float32
    )
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_a_converted_key_is_a_clear_error(monkeypatch, tmp_path):
    folder = _tiny_qwen_vl(tmp_path)

    def rename(key, renamings, converters, *args, **kwargs):
        return key, "some.pattern" if key.endswith("lm_head.weight") else None

    monkeypatch.setattr("transformers.core_model_loading.rename_source_key", rename)
    with pytest.raises(LoadError, match="component 'text_encoder'.*lm_head.weight.*converted"):
        ComponentLoader(ModelFolder.open(folder), "text_encoder", dtype=torch.float32)()


def test_two_keys_renamed_onto_one_name_keep_the_checkpoints_names(monkeypatch, tmp_path):
    """Rather than one tensor silently replacing the other, the names stay the file's, and
    matching them to the model says what is wrong."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ondeck.loading.key_mapping import library_names

    folder = _tiny_qwen_vl(tmp_path)
    module = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder")
    tensors = {"model.embed_tokens.weight": "first", "lm_head.weight": "second", "x": "third"}

    def onto_one(key, renamings, converters, *args, **kwargs):
        return ("shared.weight" if key != "x" else key), None

    monkeypatch.setattr("transformers.core_model_loading.rename_source_key", onto_one)
    assert library_names(module, tensors, "text_encoder") == tensors
