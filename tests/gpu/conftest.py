"""What the GPU tests share: tiny Wan folders, and the device's memory put back after."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from ondeck.embedded import build_wan_folder


def settle() -> int:
    """Collect garbage, wait for the device, hand cached blocks back; bytes allocated."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")


@pytest.fixture(scope="session")
def default_folder(tmp_path_factory) -> Path:
    """The embedded default's sizes (tens of MiB a component): large enough that loading
    needs new device memory, not a corner of a block the allocator already holds."""
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "default", preset="default")


@pytest.fixture
def memory_limit(monkeypatch):
    """``limit(nbytes)`` lets this process reserve at most ``nbytes`` more device memory
    than it holds now (torch.cuda.set_per_process_memory_fraction); 1.0 again after."""

    def limit(nbytes: int) -> None:
        settle()
        total = torch.cuda.mem_get_info()[1]
        fraction = min(1.0, (torch.cuda.memory_reserved() + nbytes) / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        # Where torch cannot say the fraction, ondeck reads it from here.
        monkeypatch.setenv("ONDECK_MEMORY_FRACTION", repr(fraction))

    try:
        yield limit
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        settle()


# Clock cycles of torch.cuda._sleep that keep a stream busy for tens of milliseconds:
# far longer than the host takes to queue the work a test races against it.
BUSY_CYCLES = 200_000_000


def keep_stream_busy(cycles: int = BUSY_CYCLES) -> None:
    """Queue a kernel that spins on the current stream: what is queued after it waits."""
    torch.cuda._sleep(cycles)
