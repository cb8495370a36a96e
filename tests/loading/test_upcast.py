"""The float8 upcast's first builds, with the kernel's launch stood in for (the kernel
itself runs in tests/gpu/test_upcast.py): one build at a time, and torch's conversion
where it cannot be built."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ondeck.loading import upcast

FP8 = torch.float8_e4m3fn


@pytest.fixture
def stand_in(monkeypatch):
    """The kernel applies to CPU tensors, and its launch writes torch's conversion after
    a pause; each launch's thread, start and end are noted."""
    launches: list[tuple[str, float, float]] = []

    def launch(kernel, tensor, out):
        started = time.perf_counter()
        time.sleep(0.2)
        out.copy_(tensor.to(out.dtype))
        launches.append((threading.current_thread().name, started, time.perf_counter()))

    monkeypatch.setattr(upcast, "_kernel_applies", lambda tensor, dtype: True)
    monkeypatch.setattr(upcast, "_kernel", lambda: object())
    monkeypatch.setattr(upcast, "_launch", launch)
    monkeypatch.setattr(upcast, "_built", set())
    monkeypatch.setattr(upcast, "_state", {"failed": False})
    return launches


def test_a_first_call_waits_for_a_build_under_way(stand_in):
    stored = torch.randn(64, 64).to(FP8)
    builder = threading.Thread(target=upcast.upcast, args=(stored, torch.bfloat16), name="build")
    builder.start()
    time.sleep(0.05)  # the build is under way
    widened = upcast.upcast(stored, torch.bfloat16)
    builder.join()
    assert torch.equal(widened, stored.to(torch.bfloat16))
    (first, _, first_end), (second, second_start, _) = sorted(stand_in, key=lambda x: x[1])
    assert first == "build" and second == threading.current_thread().name
    assert second_start >= first_end, "two first launches ran at once: two builds"
    # Built: later calls launch without waiting for anything.
    upcast.upcast(stored, torch.bfloat16)
    assert len(stand_in) == 3


def test_a_kernel_that_cannot_be_built_warns_once_and_torch_converts(stand_in, monkeypatch):
    tries = []

    def unbuildable(kernel, tensor, out):
        tries.append(tensor.shape)
        raise RuntimeError("no C compiler for Triton's launcher")

    monkeypatch.setattr(upcast, "_launch", unbuildable)
    stored = torch.randn(64, 64).to(FP8)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        first = upcast.upcast(stored, torch.bfloat16)
    again = upcast.upcast(stored, torch.float16)
    assert len(tries) == 1
    assert torch.equal(first, stored.to(torch.bfloat16))
    assert torch.equal(again, stored.to(torch.float16))


def test_a_load_on_the_cpu_prepares_nothing(monkeypatch):
    monkeypatch.setattr(upcast, "_prepared", set())
    upcast.prepare("cpu", FP8, torch.bfloat16)
    assert not upcast._prepared
    assert not [t for t in threading.enumerate() if t.name == "ondeck-upcast-build"]
