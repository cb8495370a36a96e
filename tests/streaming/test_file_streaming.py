"""Streamed blocks read from the files each pass, on a host whose budget holds no room for
their pinned copies: the same frames as with pinned copies, the plan saying so, and the
host memory the plan predicts (the CPU stands in for a discrete device)."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
import torch

from ondeck import memory
from ondeck.host_pool import HostGrowth
from ondeck.host_watch import HostMemoryError, HostWatch
from ondeck.pipelines.wan import WanTextToVideo
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions
from ondeck.streaming.streamer import BlockStreamer

from .conftest import budget_keeping, build_six_block_folder, transformer_blocks
from .test_wan_streaming import DISCRETE, PROMPTS, generate, stats, streaming

GiB = 2**30
PROCESS = 64 * GiB  # what the squeezed host's process holds, besides ondeck's host memory


def squeeze(pipe, room_bytes: int, monkeypatch) -> None:
    """Give ``pipe`` a host whose budget leaves ``room_bytes`` beside its process for
    streamed blocks' host memory. The host's one seam, ``memory.host_facts``, reads a
    process holding ``PROCESS`` plus what streaming holds (as its RSS would); the process
    does not grow during a run (tests/core/test_host_growth.py covers one that does)."""
    real = memory.host_facts

    def facts(**_):
        held = pipe.policy.streaming.host_bytes()
        return real(available_bytes=0, process_bytes=PROCESS + held, cgroup=None)

    monkeypatch.setattr(memory, "host_facts", facts)
    monkeypatch.setattr(pipe, "host_growth", lambda: HostGrowth(0, "given", measured=True))
    pipe.host_memory = PROCESS + room_bytes


def watch_host_memory(pipe) -> dict:
    """Host memory the transformer's streamer holds while it is loaded, seen at each load."""
    seen = {}

    def look(module):
        streamer = pipe.policy.streaming.streamers["transformer"]
        seen["host_copies"] = streamer.host_bytes
        seen["ring"] = streamer.ring_bytes
        return module

    pipe.components["transformer"].add_transform(look)
    return seen


@pytest.fixture(scope="module")
def pinned_frames(six_block_folder):
    pipe = streaming(six_block_folder, resident=2)
    frames = {prompt: generate(pipe, prompt) for prompt in PROMPTS}
    return frames, pipe.plan()


def ring_room(folder, buffers: int = 3) -> int:
    return buffers * max(transformer_blocks(folder).packed_bytes)


def test_blocks_read_from_the_files_each_pass_give_the_pinned_frames(
    six_block_folder, pinned_frames, monkeypatch
):
    frames, pinned_plan = pinned_frames
    pipe = streaming(six_block_folder, resident=2)
    squeeze(pipe, ring_room(six_block_folder), monkeypatch)
    seen = watch_host_memory(pipe)
    for prompt in PROMPTS:
        assert np.array_equal(generate(pipe, prompt), frames[prompt]), prompt
    counted = stats(pipe)
    layout = pipe.plan().streamed["transformer"]
    assert layout == pinned_plan.streamed["transformer"]
    assert counted["from_files_blocks"] == list(layout.streamed)
    # Every pass read its streamed blocks from the files, once each, and nothing into host
    # copies; beyond a call's last pass, each load reads ahead no more than the ring and
    # the slots hold.
    sizes = transformer_blocks(six_block_folder)
    per_pass = sum(sizes.block_bytes[b] for b in layout.streamed)
    loads = pipe.components["transformer"].load_count
    ahead = (3 + layout.slot_count - 1) * max(sizes.block_bytes)
    assert counted["passes"] * per_pass <= counted["file_bytes_read"]
    assert counted["file_bytes_read"] <= counted["passes"] * per_pass + loads * ahead
    assert counted["host_bytes_read"] == 0 and seen["host_copies"] == 0


