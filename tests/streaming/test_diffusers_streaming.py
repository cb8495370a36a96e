"""Streaming under the diffusers integration: the genuine WanPipeline, the same frames."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from references import in_fresh_tensors

from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions
from ondeck.tracker import CallTimer
from tests.core.helpers import FixedEvent

from .conftest import budget_keeping, transformer_blocks

SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)


def frames(pipe):
    generator = torch.Generator().manual_seed(7)
    return pipe("a fox", negative_prompt="blurry", generator=generator, **SHAPE).frames


def streaming_pipe(folder):
    """ondeck.diffusers over ``folder`` with a budget that keeps two transformer blocks."""
    import ondeck.diffusers

    budget = budget_keeping(transformer_blocks(folder), 2)
    options = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
    return ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device="cpu", policy=BudgetPolicy(budget, streaming=options)
    )


def test_a_diffusers_pipeline_streams_its_transformer_with_the_same_frames(six_block_folder):
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(six_block_folder, dtype=torch.float32)
    expected = frames(in_fresh_tensors(plain))  # see tests/references.py
    pipe = streaming_pipe(six_block_folder)
    assert np.array_equal(frames(pipe), expected)
    stats = pipe.ondeck.policy.streaming.stats()["transformer"]
    assert stats["passes"] == 2 * SHAPE["num_inference_steps"] and stats["bytes_copied"] > 0


def test_the_plan_gives_the_bytes_streamed_per_call_and_their_transfer_floor(six_block_folder):
    pipe = streaming_pipe(six_block_folder)
    assert "known after a call" in str(pipe.ondeck.plan())
    frames(pipe)
    plan = pipe.ondeck.plan()
    passes = 2 * SHAPE["num_inference_steps"]  # with and without guidance, per step
    assert plan.passes_per_call["transformer"] == passes
    assert f"in {passes} passes, a transfer floor of" in str(plan)
    assert plan.call_transfer_seconds("text_encoder") is None  # not streamed
    rate = plan.transfer_bytes_per_second
    floor = plan.streamed["transformer"].bytes_per_pass * passes / rate
    assert plan.call_transfer_seconds("transformer") == pytest.approx(floor)
    assert f"a transfer floor of {floor:.2f} s" in str(plan)


def encoder_streaming_pipe(folder):
    """ondeck.diffusers over ``folder`` with room for the transformer, the VAE and the
    text encoder streaming through one slot, not for all three whole: each stage fits
    alone, and reloading is the only other way."""
    import ondeck.diffusers
    from ondeck.loading import ModelFolder
    from ondeck.streaming import describe_blocks, find_blocks

    model_folder = ModelFolder.open(folder)

    def blocks_of(name):
        template = model_folder.template(name, torch.float32)
        return describe_blocks(template, find_blocks(template.module))[0]

    blocks = blocks_of("text_encoder")
    whole = {name: blocks_of(name).total_bytes for name in ("transformer", "vae")}
    decode_reserve = 2**17  # the decode's need the plan holds room for, estimated
    budget = whole["transformer"] + whole["vae"] + blocks.other_bytes + max(blocks.packed_bytes)
    budget += decode_reserve + 4096
    assert whole["transformer"] + whole["vae"] + blocks.total_bytes + decode_reserve > budget
    options = StreamOptions(unified=False, unmeasured_activation_fraction=0.0, slots=1)
    return ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device="cpu", policy=BudgetPolicy(budget, streaming=options)
    )


def test_a_text_encoder_called_twice_streams_so_nothing_reloads_from_the_second_run(
    six_block_folder,
):
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(six_block_folder, dtype=torch.float32)
    expected = frames(in_fresh_tensors(plain))
    pipe = encoder_streaming_pipe(six_block_folder)
    loaded = []
    for _ in range(3):
        assert np.array_equal(frames(pipe), expected)
        loaded.append(pipe.ondeck.report()["bytes_loaded"])
    report = pipe.ondeck.report()
    passes = 2 * SHAPE["num_inference_steps"]
    assert report["calls_per_run"] == {"text_encoder": 2, "transformer": passes}
    plan = pipe.ondeck.plan()
    assert set(plan.streamed) == {"text_encoder"}
    assert "keeps every component on the device" in str(plan)
    assert loaded[2] == loaded[1]  # the third run loads nothing: all stayed resident


def test_staying_resident_waits_until_the_runs_have_lost_what_the_switch_costs(
    six_block_folder, monkeypatch
):
    """The same budget, calls timed (each at a tenth of a millisecond, on any machine),
    and fresh host memory page-locking at a byte a second: the switch's one-time cost
    dwarfs what a run saves, so each run reloads and adds what it lost. The first run's
    loads (first reads, page-locking beside them) tell nothing of what reloading costs:
    run 2 weighs nothing. At the real rate the switch costs less than a run here saves,
    and it is taken (when the sum counts is tested on the plan's arithmetic, in
    test_layout.py)."""
    from ondeck.streaming import layout as layout_module

    pipe = encoder_streaming_pipe(six_block_folder)
    pipe.ondeck.tracker.call_timer = CallTimer(FixedEvent)  # calls timed, as on CUDA
    streaming = pipe.ondeck.policy.streaming
    monkeypatch.setattr(layout_module, "PAGE_LOCK_BYTES_PER_SECOND", 1.0)
    loaded, declined = [], []
    for _ in range(4):
        frames(pipe)
        loaded.append(pipe.ondeck.report()["bytes_loaded"])
        declined.append(streaming.declined_seconds)
    assert "text_encoder" not in streaming.streamers  # still reloading, run after run
    assert loaded[3] - loaded[2] == loaded[2] - loaded[1] == loaded[1] - loaded[0] > 0
    assert declined[0] == declined[1] == 0 < declined[2] < declined[3]  # runs 3, 4 lost
    plan = pipe.ondeck.plan()
    assert plan.resident_gain > 0 and "it is taken once the runs on this plan" in str(plan)
    monkeypatch.setattr(layout_module, "PAGE_LOCK_BYTES_PER_SECOND", 15e9)
    for _ in range(2):
        frames(pipe)
        loaded.append(pipe.ondeck.report()["bytes_loaded"])
    assert set(pipe.ondeck.plan().streamed) == {"text_encoder"}
    assert streaming.declined_seconds == 0  # switched: nothing declined any more
    assert loaded[5] == loaded[4]  # the run after the switch loads nothing


def test_the_loader_tells_what_its_first_streamed_load_spent_on_the_host_copies(
    six_block_folder,
):

    pipe = streaming_pipe(six_block_folder)
    loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")
    tracker = pipe.ondeck.tracker

    def last_load():
        return [
            e
            for e in tracker.events
            if e.name == "transformer" and e.kind in ("load", "fill") and e.run == tracker.runs
        ][-1]

    frames(pipe)
    assert loader.last_allocate_seconds > 0 and loader.last_placed_read_seconds > 0
    # What a reload would take: the load's device bytes over its seconds less the host
    # copies' making and filling.
    load = last_load()
    setup = loader.last_allocate_seconds + loader.last_placed_read_seconds
    assert 0 < setup < load.duration_seconds
    assert tracker.reload_bytes_per_second["transformer"] == pytest.approx(
        load.nbytes / (load.duration_seconds - setup)
    )
    assert tracker.load_bytes_per_second["transformer"] == pytest.approx(
        load.nbytes / load.duration_seconds
    )
    # The first run's rates do not price reloading for a plan.
    assert tracker.later_load_bytes_per_second == {}
    assert pipe.ondeck.snapshot().load_bytes_per_second == {}
    pipe.transformer.release()
    frames(pipe)
    assert pipe.transformer.load_count == 2
    assert loader.last_placed_read_seconds == 0, "the host copies kept their blocks"
    load = last_load()
    assert tracker.reload_bytes_per_second["transformer"] == pytest.approx(
        load.nbytes / load.duration_seconds
    )
    later = tracker.later_load_bytes_per_second
    assert later["transformer"] == tracker.load_bytes_per_second["transformer"]
    loaded_again = {e.name for e in tracker.events if e.run == 2 and e.kind in ("load", "fill")}
    assert set(later) == loaded_again  # a rate left from the first run alone stays out


def test_a_streamed_components_timed_call_leaves_out_its_waits_for_copies(
    six_block_folder, monkeypatch
):
    """Each streamed block's wait for its copy takes 20 ms here (the device stream
    waiting on the copy's event): the quickest timed call is the transformer's compute,
    not compute and waits, so a plan weighs its copies against what really hides them."""
    from ondeck.streaming import streamer as streamer_module
    from tests.core.helpers import ClockEvent

    waits = []

    def slow_wait(self, event, buffers):
        waits.append(1)
        time.sleep(0.02)

    monkeypatch.setattr(streamer_module._ImmediateCopies, "wait", slow_wait)
    pipe = streaming_pipe(six_block_folder)
    pipe.ondeck.tracker.call_timer = CallTimer(ClockEvent)
    frames(pipe)
    passes = 2 * SHAPE["num_inference_steps"]
    streamed = len(pipe.ondeck.plan().streamed["transformer"].streamed)
    assert streamed >= 2 and len(waits) == passes * streamed
    waited = streamed * 0.02  # every call stood this long waiting for its blocks
    assert pipe.ondeck.report()["seconds_per_call"]["transformer"] < waited / 2
