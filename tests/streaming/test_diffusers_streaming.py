"""Streaming under the diffusers integration: the genuine WanPipeline, the same frames."""

from __future__ import annotations

import numpy as np
import torch
from references import in_fresh_tensors

from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions

from .conftest import budget_keeping, transformer_blocks

SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)


def frames(pipe):
    generator = torch.Generator().manual_seed(7)
    return pipe("a fox", negative_prompt="blurry", generator=generator, **SHAPE).frames


def test_a_diffusers_pipeline_streams_its_transformer_with_the_same_frames(six_block_folder):
    from diffusers import WanPipeline

    import ondeck.diffusers

    plain = WanPipeline.from_pretrained(six_block_folder, dtype=torch.float32)
    expected = frames(in_fresh_tensors(plain))  # see tests/references.py
    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    options = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
    pipe = ondeck.diffusers.from_pretrained(
        six_block_folder,
        dtype=torch.float32,
        device="cpu",
        policy=BudgetPolicy(budget, streaming=options),
    )
    assert np.array_equal(frames(pipe), expected)
    stats = pipe.ondeck.policy.streaming.stats()["transformer"]
    assert stats["passes"] == 2 * SHAPE["num_inference_steps"] and stats["bytes_copied"] > 0


def test_the_plan_gives_the_bytes_streamed_per_call_and_their_transfer_floor(six_block_folder):
    import ondeck.diffusers

    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    options = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
    pipe = ondeck.diffusers.from_pretrained(
        six_block_folder,
        dtype=torch.float32,
        device="cpu",
        policy=BudgetPolicy(budget, streaming=options),
    )
    assert "known after a call" in str(pipe.ondeck.plan())
    frames(pipe)
    plan = pipe.ondeck.plan()
    passes = 2 * SHAPE["num_inference_steps"]  # with and without guidance, per step
    assert plan.passes_per_call["transformer"] == passes
    assert f"in {passes} passes, a transfer floor of" in str(plan)
