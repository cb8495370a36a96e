"""A streamed component's state across transitions: host copies dropped under host
pressure while a load is in flight, loads that fail once the module is armed, and
layouts that move blocks between the device, pinned host copies and the files from one
load to the next (the CPU stands in for a discrete device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ondeck.loading import HostCache, reads
from ondeck.streaming.file_reads import FileReads
from ondeck.streaming.streamer import BlockStreamer

from .conftest import budget_keeping, transformer_blocks
from .test_file_streaming import PROCESS, GiB, squeeze
from .test_host_cache_layouts import inputs_in, layout, placed_loader
from .test_wan_streaming import PROMPTS, generate, stats, streaming, wan


@pytest.fixture(scope="module")
def reference_frames(six_block_folder):
    pipe = wan(six_block_folder, "release")
    return {prompt: generate(pipe, prompt) for prompt in PROMPTS}


def reading_from_files(sizes, planned, from_files, *, ring_count: int = 2) -> FileReads:
    """``planned``'s blocks ``from_files`` read from the files each pass, the others pinned."""
    pinned = tuple(b for b in planned.streamed if b not in from_files)
    return FileReads(
        pinned=pinned,
        from_files=tuple(from_files),
        pinned_bytes=sum(sizes.packed_bytes[b] for b in pinned),
        file_bytes_per_pass=sum(sizes.packed_bytes[b] for b in from_files),
        ring_count=ring_count,
        ring_buffer_bytes=planned.slot_bytes,
    )


def assert_computes(module, expected, dtype=torch.float32) -> None:
    with torch.no_grad():
        for _ in range(2):  # the first pass and one fed by prefetches
            torch.testing.assert_close(module(**inputs_in(dtype))[0], expected, rtol=0, atol=0)


# -- host copies dropped while a load is in flight -------------------------------------


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
def test_host_copies_dropped_while_the_component_loads_are_not_taken_as_filled(
    six_block_folder, monkeypatch, pipelined
):
    """The host watch relieves host memory from its own thread, at any time of a run: a
    streamed component that is loading is not armed yet, so its host copies may go while
    the load reads into them. The load must still compute on its weights, and so must
    the next one."""
    loader, streamer, sizes, expected = placed_loader(six_block_folder, None, pipelined)
    streamer.use_layout(layout(sizes, (1, 2, 4)))
    real = reads.read_into
    dropped: list[int] = []

    def read_into(jobs, **options):
        if not dropped:  # once the load has its destinations: under pressure, now
            dropped.append(streamer.drop_host_copies())
        return real(jobs, **options)

    monkeypatch.setattr(reads, "read_into", read_into)
    module = loader()
    assert_computes(module, expected)
    loader.unload(module)
    assert_computes(loader(), expected)


def test_relieving_host_memory_while_the_streamed_component_loads_keeps_the_frames(
    six_block_folder, reference_frames, monkeypatch
):
    pipe = streaming(six_block_folder, resident=2)
    real_finish = BlockStreamer.finish
    relieved: list[int] = []

    def finish(self, module):
        if not relieved:  # the load has read its host copies, the module is not armed yet
            relieved.append(pipe.relieve_host_memory())
        return real_finish(self, module)

    monkeypatch.setattr(BlockStreamer, "finish", finish)
    for prompt in PROMPTS:
        assert np.array_equal(generate(pipe, prompt), reference_frames[prompt]), prompt


def test_relief_from_another_thread_waits_while_a_load_takes_its_host_regions(
    six_block_folder,
):
    """The watch's ``drop_host_copies`` checks that no load is in flight and clears
    under the streamer's lock; a load takes each host region under it too. Else relief
    that passed its check just before a load began could clear the regions the load had
    just taken, and the block would be marked filled in a fresh, unwritten region."""
    import threading

    loader, streamer, sizes, expected = placed_loader(six_block_folder, None, False)
    streamer.use_layout(layout(sizes, (1, 2, 4)))
    host = object.__getattribute__(streamer, "_host")
    real_region = host.region
    free_meanwhile: list[bool] = []

    def region(block):
        if not free_meanwhile:

            def try_the_lock():
                taken = streamer._lock.acquire(timeout=0.1)
                if taken:
                    streamer._lock.release()
                free_meanwhile.append(taken)

            other = threading.Thread(target=try_the_lock)
            other.start()
            other.join()
        return real_region(block)

    host.region = region
    try:
        module = loader()
    finally:
        host.region = real_region
    assert free_meanwhile == [False], "another thread could take the lock mid-load"
    assert_computes(module, expected)


# -- loads that fail after the module was armed ---------------------------------------


def test_a_load_whose_transform_fails_leaves_the_layout_free_to_change(
    six_block_folder, reference_frames
):
    """A transform that raises (a fused LoRA on a streamed component, say) fails the load
    after the streamer armed the module: nothing of that module may stay armed, or the
    next plan can no longer change which blocks stream."""
    pipe = streaming(six_block_folder, resident=2)
    failures = {"left": 2}  # the prefetch's load, then the stage's own

    def fails_twice(module):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected transform failure")
        return module

    pipe.components["transformer"].add_transform(fails_twice)
    with pytest.raises(Exception, match="injected transform failure"):
        generate(pipe)
    first = stats(pipe)["streamed_blocks"]
    pipe.policy.budget_bytes = budget_keeping(transformer_blocks(six_block_folder), 3)
    assert np.array_equal(generate(pipe, PROMPTS[1]), reference_frames[PROMPTS[1]])
    assert len(stats(pipe)["streamed_blocks"]) == len(first) - 1


