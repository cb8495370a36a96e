"""The device's libraries warmed on a thread of their own when a pipeline is made: asked
for once per device, never off CUDA."""

from __future__ import annotations

import torch

import ondeck.stages
import ondeck.warmup
from ondeck.warmup import start_warming

from .helpers import ThreeStages, three_loaders


def test_a_pipeline_asks_for_its_device_to_be_warmed(monkeypatch):
    asked = []
    monkeypatch.setattr(ondeck.stages, "start_warming", lambda device: asked.append(device))
    pipe = ThreeStages(three_loaders(), policy="release", device="cpu")
    assert asked == [pipe.device] == [torch.device("cpu")]


def test_nothing_is_warmed_off_cuda(monkeypatch):
    started = []
    monkeypatch.setattr(ondeck.warmup, "warm_device", lambda *a: started.append(a))
    monkeypatch.setattr(ondeck.warmup, "_STARTED", set())
    assert start_warming("cpu") is None
    assert start_warming(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert start_warming("cuda") is None
    assert started == []


def test_each_device_is_warmed_once(monkeypatch):
    """With CUDA faked as there: the first ask starts the thread, later ones do not."""
    warmed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ondeck.warmup, "_STARTED", set())
    monkeypatch.setattr(ondeck.warmup, "warm_device", lambda device, dtypes: warmed.append(device))
    first = start_warming("cuda:0")
    assert first is not None
    first.join(timeout=10)
    assert start_warming(torch.device("cuda", 0)) is None
    second = start_warming("cuda:1")
    second.join(timeout=10)
    assert warmed == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_a_failing_warm_up_is_left_to_the_stages(monkeypatch):
    def fails(device, dtypes):
        raise RuntimeError("no device after all")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ondeck.warmup, "_STARTED", set())
    monkeypatch.setattr(ondeck.warmup, "warm_device", fails)
    errors = []
    monkeypatch.setattr("threading.excepthook", lambda args: errors.append(args))
    start_warming("cuda:0").join(timeout=10)
    assert errors == []
