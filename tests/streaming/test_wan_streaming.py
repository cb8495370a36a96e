"""Block streaming on the CPU standing in for a discrete device: the same placement,
hooks and slot bindings run as on CUDA, with copies done at once instead of on a stream."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import ondeck
from ondeck.loading import ComponentLoader, reads
from ondeck.pipelines.wan import WanTextToVideo
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions, evenly_spaced

from .conftest import BLOCKS, budget_keeping, transformer_blocks

SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)
PROMPTS = ("a fox", "a heron")
# The CPU is unified memory; tests ask it to act as a discrete device. Activations are
# not measured on the CPU, so no share of the budget is set aside for them.
DISCRETE = dict(unified=False, unmeasured_activation_fraction=0.0)


def wan(folder, policy, cls=WanTextToVideo, pipelined=None):
    return cls.from_folder(
        folder,
        policy=policy,
        dtype=torch.float32,
        device="cpu",
        progress=False,
        pipelined=pipelined,
    )


def streaming(folder, resident: int = 2, cls=WanTextToVideo, pipelined=None, **options):
    budget = budget_keeping(transformer_blocks(folder), resident, options.get("slots", 2))
    policy = BudgetPolicy(budget, streaming=StreamOptions(**{**DISCRETE, **options}))
    return wan(folder, policy, cls, pipelined)


def generate(pipe, prompt: str = "a fox"):
    return pipe.generate(prompt, negative_prompt="blurry", seed=7, **SHAPE)


def stats(pipe) -> dict:
    return pipe.policy.streaming.stats()["transformer"]


@pytest.fixture(scope="module")
def reference_frames(six_block_folder):
    pipe = wan(six_block_folder, "release")
    return {prompt: generate(pipe, prompt) for prompt in PROMPTS}


class Runs:
    """Two generations with three of six blocks resident, watched as they go."""

    def __init__(self, folder):
        self.pipe = streaming(folder, resident=3)
        self.plan = self.pipe.plan()
        self.layout = self.plan.streamed["transformer"]
        self.seen: dict[int, tuple[bool, bool]] = {}
        self.pipe.components["transformer"].add_transform(self.inspect)
        self.frames = {"a fox": generate(self.pipe, "a fox")}
        self.first = dict(stats(self.pipe))
        self.loads_after_first = self.pipe.components["transformer"].load_count
        self.read: list[str] = []
        original = reads.read_into

        def watch(jobs, **options):
            self.read.extend(job.info.name for job in jobs)
            return original(jobs, **options)

        reads.read_into = watch
        try:
            # A new prompt: the encoder comes back, so the transformer went and returns.
            self.frames["a heron"] = generate(self.pipe, "a heron")
        finally:
            reads.read_into = original
        self.second = dict(stats(self.pipe))

    def inspect(self, module):
        slots = {
            module.get_buffer(f"_ondeck_stream_slot{i}").untyped_storage().data_ptr()
            for i in range(self.layout.slot_count)
        }
        for index, block in enumerate(module.blocks):
            pointers = {p.untyped_storage().data_ptr() for p in block.parameters()}
            self.seen[index] = (bool(block._forward_pre_hooks), pointers <= slots)
        return module


@pytest.fixture(scope="module")
def runs(six_block_folder):
    return Runs(six_block_folder)


def test_frames_with_streamed_blocks_match_the_unstreamed_run(runs, reference_frames):
    for prompt in PROMPTS:
        assert np.array_equal(runs.frames[prompt], reference_frames[prompt])
    assert runs.second["bytes_copied"] > runs.first["bytes_copied"] > 0


def test_the_plan_says_how_many_blocks_stay_and_what_streams(runs):
    text = str(runs.plan)
    assert runs.plan.fits()
    assert f"transformer.blocks: 3 of {BLOCKS} blocks resident" in text
    assert "3 streamed through 2 slots" in text
    assert (
        f"{ondeck.format_bytes(runs.layout.bytes_per_pass)} host to device per forward pass" in text
    )
    assert "per pass at 55.0 GB/s" in text


def test_resident_blocks_are_evenly_spaced_and_streamed_ones_view_the_slots(runs):
    layout = runs.layout
    assert layout.resident == evenly_spaced(BLOCKS, 3) == (1, 3, 5)
    for index in range(BLOCKS):
        streamed = index in layout.streamed
        assert runs.seen[index] == (streamed, streamed), index


def test_each_forward_pass_streams_the_planned_bytes(runs):
    layout, counted = runs.layout, runs.first
    assert counted["passes"] == 2 * SHAPE["num_inference_steps"]  # guidance: two per step
    assert counted["bytes_per_pass"] == layout.bytes_per_pass
    # Plus the next pass's first blocks, fetched ahead into the slots left free.
    ahead = (layout.slot_count - 1) * (layout.bytes_per_pass // len(layout.streamed))
    assert counted["bytes_copied"] == counted["passes"] * layout.bytes_per_pass + ahead


def test_the_component_holds_what_the_plan_predicts(runs):
    pipe = runs.pipe
    loads = [e for e in pipe.tracker.events if e.kind == "load" and e.name == "transformer"]
    assert len(loads) == 2
    assert all(e.nbytes == runs.layout.device_bytes for e in loads)
    assert pipe.tracker.peak_resident_bytes <= pipe.policy.budget_bytes
    assert pipe.tracker.peak_resident_bytes == runs.plan.peak_bytes


def test_a_second_generation_reads_no_streamed_block_from_the_files(runs):
    assert runs.pipe.components["transformer"].load_count == runs.loads_after_first + 1
    transformer_reads = [name for name in runs.read if name.startswith("blocks.")]
    assert transformer_reads  # the resident blocks came from the files again
    streamed = tuple(f"blocks.{index}." for index in runs.layout.streamed)
    assert not [name for name in transformer_reads if name.startswith(streamed)]
    assert runs.second["host_bytes_read"] == runs.first["host_bytes_read"] > 0


def test_release_frees_slots_and_hooks_and_host_copies_go_when_dropped(six_block_folder):
    pipe = streaming(six_block_folder, resident=2)
    refs = {}

    def capture(module):
        refs["module"] = weakref.ref(module)
        refs["slot"] = weakref.ref(module.get_buffer("_ondeck_stream_slot0"))
        return module

    pipe.components["transformer"].add_transform(capture)
    generate(pipe)
    pipe.release_all()
    gc.collect()
    assert refs["module"]() is None and refs["slot"]() is None
    streamer = pipe.policy.streaming.streamers["transformer"]
    assert not streamer.armed
    kept = streamer.host_bytes
    assert kept >= streamer.layout.bytes_per_pass  # kept on purpose: reloads skip the files
    region = weakref.ref(streamer.host_region(streamer.layout.streamed[0]))
    assert pipe.policy.streaming.drop_host_copies() == kept
    assert streamer.host_bytes == 0
    gc.collect()
    assert region() is None


def test_host_copies_can_go_with_every_release(six_block_folder, reference_frames):
    pipe = streaming(six_block_folder, resident=2, keep_host_copies=False)
    assert np.array_equal(generate(pipe, "a fox"), reference_frames["a fox"])
    streamer = pipe.policy.streaming.streamers["transformer"]
    assert not streamer.armed and streamer.host_bytes == 0  # released after Denoise
    read = stats(pipe)["host_bytes_read"]
    assert np.array_equal(generate(pipe, "a heron"), reference_frames["a heron"])
    assert stats(pipe)["host_bytes_read"] == 2 * read


def test_on_unified_memory_the_budget_error_says_streaming_frees_nothing(six_block_folder):
    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    pipe = wan(six_block_folder, BudgetPolicy(budget))  # the CPU, as it is: unified
    with pytest.raises(ondeck.BudgetError) as caught:
        generate(pipe)
    message = str(caught.value)
    assert "stage 'Denoise' needs" in message
    assert "unified memory" in message and "frees nothing" in message
    assert pipe.tracker.bytes_loaded == 0


class WithoutStreaming(WanTextToVideo):
    streamable_blocks = {"transformer": None}


class NamedBlocks(WanTextToVideo):
    streamable_blocks = {"transformer": "blocks"}


def test_a_pipeline_can_name_its_blocks_or_turn_streaming_off(six_block_folder):
    named = streaming(six_block_folder, cls=NamedBlocks)
    assert named.plan().streamed["transformer"].path == "blocks"
    refused = streaming(six_block_folder, cls=WithoutStreaming)
    with pytest.raises(ondeck.BudgetError, match="has repeated blocks to stream"):
        generate(refused)


def test_a_pass_that_raises_midway_leaves_the_next_pass_exact(six_block_folder):
    pipe = streaming(six_block_folder, resident=2)
    pipe.policy.streaming.apply(pipe, pipe.plan())
    module = pipe.components["transformer"].materialize()
    reference = ComponentLoader(six_block_folder, "transformer", dtype=torch.float32)()
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
        return_dict=False,
    )
    streamed = pipe.plan().streamed["transformer"].streamed
    failures = {"left": 1}

    def fail_once(block, args):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected")

    handle = module.blocks[streamed[1]].register_forward_pre_hook(fail_once)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="injected"):
            module(**inputs)
        expected = reference(**inputs)[0]
        for _ in range(2):
            assert torch.equal(module(**inputs)[0], expected)
    handle.remove()
    pipe.release_all()


def test_ondeck_plan_on_the_cpu_says_why_nothing_streams(six_block_folder, capsys):
    from ondeck.cli import main

    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    code = main(["plan", str(six_block_folder), "--budget", str(budget), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit" in out and "unified memory" in out and "frees nothing" in out


def test_the_plan_does_not_change_while_the_component_is_loaded_streamed(six_block_folder):
    pipe = streaming(six_block_folder, resident=2)
    before = pipe.plan()
    pipe.policy.streaming.apply(pipe, before)
    pipe.components["transformer"].materialize()
    after = pipe.plan()
    assert after.streamed == before.streamed
    assert after.component_bytes == before.component_bytes
    assert pipe.tracker.resident["transformer"] == before.streamed["transformer"].device_bytes
    pipe.release_all()


def test_three_slots_fetch_two_blocks_ahead(six_block_folder, reference_frames):
    pipe = streaming(six_block_folder, resident=1, slots=3)
    layout = pipe.plan().streamed["transformer"]
    assert layout.slot_count == 3 and len(layout.streamed) == 5
    assert np.array_equal(generate(pipe, "a fox"), reference_frames["a fox"])
    counted = stats(pipe)
    block = layout.bytes_per_pass // len(layout.streamed)
    assert counted["bytes_copied"] == counted["passes"] * layout.bytes_per_pass + 2 * block


def test_a_pipelined_load_fills_the_resident_blocks_behind_the_streamed_compute(
    six_block_folder, reference_frames, monkeypatch
):
    from ondeck.loading import pipelined

    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)  # a group per block
    pipe = streaming(six_block_folder, resident=3, pipelined=True)
    waited: list[int] = []
    original = pipelined.Filling.wait_group
    monkeypatch.setattr(
        pipelined.Filling,
        "wait_group",
        lambda self, index: waited.append(index) or original(self, index),
    )
    read = []
    for prompt in PROMPTS:
        assert np.array_equal(generate(pipe, prompt), reference_frames[prompt])
        read.append(stats(pipe)["host_bytes_read"])
    fills = [e for e in pipe.tracker.events if e.kind == "fill" and e.name == "transformer"]
    assert len(fills) == 2  # each generation loaded it pipelined
    # The head, then each of the three resident blocks' groups, waited on in both loads.
    assert sorted(set(waited)) == [0, 1, 2, 3]
    assert read[0] == read[1] > 0  # the streamed blocks' host copies were read once
    whole = streaming(six_block_folder, resident=3, pipelined=False)
    for prompt in PROMPTS:
        generate(whole, prompt)
    assert not [e for e in whole.tracker.events if e.kind == "fill"]
    for figure in ("passes", "bytes_copied", "host_bytes_read"):
        assert stats(pipe)[figure] == stats(whole)[figure], figure


def test_a_larger_budget_streams_fewer_blocks_from_the_host_copies_already_held(
    six_block_folder, reference_frames
):
    pipe = streaming(six_block_folder, resident=2)  # four of six blocks streamed
    assert np.array_equal(generate(pipe, "a fox"), reference_frames["a fox"])
    first = pipe.policy.streaming.streamers["transformer"].layout.streamed
    read = stats(pipe)["host_bytes_read"]
    # More room (as once the activations are measured): three blocks fit on the device.
    pipe.policy.budget_bytes = budget_keeping(transformer_blocks(six_block_folder), 3)
    assert np.array_equal(generate(pipe, "a heron"), reference_frames["a heron"])
    second = pipe.policy.streaming.streamers["transformer"].layout.streamed
    assert len(first) == 4 and len(second) == 3
    assert set(second) <= set(first)  # spread evenly afresh, block 4 would stream instead
    assert stats(pipe)["host_bytes_read"] == read  # no host copy read again