def test_blocks_read_from_the_files_get_their_weights_once_the_host_has_room_for_copies(
    six_block_folder, pinned_frames, monkeypatch
):
    """A block read from the files each pass holds no host copy: when the host budget
    grows and the plan pins its copy, the next load reads the block into it."""
    frames, _ = pinned_frames
    pipe = streaming(six_block_folder, resident=2)
    squeeze(pipe, ring_room(six_block_folder), monkeypatch)
    assert np.array_equal(generate(pipe, PROMPTS[0]), frames[PROMPTS[0]])
    assert stats(pipe)["from_files_blocks"]
    pipe.host_memory = PROCESS + 64 * GiB  # room for every pinned copy
    for prompt in PROMPTS:
        assert np.array_equal(generate(pipe, prompt), frames[prompt]), prompt
    streamer = pipe.policy.streaming.streamers["transformer"]
    assert not streamer.from_files and streamer.host_bytes > 0


def test_the_plan_for_a_small_host_budget_reads_from_the_files_and_predicts_the_slowdown(
    six_block_folder, pinned_frames, monkeypatch
):
    _, pinned_plan = pinned_frames
    copy_rate, read_rate = 40e9, 4e9
    options = StreamOptions(**DISCRETE, bytes_per_second=copy_rate, read_bytes_per_second=read_rate)
    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    pipe = WanTextToVideo.from_folder(
        six_block_folder,
        policy=BudgetPolicy(budget, streaming=options),
        dtype=torch.float32,
        device="cpu",
        progress=False,
    )
    squeeze(pipe, ring_room(six_block_folder), monkeypatch)
    plan = pipe.plan()
    layout, reads = plan.streamed["transformer"], plan.file_reads["transformer"]
    assert reads.from_files == layout.streamed
    slowdown = max(1, copy_rate / read_rate)  # every streamed byte read, then copied
    text = str(plan)
    assert "read from the files each pass: 4 of 4 streamed blocks" in text
    assert f"reads at {read_rate / 1e9:.2f} GB/s (given)" in text
    assert f"{slowdown:.1f}x the pinned path's" in text
    # The host pool counts the ring, not the pinned copies it no longer needs.
    pinned_host = pinned_plan.host
    assert pinned_host.pinned_bytes == layout.bytes_per_pass
    assert plan.host.pinned_bytes == 0 and plan.host.ring_bytes == reads.ring_bytes
    assert plan.host.fits()
    assert plan.host.pinned_bytes + plan.host.ring_bytes < pinned_host.pinned_bytes


def test_the_host_memory_held_is_the_ring_the_plan_predicts(six_block_folder, monkeypatch):
    pipe = streaming(six_block_folder, resident=2)
    squeeze(pipe, ring_room(six_block_folder), monkeypatch)
    predicted = pipe.plan()
    seen = watch_host_memory(pipe)
    buffers = []

    def ring_buffers(module):
        ring = pipe.policy.streaming.streamers["transformer"].ring()
        buffers.append([memory.data_ptr() for memory in ring.memory()])
        return module

    pipe.components["transformer"].add_transform(ring_buffers)
    generate(pipe)
    assert seen == {"host_copies": 0, "ring": predicted.host.ring_bytes}
    assert predicted.host.ring_bytes > 0
    # The ring's buffers outlive the release, as pinned copies would, and the next load
    # reads into the same ones: nothing is allocated (page-locked) again.
    assert stats(pipe)["ring_bytes"] == predicted.host.ring_bytes
    generate(pipe, PROMPTS[1])
    assert len(buffers) == 2 and buffers[0] == buffers[1]
    assert pipe.policy.streaming.drop_host_copies() == predicted.host.ring_bytes
    assert stats(pipe)["ring_bytes"] == 0 and stats(pipe)["host_copy_bytes"] == 0


def growing_host(pipe, room_bytes: int, grows: int, monkeypatch) -> None:
    """A squeezed host (``squeeze``) whose process grows by ``grows`` bytes during each
    run, as the host watch's RSS readings show: the reserve is ondeck's own."""
    real = memory.host_facts
    held = pipe.policy.streaming.host_bytes

    def facts(**_):
        return real(available_bytes=0, process_bytes=PROCESS + held(), cgroup=None)

    def rss() -> int:
        # As on a discrete device, the loaded weights are not the process's memory.
        started = pipe.host_watch.started_uncounted is not None
        return PROCESS + held() + (grows if started else 0)

    monkeypatch.setattr(memory, "host_facts", facts)
    pipe.host_memory = PROCESS + room_bytes
    pipe.host_watch = HostWatch(pipe.host_memory, pipe.relieve_host_memory, rss=rss)