def test_a_pipelined_load_whose_filling_fails_leaves_the_layout_free_to_change(
    six_block_folder, monkeypatch
):
    """The filling of a pipelined load fails after the module was armed (the resident
    blocks are read behind it): the streamer must not stay armed for that module."""
    from ondeck.loading import pipelined

    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)  # a group per block
    loader, streamer, sizes, expected = placed_loader(six_block_folder, None, True)
    streamer.use_layout(layout(sizes, (1, 2, 4)))
    real = reads.read_in_groups

    def head_then_failure(groups, reached, **options):
        reads.read_into(list(groups[0]), progress=False)
        reached(0)  # the module can start: the load arms it
        raise OSError("injected read failure")

    monkeypatch.setattr(reads, "read_in_groups", head_then_failure)
    with pytest.raises(Exception, match="injected read failure"):
        loader()
    monkeypatch.setattr(reads, "read_in_groups", real)
    streamer.use_layout(layout(sizes, (0, 1, 2, 3)))
    assert_computes(loader(), expected)


# -- layouts that change between loads (checked: these hold) ---------------------------


# (streamed blocks, those read from the files each pass): blocks move between resident,
# pinned and read from the files, both ways, and the ring's buffers change size.
SEQUENCE = [
    ((1, 2, 4), (2, 4)),
    ((1, 2, 4), ()),
    ((1, 2, 4), (1, 2)),
    ((0, 1, 2, 3), (0, 3)),
    ((0, 1, 2, 3), ()),
    ((2, 3), (2,)),
    ((1, 2, 3, 4), (1, 4)),
    ((1, 2, 3, 4), (2, 3)),
    ((1, 2, 3, 4), ()),
]


@pytest.mark.parametrize("cached", [False, True], ids=["no cache", "host cache"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
def test_each_load_of_a_changing_layout_computes_on_its_weights(
    six_block_folder, monkeypatch, pipelined, fp8, cached
):
    cache = None
    if cached:
        monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
        cache = HostCache(budget_bytes=2**30, pin=False)
    options = dict(dtype=torch.bfloat16, storage_dtype="fp8") if fp8 else {}
    dtype = torch.bfloat16 if fp8 else torch.float32
    loader, streamer, sizes, expected = placed_loader(six_block_folder, cache, pipelined, **options)
    for streamed, from_files in SEQUENCE:
        planned = layout(sizes, streamed)
        streamer.use_layout(
            planned, reading_from_files(sizes, planned, from_files) if from_files else None
        )
        module = loader()
        assert_computes(module, expected, dtype)
        loader.unload(module)
        if streamed == (0, 1, 2, 3) and not from_files:
            assert streamer.drop_host_copies() > 0  # between loads: read again next time


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
def test_a_load_that_fails_midway_is_retried_whole(six_block_folder, monkeypatch, pipelined):
    loader, streamer, sizes, expected = placed_loader(six_block_folder, None, pipelined)
    planned = layout(sizes, (1, 2, 4))
    streamer.use_layout(planned, reading_from_files(sizes, planned, (2,)))
    real = reads.read_into
    calls = {"count": 0}

    def second_read_fails(jobs, **options):
        calls["count"] += 1
        if calls["count"] == 2:
            raise OSError("injected read failure")
        return real(jobs, **options)

    monkeypatch.setattr(reads, "read_into", second_read_fails)
    with pytest.raises(Exception, match="injected read failure"):
        loader()
    monkeypatch.setattr(reads, "read_into", real)
    for _ in range(2):
        module = loader()
        assert_computes(module, expected)
        loader.unload(module)


@pytest.mark.parametrize("keep_host_copies", [True, False], ids=["kept", "released"])
def test_runs_whose_device_and_host_room_change_give_the_same_frames(
    six_block_folder, reference_frames, monkeypatch, keep_host_copies
):
    pipe = streaming(
        six_block_folder, resident=2, keep_host_copies=keep_host_copies, file_ring_buffers=1
    )
    sizes = transformer_blocks(six_block_folder)
    block = max(sizes.packed_bytes)
    squeeze(pipe, 2 * block, monkeypatch)
    # (blocks resident, host room in blocks): a ring of one buffer and the pinned copies
    # that fit beside it, or all of them.
    steps = [(2, 2), (2, 3), (1, 3), (3, 2), (1, None), (2, 2), (2, 1), (1, 4), (2, None)]
    split = []
    for index, (resident, room) in enumerate(steps):
        pipe.policy.budget_bytes = budget_keeping(sizes, resident)
        pipe.host_memory = PROCESS + (64 * GiB if room is None else room * block)
        prompt = PROMPTS[index % 2]
        assert np.array_equal(generate(pipe, prompt), reference_frames[prompt]), index
        split.append((stats(pipe)["streamed_blocks"], stats(pipe)["from_files_blocks"]))
        if index == 3:
            pipe.relieve_host_memory()  # between runs: the next load reads them again
    assert any(0 < len(files) < len(streamed) for streamed, files in split)
    assert any(not files for _, files in split)
