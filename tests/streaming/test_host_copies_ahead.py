"""Streamed blocks' host copies are allocated on a thread once a plan gives the layouts,
before the first load that fills them; a change of plan or of what is held stops it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ondeck.memory import FreshHostBytes
from ondeck.streaming import host
from ondeck.streaming.host import HostCopies

from .test_wan_streaming import generate, streaming, wan


@pytest.fixture(scope="module")
def fox_frames(six_block_folder):
    return generate(wan(six_block_folder, "release"), "a fox")


def allocations(monkeypatch) -> list[tuple[int, str]]:
    """(bytes, thread name) of every host copy allocated from now on."""
    made: list[tuple[int, str]] = []
    original = HostCopies._allocate

    def watched(self, block, *args):
        fresh = block not in self._regions
        region = original(self, block, *args)
        if fresh:
            made.append((region.numel(), threading.current_thread().name))
        return region

    monkeypatch.setattr(HostCopies, "_allocate", watched)
    return made


def test_a_plan_allocates_the_host_copies_before_anything_loads(
    six_block_folder, fox_frames, monkeypatch
):
    pipe = streaming(six_block_folder, resident=2, prepare_host_copies=True)
    made = allocations(monkeypatch)
    streaming_ = pipe.policy.streaming
    streaming_.apply(pipe, pipe.plan())
    streaming_._preparing._thread.join(30)
    streamer = streaming_.streamers["transformer"]
    planned = sum(streamer.sizes.packed_bytes[b] for b in streamer.layout.streamed)
    assert streamer.host_bytes == planned > 0
    assert {name for _, name in made} == {"ondeck-host-copies"}
    assert sum(nbytes for nbytes, _ in made) == planned
    made.clear()
    assert np.array_equal(generate(pipe, "a fox"), fox_frames)
    assert made == [], "the load found every region allocated"
    assert pipe.policy.streaming.stats()["transformer"]["host_bytes_read"] > 0


def test_host_copies_are_left_to_the_load_when_asked(six_block_folder, fox_frames, monkeypatch):
    from ondeck.streaming.streamer import BlockStreamer

    # As on a GPU, where they are page-locked and would be prepared unless asked not to.
    monkeypatch.setattr(BlockStreamer, "pinned", property(lambda self: True))
    pipe = streaming(six_block_folder, resident=2, prepare_host_copies=False)
    made = allocations(monkeypatch)
    assert np.array_equal(generate(pipe, "a fox"), fox_frames)
    assert made and "ondeck-host-copies" not in {name for _, name in made}


def test_preparing_stops_once_the_regions_change():
    copies = HostCopies(pinned=False)
    copies.keep_only({0: 64, 1: 64, 2: 64})
    original = copies._allocate

    def then_changed(block, *args):
        region = original(block, *args)
        copies._generation += 1  # as a release under host pressure would, meanwhile
        return region

    copies._allocate = then_changed
    assert copies.prepare(threading.Event()) == 64
    assert copies.nbytes == 64
    stop = threading.Event()
    stop.set()
    assert copies.prepare(stop) == 0


def test_a_region_asked_for_while_one_is_prepared_waits_for_it(monkeypatch):
    """The load and the preparing thread never allocate one block twice."""
    copies = HostCopies(pinned=False)
    copies.keep_only({0: 64})
    entered, release = threading.Event(), threading.Event()
    calls = []

    def slow(nbytes, dtype):
        calls.append(nbytes)
        entered.set()
        release.wait(10)
        return torch.zeros(nbytes, dtype=dtype)

    monkeypatch.setattr(torch, "empty", slow)
    worker = threading.Thread(target=copies.prepare, args=(threading.Event(),))
    worker.start()
    assert entered.wait(10)
    found = {}
    asker = threading.Thread(target=lambda: found.setdefault("region", copies.region(0)))
    asker.start()
    asker.join(0.2)
    assert asker.is_alive(), "it waits for the region being allocated"
    release.set()
    worker.join(10)
    asker.join(10)
    assert found["region"] is copies.region(0) and calls == [64]


def test_the_copies_come_in_the_order_the_stages_use_them():
    from ondeck.planning import StageUse
    from ondeck.streaming.pipeline import _stage_order

    class Pipeline:
        def stage_uses(self):
            return [
                StageUse("encode", ("text_encoder",)),
                StageUse("denoise", ("transformer", "transformer_2")),
                StageUse("decode", ("vae",)),
            ]

    names = dict.fromkeys(["text_encoder", "controlnet", "transformer_2", "transformer"])
    assert _stage_order(Pipeline(), names) == [
        "text_encoder",
        "transformer",
        "transformer_2",
        "controlnet",
    ]
    assert _stage_order(object(), names) == list(names)  # no stages known: as given


def test_pinned_copies_touch_the_next_regions_pages_while_this_one_is_registered(monkeypatch):
    """Page-locking is touching fresh pages, then registering them: the next region's
    pages are touched on a thread of their own while this one registers, and counted as
    held from before they are touched (the host watch tells ondeck's bytes by them)."""
    sizes = {0: 64, 1: 128, 2: 192}
    copies = HostCopies(pinned=True)
    copies.keep_only(sizes)
    started = {nbytes: threading.Event() for nbytes in sizes.values()}
    touched, counted, overlapped, registering = [], [], [], []

    def fresh(nbytes):
        touched.append(threading.current_thread().name)
        counted.append(copies.nbytes - sum(r.numel() for r in copies._regions.values()))
        started[nbytes].set()
        return FreshHostBytes(np.zeros(nbytes, np.uint8), 0, nbytes, nbytes)

    def registered(fresh):
        following = {64: 128, 128: 192}.get(fresh.nbytes)
        if following:
            overlapped.append(started[following].wait(5))
        held = sum(r.numel() for r in copies._regions.values())
        registering.append(copies.nbytes - held)
        return torch.from_numpy(fresh.owner)

    monkeypatch.setattr(host, "fresh_host_bytes", fresh)
    monkeypatch.setattr(host, "page_locked", registered)
    assert copies.prepare(threading.Event()) == 384
    assert overlapped == [True, True], "the next region's pages were touched meanwhile"
    assert set(touched) == {"ondeck-touch-ahead_0"}
    assert all(n > 0 for n in counted), "bytes being touched count as ondeck's"
    # Each region counts once while it registers, beside the one being touched.
    assert registering == [64 + 128, 128 + 192, 192]
    assert copies.nbytes == 384 and sorted(copies._regions) == [0, 1, 2]


def test_pages_still_being_touched_when_preparing_stops_stay_counted(monkeypatch):
    """Stopped (a release under host pressure, say) while the next region's pages are
    being touched, ``prepare`` counts those bytes until the touch is done: the host watch
    would take them for the process's own growth."""
    copies = HostCopies(pinned=True)
    copies.keep_only({0: 64, 1: 128})
    stop, touching = threading.Event(), threading.Event()
    seen = []

    class StopsAtTheFirstCheck:
        """The regions' lock; as ``prepare`` first checks whether to go on, with the next
        region's touch under way, it is told to stop."""

        def __init__(self):
            self.lock, self.entered = threading.Lock(), 0

        def __enter__(self):
            self.entered += 1
            if self.entered == 2:
                assert touching.wait(5)
                stop.set()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    def fresh(nbytes):
        if nbytes == 128:
            touching.set()
            time.sleep(0.3)  # still touching as the loop stops
            seen.append(copies.nbytes - sum(r.numel() for r in copies._regions.values()))
        return FreshHostBytes(np.zeros(nbytes, np.uint8), 0, nbytes, nbytes)

    copies._lock = StopsAtTheFirstCheck()
    monkeypatch.setattr(host, "fresh_host_bytes", fresh)
    monkeypatch.setattr(host, "page_locked", lambda fresh: torch.from_numpy(fresh.owner))
    assert copies.prepare(stop) == 0
    assert seen and seen[0] >= 128, "the pages being touched were counted"
    assert copies.nbytes == 0


def test_dropping_the_host_copies_stops_their_preparing(six_block_folder, monkeypatch):
    """Relief under host pressure frees the copies for good: the thread preparing them
    (about to page-lock the regions the layout keeps planned) stops first."""
    from ondeck.streaming.streamer import BlockStreamer

    pipe = streaming(six_block_folder, resident=2, prepare_host_copies=True)
    streaming_ = pipe.policy.streaming
    original = BlockStreamer.prepare_host_copies
    go, waiting = threading.Event(), threading.Event()

    def held_back(self, stop):
        waiting.set()
        while not (go.is_set() or stop.is_set()):
            time.sleep(0.01)
        return original(self, stop)

    monkeypatch.setattr(BlockStreamer, "prepare_host_copies", held_back)
    streaming_.apply(pipe, pipe.plan())
    preparing = streaming_._preparing
    assert waiting.wait(10)
    streaming_.drop_host_copies()
    go.set()
    preparing._thread.join(30)
    assert streaming_.streamers["transformer"].host_bytes == 0
    assert streaming_.host_bytes() == 0


def test_the_host_watch_reads_the_streamers_while_a_plan_changes_them():
    """``host_bytes`` and ``drop_host_copies`` run on the host watch's thread while the
    main thread's ``apply`` adds and removes streamers."""
    from ondeck.streaming.pipeline import BlockStreaming

    streaming_ = BlockStreaming()

    class Streamer:
        """As if ``apply`` changed the streamers in the middle of the watch's loop."""

        def __init__(self, name):
            self.name, self.ring_bytes = name, 0

        @property
        def host_bytes(self):
            streaming_.streamers.pop("b", None) or streaming_.streamers.setdefault("b", self)
            return 8

        def drop_host_copies(self):
            return self.host_bytes

    streaming_.streamers.update(a=Streamer("a"), b=Streamer("b"))
    assert streaming_.host_bytes() == 16
    assert streaming_.drop_host_copies() in (8, 16)


def test_the_host_watch_outlives_a_failed_reading():
    from ondeck.host_watch import HostWatch

    readings = []

    def rss():
        readings.append(len(readings))
        if len(readings) == 2:
            raise RuntimeError("a reading that fails once")
        return 1

    watch = HostWatch(1 << 30, lambda: 0, interval=0.01, rss=rss)
    watch.start()
    deadline = time.monotonic() + 10
    while len(readings) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    assert len(readings) >= 5, "the watch went on after the failed reading"
