"""The pipeline's LoRA bookkeeping on deferred components, against plain diffusers on
the same calls: which adapters are listed and counted as fused, and which calls are
refused when given (tried on the component's meta skeleton after the adapters loaded
before)."""

from __future__ import annotations

import pytest

import ondeck.diffusers

pytest.importorskip("peft")


def _plain_and_ours(root):
    from diffusers import FluxPipeline

    return (
        FluxPipeline.from_pretrained(root / "flux"),
        ondeck.diffusers.from_pretrained(root / "flux", policy="release"),
    )


def test_a_transformer_only_lora_is_not_listed_on_the_text_encoder(flux_loras):
    """A LoRA with no text-encoder keys is listed on the transformer only, as diffusers
    lists it: a recorded load notes the adapters it added to the component's skeleton,
    none here."""
    plain, pipe = _plain_and_ours(flux_loras)
    for each in (plain, pipe):
        each.load_lora_weights(flux_loras / "transformer_only", adapter_name="s")
    assert pipe.get_list_adapters() == plain.get_list_adapters() == {"transformer": ["s"]}


def test_fusing_a_text_encoder_without_the_adapter_counts_nothing(flux_loras):
    """fuse_lora(components=["text_encoder"]) with a transformer-only LoRA merges nothing
    there, and fused_loras stays empty as in diffusers."""
    plain, pipe = _plain_and_ours(flux_loras)
    for each in (plain, pipe):
        each.load_lora_weights(flux_loras / "transformer_only", adapter_name="s")
        each.fuse_lora(components=["text_encoder"])
    assert pipe.fused_loras == plain.fused_loras == set()


def test_fusing_counts_only_the_active_adapters(flux_loras):
    """Two adapters, one set active, then fuse_lora on the deferred text encoder: what
    merged is counted (the fuse tried on the skeleton), the active one only."""
    plain, pipe = _plain_and_ours(flux_loras)
    for each in (plain, pipe):
        each.load_lora_weights(flux_loras / "both", adapter_name="a")
        each.load_lora_weights(flux_loras / "other", adapter_name="b")
        each.set_adapters("a")
        each.fuse_lora(components=["text_encoder"])
    assert pipe.fused_loras == plain.fused_loras == {"a"}


def test_hotswapping_an_adapter_of_a_deferred_transformer_works_as_in_diffusers(wan_lora):
    """pipe.load_lora_weights(file, adapter_name="s", hotswap=True) after loading "s": the
    skeleton the call is tried on first gets the adapters loaded before, so the swap is
    taken as plain diffusers takes it."""
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(wan_lora / "wan")
    pipe = ondeck.diffusers.from_pretrained(wan_lora / "wan", policy="release")
    for each in (plain, pipe):
        each.load_lora_weights(wan_lora / "lora", adapter_name="s")
        each.load_lora_weights(wan_lora / "lora", adapter_name="s", hotswap=True)
    assert pipe.get_list_adapters() == plain.get_list_adapters()


def test_an_adapter_name_in_use_is_refused_when_given(wan_lora):
    """A second LoRA under a name already in use is refused at the call, as diffusers
    refuses it, not at the next load in the middle of a generation."""
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(wan_lora / "wan")
    plain.load_lora_weights(wan_lora / "lora", adapter_name="s")
    with pytest.raises(ValueError, match="already in use"):
        plain.load_lora_weights(wan_lora / "lora", adapter_name="s")
    pipe = ondeck.diffusers.from_pretrained(wan_lora / "wan", policy="release")
    pipe.load_lora_weights(wan_lora / "lora", adapter_name="s")
    with pytest.raises(ValueError, match="already in use"):
        pipe.load_lora_weights(wan_lora / "lora", adapter_name="s")


@pytest.mark.parametrize("lora", ["both", "transformer_only"])
def test_loading_a_flux_lora_loads_no_component(flux_loras, lora):
    """Flux's load_lora_weights reads the transformer's layer shapes first (to widen a
    layer for a Control LoRA): a deferred transformer answers from its skeleton, so the
    call loads nothing, and the first call still gives diffusers' output."""
    import numpy as np
    import torch

    plain, pipe = _plain_and_ours(flux_loras)
    for each in (plain, pipe):
        each.load_lora_weights(flux_loras / lora, adapter_name="s")
        each.set_progress_bar_config(disable=True)
    assert pipe.ondeck.tracker.resident == {}
    assert all(proxy.load_count == 0 for proxy in pipe.ondeck.deferred.values())
    call = dict(prompt="a fox", num_inference_steps=2, height=8, width=8, output_type="np")
    made = [
        each(**call, generator=torch.Generator().manual_seed(0)).images for each in (plain, pipe)
    ]
    np.testing.assert_allclose(made[1], made[0], atol=1e-6)


def test_a_loras_replay_waits_for_another_threads_adapter_call(flux_loras):
    """peft adds an adapter's layers with torch's parameter registration patched for the
    whole process, so two adapter calls at once (one replayed on the prefetch thread)
    break each other: a replay at a load waits while another adapter call runs."""
    import threading

    from ondeck.integrations.diffusers.component import ADAPTER_CALLS

    _, pipe = _plain_and_ours(flux_loras)
    pipe.load_lora_weights(flux_loras / "both", adapter_name="s")
    loaded = threading.Event()
    load = threading.Thread(
        target=lambda: (pipe.ondeck.deferred["transformer"].materialize(), loaded.set())
    )
    with ADAPTER_CALLS:  # another thread's adapter call, under way
        load.start()
        assert not loaded.wait(2), "the replay ran beside another adapter call"
    load.join(30)
    assert loaded.is_set()
    assert "s" in pipe.transformer.peft_config


def test_the_active_adapters_are_diffusers_and_nothing_stays_loaded(flux_loras):
    """get_active_adapters reads each LoRA-loadable component in turn: under ``release``
    what it loads is released as it goes, and it answers as diffusers does."""
    plain, pipe = _plain_and_ours(flux_loras)
    for each in (plain, pipe):
        each.load_lora_weights(flux_loras / "transformer_only", adapter_name="s")
        each.set_adapters(["s"], [0.5])
    assert pipe.get_active_adapters() == plain.get_active_adapters() == ["s"]
    assert not pipe.ondeck.tracker.resident
