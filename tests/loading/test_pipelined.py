"""Pipelined loading: compute starts once the parts outside the blocks are in; each block's
forward waits for its own weights; a failure or a release mid-fill leaves nothing behind."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from streaming.conftest import BLOCKS, build_six_block_folder

from ondeck.errors import LoadError
from ondeck.lazy import LazyModule
from ondeck.loading import ComponentLoader, pipelined, process_feed, ring
from ondeck.loading.pipelined import fill_groups

from .filling_helpers import GatedReads, forward, forward_in_background, wait_until
from .helpers import NO_READING_PROCESSES, WHY_NO_READING_PROCESSES


@pytest.fixture(scope="module")
def six_block_folder(tmp_path_factory):
    return build_six_block_folder(tmp_path_factory.mktemp("wan-six") / "tiny6")


@pytest.fixture(autouse=True)
def one_block_per_group(monkeypatch):
    """The tiny blocks would share one read; the tests follow them one by one."""
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)


def test_groups_put_everything_outside_the_blocks_first_then_blocks_in_order():
    names = [["blocks.1.w"], ["proj_out.w"], ["blocks.0.w"], ["blocks.10.w"], ["blocks.2.w"]]
    groups, group_of = fill_groups(names, [2**30] * len(names), "blocks", 2**26)
    assert groups == [[1], [2], [0], [4], [3]]
    assert group_of == {0: 1, 1: 2, 2: 3, 10: 4}
    # Small blocks are read together; a tensor tied across two blocks goes first.
    names = [["blocks.0.w"], ["blocks.1.w"], ["blocks.2.w"], ["blocks.0.t", "blocks.2.t"]]
    groups, group_of = fill_groups(names, [1, 1, 1, 1], "blocks", 2**26)
    assert groups == [[3], [0, 1, 2]]
    assert group_of == {0: 1, 1: 1, 2: 1}


def test_pipelined_load_gives_the_whole_loads_outputs(six_block_folder):
    whole = ComponentLoader(six_block_folder, "transformer", pipelined=False)()
    module, filling = ComponentLoader(six_block_folder, "transformer", pipelined=True).begin()
    assert filling is not None
    assert torch.equal(forward(module), forward(whole))
    # Each block's wait removed itself once passed: later forwards pay nothing.
    assert all(not block._forward_pre_hooks for block in module.blocks)
    filling.wait()
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), module.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_small_components_load_whole_unless_asked(six_block_folder):
    _, filling = ComponentLoader(six_block_folder, "transformer").begin()
    assert filling is None  # far below the size worth pipelining
    _, filling = ComponentLoader(six_block_folder, "transformer", pipelined=False).begin()
    assert filling is None


def test_a_block_waits_for_exactly_its_own_weights(six_block_folder, monkeypatch):
    gates = GatedReads(monkeypatch, gated_blocks=range(BLOCKS))
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True)
    module, filling = loader.begin()  # returns with every block still held back
    assert gates.read_blocks == [None, 0]  # the parts outside the blocks, then block 0 waits
    ran, result, worker = forward_in_background(module)
    worker.join(0.3)
    assert worker.is_alive() and ran == []  # block 0 is not in yet
    gates.open(0)
    gates.open(1)
    wait_until(lambda: gates.read_blocks[-1] == 2)
    worker.join(0.3)
    assert ran == [0, 1]  # blocks 0 and 1 ran; block 2 waits for its own weights
    gates.open_all()
    worker.join(30)
    assert not worker.is_alive()
    assert filling.waited_seconds > 0
    filling.wait()
    # The fill's reads ran from before block 0 was let through (0.3 s held back) to the
    # end, inside the whole load.
    assert 0.3 < loader.last_read_seconds <= loader.last_load_seconds
    reference = ComponentLoader(six_block_folder, "transformer", pipelined=False)()
    assert torch.equal(result["out"], forward(reference))


def test_a_failed_fill_fails_the_forward_and_the_proxy_frees_the_module(
    six_block_folder, monkeypatch
):
    GatedReads(monkeypatch, fail_block=3)
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True)
    proxy = LazyModule("transformer", loader)
    with pytest.raises(LoadError, match="transformer.*disk went away"):
        forward(proxy)
    module = weakref.ref(object.__getattribute__(proxy, "_ondeck_module"))
    with pytest.raises(LoadError, match="disk went away"):
        proxy.materialize()  # waits for every weight: the fill failed, so it releases
    gc.collect()
    assert module() is None
    assert not object.__getattribute__(proxy, "_ondeck_module")


def test_release_during_a_fill_stops_it_and_frees_the_memory(six_block_folder, monkeypatch):
    gates = GatedReads(monkeypatch, gated_blocks=[2])
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True)
    proxy = LazyModule("transformer", loader)
    module = proxy.materialize(complete=False)
    storage = module.blocks[0].attn1.to_q.weight.untyped_storage()
    reference = weakref.ref(module)
    del module
    wait_until(lambda: 2 in gates.read_blocks)
    releasing = threading.Thread(target=proxy.release)
    releasing.start()
    releasing.join(0.3)
    assert releasing.is_alive()  # waits for the read in flight: nothing writes freed memory
    gates.open(2)
    releasing.join(30)
    assert not releasing.is_alive()
    assert gates.read_blocks[-1] == 2  # no later block was read
    assert storage.nbytes() == 0
    gc.collect()
    assert reference() is None
    # The next use loads again, whole and correct.
    reference_out = forward(ComponentLoader(six_block_folder, "transformer", pipelined=False)())
    assert torch.equal(forward(proxy), reference_out)


def test_anything_but_a_call_waits_for_every_weight(six_block_folder, monkeypatch):
    gates = GatedReads(monkeypatch, gated_blocks=[BLOCKS - 1])
    proxy = LazyModule(
        "transformer", ComponentLoader(six_block_folder, "transformer", pipelined=True)
    )
    proxy.materialize(complete=False)
    got: dict = {}
    reader = threading.Thread(target=lambda: got.setdefault("w", proxy.blocks[BLOCKS - 1]))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # attribute access waits for the last block
    gates.open_all()
    reader.join(30)
    whole = ComponentLoader(six_block_folder, "transformer", pipelined=False)()
    assert torch.equal(got["w"].ffn.net[2].weight, whole.blocks[BLOCKS - 1].ffn.net[2].weight)


def test_a_replayed_cast_waits_for_the_weights_before_it_runs(six_block_folder):
    proxy = LazyModule(
        "transformer", ComponentLoader(six_block_folder, "transformer", pipelined=True)
    )
    proxy.to(torch.float64)
    proxy.release()
    loaded = proxy.materialize(complete=False)
    assert object.__getattribute__(proxy, "_ondeck_filling") is None  # waited before the cast
    whole = ComponentLoader(six_block_folder, "transformer", pipelined=False)().double()
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_transform_that_leaves_the_weights_alone_does_not_wait_for_them(
    six_block_folder, monkeypatch
):
    gates = GatedReads(monkeypatch, gated_blocks=[BLOCKS - 1])
    proxy = LazyModule(
        "transformer", ComponentLoader(six_block_folder, "transformer", pipelined=True)
    )
    hooked: list[torch.nn.Module] = []
    proxy.add_transform(lambda module: hooked.append(module) or module, reads_weights=False)
    loaded = proxy.materialize(complete=False)  # the last block is still held back
    assert hooked == [loaded]
    assert object.__getattribute__(proxy, "_ondeck_filling") is not None
    # A transform that may read the weights waits for every one of them.
    weighed: list[float] = []
    reader = threading.Thread(
        target=lambda: proxy.add_transform(
            lambda module: (
                weighed.append(float(module.blocks[BLOCKS - 1].ffn.net[2].weight.detach().sum()))
                or module
            )
        )
    )
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and weighed == []
    gates.open_all()
    reader.join(30)
    whole = ComponentLoader(six_block_folder, "transformer", pipelined=False)()
    assert weighed == [float(whole.blocks[BLOCKS - 1].ffn.net[2].weight.sum())]
    # Both apply again at the next load, which waits for every weight (one transform reads).
    proxy.release()
    hooked.clear()
    proxy.materialize(complete=False)
    assert len(hooked) == 1 and len(weighed) == 2
    assert object.__getattribute__(proxy, "_ondeck_filling") is None


@pytest.mark.parametrize("policy", ["release", "budget"])
def test_a_pipeline_computes_while_blocks_arrive_and_gives_the_same_frames(
    six_block_folder, policy
):
    from ondeck.pipelines.wan import WanTextToVideo

    def generate(pipelined):
        pipe = WanTextToVideo.from_folder(
            six_block_folder,
            policy=policy,
            dtype=torch.float32,
            device="cpu",
            progress=False,
            pipelined=pipelined,
        )
        shape = dict(height=16, width=16, num_frames=5, num_inference_steps=2)
        frames = [pipe.generate(p, seed=7, max_sequence_length=16, **shape) for p in ("a", "b")]
        return frames, pipe.tracker

    whole, _ = generate(False)
    frames, tracker = generate(True)
    for ours, theirs in zip(frames, whole, strict=True):
        assert np.array_equal(ours, theirs)
    # Sorted: a fill is recorded when its last block is in, which under load may come
    # after a later component's.
    fills = sorted(event.name for event in tracker.events if event.kind == "fill")
    if policy == "release":
        # Loaded by their calls, on each run; the VAE is used through .decode(), which
        # waits for all of it, so it loads whole.
        assert fills == ["text_encoder", "text_encoder", "transformer", "transformer"]
    else:
        # Loaded by the policy before each stage, once: all three may compute early.
        assert fills == ["text_encoder", "transformer", "vae"]


def test_the_next_load_finds_its_skeleton_built_behind_the_last_one(six_block_folder, monkeypatch):
    from ondeck.loading.skeleton import Skeleton

    copies_here: list[str] = []
    fresh = Skeleton.fresh

    def watched(self):
        copies_here.append(threading.current_thread().name)
        return fresh(self)

    monkeypatch.setattr(Skeleton, "fresh", watched)
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True)
    module, filling = loader.begin()
    filling.wait()  # its thread then copies the skeleton for the next load
    filling._thread.join()
    expected = forward(module)
    del module
    copies_here.clear()
    again, filling = loader.begin()
    assert copies_here == []  # none on the caller's thread: the spare was used
    assert torch.equal(forward(again), expected)
    filling.wait()
    assert copies_here and copies_here[0].startswith("ondeck-fill")


def test_a_load_ends_without_waiting_for_the_next_loads_skeleton(six_block_folder, monkeypatch):
    """The next load's skeleton (a deep copy, and for fp8 storage its hooks: 0.1-0.2 s for
    a 14B transformer) is built after the fill has ended: whoever waits for the fill (the
    loader's call, the next run's loads) does not wait for it."""
    gate, building = threading.Event(), threading.Event()
    build = ComponentLoader._pipelined_skeleton

    def held(self, template):
        if threading.current_thread().name.startswith("ondeck-fill"):
            building.set()
            assert gate.wait(30), "the test never opened the gate"
        return build(self, template)

    monkeypatch.setattr(ComponentLoader, "_pipelined_skeleton", held)
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True)
    expected = forward(ComponentLoader(six_block_folder, "transformer", pipelined=False)())
    module = loader()  # returns while its filling's thread is held building the next skeleton
    try:
        assert building.wait(30) and not gate.is_set()
        assert loader._spare is None
        assert torch.equal(forward(module), expected)
    finally:
        gate.set()
    for thread in threading.enumerate():
        if thread.name.startswith("ondeck-fill"):
            thread.join(30)
    assert loader._spare is not None  # built once let go, for the next load


def test_a_filling_that_cannot_start_gives_back_its_host_cache_reservation(
    six_block_folder, monkeypatch
):
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)

    def no_thread(filling):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pipelined.Filling, "start", no_thread)
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True, host_cache=cache)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        loader.begin()
    assert cache._pending == {} and cache.resident_bytes == 0
    monkeypatch.undo()
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    loader()  # the next load can still reserve, and fills the cache
    assert cache.resident_bytes > 0


EXITS_MID_FILL = """
import sys, time
from pathlib import Path
import torch
from ondeck.loading.pipelined import start_filling

