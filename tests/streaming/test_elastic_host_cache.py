"""An elastic host cache: it takes what the plan leaves of the host room once the
streamed blocks' pinned copies are counted, keeps the components a run loads again, and
holds nothing of a component the plan never releases."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from ondeck.loading import HostCache, TensorInfo
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions

from .conftest import budget_keeping, transformer_blocks

SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)
MiB = 2**20


def info(nbytes: int) -> TensorInfo:
    return TensorInfo("t", torch.uint8, (nbytes,), 0, nbytes, "f.safetensors")


def fill(cache: HostCache, key: tuple, nbytes: int) -> bool:
    buffers = cache.reserve(key, [info(nbytes)])
    if buffers is None:
        return False
    cache.commit(key, buffers)
    return True


def test_an_elastic_cache_shrinks_to_its_room_and_evicts_nothing_to_take_more():
    cache = HostCache(1000, pin=False, elastic=True)
    assert fill(cache, ("f", "a", 1), 300) and fill(cache, ("f", "b", 1), 300)

    assert cache.fit(400) == 300  # the least recently used entry goes
    assert cache.keys() == [("f", "b", 1)] and cache.budget_bytes == 400
    assert not fill(cache, ("f", "c", 1), 200)  # it would have to evict b
    assert cache.keys() == [("f", "b", 1)]

    cache.fit(10**9)  # never past what it was given
    assert cache.budget_bytes == 1000
    assert fill(cache, ("f", "c", 1), 200)

    cache.fit(10**9, kept_on_device=[("f", "b")])  # b never reloads: it goes, and stays out
    assert cache.keys() == [("f", "c", 1)]
    assert not fill(cache, ("f", "b", 2), 100)


def test_a_fixed_cache_keeps_its_budget_and_evicts_to_make_room():
    cache = HostCache(1000, pin=False)
    assert fill(cache, ("f", "a", 1), 600)
    assert cache.fit(100) == 0 and cache.budget_bytes == 1000
    assert fill(cache, ("f", "b", 1), 600)
    assert cache.keys() == [("f", "b", 1)]


@pytest.fixture
def cache_serves_cpu(monkeypatch):
    """Let host caches serve CPU loads, which they refuse otherwise, so their path runs."""
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))


def load(folder, cache, budget, host_memory=None):
    import ondeck.diffusers

    options = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
    pipe = ondeck.diffusers.from_pretrained(
        folder,
        dtype=torch.float32,
        device="cpu",
        policy=BudgetPolicy(budget, streaming=options),
        host_cache=cache,
        host_memory=host_memory,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def frames(pipe):
    generator = torch.Generator().manual_seed(7)
    return pipe("a fox", negative_prompt="blurry", generator=generator, **SHAPE).frames


def test_the_elastic_cache_gives_way_to_the_pinned_copies_a_fixed_one_takes(
    six_block_folder, cache_serves_cpu
):
    """Under a host budget with room for the streamed blocks' copies and little more, a
    fixed cache's budget sends the streamed blocks to the files; an elastic one of the
    same size leaves them their copies, and the reloads of the next runs come from it."""
    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    host_memory = psutil.Process().memory_info().rss + 512 * MiB

    fixed = load(six_block_folder, HostCache(2**30, pin=False), budget, host_memory)
    expected = frames(fixed)
    assert fixed.ondeck.plan().file_reads  # the guard below can fail

    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = load(six_block_folder, cache, budget, host_memory)
    runs = [frames(pipe) for _ in range(2)]
    plan = pipe.ondeck.plan()

    assert not plan.file_reads and plan.pinned_host_bytes > 0
    assert 0 < cache.budget_bytes < 512 * MiB
    assert cache.stats()["held_bytes"] <= cache.budget_bytes
    assert {key[1] for key in cache.keys()} == {"text_encoder", "transformer", "vae"}
    assert cache.hits >= 3  # the second run's three loads
    assert pipe.ondeck.loaders["transformer"].last_source == "host cache"
    assert all(np.array_equal(run, expected) for run in runs)
    assert "an elastic host cache takes what is left, up to" in str(plan)


def test_the_elastic_cache_holds_nothing_of_components_that_stay_loaded(
    six_block_folder, cache_serves_cpu
):
    cache = HostCache(2**30, pin=False, elastic=True)
    streaming = load(
        six_block_folder, cache, budget_keeping(transformer_blocks(six_block_folder), 2)
    )
    frames(streaming)
    assert cache.keys()  # the guard below can fail
    streaming.ondeck.close()

    everything = load(six_block_folder, cache, 2**30)
    for _ in range(2):
        frames(everything)

    assert not cache.keys()


def test_a_last_run_adds_nothing_to_the_elastic_cache(six_block_folder, cache_serves_cpu):
    """A one-shot command's run (``more_runs`` False) is the last: nothing it would keep
    is loaded again, so it pins nothing for the cache; what an earlier run kept stays."""
    budget = budget_keeping(transformer_blocks(six_block_folder), 2)
    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = load(six_block_folder, cache, budget)
    pipe.ondeck.more_runs = False
    frames(pipe)
    assert not cache.keys()

    pipe.ondeck.more_runs = True
    frames(pipe)
    kept = set(cache.keys())
    assert kept
    pipe.ondeck.more_runs = False
    frames(pipe)
    assert (
        set(cache.keys()) == kept and pipe.ondeck.loaders["transformer"].last_source == "host cache"
    )
