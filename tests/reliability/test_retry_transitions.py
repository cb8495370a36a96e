"""Transitions around an out-of-memory retry, a prefetch cut short, an aborted run and
``release_all()``: what the tracker counts, what stays loaded, and whether the next run
gives what a fresh pipeline gives. On the CPU: out of memory is a ``MemoryError`` raised
by a stage, as ``tests/core/test_stages.py`` does."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import warnings
import weakref

import pytest
import torch
from core.helpers import Apply, CountingLoader, ProfiledThreeStages, ThreeStages, use_profiles

import ondeck
from ondeck.lazy import LazyModule
from ondeck.policy import ReleasePolicy

ONE = 2**20
FEATURES = 32


def fresh_state() -> dict:
    return {"x": torch.ones(2, FEATURES)}


def loaders() -> dict[str, CountingLoader]:
    # Each loader seeds by its width: every pipeline built here computes the same.
    return {name: CountingLoader(FEATURES) for name in ("encoder", "denoiser", "decoder")}


def swap_stage(pipe, index: int, stage: ondeck.Stage) -> None:
    object.__setattr__(stage, "_ondeck_pipeline", pipe)
    pipe.stages[index] = stage
    pipe.invalidate_schedule()


class CallsThrice(Apply):
    """Calls its component three times; the first attempt runs out of memory after
    the second call."""

    def __init__(self, component, name):
        super().__init__(component, name)
        object.__setattr__(self, "attempts", 0)

    def forward(self, state):
        object.__setattr__(self, "attempts", self.attempts + 1)
        x = state["x"]
        for call in range(3):
            x = self.component(x)
            if self.attempts == 1 and call == 1:
                raise MemoryError("out of memory")
        state["x"] = x
        return state


def test_an_out_of_memory_retry_counts_the_calls_of_the_run_not_of_both_attempts():
    """``calls_per_run`` feeds the plan (which components stream): the failed attempt's
    calls must not count as the run's."""
    pipe = ThreeStages(loaders(), policy="budget", budget="1GiB", prefetch=False)
    pipe(fresh_state())  # everything stays resident: the retry has something to free
    stage = CallsThrice(pipe.components["denoiser"], "Denoise")
    swap_stage(pipe, 1, stage)
    pipe(fresh_state())
    assert stage.attempts == 2  # it did run out of memory and retry
    assert pipe.tracker.calls_per_run["denoiser"] == 3


class WritesThenRunsOut(Apply):
    """Writes its result into the state, then runs out of memory (a late allocation)
    on its first attempt."""

    def __init__(self, component, name):
        super().__init__(component, name)
        object.__setattr__(self, "attempts", 0)

    def forward(self, state):
        object.__setattr__(self, "attempts", self.attempts + 1)
        state["x"] = self.component(state["x"])
        if self.attempts == 1:
            raise MemoryError("out of memory")
        return state


def test_an_out_of_memory_retry_starts_from_the_state_the_stage_was_given():
    """The retry must compute what one clean attempt computes: not the component applied
    to the failed attempt's output."""
    expected = ThreeStages(loaders(), policy="budget", budget="1GiB", prefetch=False)(
        fresh_state()
    )["x"]
    pipe = ThreeStages(loaders(), policy="budget", budget="1GiB", prefetch=False)
    pipe(fresh_state())
    stage = WritesThenRunsOut(pipe.components["denoiser"], "Denoise")
    swap_stage(pipe, 1, stage)
    got = pipe(fresh_state())["x"]
    assert stage.attempts == 2
    assert torch.equal(got, expected)


class RunsOutFirst(Apply):
    """Runs out of memory on its first attempt before touching the state."""

    def __init__(self, component, name):
        super().__init__(component, name)
        object.__setattr__(self, "attempts", 0)

    def forward(self, state):
        object.__setattr__(self, "attempts", self.attempts + 1)
        if self.attempts == 1:
            raise MemoryError("out of memory")
        return super().forward(state)


class SeededLoader:
    """The same Linear on any thread (no global random state)."""

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self) -> torch.nn.Linear:
        module = torch.nn.Linear(FEATURES, FEATURES)
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        return module


