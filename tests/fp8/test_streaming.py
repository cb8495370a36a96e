"""Block streaming of an fp8 transformer: fp8 bytes move, and streamed blocks keep
computing from their slots (an in-place cast would leave them private copies)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streaming.conftest import budget_keeping

from ondeck.lazy import module_nbytes
from ondeck.pipelines.wan import WanTextToVideo
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions, describe_blocks, find_blocks

SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)
DISCRETE = dict(unified=False, unmeasured_activation_fraction=0.0)
FP8 = {"transformer": "fp8"}


@pytest.fixture(scope="module")
def six_blocks(tmp_path_factory):
    """The tiny Wan folder with a six-block transformer wide enough that, in fp8, it is
    still the largest component (the VAE decodes in float32)."""
    from streaming.conftest import build_six_block_folder

    folder = tmp_path_factory.mktemp("fp8-six") / "tiny6"
    return build_six_block_folder(folder, attention_head_dim=48, ffn_dim=384)


def wan(folder, policy, storage_dtype=None):
    return WanTextToVideo.from_folder(
        folder,
        policy=policy,
        dtype=torch.bfloat16,
        device="cpu",
        progress=False,
        storage_dtype=storage_dtype,
    )


def block_sizes(pipe):
    loader = pipe.loaders["transformer"]
    template = loader.template
    return describe_blocks(template, find_blocks(template.module))[0]


def generate(pipe, prompt="a fox"):
    return pipe.generate(prompt, negative_prompt="blurry", seed=7, **SHAPE)


def streamed(folder, storage_dtype, resident: int):
    sizes = block_sizes(wan(folder, "release", storage_dtype))
    policy = BudgetPolicy(budget_keeping(sizes, resident), streaming=StreamOptions(**DISCRETE))
    return wan(folder, policy, storage_dtype)


def slot_views(module, layout) -> dict[int, bool]:
    """Whether each streamed block's parameters all live in the streaming slots."""
    slots = {
        module.get_buffer(f"_ondeck_stream_slot{i}").untyped_storage().data_ptr()
        for i in range(layout.slot_count)
    }
    return {
        index: {p.untyped_storage().data_ptr() for p in module.blocks[index].parameters()} <= slots
        for index in layout.streamed
    }


def test_streamed_fp8_blocks_compute_from_their_slots_and_match_the_whole_fp8_run(six_blocks):
    whole = wan(six_blocks, "release", FP8)
    expected = [generate(whole, "a fox"), generate(whole, "a heron")]

    pipe = streamed(six_blocks, FP8, resident=3)
    layout = pipe.plan().streamed["transformer"]
    after_passes: list[tuple[bool, int]] = []

    def watch(module):
        def after_pass(module, args, output):
            views = slot_views(module, layout)
            after_passes.append((all(views.values()), module_nbytes(module)))

        module.register_forward_hook(after_pass)
        return module

    pipe.components["transformer"].add_transform(watch)
    frames = [generate(pipe, "a fox"), generate(pipe, "a heron")]
    # After every forward pass: the streamed blocks still view the slots, and the
    # component holds what the plan says (no private fp8 copies left behind).
    assert len(after_passes) == 2 * 2 * SHAPE["num_inference_steps"]
    assert set(after_passes) == {(True, layout.device_bytes)}
    for ours, reference in zip(frames, expected, strict=True):
        assert np.array_equal(ours, reference)


def test_fp8_blocks_stream_fp8_bytes(six_blocks):
    computed = block_sizes(wan(six_blocks, "release"))
    stored = block_sizes(wan(six_blocks, "release", FP8))
    assert sum(stored.block_bytes) < 0.6 * sum(computed.block_bytes)

    pipe = streamed(six_blocks, FP8, resident=3)
    layout = pipe.plan().streamed["transformer"]
    generate(pipe)
    stats = pipe.policy.streaming.stats()["transformer"]
    assert stats["bytes_per_pass"] == layout.bytes_per_pass
    per_block = {stored.packed_bytes[block] for block in layout.streamed}
    assert layout.bytes_per_pass == sum(stored.packed_bytes[b] for b in layout.streamed)
    assert max(per_block) < min(computed.packed_bytes)


def test_the_plan_says_what_fits_at_each_storage_choice(six_blocks):
    sizes = block_sizes(wan(six_blocks, "release"))
    budget = budget_keeping(sizes, resident=3)
    policy = lambda: BudgetPolicy(budget, streaming=StreamOptions(**DISCRETE))  # noqa: E731
    as_computed = wan(six_blocks, policy()).plan()
    in_fp8 = wan(six_blocks, policy(), FP8).plan()
    assert as_computed.fit_summary() == "streams 3 of 6 transformer blocks"
    assert in_fp8.fit_summary().startswith("keeps the ")
    assert "nothing streamed" in in_fp8.fit_summary()
    assert in_fp8.component_bytes["transformer"] < as_computed.component_bytes["transformer"]
