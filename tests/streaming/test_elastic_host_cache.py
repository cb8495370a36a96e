"""An elastic host cache: it takes what the plan leaves of the host room once the
streamed blocks' pinned copies are counted, keeps the components a run loads again, and
holds nothing of a component the plan never releases."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import ondeck
from ondeck.lazy import loader_of
from ondeck.loading import ComponentLoader, HostCache, TensorInfo
from ondeck.memory import parse_bytes
from ondeck.policy import BudgetPolicy, EagerPolicy
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


def test_an_elastic_cache_takes_the_room_it_is_given_and_evicts_nothing_to_take_more():
    cache = HostCache(1000, pin=False, elastic=True)
    assert not fill(cache, ("f", "a", 1), 1)  # no room until a plan gives it some
    cache.fit(1000)
    assert fill(cache, ("f", "a", 1), 300) and fill(cache, ("f", "b", 1), 300)

    assert cache.fit(400) == 300  # the least recently used entry goes
    assert cache.keys() == [("f", "b", 1)] and cache.budget_bytes == 400
    assert not fill(cache, ("f", "c", 1), 200)  # it would have to evict b
    assert cache.keys() == [("f", "b", 1)]

    cache.fit(10**9)  # never past what it was given
    assert cache.budget_bytes == 1000
    assert fill(cache, ("f", "c", 1), 200)

    cache.fit(10**9, refused=[("f", "b")])  # b is not loaded again: no new entry of it
    assert not fill(cache, ("f", "b", 2), 100)
    assert set(cache.keys()) == {("f", "b", 1), ("f", "c", 1)}  # its entry serves a load
    assert not cache.reserve(("gguf", "x"), [info(10)], owner=("f", "b"))  # any key

    cache.fit(10**9, adding=False)  # a last run: no more than it holds
    assert cache.budget_bytes == 500 and not fill(cache, ("f", "d", 1), 1)


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
        policy=BudgetPolicy(budget, streaming=options) if isinstance(budget, int) else budget,
        host_cache=cache,
        host_memory=host_memory,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def streaming_budget(folder) -> int:
    return budget_keeping(transformer_blocks(folder), 2)


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
    # The process as the plan counts it (its RSS may hold memory freed since), and 512 MiB.
    process = load(six_block_folder, None, budget).ondeck.plan().host.process_bytes
    host_memory = process + 512 * MiB

    fixed = load(six_block_folder, HostCache(2**30, pin=False), budget, host_memory)
    expected = frames(fixed)
    assert fixed.ondeck.plan().file_reads  # the guard below can fail

    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = load(six_block_folder, cache, budget, host_memory)
    runs = [frames(pipe) for _ in range(2)]
    plan = pipe.ondeck.plan()

    assert not plan.file_reads and plan.pinned_host_bytes > 0
    assert 0 < cache.budget_bytes < 768 * MiB  # what is left, not its 1 GiB
    assert cache.stats()["held_bytes"] <= cache.budget_bytes
    assert {key[1] for key in cache.keys()} == {"text_encoder", "transformer", "vae"}
    assert cache.hits >= 3  # the second run's three loads
    assert pipe.ondeck.loaders["transformer"].last_source == "host cache"
    assert all(np.array_equal(run, expected) for run in runs)
    assert "an elastic host cache takes what is left for the components a later run" in str(plan)


def test_the_elastic_cache_takes_nothing_of_components_that_stay_loaded(
    six_block_folder, cache_serves_cpu
):
    """Everything fits: no component is loaded again, so the cache takes none, the
    eager policy's loads at construction (before any run gives it room) included."""
    for policy in (BudgetPolicy(2**30), EagerPolicy()):
        cache = HostCache(2**30, pin=False, elastic=True)
        pipe = load(six_block_folder, cache, policy)
        for _ in range(2):
            frames(pipe)
        assert not cache.keys()


def test_entries_held_serve_a_pipeline_whose_plan_now_keeps_everything(
    six_block_folder, cache_serves_cpu
):
    """A pipeline that keeps everything on the device still loads each component once:
    what the cache holds of them (from a pipeline that streamed) serves that load."""
    cache = HostCache(2**30, pin=False, elastic=True)
    first = load(six_block_folder, cache, streaming_budget(six_block_folder))
    frames(first)
    first.ondeck.close()
    assert {key[1] for key in cache.keys()} == {"text_encoder", "transformer", "vae"}

    pipe = load(six_block_folder, cache, BudgetPolicy(2**30))
    frames(pipe)

    sources = {name: loader.last_source for name, loader in pipe.ondeck.loaders.items()}
    assert all(source.startswith("host cache") for source in sources.values()), sources


class Touch(ondeck.Stage):
    def __init__(self, name, *models):
        super().__init__()
        self.name, self.models = name, list(models)

    def forward(self, state):
        for model in self.models:
            next(model.parameters())
        return state


