"""Changes to a block's weights made as they land (``Filling.when_in_place``): each runs
once, before its block computes; a failed one fails the load; a cancelled or finished
filling leaves no change half made and no hook on the module."""

from __future__ import annotations

import copy
import functools
import gc
import threading
import time
import weakref

import pytest
import torch
from streaming.conftest import BLOCKS, build_six_block_folder

from ondeck.errors import LoadError
from ondeck.loading import ComponentLoader, pipelined

from .filling_helpers import GatedReads, forward, forward_in_background, wait_until


@pytest.fixture(scope="module")
def six_block_folder(tmp_path_factory):
    return build_six_block_folder(tmp_path_factory.mktemp("wan-six") / "tiny6")


@pytest.fixture(autouse=True)
def one_block_per_group(monkeypatch):
    """The tiny blocks would share one read; the tests follow them one by one."""
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)


def test_a_change_to_a_block_runs_once_its_weights_land_before_the_block_computes(
    six_block_folder, monkeypatch
):
    gates = GatedReads(monkeypatch, gated_blocks=range(BLOCKS))
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    found = {}

    def double(number):
        weight = module.blocks[number].attn1.to_q.weight
        found[number] = weight.detach().clone()  # what the change found in place
        weight.data.mul_(2)

    for number in (0, 4):
        filling.when_in_place(number, functools.partial(double, number))
    ran, result, worker = forward_in_background(module)
    worker.join(0.3)
    assert found == {} and ran == []  # block 0's weights are not in yet
    gates.open_all()
    worker.join(30)
    assert list(found) == [0, 4], "each change ran once, at its block"

    reference = ComponentLoader(six_block_folder, "transformer", pipelined=False)()
    for number in (0, 4):
        weight = reference.blocks[number].attn1.to_q.weight
        assert torch.equal(found[number], weight), "the change saw the block's weights"
        weight.data.mul_(2)
    assert torch.equal(result["out"], forward(reference)), "the blocks computed changed"


def test_changes_to_blocks_no_forward_reached_run_when_the_fill_is_waited_for(
    six_block_folder, monkeypatch
):
    gates = GatedReads(monkeypatch, gated_blocks=[3])
    _, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    changed = []
    filling.when_in_place(5, lambda: changed.append(5))
    filling.when_in_place(1, lambda: changed.append(1))
    assert changed == [], "they wait for their blocks"
    gates.open(3)
    filling.wait()
    assert changed == [5, 1], "in the order given"
    filling.when_in_place(2, lambda: changed.append(2))
    assert changed == [5, 1, 2], "in place already: at once"


def test_a_change_waits_for_the_end_of_a_fill_whose_weights_are_read_back(
    six_block_folder, monkeypatch
):
    gates = GatedReads(monkeypatch, gated_blocks=[3])
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    filling.reads_back = True  # the loader copies the filled weights somewhere at the end
    changed = []
    filling.when_in_place(0, lambda: changed.append(0))
    ran, _, worker = forward_in_background(module)
    worker.join(0.3)
    assert ran == [] and changed == [], "block 0 is in, but block 3 is not"
    gates.open(3)
    worker.join(30)
    assert changed == [0] and ran == list(range(BLOCKS))


def test_a_block_computes_only_once_the_thread_making_its_change_is_done(
    six_block_folder, monkeypatch
):
    """``wait()`` on another thread (the next run's prefetch) makes the changes no forward
    reached yet; a forward arriving at such a block waits for them to be made."""
    gates = GatedReads(monkeypatch, gated_blocks=[3])
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    events = []

    def slow_change():
        events.append("change starts")
        threading.Event().wait(0.3)
        events.append("change done")

    filling.when_in_place(4, slow_change)
    # The waiting thread starts the change while the forward is still at block 3.
    module.blocks[3].register_forward_pre_hook(lambda *_: time.sleep(0.15))
    module.blocks[4].register_forward_pre_hook(lambda *_: events.append("block 4 computes"))
    _, result, worker = forward_in_background(module)
    waiter = threading.Thread(target=filling.wait)
    waiter.start()
    gates.open(3)
    for thread in (waiter, worker):
        thread.join(30)
    assert events == ["change starts", "change done", "block 4 computes"]
    assert "out" in result


