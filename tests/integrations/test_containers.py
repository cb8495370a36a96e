"""Models held inside a container component are deferred one by one: each ControlNet in
a ``MultiControlNetModel``; LTX's latent upsampler, a class from a diffusers pipeline
package (library ``ltx`` in model_index.json)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from references import in_fresh_tensors

import ondeck
import ondeck.diffusers

from .breadth_pipelines import ALL_FAMILIES, build_sd_controlnet
from .tiny_pipelines import run

NETS = ("controlnet.nets.0", "controlnet.nets.1")


def _two_controlnets():
    family = ALL_FAMILIES["sd_controlnet"]
    image = family.call["image"]
    return family.__class__(**{**family.__dict__, "call": {**family.call, "image": [image] * 2}})


@pytest.fixture(scope="module")
def multi_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("multicontrolnet") / "pipe"
    build_sd_controlnet(path, controlnets=2)
    return path


@pytest.fixture(scope="module")
def multi_reference(multi_folder):
    from diffusers import StableDiffusionControlNetPipeline

    plain = in_fresh_tensors(StableDiffusionControlNetPipeline.from_pretrained(multi_folder))
    plain.set_progress_bar_config(disable=True)
    return run(plain, _two_controlnets())


def load(path, policy="release"):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing falls back to diffusers
        pipe = ondeck.diffusers.from_pretrained(path, device="cpu", policy=policy, progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def loads_per_call(pipe, expected):
    """Two calls, each checked against ``expected``; yields each call's loads."""
    for call in (1, 2):
        before = {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}
        assert np.array_equal(run(pipe, _two_controlnets()), expected), call
        yield {name: p.load_count - before[name] for name, p in pipe.ondeck.deferred.items()}


def test_each_controlnet_in_a_multicontrolnet_is_deferred_and_loads_once_per_call(
    multi_folder, multi_reference
):
    from diffusers import MultiControlNetModel

    pipe = load(multi_folder)
    assert isinstance(pipe.controlnet, MultiControlNetModel)
    assert set(NETS) <= set(pipe.ondeck.deferred)
    assert all(ondeck.is_lazy(net) and not ondeck.is_loaded(net) for net in pipe.controlnet.nets)

    for call, loads in enumerate(loads_per_call(pipe, multi_reference), start=1):
        assert set(loads.values()) == {1}, f"call {call}: {loads}"
        assert not any(ondeck.is_loaded(net) for net in pipe.controlnet.nets), call


def test_moving_the_pipeline_loads_no_controlnet(multi_folder):
    pipe = load(multi_folder)
    pipe.to("cpu")
    pipe.to(torch.float32)
    assert all(pipe.ondeck.deferred[name].load_count == 0 for name in NETS)


def test_a_controlnet_without_safetensors_is_named_in_one_warning(multi_folder, tmp_path):
    import shutil

    from safetensors.torch import load_file

    folder = shutil.copytree(multi_folder, tmp_path / "pipe")
    weights = folder / "controlnet_1" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(weights), weights.with_suffix(".bin"))
    weights.unlink()

    with pytest.warns(UserWarning) as caught:
        pipe = ondeck.diffusers.from_pretrained(folder, device="cpu", policy="release")
    messages = [str(w.message) for w in caught if "not deferred" in str(w.message)]
    assert len(messages) == 1, messages
    assert "'controlnet' (MultiControlNetModel)" in messages[0]
    assert "controlnet_1 holds no safetensors weights" in messages[0]
    assert not any(name.startswith("controlnet") for name in pipe.ondeck.deferred)


@pytest.fixture(scope="module")
def upsampler_folder(tmp_path_factory):
    from diffusers import AutoencoderKLLTXVideo, LTXLatentUpsamplePipeline
    from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel

    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4,
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    torch.manual_seed(1)
    upsampler = LTXLatentUpsamplerModel(
        in_channels=8, mid_channels=32, num_blocks_per_stage=1, dims=3
    )
    path = tmp_path_factory.mktemp("ltx-upsample") / "pipe"
    LTXLatentUpsamplePipeline(vae=vae.eval(), latent_upsampler=upsampler.eval()).save_pretrained(
        path
    )
    return path


def _upsample(pipe):
    video = torch.randn((5, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    return pipe(
        video=video,
        height=32,
        width=32,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames


def test_ltx_latent_upsampler_is_deferred_and_matches_diffusers(upsampler_folder):
    from diffusers import LTXLatentUpsamplePipeline

    index = json.loads((upsampler_folder / "model_index.json").read_text())
    assert index["latent_upsampler"][0] == "ltx", "a class from diffusers' ltx package"
    plain = in_fresh_tensors(LTXLatentUpsamplePipeline.from_pretrained(upsampler_folder))
    plain.set_progress_bar_config(disable=True)
    expected = _upsample(plain)

    pipe = load(upsampler_folder)
    assert set(pipe.ondeck.deferred) == {"vae", "latent_upsampler"}
    assert not ondeck.is_loaded(pipe.latent_upsampler)
    assert np.array_equal(_upsample(pipe), expected)
    assert pipe.latent_upsampler.load_count == 1
    assert not ondeck.is_loaded(pipe.latent_upsampler)


def test_a_container_is_not_offered_for_sharding_by_the_command_or_the_loader(multi_folder):
    """The command's check (before the ranks start) and the loader agree on the models
    that can be sharded: a container holds no rows of its own."""
    from ondeck.cli.commands import check_shard_names
    from ondeck.cli.options import UsageError
    from ondeck.loading import ModelFolder
    from ondeck.loading.sharded import shardable_models

    models = shardable_models(ModelFolder.open(multi_folder))
    assert "controlnet" not in models
    assert {"unet", "text_encoder", "vae"} <= set(models)
    with pytest.raises(UsageError, match=r"cannot shard \['controlnet'\]"):
        check_shard_names(("controlnet",), multi_folder, ())
    with pytest.raises(ValueError, match=r"cannot shard \['controlnet'\]"):
        ondeck.diffusers.from_pretrained(multi_folder, device="cpu", shard=["controlnet"])
