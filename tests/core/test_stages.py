"""Stages, the release schedule, and the failure paths of a pipeline run."""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import pytest
import torch

import ondeck

from .helpers import Apply, CountingLoader, ThreeStages, state, three_loaders


def release_pipeline(loaders=None, **kwargs):
    return ThreeStages(loaders or three_loaders(), policy="release", **kwargs)


def test_schedule_releases_each_component_after_its_last_holder():
    pipe = release_pipeline()
    assert pipe.schedule == {"Encode": ["encoder"], "Denoise": ["denoiser"], "Decode": ["decoder"]}


def test_schedule_never_loads():
    loaders = three_loaders()
    pipe = release_pipeline(loaders)
    pipe.schedule
    pipe.plan()
    assert [loader.calls for loader in loaders.values()] == [0, 0, 0]
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_run_releases_everything_and_keeps_one_component_at_a_time():
    pipe = release_pipeline()
    result = pipe(state())
    assert result["order"] == ["Encode", "Denoise", "Decode"]
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())
    one = (32 * 32 + 32) * 4
    assert pipe.tracker.peak_resident_bytes == one


def test_released_modules_are_gone():
    pipe = release_pipeline()
    refs = []
    for proxy in pipe.deferred.values():
        proxy.add_transform(lambda module: refs.append(weakref.ref(module)) or module)
    pipe(state())
    gc.collect()
    assert len(refs) == 3
    assert all(ref() is None for ref in refs)


def test_component_held_by_two_stages_is_released_after_the_last():
    class Shared(ondeck.Pipeline):
        lazy_components = ("a", "b")

        def create_stages(self):
            c = self.components
            return [Apply(c["a"], "One"), Apply(c["b"], "Two"), Apply(c["a"], "Three")]

    pipe = Shared({"a": CountingLoader(8), "b": CountingLoader(8)}, policy="release")
    assert pipe.schedule == {"One": [], "Two": ["b"], "Three": ["a"]}


def test_nested_stage_holder_releases_the_right_component():
    class Outer(ondeck.Stage):
        def __init__(self, inner, extra):
            super().__init__()
            self.parts = {"inner": [inner]}
            self.extra = (extra,)

        def forward(self, state):
            state = self.parts["inner"][0](state)
            state["x"] = self.extra[0](state["x"])
            return state

    class Nested(ondeck.Pipeline):
        lazy_components = ("a", "b", "c")

        def create_stages(self):
            c = self.components
            return [Outer(Apply(c["a"], "Inner"), c["b"]), Apply(c["c"], "Last")]

    pipe = Nested({k: CountingLoader(4) for k in "abc"}, policy="release")
    assert pipe.schedule == {"Outer": ["a", "b"], "Last": ["c"]}
    pipe({"x": torch.ones(1, 4)})
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_schedule_walk_survives_cycles():
    class Loop(ondeck.Stage):
        def __init__(self, component):
            super().__init__()
            self.component = component
            self.me = [self]

        def forward(self, state):
            return state

    class P(ondeck.Pipeline):
        lazy_components = ("a",)

        def create_stages(self):
            return [Loop(self.components["a"])]

    assert P({"a": CountingLoader()}, policy="release").schedule == {"Loop": ["a"]}


def test_add_stage_rebuilds_the_schedule():
    pipe = release_pipeline()
    assert pipe.schedule["Decode"] == ["decoder"]
    pipe.add_stage(Apply(pipe.components["encoder"], "Refine"))
    assert pipe.schedule["Encode"] == []
    assert pipe.schedule["Refine"] == ["encoder"]


def test_component_swap_rebuilds_the_schedule():
    pipe = release_pipeline()
    pipe.stages[2].component = pipe.components["denoiser"]
    assert pipe.schedule == {"Encode": ["encoder"], "Denoise": [], "Decode": ["denoiser"]}


def test_deferred_component_no_stage_holds_is_never_released_and_warned():
    class Partial(ondeck.Pipeline):
        lazy_components = ("used", "orphan")

        def create_stages(self):
            return [Apply(self.components["used"], "Use")]

    pipe = Partial({"used": CountingLoader(4), "orphan": CountingLoader(4)}, policy="release")
    with pytest.warns(UserWarning, match="orphan"):
        pipe.schedule
    pipe.components["orphan"].materialize()
    pipe({"x": torch.ones(1, 4)})
    assert ondeck.is_loaded(pipe.components["orphan"])


def test_failing_stage_still_releases_its_components():
    class Boom(ondeck.Stage):
        def __init__(self, component):
            super().__init__()
            self.component = component

        def forward(self, state):
            self.component.weight  # loads
            raise RuntimeError("boom")

    boom = Boom(ondeck.LazyModule("x", CountingLoader()))
    released = []
    boom.component.on_release(lambda: released.append(True))

    class P(ondeck.Pipeline):
        lazy_components = ("x",)

        def create_stages(self):
            return [boom]

        def __call__(self, state):  # a pipeline with its own run loop still frees
            return self.stages[0](state)

    pipe = P({"x": boom.component}, policy="release")
    with pytest.raises(RuntimeError, match="boom"):
        pipe({})
    assert released == [True]
    assert not ondeck.is_loaded(boom.component)