log = Path(sys.argv[1])

def fill(group):
    with log.open("a") as out:
        out.write(f"group {group}\\n")
    time.sleep(0.05)

def finished(error):
    with log.open("a") as out:
        out.write(f"finished {type(error).__name__}\\n")

filling = start_filling("transformer", list(range(200)), fill, finished, device=torch.device("cpu"))
filling.wait_group(0)
"""


def test_a_filling_still_running_at_exit_is_stopped_and_waited_for(tmp_path):
    # The script ends after its first group; 200 groups would take 10 s. A daemon thread
    # left inside torch as the interpreter shuts down can abort the exit, so the exit
    # stops the filling after its current group and lets it finish.
    log = tmp_path / "log.txt"
    done = subprocess.run(
        [sys.executable, "-c", EXITS_MID_FILL, str(log)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[-1] == "finished LoadError"  # "loading was stopped", after the group it read
    assert 1 <= len(lines) - 1 < 200


@pytest.mark.skipif(NO_READING_PROCESSES, reason=WHY_NO_READING_PROCESSES)
def test_one_read_through_the_processes_hands_each_block_over_as_it_arrives(
    six_block_folder, monkeypatch
):
    """Through the reading processes a pipelined load is one read (on the CPU only when
    asked for): blocks 0 and 1 compute while block 2's first chunk is held back."""
    gate, _ = _one_read(monkeypatch, hold_block=2)
    feeds: list[int] = []  # one feeding thread per read through the processes
    feed = process_feed.feed
    monkeypatch.setattr(
        process_feed,
        "feed",
        lambda state, lease: feeds.append(len(state.chunks)) or feed(state, lease),
    )
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=True)
    module, filling = loader.begin()
    ran, result, worker = forward_in_background(module)
    wait_until(lambda: ran == [0, 1])
    worker.join(0.3)
    assert worker.is_alive() and ran == [0, 1]  # block 2 waits for its own weights
    gate.set()
    worker.join(30)
    filling.wait()
    assert len(feeds) == 1 and loader.last_readers == "processes"  # one read for all groups
    monkeypatch.undo()
    whole = ComponentLoader(six_block_folder, "transformer", pipelined=False)()
    assert torch.equal(result["out"], forward(whole))


