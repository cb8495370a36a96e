"""The CUDA libraries started behind a pipeline's set-up (``ondeck.warmup``)."""

from __future__ import annotations

import pytest
import torch

from ondeck import warmup


def test_nothing_starts_off_cuda_or_when_turned_off(monkeypatch):
    assert warmup.start("cpu", torch.bfloat16) is None
    assert warmup.start(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ONDECK_WARMUP", "0")
    assert warmup.start("cuda", torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_operation_it_starts_a_library_for_is_valid(dtype):
    # The same operations on the CPU: an argument a kernel rejects shows here, not as a
    # warm-up that silently stops on the first one.
    warmup._kernels(torch.device("cpu"), dtype)


def test_a_failure_is_kept_not_raised(monkeypatch):
    monkeypatch.setattr(warmup, "last_error", None)

    def broken(device, dtype):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(warmup, "_kernels", broken)
    monkeypatch.setattr(torch.cuda, "device", lambda device: torch.device("cpu"))
    warmup._exercise(torch.device("cpu"), torch.bfloat16)
    assert str(warmup.last_error) == "no kernel"
