"""The prompts Wan's own stages keep (``PromptCache``, always on: what ``ondeck
generate`` and ``ondeck serve`` run a plain Wan 2.1 folder on): never from an encoder
changed since, never shared with the caller's state."""

from __future__ import annotations

import pytest
import torch

from ondeck.embedded import build_wan_folder
from ondeck.pipelines.wan import WanTextToVideo


@pytest.fixture(scope="module")
def wan_own_folder(tmp_path_factory):
    return build_wan_folder(tmp_path_factory.mktemp("wan-prompts") / "tiny", preset="tiny")


def _wan(folder):
    return WanTextToVideo.from_folder(
        folder, policy="release", dtype=torch.float32, device="cpu", progress=False
    )


def _state(prompt="a fox"):
    return {
        "prompt": prompt,
        "negative_prompt": "",
        "height": 32,
        "width": 32,
        "num_frames": 5,
        "num_inference_steps": 2,
        "guidance_scale": 5.0,
        "generator": torch.Generator("cpu").manual_seed(0),
        "latents": None,
        "max_sequence_length": 512,
        "output_type": "np",
        "device": torch.device("cpu"),
        "progress": None,
    }


def _zero_embeddings(module):
    module.get_input_embeddings().weight.data.zero_()
    return module


def test_a_prompt_run_before_the_text_encoder_changed_is_encoded_again(
    wan_own_folder,
):
    """A transform added to Wan's text encoder after a run (docs/stages.md: a LoRA or a
    quantisation re-applied after every load) reaches the prompts already run: the key
    holds the encoder's changes (``LazyModule.changes``), so they are encoded again, as
    a fresh pipeline with the transform encodes them."""
    pipe = _wan(wan_own_folder)
    before = pipe(_state())["prompt_embeds"].clone()
    pipe.components["text_encoder"].add_transform(_zero_embeddings)
    after = pipe(_state())["prompt_embeds"].clone()

    fresh = _wan(wan_own_folder)
    fresh.components["text_encoder"].add_transform(_zero_embeddings)
    expected = fresh(_state())["prompt_embeds"].clone()

    assert not torch.equal(before, expected)  # the transform does change the embeddings
    assert torch.equal(after, expected), "the embeddings kept from before the transform"


def test_the_embeddings_a_run_hands_back_are_a_copy_of_the_kept_ones(wan_own_folder):
    """On the CPU ``.cpu()`` and ``.to(device)`` return the tensor itself: a run hands
    back a copy, so a caller changing ``state["prompt_embeds"]`` in place does not change
    what later runs with that prompt are conditioned on."""
    pipe = _wan(wan_own_folder)
    first = pipe(_state())
    expected = first["prompt_embeds"].clone()
    first["prompt_embeds"].mul_(0)  # the caller's own tensor, it thinks
    second = pipe(_state())
    assert torch.equal(second["prompt_embeds"], expected), "the cache handed out an alias"
