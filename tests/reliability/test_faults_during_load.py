"""Faults in the middle of a load: I/O errors, allocator failures, interrupts.

After each one nothing is half-resident (the proxy unloaded, the tracker empty for it,
no skeleton or weight memory alive), the tracker agrees with what is loaded, and the
next run succeeds with the frames of an undisturbed run.
"""

from __future__ import annotations

import gc
import json
import math
import random
import signal
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import ondeck
from ondeck.lazy import LazyModule, module_nbytes
from ondeck.loading import ModelFolder
from ondeck.pipelines import wan as wan_module

from .helpers import (
    MODELS,
    AllocationFault,
    MiB,
    ReadFault,
    Watcher,
    assert_nothing_resident,
    assert_tracker_agrees,
    generate,
    io_error,
    loaded_names,
    settled_rss,
    wan,
)

SEEDS = (0, 1)


def random_tensor(folder, component: str, seed: int):
    """A tensor with data, picked at random from the component's files."""
    tensors = ModelFolder.open(folder).tensors(component)
    names = sorted(name for name, info in tensors.items() if info.nbytes)
    return tensors[random.Random(f"{component}-{seed}").choice(names)]


def slot_count(folder, component: str) -> int:
    return len(ModelFolder.open(folder).skeleton(component, torch.float32).slots)


def assert_clean_after_fault(pipe, watcher) -> None:
    assert_nothing_resident(pipe)
    assert_tracker_agrees(pipe)
    assert watcher.alive() == []


def assert_next_run_is_clean(pipe, frames) -> None:
    assert np.array_equal(generate(pipe), frames)
    assert_tracker_agrees(pipe)
    assert_nothing_resident(pipe)


def runtime_error() -> None:
    raise RuntimeError("reader bug")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("component", MODELS)
@pytest.mark.parametrize("fault", [io_error, runtime_error], ids=["eio", "bug"])
def test_read_failure_at_a_random_tensor_leaves_nothing_resident(
    tiny_template, clean_frames, monkeypatch, component, seed, fault
):
    info = random_tensor(tiny_template, component, seed)
    pipe = wan(tiny_template)
    watcher = Watcher(monkeypatch)
    injected = ReadFault(monkeypatch, info.path, info.start, info.end, fault)
    with pytest.raises(ondeck.LoadError) as excinfo:
        generate(pipe)
    assert injected.fired == 1
    message = str(excinfo.value)
    assert f"component '{component}'" in message
    if fault is io_error:
        assert info.path in message and f"tensor '{info.name}'" in message
        assert "Input/output error" in message
    else:  # an unexpected exception is wrapped, named, and chained as it was
        assert "RuntimeError: reader bug" in message
        assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert_clean_after_fault(pipe, watcher)
    assert_next_run_is_clean(pipe, clean_frames)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("component", MODELS)
@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError()],
    ids=["torch-oom", "memory-error"],
)
def test_allocator_failure_at_a_random_tensor_leaves_nothing_resident(
    tiny_template, clean_frames, monkeypatch, component, seed, error
):
    at = random.Random(f"{component}-{seed}").randint(1, slot_count(tiny_template, component))
    pipe = wan(tiny_template)
    watcher = Watcher(monkeypatch)
    # Other components allocate too; fail only inside this one's load.
    fault = AllocationFault(monkeypatch, at, error, component=component)
    with pytest.raises(ondeck.LoadError) as excinfo:
        generate(pipe)
    assert fault.fired == 1
    assert f"component '{component}'" in str(excinfo.value)
    assert excinfo.value.__cause__ is error
    assert_clean_after_fault(pipe, watcher)
    assert_next_run_is_clean(pipe, clean_frames)


@pytest.mark.parametrize("component", MODELS)
def test_interrupt_during_allocation_leaves_nothing_resident(
    tiny_template, clean_frames, monkeypatch, component
):
    at = random.Random(component).randint(1, slot_count(tiny_template, component))
    pipe = wan(tiny_template)
    watcher = Watcher(monkeypatch)
    AllocationFault(monkeypatch, at, KeyboardInterrupt(), component=component)
    with pytest.raises(KeyboardInterrupt):
        generate(pipe)
    assert_clean_after_fault(pipe, watcher)
    assert_next_run_is_clean(pipe, clean_frames)


def interrupt_main_thread() -> None:
    """What Ctrl-C does: SIGINT to the process, handled by the main thread.

    The reading thread then holds on a moment, so the main thread is still waiting for
    this read when the signal lands.
    """
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    time.sleep(0.2)


@pytest.mark.parametrize("component", MODELS)
def test_ctrl_c_while_reading_leaves_nothing_resident(
    tiny_template, clean_frames, monkeypatch, python_sigint, component
):
    info = random_tensor(tiny_template, component, seed=0)
    pipe = wan(tiny_template)
    watcher = Watcher(monkeypatch)
    fault = ReadFault(monkeypatch, info.path, info.start, info.end, interrupt_main_thread)
    with pytest.raises(KeyboardInterrupt):
        generate(pipe)
    assert fault.fired == 1
    assert_clean_after_fault(pipe, watcher)
    assert_next_run_is_clean(pipe, clean_frames)