def test_out_of_memory_in_the_last_stage_frees_the_next_runs_early_load_and_retries(
    monkeypatch, tmp_path
):
    """Under ``release`` the last stage loads the next run's encoder beside it. When
    that stage runs out of memory, the early load is what the policy keeps: it is
    freed and the stage retried, not the whole run lost."""
    store = use_profiles(monkeypatch, tmp_path / "profiles.json")
    for stage, nbytes in {"Encode": ONE, "Denoise": 8 * ONE, "Decode": ONE}.items():
        store.record("three", {"width": FEATURES}, stage, nbytes)
    components = {
        name: ondeck.LazyModule(
            name, SeededLoader(seed), spec=ondeck.ComponentSpec(cls=torch.nn.Linear, nbytes=ONE)
        )
        for seed, name in enumerate(("encoder", "denoiser", "decoder"))
    }
    pipe = ProfiledThreeStages(components, policy=ReleasePolicy())
    expected = pipe(fresh_state())["x"]
    assert set(pipe.resident()) == {"encoder"}  # loaded ahead: the setting under test
    stage = RunsOutFirst(pipe.components["decoder"], "Decode")
    swap_stage(pipe, 2, stage)
    got = pipe(fresh_state())["x"]  # raises MemoryError today
    assert stage.attempts == 2
    assert torch.equal(got, expected)


def test_release_all_releases_the_others_when_one_release_fails():
    """``release_all()`` (and ``close()``) must not leave components loaded because an
    earlier one's release hook raised; the error is raised once all are released."""
    pipe = ThreeStages(loaders(), policy="budget", budget="1GiB", prefetch=False)
    pipe(fresh_state())
    assert set(pipe.resident()) == {"encoder", "denoiser", "decoder"}
    pipe.components["encoder"].on_release(lambda: (_ for _ in ()).throw(OSError("hook broke")))
    with pytest.raises(OSError, match="hook broke"):
        pipe.release_all()
    assert set(pipe.resident()) == set()
    assert pipe.tracker.resident == {}


def test_ctrl_c_while_waiting_for_a_prefetch_leaves_nothing_loaded_after_the_run(monkeypatch):
    """Ctrl-C lands while the stage waits for its component's prefetch, which has not
    taken the component's lock yet. The aborted run must not leave that prefetch to load
    the component afterwards, registered and holding its bytes, with no run under way."""
    built: list[weakref.ref] = []

    class Watched(CountingLoader):
        def __call__(self):
            module = super().__call__()
            built.append(weakref.ref(module))
            return module

    components = {n: Watched(FEATURES) for n in ("encoder", "denoiser", "decoder")}
    pipe = ThreeStages(components, policy="budget", budget="1GiB", prefetch=True)
    gate = threading.Event()
    real_materialize = LazyModule.materialize

    def late_prefetch(self, **options):
        if threading.current_thread().name.startswith("ondeck-prefetch"):
            gate.wait(10)  # a busy machine: the prefetch starts late
        return real_materialize(self, **options)

    real_result = concurrent.futures.Future.result
    interrupted = []

    def result(self, timeout=None):
        if threading.current_thread() is threading.main_thread():
            if not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt  # Ctrl-C while blocked on the prefetch
            gate.set()  # the abort waits for the prefetch: let it finish
        return real_result(self, timeout)

    monkeypatch.setattr(LazyModule, "materialize", late_prefetch)
    monkeypatch.setattr(concurrent.futures.Future, "result", result)
    with pytest.raises(KeyboardInterrupt):
        pipe(fresh_state())
    assert interrupted
    monkeypatch.setattr(concurrent.futures.Future, "result", real_result)
    gate.set()
    pipe.executor.close()  # joins the prefetch thread: whatever it was doing is done
    assert set(pipe.resident()) == set()
    assert pipe.tracker.resident == {}
    gc.collect()
    alive = [ref() for ref in built if ref() is not None]
    held = sum(sum(p.numel() * p.element_size() for p in m.parameters()) for m in alive)
    assert held == 0, f"{held} bytes of a load started by the aborted run are still held"


class InterruptsBetweenStages(Apply):
    """Raises KeyboardInterrupt once, from user code after its component ran."""

    def __init__(self, component, name):
        super().__init__(component, name)
        object.__setattr__(self, "fired", False)

    def forward(self, state):
        state = super().forward(state)
        if not self.fired:
            object.__setattr__(self, "fired", True)
            raise KeyboardInterrupt
        return state


@pytest.mark.parametrize(
    "policy", [dict(policy="release"), dict(policy="budget", budget="1GiB")], ids=str
)
def test_a_run_after_an_interrupted_one_matches_a_fresh_pipeline(policy):
    expected = ThreeStages(loaders(), **policy)(fresh_state())["x"]
    pipe = ThreeStages(loaders(), **policy)
    pipe(fresh_state())
    swap_stage(pipe, 1, InterruptsBetweenStages(pipe.components["denoiser"], "Denoise"))
    with pytest.raises(KeyboardInterrupt):
        pipe(fresh_state())
    assert pipe.tracker.resident == {}
    assert not any(ondeck.is_loaded(p) for p in pipe.deferred.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about a prefetch of the aborted run
        got = pipe(fresh_state())["x"]
    assert torch.equal(got, expected)
    assert set(pipe.tracker.resident) == set(pipe.resident())
