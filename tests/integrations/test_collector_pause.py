"""A run pauses Python's cyclic garbage collector and leaves it as it found it: the module
trees a run loads and releases go by their reference counts, never scanned."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from core.helpers import ThreeStages, three_loaders

import ondeck.diffusers
from ondeck import memory

from .tiny_pipelines import FAMILIES, run


@pytest.fixture
def eager_collector():
    """Collections after every few allocations, for this test only: one left in a run
    would be seen."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.enable()
    gc.set_threshold(50, 2, 2)
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def _collections_during(pipe, calls: int) -> tuple[int, list[bool]]:
    """Collections started while a component was loaded, and whether the collector was
    on at each denoising step."""
    started = []

    def note(phase, info):
        if phase == "start" and pipe.ondeck.tracker.resident:
            started.append(info["generation"])

    steps: list[bool] = []

    def at_step(pipeline, step, timestep, kwargs):
        steps.append(gc.isenabled())
        return kwargs

    gc.callbacks.append(note)
    try:
        for _ in range(calls):
            run(pipe, FAMILIES["sd3"], callback_on_step_end=at_step)
    finally:
        gc.callbacks.remove(note)
    return len(started), steps


def _release_pipe(folders):
    pipe = ondeck.diffusers.from_pretrained(
        folders["sd3"], device="cpu", policy="release", progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_release_calls_are_never_collected_and_the_collector_is_on_after(folders, eager_collector):
    pipe = _release_pipe(folders)
    collections, steps = _collections_during(pipe, calls=2)
    assert steps and not any(steps)
    assert collections == 0
    assert gc.isenabled()
    assert not pipe.ondeck.tracker.resident  # released by the call, collector or not


def test_a_collector_the_caller_turned_off_stays_off(folders, eager_collector):
    pipe = _release_pipe(folders)
    gc.disable()
    run(pipe, FAMILIES["sd3"])
    assert not gc.isenabled()


def test_it_can_be_turned_off(folders, eager_collector, monkeypatch):
    monkeypatch.setenv("ONDECK_GC_PAUSE", "0")
    pipe = _release_pipe(folders)
    collections, steps = _collections_during(pipe, calls=1)
    assert steps and all(steps)
    assert collections > 0  # what the pause keeps out, at these thresholds


def test_a_pipeline_of_stages_pauses_it_too(eager_collector):
    class Watching(ThreeStages):
        def create_stages(self):
            stages = super().create_stages()
            forward = stages[1].forward

            def watched(state):
                state["collecting"] = gc.isenabled()
                return forward(state)

            stages[1].forward = watched
            return stages

    pipe = Watching(three_loaders(), policy="release", device="cpu")
    result = pipe({"x": torch.ones(2, 32)})
    assert result["collecting"] is False
    assert gc.isenabled()


def test_overlapping_runs_pause_once_and_resume_after_the_last(eager_collector):
    first_in, second_out = threading.Event(), threading.Event()
    seen = {}

    def first():
        with memory.collector_paused():
            first_in.set()
            second_out.wait(10)
            seen["after the second ended"] = gc.isenabled()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with memory.collector_paused():
        seen["inside both"] = gc.isenabled()
    second_out.set()
    thread.join(10)
    assert seen == {"inside both": False, "after the second ended": False}
    assert gc.isenabled()


def test_a_resume_an_interrupt_cut_short_is_made_good_by_the_next_run(eager_collector, monkeypatch):
    """Ctrl-C inside the turning back on leaves the collector off for that moment; the
    next run ends with it on, as the caller had it."""
    real, calls = gc.enable, []

    def interrupted() -> None:
        if not calls:
            calls.append("interrupted")
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(gc, "enable", interrupted)
    with pytest.raises(KeyboardInterrupt), memory.collector_paused():
        pass
    assert not gc.isenabled()
    with memory.collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