def test_the_rings_stay_across_releases_once_the_growth_is_measured_and_go_under_pressure(
    six_block_folder, monkeypatch
):
    pipe = streaming(six_block_folder, resident=2)
    grows = max(transformer_blocks(six_block_folder).packed_bytes)
    rings = ring_room(six_block_folder)
    growing_host(pipe, rings + grows, grows, monkeypatch)
    assert not pipe.host_growth().measured
    generate(pipe)
    # The first run's reserve was a guess: its rings went with the releases.
    assert stats(pipe)["ring_bytes"] == 0
    plan = pipe.plan()
    assert pipe.report()["host_growth_bytes"] == grows == plan.host.growth_bytes
    assert plan.file_reads_fit and plan.host.fits()
    generate(pipe)
    assert stats(pipe)["ring_bytes"] == plan.host.ring_bytes > 0  # kept, the reserve measured
    # A budget that holds the rings but not the growth beside them: the plan says so,
    # the kept buffers go before the next load, and that load's go with its release.
    pipe.host_memory = PROCESS + rings + grows // 2
    pipe.host_watch.budget_bytes = pipe.host_memory
    squeezed = pipe.plan()
    assert not squeezed.file_reads_fit and not squeezed.host.fits()
    with pytest.raises(HostMemoryError):
        generate(pipe)  # the process grew past the budget, as the plan said it would
    assert stats(pipe)["ring_bytes"] == 0 and stats(pipe)["host_copy_bytes"] == 0


def ring_weakrefs(pipe) -> list:
    refs = []

    def look(module):
        ring = pipe.policy.streaming.streamers["transformer"].ring()
        refs.extend(weakref.ref(memory) for memory in ring.memory())
        return module

    pipe.components["transformer"].add_transform(look)
    return refs


def with_kept_rings(folder, monkeypatch):
    """A squeezed pipeline after a run, and weak references to its ring's buffers, which
    it kept across the release."""
    pipe = streaming(folder, resident=2)
    squeeze(pipe, ring_room(folder), monkeypatch)
    refs = ring_weakrefs(pipe)
    generate(pipe)
    gc.collect()
    assert refs and all(ref() is not None for ref in refs)  # kept across the release
    return pipe, refs


def test_closing_the_pipeline_frees_the_kept_rings(six_block_folder, monkeypatch):
    pipe, refs = with_kept_rings(six_block_folder, monkeypatch)
    pipe.close()
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert stats(pipe)["ring_bytes"] == 0


def test_a_deleted_pipeline_frees_the_kept_rings(six_block_folder, monkeypatch):
    pipe, refs = with_kept_rings(six_block_folder, monkeypatch)
    monkeypatch.undo()  # the fakes hold the pipeline
    del pipe
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_room_for_some_pinned_copies_keeps_them_and_reads_the_rest(
    six_block_folder, pinned_frames, monkeypatch
):
    frames, _ = pinned_frames
    pipe = streaming(six_block_folder, resident=2, file_ring_buffers=1)  # 4 blocks stream
    block = max(transformer_blocks(six_block_folder).packed_bytes)
    squeeze(pipe, ring_room(six_block_folder, buffers=1) + 2 * block, monkeypatch)
    seen = watch_host_memory(pipe)
    plan = pipe.plan()
    reads = plan.file_reads["transformer"]
    assert len(reads.pinned) == 2 and len(reads.from_files) == 2
    for prompt in PROMPTS:
        assert np.array_equal(generate(pipe, prompt), frames[prompt]), prompt
    assert stats(pipe)["from_files_blocks"] == list(reads.from_files)
    assert seen == {"host_copies": reads.pinned_bytes, "ring": reads.ring_bytes}
    # The second run keeps to the same split: no layout change, no host copy read twice.
    assert pipe.plan().file_reads["transformer"] == reads
    assert stats(pipe)["host_bytes_read"] == sum(
        transformer_blocks(six_block_folder).block_bytes[b] for b in reads.pinned
    )