def test_run_that_raises_leaves_nothing_loaded():
    loaders = three_loaders()
    pipe = ThreeStages(loaders, policy="budget", budget="1GiB")

    class Fail(ondeck.Stage):
        def forward(self, state):
            raise ValueError("stage failed")

    pipe.add_stage(Fail())
    with pytest.raises(ValueError, match="stage failed"):
        pipe(state())
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_release_error_never_masks_the_stage_error():
    pipe = release_pipeline()
    pipe.components["encoder"].on_release(lambda: (_ for _ in ()).throw(OSError("release broke")))

    class Fail(Apply):
        def forward(self, state):
            self.component.weight
            raise KeyError("original")

    pipe.stages[0] = Fail(pipe.components["encoder"], "Encode")
    object.__setattr__(pipe.stages[0], "_ondeck_pipeline", pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyError, match="original"):
            pipe(state())


def test_release_all_frees_every_deferred_component():
    pipe = release_pipeline()
    for proxy in pipe.deferred.values():
        proxy.materialize()
    assert pipe.release_all() == 3 * (32 * 32 + 32) * 4
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_training_mode_keeps_everything_resident_and_warns():
    pipe = release_pipeline()
    with pytest.warns(UserWarning, match="resident"):
        pipe.train()
    pipe(state())
    assert all(ondeck.is_loaded(p) for p in pipe.deferred.values())
    pipe.eval()
    pipe(state())
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_components_not_listed_as_lazy_are_loaded_up_front():
    class NothingDeferred(ThreeStages):
        lazy_components = ()

    loaders = three_loaders()
    pipe = NothingDeferred(loaders, policy="release")
    assert [loader.calls for loader in loaders.values()] == [1, 1, 1]
    assert pipe.deferred == {}
    pipe(state())
    assert pipe.schedule == {"Encode": [], "Denoise": [], "Decode": []}


def test_already_loaded_module_stays_resident():
    loaders = three_loaders()
    module = torch.nn.Linear(32, 32)
    pipe = ThreeStages({**loaders, "denoiser": module}, policy="release")
    pipe(state())
    assert pipe.components["denoiser"] is module
    assert "denoiser" not in pipe.deferred


def test_eager_loads_everything_at_construction():
    loaders = three_loaders()
    pipe = ThreeStages(loaders, policy="eager")
    assert [loader.calls for loader in loaders.values()] == [1, 1, 1]
    pipe(state())
    pipe(state())
    assert [loader.calls for loader in loaders.values()] == [1, 1, 1]
    assert all(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_concurrent_calls_serialise():
    class Slow(ondeck.Stage):
        active = 0
        overlap = False

        def forward(self, state):
            Slow.active += 1
            Slow.overlap |= Slow.active > 1
            time.sleep(0.02)
            Slow.active -= 1
            return state

    pipe = release_pipeline()
    pipe.add_stage(Slow())
    threads = [threading.Thread(target=pipe, args=(state(),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not Slow.overlap
    assert pipe.tracker.runs == 4


def test_reentrant_call_is_rejected():
    pipe = release_pipeline()

    class Reenter(ondeck.Stage):
        def forward(self, state):
            return pipe(state)

    pipe.add_stage(Reenter())
    with pytest.raises(ondeck.ConcurrentRunError):
        pipe(state())
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_component_in_use_is_not_released_by_another_thread():
    pipe = release_pipeline()
    entered = threading.Event()
    finish = threading.Event()
    released_while_running = []

    class Hold(Apply):
        def forward(self, state):
            self.component.weight
            entered.set()
            finish.wait(2)
            released_while_running.append(not ondeck.is_loaded(self.component))
            return state

    hold = Hold(pipe.components["encoder"], "Hold")
    pipe.add_stage(hold)
    runner = threading.Thread(target=pipe, args=(state(),))
    runner.start()
    entered.wait(2)
    releaser = threading.Thread(target=pipe.components["encoder"].release)
    releaser.start()
    time.sleep(0.05)
    finish.set()
    runner.join()
    releaser.join()
    assert released_while_running == [False]


def test_ctrl_c_while_freeing_leaves_the_tracker_honest(monkeypatch):
    from ondeck import lazy

    pipe = release_pipeline()
    for proxy in pipe.deferred.values():
        object.__setattr__(proxy, "_ondeck_free_storage", True)

    def interrupted(module):
        raise KeyboardInterrupt

    monkeypatch.setattr(lazy, "free_module_storages", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipe(state())
    assert pipe.tracker.resident == {}
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())


def test_memory_error_in_a_stage_evicts_and_retries_under_budget():
    loaders = three_loaders()
    pipe = ThreeStages(loaders, policy="budget", budget="1GiB")
    failures = []

    class Hungry(Apply):
        def forward(self, state):
            if not failures:
                failures.append(True)
                raise MemoryError("host memory exhausted")
            return super().forward(state)

    pipe(state())  # everything resident afterwards
    hungry = Hungry(pipe.components["decoder"], "Decode")
    object.__setattr__(hungry, "_ondeck_pipeline", pipe)
    pipe.stages[2] = hungry
    pipe.invalidate_schedule()
    result = pipe(state())
    assert failures == [True]
    assert result["order"][-1] == "Decode"
    assert not ondeck.is_loaded(pipe.components["encoder"])  # evicted to make room