def _one_read(
    monkeypatch, hold_block: int, fail: bool = False
) -> tuple[threading.Event, threading.Event]:
    """Pipelined loads read through the processes (one read); the copying thread waits at
    the first chunk of ``hold_block`` until the returned gate opens, then fails if asked.
    The second event is set once the copying thread waits there."""
    monkeypatch.setattr(process_feed, "processes_wanted", lambda jobs, processes, devices: True)
    gate, held = threading.Event(), threading.Event()
    deliver = ring.deliver

    def holding(chunk, *rest):
        if chunk.job.info.name.startswith(f"blocks.{hold_block}."):
            held.set()
            assert gate.wait(30), "the test never opened the gate"
            if fail:
                raise OSError("the disk went away")
        return deliver(chunk, *rest)

    monkeypatch.setattr(ring, "deliver", holding)
    return gate, held


@pytest.mark.skipif(NO_READING_PROCESSES, reason=WHY_NO_READING_PROCESSES)
def test_release_during_one_read_stops_it_and_frees_the_memory(six_block_folder, monkeypatch):
    gate, held = _one_read(monkeypatch, hold_block=2)
    proxy = LazyModule(
        "transformer", ComponentLoader(six_block_folder, "transformer", pipelined=True)
    )
    module = proxy.materialize(complete=False)
    filling = object.__getattribute__(proxy, "_ondeck_filling")
    storage = module.blocks[0].attn1.to_q.weight.untyped_storage()
    reference = weakref.ref(module)
    del module
    # Released while the copying thread is inside block 2 (released earlier, the read
    # stops at the next group's end, before it gets there).
    assert held.wait(10)
    releasing = threading.Thread(target=proxy.release)
    releasing.start()
    releasing.join(0.3)
    assert releasing.is_alive()  # waits for the copying thread: nothing writes freed memory
    gate.set()
    releasing.join(30)
    assert not releasing.is_alive()
    assert isinstance(filling.failure, LoadError) and "stopped" in str(filling.failure)
    assert storage.nbytes() == 0
    gc.collect()
    assert reference() is None
    monkeypatch.undo()
    expected = forward(ComponentLoader(six_block_folder, "transformer", pipelined=False)())
    assert torch.equal(forward(proxy), expected)