def test_after_a_run_the_plan_uses_the_measured_read_rate(six_block_folder, monkeypatch):
    pipe = streaming(six_block_folder, resident=2)
    squeeze(pipe, ring_room(six_block_folder), monkeypatch)
    assert "(default: a disk read" in str(pipe.plan())
    generate(pipe)
    counted = stats(pipe)
    rate = counted["file_bytes_read"] / counted["file_read_seconds"]
    assert pipe.plan().read_rates["transformer"] == (rate, "measured: its reads each pass")
    assert f"reads at {rate / 1e9:.2f} GB/s (measured: its reads each pass)" in str(pipe.plan())


@pytest.fixture(scope="module")
def wide_six_blocks(tmp_path_factory):
    """Six blocks wide enough that, in fp8, the transformer is still the largest component."""
    folder = tmp_path_factory.mktemp("fp8-files") / "tiny6"
    return build_six_block_folder(folder, attention_head_dim=48, ffn_dim=384)


def test_fp8_blocks_read_from_the_files_give_the_pinned_fp8_frames(wide_six_blocks, monkeypatch):
    def fp8_streaming():
        template = (
            WanTextToVideo.from_folder(
                wide_six_blocks,
                dtype=torch.bfloat16,
                device="cpu",
                storage_dtype={"transformer": "fp8"},
            )
            .loaders["transformer"]
            .template
        )
        from ondeck.streaming import describe_blocks, find_blocks

        sizes, _ = describe_blocks(template, find_blocks(template.module))
        policy = BudgetPolicy(budget_keeping(sizes, 2), streaming=StreamOptions(**DISCRETE))
        pipe = WanTextToVideo.from_folder(
            wide_six_blocks,
            policy=policy,
            dtype=torch.bfloat16,
            device="cpu",
            progress=False,
            storage_dtype={"transformer": "fp8"},
        )
        return pipe, 3 * max(sizes.packed_bytes)

    pinned, _ = fp8_streaming()
    expected = generate(pinned)
    assert not stats(pinned)["from_files_blocks"]
    pipe, room = fp8_streaming()
    squeeze(pipe, room, monkeypatch)
    assert np.array_equal(generate(pipe), expected)
    assert stats(pipe)["from_files_blocks"] == stats(pinned)["streamed_blocks"]
    streamer = pipe.policy.streaming.streamers["transformer"]
    assert streamer.sizes.packed_bytes != transformer_blocks(wide_six_blocks).packed_bytes


def test_a_block_computes_while_the_next_one_is_still_read_from_the_files(
    six_block_folder, pinned_frames, monkeypatch
):
    """A block's pre-hook copies the blocks after it ahead, but never waits for one still
    being read: the block about to compute would wait for another's read. Here the second
    streamed block's read is slow; the first computes before that read ends."""
    frames, _ = pinned_frames
    pipe = streaming(six_block_folder, resident=2)
    squeeze(pipe, ring_room(six_block_folder), monkeypatch)
    first, second = pipe.plan().file_reads["transformer"].from_files[:2]
    events: list[tuple[str, int]] = []
    real_read = BlockStreamer.read_block

    def read_block(self, block, buffer):
        nbytes = real_read(self, block, buffer)
        if block == second:
            time.sleep(0.3)
        events.append(("read", block))
        return nbytes

    def watch_compute(module):
        for block in (first, second):
            module.blocks[block].register_forward_pre_hook(
                lambda _module, _args, block=block: events.append(("compute", block))
            )
        return module

    monkeypatch.setattr(BlockStreamer, "read_block", read_block)
    pipe.components["transformer"].add_transform(watch_compute)
    assert np.array_equal(generate(pipe, PROMPTS[0]), frames[PROMPTS[0]])
    assert events.index(("compute", first)) < events.index(("read", second)), events[:6]