def stage_pipeline(folder, cache, layout, policy):
    """An ondeck Pipeline whose stages hold ``layout`` (``[(stage, [components])]``),
    each component a ComponentLoader of ``folder`` feeding ``cache``."""
    names = tuple(dict.fromkeys(name for _, held in layout for name in held))

    class Stages(ondeck.Pipeline):
        lazy_components = names

        def create_stages(self):
            return [Touch(stage, *(self.components[n] for n in held)) for stage, held in layout]

    loaders = {
        name: ComponentLoader(folder, name, device="cpu", host_cache=cache, progress=False)
        for name in names
    }
    return Stages(loaders, policy=policy, device="cpu")


def test_under_release_a_component_of_every_stage_is_kept_for_the_next_run(
    six_block_folder, cache_serves_cpu
):
    """``release`` frees everything after a run, a component every stage holds too:
    the next run loads it from the cache."""
    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = stage_pipeline(six_block_folder, cache, [("A", ["vae"]), ("B", ["vae"])], "release")
    for _ in range(2):
        pipe({})
    assert pipe.deferred["vae"].load_count == 2  # loaded again in the second run
    assert loader_of(pipe.deferred["vae"]).last_source == "host cache"


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


def test_a_last_run_keeps_what_the_cache_holds_while_an_early_load_fills_it(
    six_block_folder, cache_serves_cpu
):
    """A load the previous run started for the next (pipelined, it commits later) holds
    a reservation when the last run's cache is fitted: it counts, so no entry the last
    run loads again is evicted for it."""
    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = load(six_block_folder, cache, streaming_budget(six_block_folder))
    frames(pipe)
    held = set(cache.keys())
    assert held
    size = min(cache.stats()["held_bytes"] // 2, 64 * 1024)
    assert cache.reserve(("in", "flight", 1), [info(size)])  # not committed yet

    pipe.ondeck.more_runs = False
    pipe.ondeck.fit_host_caches()

    assert set(cache.keys()) == held


def test_the_plan_of_a_last_run_says_the_cache_takes_nothing(six_block_folder, cache_serves_cpu):
    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = load(six_block_folder, cache, streaming_budget(six_block_folder))
    assert "an elastic host cache takes what is left" in str(pipe.ondeck.plan())
    pipe.ondeck.more_runs = False

    assert "it holds and takes nothing in a last run" in str(pipe.ondeck.plan())


def test_ranks_on_one_host_share_the_room_their_elastic_caches_take(
    six_block_folder, cache_serves_cpu, monkeypatch
):
    """Under torchrun every rank sees the host's free memory as its own: each rank's
    elastic cache takes its share of what the plan leaves."""
    cache = HostCache(2**40, pin=False, elastic=True)
    pipe = load(six_block_folder, cache, streaming_budget(six_block_folder))
    pipe.ondeck.fit_host_caches()
    alone = cache.budget_bytes
    assert alone > 2**20

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    pipe.ondeck.fit_host_caches()

    assert cache.budget_bytes == pytest.approx(alone / 4, rel=0.05)


def rss_pipeline(folder, cache, room: int):
    """A release pipeline over ``folder`` whose host budget leaves about ``room``."""
    pipe = stage_pipeline(folder, cache, [("A", ["text_encoder"]), ("B", ["vae"])], "release")
    pipe.host_memory = pipe.plan().host.process_bytes + room
    return pipe


@pytest.mark.parametrize("more_runs", [True, False])
def test_a_load_still_filling_the_cache_is_counted_once(
    six_block_folder, cache_serves_cpu, more_runs
):
    """A load still filling its entry (one the previous run started for the next) holds
    memory the process shows: fitting the cache counts it once, so an entry that fits
    beside it stays."""
    cache = HostCache(2**40, pin=False, elastic=True)
    pipe = rss_pipeline(six_block_folder, cache, 1024 * MiB)
    pipe.fit_host_caches()
    assert cache.budget_bytes > 950 * MiB
    entry = cache.reserve(("f", "kept", 1), [info(600 * MiB)])
    entry["t"].fill_(1)  # in the process's memory, as a real entry is
    cache.commit(("f", "kept", 1), entry)
    filling = cache.reserve(("f", "filling", 1), [info(300 * MiB)])
    filling["t"].fill_(1)  # its bytes written, not committed yet

    pipe.more_runs = more_runs
    pipe.fit_host_caches()

    assert ("f", "kept", 1) in cache.keys()
    cache.discard(("f", "filling", 1))


def test_the_plan_says_what_each_ranks_elastic_cache_may_take(
    six_block_folder, cache_serves_cpu, monkeypatch
):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cache = HostCache(2**40, pin=False, elastic=True)
    pipe = rss_pipeline(six_block_folder, cache, 1024 * MiB)

    text = str(pipe.plan())
    pipe.fit_host_caches()

    said = re.search(r"an elastic host cache takes what is left .*?up to ([\d.]+ \w+)", text)
    assert said and "this rank's share of 4" in text, text
    assert parse_bytes(said.group(1)) == pytest.approx(cache.budget_bytes, rel=0.05)
