"""The warm-up on a CUDA device: it runs on a stream of its own, leaves the caller's
stream and memory as they were, and is started once per device."""

from __future__ import annotations

import pytest
import torch

import ondeck.warmup
from ondeck.warmup import start_warming, warm_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_warming_leaves_the_current_stream_and_no_memory_behind():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream(device)
    allocated = torch.cuda.memory_allocated(device)
    warm_device(device)
    assert torch.cuda.current_stream(device) == stream
    assert torch.cuda.memory_allocated(device) == allocated


def test_a_device_is_warmed_once_on_a_daemon_thread(monkeypatch):
    monkeypatch.setattr(ondeck.warmup, "_STARTED", set())
    thread = start_warming("cuda")
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert start_warming(torch.device("cuda", torch.cuda.current_device())) is None
