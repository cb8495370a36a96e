"""Several threads on one pipeline.

Documented behaviour: calls from other threads queue on the pipeline's run lock and run
one after another; a call from inside the pipeline's own run raises
``ConcurrentRunError``; a component is never released while a stage holds it; the first
access from several threads at once loads the component once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import ondeck
from ondeck.lazy import LazyModule
from ondeck.loading import ModelFolder
from ondeck.pipelines import wan as wan_module

from .helpers import LoaderCalls, ReadFault, assert_tracker_agrees, generate, io_error, wan

JOBS = [("a fox", 0), ("a heron", 1), ("a fox", 2), ("an owl", 3)]


def stage_intervals(pipe) -> list[tuple[str, str]]:
    return [(e.kind, e.name) for e in pipe.tracker.events if e.kind.startswith("stage_")]


@pytest.mark.parametrize(
    "policy, options", [("release", {}), ("budget", {"budget": "1GiB"})], ids=["release", "budget"]
)
def test_concurrent_calls_queue_and_give_the_sequential_frames(tiny_template, policy, options):
    sequential = wan(tiny_template, policy, **options)
    expected = [generate(sequential, prompt, seed) for prompt, seed in JOBS]
    pipe = wan(tiny_template, policy, **options)
    barrier = threading.Barrier(len(JOBS))

    def job(prompt_and_seed):
        barrier.wait()
        return generate(pipe, *prompt_and_seed)

    with ThreadPoolExecutor(len(JOBS)) as pool:
        frames = list(pool.map(job, JOBS))
    for got, want in zip(frames, expected, strict=True):
        assert np.array_equal(got, want)
    # Serialised: every stage ends before the next begins, and each run is whole.
    names = [stage.name for stage in pipe.stages]
    intervals = stage_intervals(pipe)
    assert len(intervals) == 2 * len(names) * len(JOBS)
    for index in range(0, len(intervals), 2):
        (start, started), (end, ended) = intervals[index], intervals[index + 1]
        assert (start, end) == ("stage_start", "stage_end") and started == ended
        assert started == names[(index // 2) % len(names)]
    assert pipe.tracker.runs == len(JOBS)
    assert_tracker_agrees(pipe)


def test_a_waiting_call_starts_only_after_the_running_one_returns(tiny_template, monkeypatch):
    pipe = wan(tiny_template)
    inside, order = threading.Event(), []
    real_forward = wan_module.Denoise.forward

    def slow_forward(self, state):
        inside.set()
        time.sleep(0.3)
        return real_forward(self, state)

    monkeypatch.setattr(wan_module.Denoise, "forward", slow_forward)

    def first():
        generate(pipe, "a fox")
        order.append("first returned")

    def second():
        inside.wait()
        order.append("second called")
        generate(pipe, "a heron")
        order.append("second returned")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert order == ["second called", "first returned", "second returned"]


class CallsItsPipeline(ondeck.Stage):
    def __init__(self, pipeline_ref: list):
        super().__init__()
        self._pipeline_ref = pipeline_ref
        self.errors: list[BaseException] = []

    def forward(self, state):
        try:
            self._pipeline_ref[0](state)
        except ondeck.ConcurrentRunError as error:
            self.errors.append(error)
        return state


def test_a_call_from_inside_a_stage_raises_concurrent_run_error(tiny_template, clean_frames):
    pipe = wan(tiny_template)
    stage = CallsItsPipeline([pipe])
    pipe.add_stage(stage)
    frames = generate(pipe)
    assert len(stage.errors) == 1
    assert "called again from inside its own run" in str(stage.errors[0])
    # The outer run is undisturbed and the pipeline stays usable.
    assert np.array_equal(frames, clean_frames)
    assert np.array_equal(generate(pipe), clean_frames)
    assert_tracker_agrees(pipe)


def test_the_reentrant_error_propagates_when_the_stage_does_not_catch_it(tiny_template):
    pipe = wan(tiny_template)

    class Reenter(ondeck.Stage):
        def forward(self, state):
            return pipe(state)

    pipe.add_stage(Reenter())
    with pytest.raises(ondeck.ConcurrentRunError):
        generate(pipe)
    # The aborted run released everything and the lock is free again.
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())
    assert pipe._run_lock.acquire(blocking=False)
    pipe._run_lock.release()


@pytest.mark.parametrize("how", ["release_all", "proxy.release"])
def test_a_component_is_not_released_while_its_stage_runs(
    tiny_template, clean_frames, monkeypatch, how
):
    pipe = wan(tiny_template)
    transformer = pipe.components["transformer"]
    inside, release_called, stage_done = threading.Event(), threading.Event(), threading.Event()
    observed = {}
    real_forward = wan_module.Denoise.forward

    def forward(self, state):
        module = transformer.materialize()
        inside.set()
        release_called.wait(timeout=10)
        time.sleep(0.2)  # the releasing thread is now waiting, or has (wrongly) released
        observed["still loaded"] = ondeck.is_loaded(transformer)
        state = real_forward(self, state)
        observed["same module"] = transformer.materialize() is module
        stage_done.set()
        return state

    monkeypatch.setattr(wan_module.Denoise, "forward", forward)

    def release():
        inside.wait(timeout=10)
        release_called.set()
        if how == "release_all":
            pipe.release_all()
        else:
            transformer.release()
        observed["stage done when release returned"] = stage_done.is_set()

    releaser = threading.Thread(target=release)
    releaser.start()
    frames = generate(pipe)
    releaser.join(timeout=30)
    assert observed == {
        "still loaded": True,
        "same module": True,
        "stage done when release returned": True,
    }
    assert np.array_equal(frames, clean_frames)
    assert transformer.load_count == 1
    assert_tracker_agrees(pipe)


class HoldsItsComponent(ondeck.Stage):
    def __init__(self, component):
        super().__init__()
        self.component = component

    def forward(self, state):
        module = self.component.materialize()
        time.sleep(0.2)
        state["kept"] = ondeck.is_loaded(self.component) and self.component.materialize() is module
        return state


class OneStage(ondeck.Pipeline):
    lazy_components = ("a",)

    def create_stages(self):
        return [HoldsItsComponent(self.components["a"])]


def test_a_release_preempted_after_its_pin_check_still_waits_for_the_stage(monkeypatch):
    """A releasing thread that loses the CPU right after finding no pins must not free
    the component of a stage that started in between (seen once in 30,000 runs with
    sys.setswitchinterval(1e-6) before the check and the release became one step)."""
    pipe = OneStage({"a": lambda: torch.nn.Linear(4, 4)}, policy="budget", budget="1GiB")
    proxy = pipe.components["a"]
    proxy.materialize()
    real_wait = LazyModule._wait_until_unpinned

    def preempted_after_the_check(self, *args, **kwargs):
        result = real_wait(self, *args, **kwargs)
        time.sleep(0.1)
        return result

    monkeypatch.setattr(LazyModule, "_wait_until_unpinned", preempted_after_the_check)
    releaser = threading.Thread(target=proxy.release)
    releaser.start()
    time.sleep(0.02)
    state = pipe({})
    releaser.join(timeout=30)
    assert not releaser.is_alive()
    # Either order is right (release first and the stage reloads, or the stage first and
    # the release waits for it); freeing the module under the running stage is not.
    assert state["kept"], "the stage's component was released while the stage ran"


def test_concurrent_first_access_loads_once(tiny_template, monkeypatch):
    calls = LoaderCalls(monkeypatch)
    pipe = wan(tiny_template)
    transformer = pipe.components["transformer"]
    threads = 8
    barrier = threading.Barrier(threads)

    def first_access(index):
        barrier.wait()
        # Different first touches: attribute, call-through, materialize.
        if index % 3 == 0:
            return transformer.materialize()
        if index % 3 == 1:
            transformer.blocks  # noqa: B018 - any attribute loads
            return transformer.materialize()
        return transformer.eval().materialize()

    with ThreadPoolExecutor(threads) as pool:
        modules = list(pool.map(first_access, range(threads)))
    assert calls.calls == {"transformer": 1}
    assert all(module is modules[0] for module in modules)
    loads = [e for e in pipe.tracker.events if e.kind == "load"]
    assert [e.name for e in loads] == ["transformer"]
    assert_tracker_agrees(pipe)


def test_concurrent_first_access_to_different_components_loads_each_once(
    tiny_template, clean_frames, monkeypatch
):
    calls = LoaderCalls(monkeypatch)
    pipe = wan(tiny_template, "budget", budget="1GiB")
    proxies = [pipe.components[name] for name in ("text_encoder", "transformer", "vae")] * 3
    barrier = threading.Barrier(len(proxies))

    def first_access(proxy):
        barrier.wait()
        return proxy.materialize()

    with ThreadPoolExecutor(len(proxies)) as pool:
        list(pool.map(first_access, proxies))
    assert calls.calls == {"text_encoder": 1, "transformer": 1, "vae": 1}
    assert_tracker_agrees(pipe)
    # Loaded from three threads at once, the components compute what a clean run does.
    assert np.array_equal(generate(pipe), clean_frames)
    assert calls.total == 3


def test_a_failed_first_load_under_concurrent_access_is_retried_once(
    tiny_template, clean_frames, monkeypatch
):
    """The first load fails (an I/O error) while other threads wait for it: the waiting
    threads retry, one load succeeds, and they all share its module."""
    calls = LoaderCalls(monkeypatch)
    pipe = wan(tiny_template)
    transformer = pipe.components["transformer"]
    info = max(ModelFolder.open(tiny_template).tensors("transformer").values(), key=lambda i: i.end)
    ReadFault(monkeypatch, info.path, info.start, info.end, io_error)
    threads = 6
    barrier = threading.Barrier(threads)

    def first_access(_):
        barrier.wait()
        try:
            return transformer.materialize()
        except ondeck.LoadError as error:
            return error

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(first_access, range(threads)))
    errors = [r for r in results if isinstance(r, ondeck.LoadError)]
    modules = [r for r in results if not isinstance(r, ondeck.LoadError)]
    assert len(errors) == 1 and "Input/output error" in str(errors[0])
    assert len(modules) == threads - 1 and all(m is modules[0] for m in modules)
    assert calls.calls == {"transformer": 2}
    assert [e.name for e in pipe.tracker.events if e.kind == "load"] == ["transformer"]
    assert_tracker_agrees(pipe)
    assert np.array_equal(generate(pipe), clean_frames)
