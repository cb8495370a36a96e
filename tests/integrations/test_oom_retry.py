"""A component's turn that runs out of memory on the diffusers path: the call runs again
from its start, the plan keeping more room for that turn's activations (so the
transformer streams blocks it held whole), with the same random draws. On the CPU, with
a discrete card faked through ``ondeck.memory.device_facts`` and the error raised by the
transformer's forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streaming.conftest import build_six_block_folder

import ondeck.diffusers
from ondeck import memory

GIB = 2**30
CALL = dict(
    prompt="a fox", height=16, width=16, num_frames=5, num_inference_steps=2, output_type="np"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_six_block_folder(tmp_path_factory.mktemp("oom") / "wan")


def open_pipe(folder, **options):
    pipe = ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device="cpu", progress=False, **options
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def frames(pipe, seed: int = 0) -> np.ndarray:
    return pipe(**CALL, generator=torch.Generator().manual_seed(seed)).frames[0]


def card_where_the_transformer_just_fits(monkeypatch, folder) -> None:
    """A card whose ``auto`` budget holds the transformer whole with 5% to spare: too
    little for the tenth of the budget kept for it after running out of memory."""
    sizes = open_pipe(folder, policy="release").ondeck.component_bytes()
    budget = int(sizes["transformer"] / 0.95)
    card = memory.DeviceFacts("cuda:9", False, 2 * GIB, GIB + budget)
    monkeypatch.setattr(memory, "device_facts", lambda device=None: card)


def running_out(monkeypatch, times: int) -> list[int]:
    """The transformer's forward raises out of memory its first ``times`` calls; one
    entry per call."""
    from diffusers import WanTransformer3DModel

    forward = WanTransformer3DModel.forward
    calls: list[int] = []

    def failing(module, *args, **kwargs):
        calls.append(len(calls))
        if len(calls) <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return forward(module, *args, **kwargs)

    monkeypatch.setattr(WanTransformer3DModel, "forward", failing)
    return calls


def test_a_turn_out_of_memory_runs_the_call_again_streaming(folder, monkeypatch):
    expected = frames(open_pipe(folder, policy="release"))
    card_where_the_transformer_just_fits(monkeypatch, folder)
    pipe = open_pipe(folder)
    assert "transformer" not in pipe.ondeck.plan().streamed  # whole, at first
    calls = running_out(monkeypatch, times=1)

    with pytest.warns(UserWarning, match="transformer ran out of memory"):
        got = frames(pipe)

    assert np.array_equal(got, expected)  # the same noise drawn again
    assert "transformer" in pipe.ondeck.plan().streamed
    assert pipe.ondeck.policy.streaming.stats()["transformer"]["passes"] > 0
    assert pipe.ondeck.snapshot().measured_activation["transformer"] > 0
    assert len(calls) > 1
    # The next call plans with the room kept: no error, the same frames.
    assert np.array_equal(frames(pipe), expected)
    # A first run plans against the estimate's reserve: running out there says nothing
    # about the measured one. After a completed run it does, and later runs keep the
    # estimate's reserve.
    policy = pipe.ondeck.policy
    assert policy.measured_budget_bytes > policy.estimated_budget_bytes
    running_out(monkeypatch, times=1)
    with pytest.warns(UserWarning, match="transformer ran out of memory"):
        assert np.array_equal(frames(pipe), expected)
    assert policy.measured_budget_bytes == policy.estimated_budget_bytes


def test_out_of_memory_that_more_room_does_not_cure_is_raised_with_nothing_loaded(
    folder, monkeypatch
):
    card_where_the_transformer_just_fits(monkeypatch, folder)
    pipe = open_pipe(folder)
    calls = running_out(monkeypatch, times=100)

    with pytest.warns(UserWarning), pytest.raises(torch.OutOfMemoryError):
        frames(pipe)

    assert len(calls) <= 3  # the call and at most two more
    assert pipe.ondeck.tracker.resident == {}


def test_out_of_memory_under_release_is_raised_at_once(folder, monkeypatch):
    pipe = open_pipe(folder, policy="release")
    calls = running_out(monkeypatch, times=1)
    with pytest.raises(torch.OutOfMemoryError):
        frames(pipe)
    assert len(calls) == 1


def test_a_retry_after_a_learned_call_counts_only_its_own_calls(folder, monkeypatch):
    """The attempt that ran out of memory made calls of its own: the call run again from
    its start must not count them, or its turns would end early, after fewer calls than
    it makes, and load components again."""
    expected = frames(open_pipe(folder, policy="release"))
    card_where_the_transformer_just_fits(monkeypatch, folder)
    pipe = open_pipe(folder)
    frames(pipe)  # learns the order and how often each component is called
    learned = dict(pipe.ondeck.tracker.calls_per_run)
    loads = {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}
    from diffusers import WanTransformer3DModel

    forward = WanTransformer3DModel.forward
    failed: list[int] = []

    def failing_late(module, *args, **kwargs):
        if not failed and pipe.ondeck.tracker.calls_so_far().get("transformer") == 2:
            failed.append(1)  # the transformer's second call of this run
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return forward(module, *args, **kwargs)

    monkeypatch.setattr(WanTransformer3DModel, "forward", failing_late)
    under_way: list[int] = []  # calls of components under way at each scheduler step
    step = pipe.scheduler.step

    def stepping(*args, **kwargs):
        under_way.append(pipe.ondeck._in_calls)
        return step(*args, **kwargs)

    pipe.scheduler.step = stepping
    with pytest.warns(UserWarning, match="transformer ran out of memory"):
        got = frames(pipe)
    assert failed and np.array_equal(got, expected)
    assert under_way and set(under_way) == {0}, "the failed call is not under way any more"
    assert pipe.ondeck.tracker.calls_per_run == learned
    after = {name: proxy.load_count - loads[name] for name, proxy in pipe.ondeck.deferred.items()}
    assert after["text_encoder"] <= 2 and after["transformer"] <= 2, after


def test_a_stored_peak_that_proves_too_small_is_run_again_with_more_room(
    folder, monkeypatch, tmp_path
):
    """A peak an earlier process stored for this call (a smaller card's, an older
    version's) counts at least the room kept once the turn runs out of memory."""
    from ondeck.profiles import ActivationProfiles

    store = ActivationProfiles(tmp_path / "profiles.json")
    monkeypatch.setattr("ondeck.profiles._default", store)
    measured = open_pipe(folder, policy="release")
    expected = frames(measured)
    store.record(measured.ondeck.profile_model, measured.ondeck.run_shape, "transformer", 1)
    card_where_the_transformer_just_fits(monkeypatch, folder)
    pipe = open_pipe(folder)
    running_out(monkeypatch, times=1)

    with pytest.warns(UserWarning, match="transformer ran out of memory"):
        got = frames(pipe)

    assert np.array_equal(got, expected)
    assert "transformer" in pipe.ondeck.plan().streamed


def test_out_of_memory_whose_room_no_plan_holds_is_raised_as_it_is(folder, monkeypatch):
    """Where the room kept for the turn's activations would make the next attempt's plan
    refuse, the call is not run again: the out-of-memory error stands, not a refusal."""
    from ondeck.integrations.diffusers import runtime

    card_where_the_transformer_just_fits(monkeypatch, folder)
    pipe = open_pipe(folder)
    monkeypatch.setattr(runtime, "OOM_FIRST_ROOM_FRACTION", 5.0)  # five budgets' room
    expected = frames(open_pipe(folder, policy="release"))
    calls = running_out(monkeypatch, times=1)
    with pytest.raises(torch.OutOfMemoryError):
        frames(pipe)
    assert len(calls) == 1
    assert pipe.ondeck.tracker.resident == {}
    # Nor does the room it would have kept stay: the next call plans and runs as before.
    assert pipe.ondeck.plan().overflow() is None
    assert np.array_equal(frames(pipe), expected)