def test_interrupt_between_load_and_bookkeeping_keeps_the_tracker_honest(
    tiny_template, clean_frames, monkeypatch
):
    """The module is built and handed over, then the interrupt lands before it is recorded."""
    pipe = wan(tiny_template)
    watcher = Watcher(monkeypatch)
    real_loaded = pipe.tracker.loaded

    def loaded(name, *args, **kwargs):
        if name == "transformer":
            raise KeyboardInterrupt
        return real_loaded(name, *args, **kwargs)

    monkeypatch.setattr(pipe.tracker, "loaded", loaded)
    with pytest.raises(KeyboardInterrupt):
        generate(pipe)
    monkeypatch.setattr(pipe.tracker, "loaded", real_loaded)
    assert_clean_after_fault(pipe, watcher)
    assert_next_run_is_clean(pipe, clean_frames)


def test_an_aborted_run_leaves_no_prefetch_behind(tiny_template, monkeypatch):
    """A run that fails while the next component is still queued for prefetch must not
    have that prefetch load it after the run has released everything."""
    pipe = wan(tiny_template, "budget", budget="1GiB")
    real_materialize = LazyModule.materialize

    def slow_to_start(self, **options):
        if threading.current_thread().name.startswith("ondeck-prefetch"):
            time.sleep(0.2)  # a busy machine: the prefetch thread starts late
        return real_materialize(self, **options)

    def failing_denoise(self, state):
        raise RuntimeError("the denoiser failed")

    monkeypatch.setattr(LazyModule, "materialize", slow_to_start)
    monkeypatch.setattr(wan_module.Denoise, "forward", failing_denoise)
    with pytest.raises(RuntimeError, match="the denoiser failed"):
        generate(pipe)
    time.sleep(0.5)
    assert loaded_names(pipe) == set()
    assert pipe.tracker.resident == {}


def test_an_interrupt_during_release_keeps_the_tracker_honest(tiny_template, clean_frames):
    """Ctrl-C inside a release (here: in a release hook) still frees the component and
    tells the tracker."""
    pipe = wan(tiny_template)
    interrupted = []

    def on_release():
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    pipe.components["text_encoder"].on_release(on_release)
    with pytest.raises(KeyboardInterrupt):
        generate(pipe)
    assert interrupted
    assert_nothing_resident(pipe)
    assert_next_run_is_clean(pipe, clean_frames)


def test_an_interrupt_in_a_transform_gives_the_memory_back(tiny_template, clean_frames):
    """Ctrl-C during a transform (torch.compile, say) frees the freshly loaded module even
    while the caller keeps the KeyboardInterrupt and its traceback."""
    pipe = wan(tiny_template)
    built = []

    def transform(module):
        built.append(weakref.ref(module))
        if len(built) == 1:
            raise KeyboardInterrupt
        return module

    pipe.components["transformer"].add_transform(transform)
    with pytest.raises(KeyboardInterrupt) as excinfo:
        generate(pipe)
    gc.collect()
    module = built[0]()
    held = module_nbytes(module) if module is not None else 0
    del module
    assert excinfo.value is not None  # still held
    assert held == 0, f"{held} bytes of the interrupted load are still held"
    assert_nothing_resident(pipe)
    assert_next_run_is_clean(pipe, clean_frames)


def test_failed_prefetch_is_retried_by_its_stage(tiny_template, clean_frames, monkeypatch):
    """Under ``budget`` the transformer loads on the prefetch thread during the encoder's
    stage; an allocator failure there is reported as a warning and the stage loads it."""
    pipe = wan(tiny_template, "budget", budget="1GiB")
    fault = AllocationFault(
        monkeypatch, 1, torch.OutOfMemoryError("out of memory"), component="transformer"
    )
    with pytest.warns(UserWarning, match="prefetching 'transformer' failed"):
        frames = generate(pipe)
    assert fault.fired == 1
    assert np.array_equal(frames, clean_frames)
    assert pipe.components["transformer"].load_count == 1
    assert_tracker_agrees(pipe)