@pytest.mark.skipif(NO_READING_PROCESSES, reason=WHY_NO_READING_PROCESSES)
def test_a_read_failing_mid_way_fails_the_forward_that_needs_the_block(
    six_block_folder, monkeypatch
):
    gate, _ = _one_read(monkeypatch, hold_block=3, fail=True)
    gate.set()
    proxy = LazyModule(
        "transformer", ComponentLoader(six_block_folder, "transformer", pipelined=True)
    )
    with pytest.raises(LoadError, match="transformer"):
        forward(proxy)
    module = weakref.ref(object.__getattribute__(proxy, "_ondeck_module"))
    with pytest.raises(LoadError) as failed:
        proxy.materialize()
    gc.collect()
    assert module() is None
    # The memory is freed; no frame of the error still holds a view of it (the reader's
    # chunks), which a traceback shown with its locals would read.
    assert _freed_tensors_in_frames(failed.value) == []


@pytest.mark.parametrize("readers", ["processes", "threads"])
def test_a_whole_load_failing_mid_read_keeps_no_view_of_its_freed_memory(
    six_block_folder, monkeypatch, readers
):
    """Loaded whole, through either reader, a read that fails half way frees what the
    load took, and no frame of the error keeps a view of it."""
    if readers == "processes":
        if NO_READING_PROCESSES:
            pytest.skip(WHY_NO_READING_PROCESSES)
        gate, _ = _one_read(monkeypatch, hold_block=3, fail=True)
        gate.set()
    else:
        monkeypatch.setenv("ONDECK_READ_PROCESSES", "0")
        original = ring.pread_exact

        def failing(fd, address, length, offset, info, component):
            if info.name.startswith("blocks.3."):
                raise OSError("the disk went away")
            return original(fd, address, length, offset, info, component)

        monkeypatch.setattr(ring, "pread_exact", failing)
    loader = ComponentLoader(six_block_folder, "transformer", pipelined=False)
    with pytest.raises((LoadError, OSError)) as failed:
        loader()
    assert _freed_tensors_in_frames(failed.value) == []


