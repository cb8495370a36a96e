"""A pipeline's __init__ reads any config value of a deferred component without loading it."""

from __future__ import annotations

import json
import shutil

import torch

import ondeck.diffusers
from ondeck.lazy import is_loaded


def test_a_list_attribute_read_at_construction_loads_nothing(folders, tmp_path):
    # WanVideoToVideoPipeline.__init__ reads vae.temperal_downsample, a list.
    folder = shutil.copytree(folders["wan"], tmp_path / "wan-v2v")
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "WanVideoToVideoPipeline"
    index.pop("transformer_2", None)
    index.pop("boundary_ratio", None)
    index.pop("expand_timesteps", None)
    (folder / "model_index.json").write_text(json.dumps(index))

    pipe = ondeck.diffusers.from_pretrained(
        folder, torch_dtype=torch.float32, device="cpu", policy="release", progress=False
    )
    assert not any(is_loaded(proxy) for proxy in pipe.ondeck.deferred.values())
    from diffusers import AutoencoderKLWan

    reference = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(folder / "vae"))
    assert pipe.vae_scale_factor_temporal == 2 ** sum(reference.temperal_downsample)
    assert pipe.vae_scale_factor_spatial == 2 ** len(reference.temperal_downsample)


def test_a_model_that_cannot_be_deferred_is_named_in_a_warning(folders, tmp_path):
    import pytest

    from ondeck.integrations.diffusers.loading import _can_defer
    from ondeck.loading import ModelFolder

    folder = shutil.copytree(folders["wan"], tmp_path / "wan-no-weights")
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.unlink()
    opened = ModelFolder.open(folder)
    with pytest.warns(UserWarning, match="'transformer' is not deferred: .* no safetensors"):
        assert not _can_defer(opened, "transformer")
    assert _can_defer(opened, "vae")