@pytest.mark.parametrize(
    "error",
    [lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"), MemoryError],
    ids=["torch-oom", "memory-error"],
)
def test_out_of_memory_in_a_stage_under_budget_evicts_and_retries(
    tiny_template, clean_frames, monkeypatch, error
):
    """Out of memory inside the denoiser frees what that stage does not hold (the text
    encoder) and runs the stage once more; the run then gives the usual frames.

    ``MemoryError`` is how an allocation fails on the CPU and on unified memory."""
    from diffusers import WanTransformer3DModel

    pipe = wan(tiny_template, "budget", budget="1GiB", prefetch=False)
    real_forward = WanTransformer3DModel.forward
    raised = []

    def forward(self, *args, **kwargs):
        if not raised:
            raised.append(True)
            raise error()
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(WanTransformer3DModel, "forward", forward)
    frames = generate(pipe)
    assert raised
    assert np.array_equal(frames, clean_frames)
    assert not ondeck.is_loaded(pipe.components["text_encoder"])
    assert ondeck.is_loaded(pipe.components["transformer"])
    assert_tracker_agrees(pipe)


# -- large components: the resident set must come back too ------------------------------


def late_tensor(folder, component: str):
    """The tensor whose data ends last in the file: most of the file is read before it."""
    tensors = ModelFolder.open(folder).tensors(component)
    return max(tensors.values(), key=lambda info: info.end)


@pytest.mark.parametrize("fault", [io_error, interrupt_main_thread], ids=["eio", "ctrl-c"])
def test_fault_late_in_a_large_load_gives_the_memory_back(
    default_template, clean_default_frames, monkeypatch, python_sigint, fault
):
    pipe = wan(default_template)
    component_bytes = pipe.component_bytes()["transformer"]
    generate(pipe)
    watcher = Watcher(monkeypatch)
    info = late_tensor(default_template, "transformer")
    before = settled_rss()
    for _ in range(2):
        ReadFault(monkeypatch, info.path, info.start, info.end, fault)
        with pytest.raises((ondeck.LoadError, KeyboardInterrupt)):
            generate(pipe)
        assert_clean_after_fault(pipe, watcher)
    grown = settled_rss() - before
    assert component_bytes > 100 * MiB
    assert grown < 16 * MiB, f"resident set grew {grown / MiB:.1f} MiB"
    monkeypatch.undo()
    assert_next_run_is_clean(pipe, clean_default_frames)


# -- Ctrl-C at any moment -------------------------------------------------------------


def interrupt_at_random_moments(pipe, frames, landed: int, seed: int) -> dict:
    """Send SIGINT to the main thread at a random moment of runs until ``landed`` of the
    interrupts have landed inside a run (at most four times as many trials).

    The moment is drawn per trial from the length of the undisturbed run just before it
    (every trial is followed by one, which must give the clean frames), so the count
    follows the machine's speed as it changes. An interrupt that arrives after the run
    returned is not counted. After every trial the pipeline must be usable: under
    ``release`` nothing is left loaded, and the tracker names what is loaded.
    """
    run_seconds = math.inf
    for _ in range(2):  # the second run is the steady state (under budget: no loads)
        started = time.perf_counter()
        assert np.array_equal(generate(pipe), frames)
        run_seconds = min(run_seconds, time.perf_counter() - started)
    rng = random.Random(seed)
    main = threading.main_thread().ident
    outcome = {"trials": 0, "interrupted": 0, "completed": 0, "after_the_run": 0}
    outcome["stale_tracker"] = 0
    while outcome["interrupted"] < landed and outcome["trials"] < 4 * landed:
        trial = outcome["trials"]
        outcome["trials"] += 1
        timer = threading.Timer(
            rng.uniform(0, 0.9 * run_seconds), signal.pthread_kill, (main, signal.SIGINT)
        )
        try:
            timer.start()
            try:
                generate(pipe, prompt=f"take {trial % 3}", seed=trial)
                outcome["completed"] += 1
            except KeyboardInterrupt:
                outcome["interrupted"] += 1
            finally:
                timer.cancel()
                timer.join()
        except KeyboardInterrupt:  # the signal came once the run had returned
            outcome["after_the_run"] += 1
        if pipe.policy.name == "release":
            assert loaded_names(pipe) == set()
        if set(pipe.tracker.resident) != loaded_names(pipe):
            outcome["stale_tracker"] += 1
        started = time.perf_counter()
        assert np.array_equal(generate(pipe), frames)
        run_seconds = time.perf_counter() - started
    return outcome


@pytest.mark.parametrize("policy, options", [("release", {}), ("budget", {"budget": "1GiB"})])
def test_ctrl_c_at_a_random_moment_leaves_a_usable_pipeline_and_an_honest_tracker(
    tiny_template, clean_frames, python_sigint, policy, options
):
    outcome = interrupt_at_random_moments(
        wan(tiny_template, policy, **options), clean_frames, 10, 0
    )
    assert outcome["interrupted"] == 10, outcome
    assert outcome["stale_tracker"] == 0, outcome


@pytest.mark.soak
@pytest.mark.parametrize("policy, options", [("release", {}), ("budget", {"budget": "1GiB"})])
def test_ctrl_c_at_five_hundred_random_moments(
    tiny_template, clean_frames, python_sigint, policy, options
):
    outcome = interrupt_at_random_moments(
        wan(tiny_template, policy, **options), clean_frames, 500, 1
    )
    print(json.dumps({"policy": policy, **outcome}))
    assert outcome["interrupted"] == 500, outcome
    assert outcome["stale_tracker"] == 0, outcome
