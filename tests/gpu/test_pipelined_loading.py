"""Pipelined loading on CUDA: a forward that starts while blocks still arrive (from the
files and from the host cache) computes exactly what a whole load computes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ondeck.lazy import LazyModule
from ondeck.loading import ComponentLoader, HostCache, pipelined, ring

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def six_blocks(tmp_path_factory):
    from streaming.conftest import build_six_block_folder

    return build_six_block_folder(tmp_path_factory.mktemp("wan-six") / "tiny6")


@pytest.fixture(autouse=True)
def one_block_per_group(monkeypatch):
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)


def forward(module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return module(
            hidden_states=torch.randn(1, 16, 2, 8, 8, generator=generator).cuda(),
            timestep=torch.tensor([500.0]).cuda(),
            encoder_hidden_states=torch.randn(1, 7, 32, generator=generator).cuda(),
            return_dict=False,
        )[0]


def held_back(monkeypatch, blocks, hold) -> None:
    """``hold()`` runs on the copying thread before the first chunk of each of ``blocks``
    is copied: from the files the groups are one read, held back only there."""
    deliver = ring.deliver
    seen: set[str] = set()

    def holding(chunk, *rest):
        name = chunk.job.info.name
        block = name.split(".")[1] if name.startswith("blocks.") else None
        if block in blocks and block not in seen:
            seen.add(block)
            hold()
        return deliver(chunk, *rest)

    monkeypatch.setattr(ring, "deliver", holding)


def slow_reads(monkeypatch, seconds: float = 0.05) -> None:
    """Each block's weights take a while to come, so the forward overtakes the loading."""
    held_back(monkeypatch, {str(block) for block in range(64)}, lambda: time.sleep(seconds))


def test_a_forward_that_overtakes_the_loading_computes_the_whole_loads_result(
    six_blocks, monkeypatch
):
    whole = forward(ComponentLoader(six_blocks, "transformer", device="cuda", pipelined=False)())
    slow_reads(monkeypatch)
    proxy = LazyModule(
        "transformer", ComponentLoader(six_blocks, "transformer", device="cuda", pipelined=True)
    )
    ours = forward(proxy)
    filling = object.__getattribute__(proxy, "_ondeck_filling")
    assert filling is not None and filling.waited_seconds > 0  # it did run ahead
    assert torch.equal(ours, whole)
    before = torch.cuda.memory_allocated()
    freed = proxy.release()
    assert freed > 0 and torch.cuda.memory_allocated() <= before - freed


def test_from_the_host_cache_too(six_blocks):
    cache = HostCache(2**30)
    options = dict(device="cuda", pipelined=True, host_cache=cache)
    first, filling = ComponentLoader(six_blocks, "transformer", **options).begin()
    expected = forward(first)
    filling.wait()
    again = ComponentLoader(six_blocks, "transformer", **options)
    module, filling = again.begin()
    assert again.last_source == "host cache" and filling is not None
    assert torch.equal(forward(module), expected)
    filling.wait()


@pytest.mark.parametrize("source", ["files", "host cache"])
def test_a_fill_does_not_wait_for_compute_queued_after_its_destinations(
    six_blocks, monkeypatch, source
):
    """Copies into a pipelined load's blocks start after what was queued when its memory
    was allocated, not after the compute queued since: otherwise each block's weights
    would start arriving only once the blocks before it had computed."""
    options = dict(device="cuda", pipelined=True)
    if source == "host cache":
        options["host_cache"] = HostCache(2**30)
        ComponentLoader(six_blocks, "transformer", **options)()  # fills the cache
    gate = threading.Event()
    original = ComponentLoader._copy_and_read

    def gated(loader, jobs, *args, **kwargs):
        if any(job.info.name.startswith("blocks.2.") for job in jobs):
            assert gate.wait(30), "the test never opened the gate"
        return original(loader, jobs, *args, **kwargs)

    if source == "host cache":
        monkeypatch.setattr(ComponentLoader, "_copy_and_read", gated)
    else:
        held_back(monkeypatch, {"2"}, lambda: gate.wait(30))
    loader = ComponentLoader(six_blocks, "transformer", **options)
    module, filling = loader.begin()
    if source == "host cache":
        assert loader.last_source == "host cache"
    torch.cuda._sleep(2_000_000_000)  # about a second of the device, queued after the load
    slept = torch.cuda.Event()
    slept.record()
    gate.set()
    filling.wait()
    assert not slept.query()  # every block arrived while the device was still busy
    torch.cuda.synchronize()
    whole = ComponentLoader(six_blocks, "transformer", device="cuda", pipelined=False)()
    assert torch.equal(forward(module), forward(whole))