def _freed_tensors_in_frames(error: BaseException) -> list[tuple[str, str]]:
    """(function, local) of every tensor, or chunk's target, in the frames of ``error``
    and its causes whose storage no longer holds its elements. Reads no tensor."""
    from ondeck.loading.chunks import Chunk

    found, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            for name, value in tb.tb_frame.f_locals.items():
                tensor = value.target if isinstance(value, Chunk) else value
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.device.type != "meta"
                    and tensor.untyped_storage().nbytes() < tensor.numel() * tensor.element_size()
                ):
                    found.append((tb.tb_frame.f_code.co_name, name))
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return found


def test_fills_onto_one_device_take_turns_in_the_order_they_started():
    """A second fill (the next component) starts reading only once the first has ended,
    so the component needed first is whole first; a fill stopped while it waits for its
    turn ends at once, and the fills after it still run."""
    order: list[str] = []
    hold = threading.Event()
    ended: dict[str, BaseException | None] = {}

    def filler(name: str, gate: threading.Event | None = None):
        def fill(group):
            if gate is not None:
                gate.wait(10)
            order.append(f"{name}{group}")

        return fill

    def finished(name: str):
        return lambda error: ended.__setitem__(name, error)

    cpu = torch.device("cpu")
    first = pipelined.start_filling("a", [0, 1], filler("a", hold), finished("a"), device=cpu)
    waiting = pipelined.start_filling("b", [0, 1], filler("b"), finished("b"), device=cpu)
    last = pipelined.start_filling("c", [0], filler("c"), finished("c"), device=cpu)
    waiting.cancel()  # returns without the first fill ending
    assert isinstance(ended["b"], LoadError) and "stopped" in str(ended["b"])
    assert order == [] and "a" not in ended and "c" not in ended
    hold.set()
    last.wait()
    first.wait()
    assert order == ["a0", "a1", "c0"]
    assert ended["a"] is None and ended["c"] is None
