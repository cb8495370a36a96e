"""Exact-size page-locked host memory: registered with CUDA page by page, unregistered
once its last view is gone. CUDA's runtime is replaced by a recorder on this CPU host."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from ondeck import memory


class Runtime:
    def __init__(self, status: int = 0):
        self.status = status
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:  # noqa: N802
        if self.status == 0:
            self.registered[pointer] = size
        return self.status

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        self.unregistered.append(pointer)
        return 0


def test_exactly_the_pages_asked_for_are_registered_and_released_with_the_last_view(
    monkeypatch,
):
    runtime = Runtime()
    monkeypatch.setattr(memory, "_cudart", lambda: runtime)
    tensor = memory.pinned_host_bytes(10_000)
    assert tensor.dtype == torch.uint8 and tensor.numel() == 10_000
    ((pointer, size),) = runtime.registered.items()
    assert pointer == tensor.data_ptr() and pointer % 4096 == 0
    assert size == 12_288  # 10,000 bytes rounded up to the page, not to a power of two
    view = tensor[100:200]
    del tensor
    gc.collect()
    assert runtime.unregistered == []  # a view still reads it
    view.fill_(7)
    assert int(view.sum()) == 700
    del view
    gc.collect()
    assert runtime.unregistered == [pointer]


def test_where_registering_fails_torchs_pinned_allocator_serves(monkeypatch):
    monkeypatch.setattr(memory, "_cudart", lambda: Runtime(status=1))
    asked: list[dict] = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        asked.append(kwargs)
        return empty(*args, **{**kwargs, "pin_memory": False})  # no CUDA on this host

    monkeypatch.setattr(torch, "empty", recording_empty)
    tensor = memory.pinned_host_bytes(100)
    assert tensor.numel() == 100 and asked[-1]["pin_memory"] is True


def _resident_fraction(pointer: int, nbytes: int) -> float:
    """The share of the pages in [pointer, pointer + nbytes) the kernel has backed
    (mincore), read from this region alone rather than from the process's RSS, which
    other threads' frees move."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // memory._PAGE)
    vector = (ctypes.c_ubyte * pages)()
    status = libc.mincore(ctypes.c_void_p(pointer), ctypes.c_size_t(nbytes), vector)
    assert status == 0, f"mincore failed: errno {ctypes.get_errno()}"
    return sum(byte & 1 for byte in vector) / pages


class ResidencyRecorder(Runtime):
    """Records how much of each region is backed by pages as it is registered."""

    def __init__(self):
        super().__init__()
        self.resident: dict[int, float] = {}

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:  # noqa: N802
        self.resident[pointer] = _resident_fraction(pointer, size)
        return super().cudaHostRegister(pointer, size, flags)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is read on Linux")
def test_a_large_region_is_backed_by_pages_on_several_threads_before_it_is_registered(
    monkeypatch,
):
    import ctypes
    import threading

    runtime = ResidencyRecorder()
    monkeypatch.setattr(memory, "_cudart", lambda: runtime)
    monkeypatch.setattr(memory.os, "cpu_count", lambda: 4)
    touched: list[tuple[int, int]] = []
    memset = ctypes.memset

    def recording_memset(pointer, value, count):
        touched.append((threading.get_ident(), count))
        return memset(pointer, value, count)

    monkeypatch.setattr(ctypes, "memset", recording_memset)
    nbytes = memory._TOUCH_THREADS_FROM * 2
    tensor = memory.pinned_host_bytes(nbytes)
    assert runtime.registered == {tensor.data_ptr(): nbytes}
    assert sum(count for _, count in touched) == nbytes, "every byte touched"
    assert len({thread for thread, _ in touched}) > 1 and len(touched) == 4
    assert runtime.resident[tensor.data_ptr()] == 1.0, "the pages are there before registering"
    assert int(tensor[:: 2**20].sum()) == 0

    touched.clear()
    memory.pinned_host_bytes(memory._TOUCH_THREADS_FROM // 2)
    assert touched == [], "a small region is left to registering"
