"""The first-use warm-up: once per process and CUDA device, started by a pipeline's first
load onto a CUDA device with its components' dtypes, joined when the pipeline closes;
``ONDECK_WARM_UP`` chooses its kinds, or none. (What it saves is measured on the GPU:
``benchmarks/experiments/first_use.py``.)"""

from __future__ import annotations

import threading

import pytest
import torch

from ondeck import ComponentSpec, first_use
from ondeck.executor import Executor
from ondeck.snapshot import Steps


class Proxy:
    def __init__(self, dtype):
        self.spec = ComponentSpec(dtype=dtype)
        self.loads = 0

    def materialize(self, complete: bool = True):
        self.loads += 1


class Pipeline:
    def __init__(self, device: str):
        self.device = torch.device(device)
        self.deferred = {
            "text_encoder": Proxy(torch.bfloat16),
            "tokenizer_like": Proxy(None),
            "vae": Proxy(torch.float32),
        }


@pytest.fixture
def started(monkeypatch):
    calls: list[tuple] = []
    gate = threading.Event()

    def fake_start(device, dtypes):
        calls.append((device, list(dtypes)))
        thread = threading.Thread(target=gate.wait, args=(5,))
        thread.start()
        return thread

    monkeypatch.setattr("ondeck.executor.start_warm_up", fake_start)
    monkeypatch.delenv("ONDECK_WARM_UP", raising=False)
    return calls, gate


def test_the_first_load_on_a_cuda_device_starts_it_once_and_close_joins_it(started):
    calls, gate = started
    pipeline = Pipeline("cuda:0")
    executor = Executor(pipeline)
    executor.before_stage(Steps(load=("text_encoder",)))
    executor.before_stage(Steps(load=("vae",)))
    assert calls == [(torch.device("cuda:0"), [torch.bfloat16, torch.float32])]
    assert pipeline.deferred["vae"].loads == 1
    closing = threading.Thread(target=executor.close)
    closing.start()
    closing.join(timeout=0.2)
    assert closing.is_alive()  # waits for the warm-up
    gate.set()
    closing.join(timeout=10)
    assert not closing.is_alive()


def test_not_on_the_cpu(started):
    calls, _ = started
    executor = Executor(Pipeline("cpu"))
    executor.before_stage(Steps(load=("text_encoder",)))
    executor.close()
    assert calls == []


@pytest.fixture
def fake_warm_up(monkeypatch):
    seen: list[tuple] = []
    monkeypatch.setattr(first_use, "warm_up", lambda *args: seen.append(args))
    monkeypatch.delenv("ONDECK_WARM_UP", raising=False)
    return seen


def test_the_environment_chooses_what_warms_or_nothing(fake_warm_up, monkeypatch):
    monkeypatch.setenv("ONDECK_WARM_UP", "0")
    assert first_use.start_warm_up(torch.device("cuda", 5), [torch.bfloat16]) is None
    monkeypatch.setenv("ONDECK_WARM_UP", " convolution, pointwise")
    thread = first_use.start_warm_up(torch.device("cuda", 5), [torch.bfloat16])
    thread.join(timeout=10)
    assert fake_warm_up == [
        (torch.device("cuda", 5), (torch.bfloat16,), ("convolution", "pointwise"))
    ]
    monkeypatch.setenv("ONDECK_WARM_UP", "convolution,flash")
    with pytest.raises(ValueError, match="ONDECK_WARM_UP='convolution,flash': unknown flash"):
        first_use.start_warm_up(torch.device("cuda", 4), [torch.bfloat16])


def test_start_warm_up_runs_once_per_process_and_device(fake_warm_up):
    device = torch.device("cuda", 7)  # no stand-in runs: warm_up is replaced
    thread = first_use.start_warm_up(device, [torch.float16])
    assert thread is not None
    thread.join(timeout=10)
    every = tuple(name for name, _ in first_use.STAND_INS)
    assert fake_warm_up == [(device, (torch.float16,), every)]
    assert first_use.start_warm_up(device, [torch.float16]) is None
    assert first_use.start_warm_up(torch.device("cpu"), [torch.float16]) is None
    assert len(fake_warm_up) == 1


def test_a_failing_stand_in_costs_only_the_warm_up(monkeypatch):
    def failing(*args):
        raise RuntimeError("no such library")

    raised: list = []
    monkeypatch.setattr(first_use, "warm_up", failing)
    monkeypatch.delenv("ONDECK_WARM_UP", raising=False)
    monkeypatch.setattr(threading, "excepthook", raised.append)
    thread = first_use.start_warm_up(torch.device("cuda", 6), [torch.bfloat16])
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert raised == []
