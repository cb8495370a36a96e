from __future__ import annotations

import pytest
import torch

from ondeck.loading import ComponentLoader, HostCache, TensorInfo, reads, ring
from ondeck.loading import host_cache as host_cache_module

from .helpers import assert_same_state, from_pretrained


def info(name: str, nbytes: int) -> TensorInfo:
    return TensorInfo(name, torch.uint8, (nbytes,), 0, nbytes, "f.safetensors")


def fill(cache: HostCache, key, nbytes: int) -> bool:
    buffers = cache.reserve(key, [info("t", nbytes)])
    if buffers is None:
        return False
    cache.commit(key, buffers)
    return True


@pytest.fixture
def cache_on_cpu(monkeypatch):
    """Let the cache serve CPU loads, which it normally refuses, so its path runs here."""
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    return HostCache(budget_bytes=2**30, pin=False)


class Properties:
    def __init__(self, is_integrated: bool):
        self.is_integrated = is_integrated


def as_if_cuda(monkeypatch, *, integrated: bool) -> None:
    """torch.cuda as on a machine whose GPU is discrete, or integrated (unified memory)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties(integrated))


def test_disabled_where_a_host_copy_would_be_the_same_memory_twice(monkeypatch):
    assert not HostCache.enabled_for("cpu")
    assert not HostCache.enabled_for(torch.device("cpu"))
    assert not HostCache.enabled_for("mps")
    as_if_cuda(monkeypatch, integrated=True)
    assert not HostCache.enabled_for("cuda")
    assert not HostCache.enabled_for("cuda:0")


def test_enabled_for_a_discrete_gpu(monkeypatch):
    as_if_cuda(monkeypatch, integrated=False)
    assert HostCache.enabled_for("cuda")
    assert HostCache.enabled_for(torch.device("cuda", 0))


def test_loader_ignores_a_cache_for_cpu_targets(wan_template):
    cache = HostCache(budget_bytes=2**30)
    loader = ComponentLoader(wan_template, "vae", device="cpu", host_cache=cache)
    loader()
    loader()
    assert loader.host_cache is None
    assert (cache.hits, cache.misses, cache.resident_bytes) == (0, 0, 0)


def test_default_budget_is_half_of_what_is_available_less_headroom_never_negative(monkeypatch):
    import psutil

    GiB = 2**30
    available = {"bytes": 20 * GiB}

    class Memory:
        @property
        def available(self):
            return available["bytes"]

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    assert host_cache_module.default_budget_bytes() == 6 * GiB
    assert HostCache().budget_bytes == 6 * GiB
    available["bytes"] = 4 * GiB
    assert host_cache_module.default_budget_bytes() == 0
    assert HostCache().budget_bytes == 0


def test_second_load_is_a_hit_and_identical(wan_template, cache_on_cpu, monkeypatch):
    loader = ComponentLoader(wan_template, "transformer", host_cache=cache_on_cpu)
    first = loader()
    assert (cache_on_cpu.hits, cache_on_cpu.misses) == (0, 1)
    assert loader.last_source in ("page cache", "disk")
    assert cache_on_cpu.resident_bytes == loader.folder.file_bytes("transformer")

    def no_file_reads(*args, **kwargs):
        raise AssertionError("a cache hit read the file")

    monkeypatch.setattr(reads, "read_into", no_file_reads)
    second = loader()
    assert (cache_on_cpu.hits, cache_on_cpu.misses) == (1, 1)
    assert loader.last_source == "host cache"
    assert_same_state(second, first)


def test_cached_bytes_are_the_files_not_the_cast(wan_template, cache_on_cpu):
    ComponentLoader(wan_template, "vae", dtype=torch.float32, host_cache=cache_on_cpu)()
    loader = ComponentLoader(wan_template, "vae", dtype=torch.bfloat16, host_cache=cache_on_cpu)
    loaded = loader()
    assert loader.last_source == "host cache"
    assert_same_state(loaded, from_pretrained(wan_template, "vae", torch.bfloat16))


def test_failed_first_load_leaves_no_entry(wan_template, cache_on_cpu, monkeypatch):
    from ondeck.errors import LoadError

    def broken(*args, **kwargs):
        raise LoadError("disk vanished")

    monkeypatch.setattr(ring, "pread_exact", broken)
    loader = ComponentLoader(wan_template, "vae", host_cache=cache_on_cpu)
    with pytest.raises(LoadError):
        loader()
    assert cache_on_cpu.keys() == [] and cache_on_cpu.resident_bytes == 0


def test_lru_eviction_respects_the_budget():
    cache = HostCache(budget_bytes=1000, pin=False)
    assert fill(cache, "a", 400) and fill(cache, "b", 400)
    assert cache.get("a") is not None  # "a" is now the most recently used
    assert fill(cache, "c", 400)
    assert cache.keys() == ["a", "c"]
    assert cache.resident_bytes == 800 <= cache.budget_bytes


def test_entry_larger_than_the_budget_is_not_kept():
    cache = HostCache(budget_bytes=100, pin=False)
    assert fill(cache, "a", 60)
    assert not fill(cache, "huge", 101)
    assert cache.keys() == ["a"]


def test_hits_and_misses_are_counted():
    cache = HostCache(budget_bytes=100, pin=False)
    assert cache.get("a") is None
    fill(cache, "a", 10)
    assert cache.get("a") is not None
    assert (cache.hits, cache.misses) == (1, 1)


def test_stats_count_entries_held_bytes_and_tensor_bytes():
    cache = HostCache(budget_bytes=100, pin=False)
    fill(cache, "a", 10)
    buffers = cache.reserve("b", [info("x", 20), info("y", 5)])
    assert cache.stats()["entries"] == 1  # a reservation is not an entry yet
    cache.commit("b", buffers)
    assert cache.get("missing") is None
    assert cache.stats() == {
        "entries": 2,
        "held_bytes": 35,
        "tensor_bytes": 35,
        "hits": 0,
        "misses": 1,
    }


def test_pinned_entries_hold_exactly_their_tensors_aligned_bytes():
    """torch's pinned allocator rounds each request up to a power of two (a 10.1 GiB text
    encoder in one buffer: 16 GiB); an entry's pinned arenas are its bytes, exactly."""
    from types import SimpleNamespace

    from ondeck.loading.host_cache import _arenas

    mib = 2**20
    sizes = [50 * mib + 4096, 135 * mib + 8192, 20 * 1024 + 3] * 120
    infos = [SimpleNamespace(name=f"t{i}", nbytes=n) for i, n in enumerate(sizes)]
    arenas = _arenas(infos, pinned=True)
    assert sum(capacity for capacity, _ in arenas) == sum((n + 255) // 256 * 256 for n in sizes)
    for capacity, members in arenas:
        offsets = sorted((offset, sizes[index]) for index, offset in members.items())
        assert all(offset % 256 == 0 for offset, _ in offsets)
        for (offset, nbytes), (following, _) in zip(offsets, offsets[1:], strict=False):
            assert offset + nbytes <= following
        assert offsets[-1][0] + offsets[-1][1] <= capacity
    # Pageable memory: a buffer per tensor, exactly its bytes.
    assert _arenas(infos[:2], pinned=False) == [(sizes[0], {0: 0}), (sizes[1], {1: 0})]


def test_pinned_entries_are_held_in_arenas_of_bounded_size():
    sizes = [100, host_cache_module.ARENA_BYTES, 7, 3 * host_cache_module.ARENA_BYTES // 4, 5]
    infos = [info(f"t{i}", nbytes) for i, nbytes in enumerate(sizes)]
    arenas = host_cache_module._arenas(infos, pinned=True)
    placed = sorted(index for _, members in arenas for index in members)
    assert placed == list(range(len(sizes)))  # every tensor once
    for capacity, members in arenas:
        # Back to back in file order, within the arena, no larger than the bound unless
        # one tensor is.
        ends = [offset + sizes[index] for index, offset in members.items()]
        assert max(ends) <= capacity
        assert capacity <= host_cache_module.ARENA_BYTES or len(members) == 1
        assert list(members) == sorted(members)
    assert len(arenas) == 3  # [100], [ARENA], [7, 3/4 ARENA, 5]
    # A numbered block's tensors never share an arena with another's: when a block moves
    # to streaming, its arenas are freed whole.
    names = ["blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.10.a", "norm.weight", "proj.bias"]
    arenas = host_cache_module._arenas([info(name, 64) for name in names], pinned=True)
    assert [sorted(members) for _, members in arenas] == [[0, 1], [2], [3], [4, 5]]


def test_a_reservation_that_cannot_fit_evicts_nothing():
    """While another load holds a reservation, one that cannot fit even with every entry
    evicted is refused and leaves the entries alone: evicting them would give the refused
    load nothing, and the next load of an evicted component would read its file again."""
    cache = HostCache(budget_bytes=100, pin=False)
    held = cache.reserve("held", [info("t", 10)])
    cache.commit("held", held)
    assert cache.reserve("in flight", [info("t", 80)]) is not None  # a load in progress

    assert cache.reserve("too big beside it", [info("t", 30)]) is None

    assert "held" in cache, "an entry was evicted for a reservation that was then refused"


def test_a_copy_into_the_cache_that_fails_leaves_no_reservation_behind():
    """A stored tensor that cannot be copied into its host buffer: the error goes to the
    load, and the bytes reserved for the entry are given back."""
    from types import SimpleNamespace

    from ondeck.loading import fp8

    cache = HostCache(budget_bytes=1 << 20, pin=False)
    good = SimpleNamespace(
        info=TensorInfo("a", torch.uint8, (64,), 0, 64),
        destination=torch.ones(64, dtype=torch.uint8),
    )
    unreadable = torch.empty(64, dtype=torch.uint8, device="meta")
    bad = SimpleNamespace(info=TensorInfo("b", torch.uint8, (64,), 64, 128), destination=unreadable)

    with pytest.raises(NotImplementedError):
        fp8.keep_in_cache(cache, "component", [good, bad])

    assert "component" not in cache
    assert cache.held_bytes == 0, "the failed load's reservation is still held"
    fp8.keep_in_cache(cache, "component", [good])
    assert cache.get("component")["a"].tolist() == [1] * 64, "a later load is kept"
