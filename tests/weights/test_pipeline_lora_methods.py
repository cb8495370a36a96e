"""The pipeline's own LoRA methods on a LoRA that reaches a text encoder as well as the
transformer (Flux: CLIP and the transformer). diffusers changes a text encoder's layers
in place through helper functions; on a deferred encoder each such call is recorded, so
the next load, after a release, gives what plain diffusers gives."""

from __future__ import annotations

import numpy as np
import pytest
from integrations.tiny_pipelines import FAMILIES, run
from references import in_fresh_tensors

import ondeck
import ondeck.diffusers

pytest.importorskip("peft")

FLUX = FAMILIES["flux"]


def _with_lora(pipe, root):
    pipe.load_lora_weights(root / "both", adapter_name="style")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _plain(root):
    from diffusers import FluxPipeline

    return _with_lora(in_fresh_tensors(FluxPipeline.from_pretrained(root / "flux")), root)


def _loads(pipe) -> dict[str, int]:
    return {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}


CALLS = {
    "set_adapters": lambda pipe: pipe.set_adapters(["style"], [0.4]),
    "per component": lambda pipe: pipe.set_adapters(
        "style", {"text_encoder": 0.3, "transformer": 1.5}
    ),
    "disable_lora": lambda pipe: pipe.disable_lora(),
    "delete_adapters": lambda pipe: pipe.delete_adapters("style"),
    "unload_lora_weights": lambda pipe: pipe.unload_lora_weights(),
    "fuse, then unload": lambda pipe: (
        pipe.fuse_lora(components=["transformer", "text_encoder"], lora_scale=0.6),
        pipe.unload_lora_weights(),
    ),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_pipeline_lora_call_on_a_deferred_text_encoder_outlives_its_reloads(flux_loras, call):
    plain = _plain(flux_loras)
    loaded = run(plain, FLUX)
    CALLS[call](plain)
    expected = run(plain, FLUX)
    assert not np.array_equal(expected, loaded), "the call changes the output"

    pipe = _with_lora(
        ondeck.diffusers.from_pretrained(flux_loras / "flux", policy="release"), flux_loras
    )
    CALLS[call](pipe)
    for _ in range(2):  # release: every call loads every component again
        assert np.array_equal(run(pipe, FLUX), expected)
    assert _loads(pipe)["text_encoder"] == 2


def test_setting_adapters_asks_no_component_to_load_and_names_a_missing_one(flux_loras):
    plain = _plain(flux_loras)
    pipe = _with_lora(
        ondeck.diffusers.from_pretrained(flux_loras / "flux", policy="release"), flux_loras
    )
    before = _loads(pipe)  # (Flux's load_lora_weights itself reads the transformer's layers)
    assert pipe.get_list_adapters() == plain.get_list_adapters()
    with pytest.raises(ValueError, match=r"Adapter name\(s\) \{'other'\} not in the list"):
        pipe.set_adapters(["style", "other"])
    pipe.set_adapters(["style"], [0.4])
    assert _loads(pipe) == before, "nothing loads to list or set adapters"
    plain.set_adapters(["style"], [0.4])
    assert np.array_equal(run(pipe, FLUX), run(plain, FLUX))


@pytest.mark.parametrize("call", ["delete_adapters", "unload_lora_weights"])
def test_a_deleted_adapter_is_no_longer_listed_and_cannot_be_set(flux_loras, call):
    pipe = _with_lora(
        ondeck.diffusers.from_pretrained(flux_loras / "flux", policy="release"), flux_loras
    )
    CALLS[call](pipe)
    assert pipe.get_list_adapters() == {}
    with pytest.raises(ValueError, match="not in the list of present adapters"):
        pipe.set_adapters("style")


def test_a_fuse_on_a_deferred_text_encoder_is_counted_as_diffusers_counts_it(flux_loras):
    plain = _plain(flux_loras)
    pipe = _with_lora(
        ondeck.diffusers.from_pretrained(flux_loras / "flux", policy="release"), flux_loras
    )
    for each in (plain, pipe):
        each.fuse_lora(components=["text_encoder"], lora_scale=0.6)
    assert pipe.fused_loras == plain.fused_loras == {"style"}
    assert np.array_equal(run(pipe, FLUX), run(plain, FLUX))


def test_a_fuse_naming_the_transformer_alone_leaves_the_text_encoder_unfused(flux_loras):
    plain = _plain(flux_loras)
    pipe = _with_lora(
        ondeck.diffusers.from_pretrained(flux_loras / "flux", policy="release"), flux_loras
    )
    for each in (plain, pipe):
        each.fuse_lora(components=["transformer"], lora_scale=0.6)
    for _ in range(2):
        assert np.array_equal(run(pipe, FLUX), run(plain, FLUX))


@pytest.mark.parametrize(
    "policy", [dict(policy="release"), dict(policy="budget", budget="600KiB", prefetch=False)]
)
def test_a_lora_scale_given_to_a_call_holds_across_the_encoders_turns(flux_loras, policy):
    """joint_attention_kwargs={"scale": s}: diffusers scales the text encoder's LoRA
    layers, encodes with CLIP and T5, then scales them back. A CLIP released during T5's
    turn and loaded again must neither compute at scale 1 nor be divided by s after its
    fresh load (which would carry 1/s into the calls after)."""
    import torch

    plain = _plain(flux_loras)
    pipe = _with_lora(ondeck.diffusers.from_pretrained(flux_loras / "flux", **policy), flux_loras)
    call = dict(prompt="a fox", num_inference_steps=2, height=8, width=8, output_type="np")
    scaled = dict(joint_attention_kwargs={"scale": 0.3})
    for given in ({}, scaled, {}, scaled, {}):
        made = [
            each(**call, **given, generator=torch.Generator().manual_seed(0)).images
            for each in (plain, pipe)
        ]
        np.testing.assert_allclose(made[1], made[0], atol=1e-5, err_msg=str(given))