def test_a_change_that_fails_fails_the_load_and_is_never_made_again(six_block_folder, monkeypatch):
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    made = []

    def out_of_memory():
        made.append("first")
        raise RuntimeError("out of memory")

    filling.when_in_place(2, out_of_memory)
    filling.when_in_place(2, lambda: made.append("second"))
    with pytest.raises(LoadError, match="transformer.*block 2.*out of memory"):
        forward(module)
    with pytest.raises(LoadError, match="block 2"):
        forward(module)  # not half changed and computing as if whole
    with pytest.raises(LoadError, match="block 2"):
        filling.wait()
    assert made == ["first"]


@pytest.mark.parametrize("storage_dtype", [None, "fp8"])
def test_changes_wait_for_the_end_of_a_fill_a_storage_dtype_caches_from_the_device(
    six_block_folder, storage_dtype, monkeypatch
):
    """Kept in a storage dtype, a component goes into the host cache from its filled
    tensors once the fill ends: a change made before then would be cached with it."""
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    loader = ComponentLoader(
        six_block_folder,
        "transformer",
        pipelined=True,
        storage_dtype=storage_dtype,
        host_cache=cache,
    )
    _, filling = loader.begin()
    assert filling.reads_back == (storage_dtype is not None)
    filling.wait()


def test_a_waited_for_module_holds_no_hook_of_its_filling(six_block_folder, monkeypatch):
    """Once ``wait()`` returns the module can be copied and saved: no hook keeps the
    filling (its locks and thread) reachable from it."""
    gates = GatedReads(monkeypatch, gated_blocks=[3])
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    made = []
    filling.when_in_place(1, lambda: made.append(1))
    filling.when_in_place(5, lambda: made.append(5))
    gates.open(3)
    filling.wait()
    assert made == [1, 5]
    twin = copy.deepcopy(module)  # a lock among the hooks' state would refuse
    assert torch.equal(forward(twin), forward(module))
    assert all(not block._forward_pre_hooks for block in module.blocks)


def test_cancel_waits_for_a_change_another_thread_is_making(six_block_folder, monkeypatch):
    """The memory a cancelled load frees must not be written after ``cancel()`` returns,
    and a change still waiting for its block is never made."""
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    started, events = threading.Event(), []

    def slow_change():
        started.set()
        threading.Event().wait(0.3)
        events.append("change done")

    filling.when_in_place(2, slow_change)
    filling.when_in_place(4, lambda: events.append("block 4 changed"))
    module.blocks[3].register_forward_pre_hook(lambda *_: time.sleep(1.5))  # not at 4 before cancel
    _, _, worker = forward_in_background(module)
    assert started.wait(30)
    wait_until(lambda: filling.seconds is not None)  # every weight in: only changes left
    filling.cancel()
    events.append("cancelled")
    assert events == ["change done", "cancelled"]
    with pytest.raises(LoadError, match="stopped"):
        filling.when_in_place(0, lambda: events.append("after"))
    with pytest.raises(LoadError, match="stopped"):
        filling.wait()
    worker.join(30)
    assert events == ["change done", "cancelled"], "block 4's change was dropped"


def test_a_failed_change_keeps_no_tensor_alive(six_block_folder, monkeypatch):
    """The error outlives the load; the frames of the change that raised it must not
    keep the weights it was writing."""
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    seen = []

    def failing():
        weight = torch.empty(1 << 20)  # a tensor only this frame holds
        seen.append(weakref.ref(weight))
        raise RuntimeError("out of memory")

    filling.when_in_place(2, failing)
    with pytest.raises(LoadError, match="block 2") as failed:
        filling.wait()
    gc.collect()
    assert seen[0]() is None, "the error's frames keep the change's tensor"
    assert isinstance(failed.value.__cause__, RuntimeError)
