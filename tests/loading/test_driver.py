"""The CUDA driver calls of the reader's copying thread (``loading.driver``), on the CPU:
how they are found and how their errors read. Their copies are tested on CUDA
(``test_cuda.py``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ondeck.loading import driver as driver_module


class FakeFunction:
    """A library function: ``argtypes``/``restype`` set by the wrapper, a status returned."""

    def __init__(self, status: int):
        self.status = status
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)
        return self.status


class FakeLibrary:
    def __init__(self, copy=0, record=0, query=0):
        self.cuMemcpyHtoDAsync_v2 = FakeFunction(copy)
        self.cuEventRecord = FakeFunction(record)
        self.cuEventQuery = FakeFunction(query)
        self.cuStreamWaitEvent = FakeFunction(0)

    def cuGetErrorName(self, status, name):
        names = {1: b"CUDA_ERROR_INVALID_VALUE", 201: b"CUDA_ERROR_INVALID_CONTEXT"}
        ctypes.cast(name, ctypes.POINTER(ctypes.c_char_p))[0] = names.get(status)
        return 0 if status in names else 1


def test_calls_reach_the_library_with_their_arguments():
    library = FakeLibrary()
    calls = driver_module.Driver(library)
    calls.copy(0x7000, 0x1000, 4096, 0x20)
    calls.record(0x30, 0x20)
    calls.wait(0x40, 0x30)
    assert library.cuMemcpyHtoDAsync_v2.calls == [(0x7000, 0x1000, 4096, 0x20)]
    assert library.cuEventRecord.calls == [(0x30, 0x20)]
    assert library.cuStreamWaitEvent.calls == [(0x40, 0x30, 0)]
    assert calls.done(0x30) is True


def test_an_event_not_reached_yet_is_not_done():
    assert driver_module.Driver(FakeLibrary(query=600)).done(0x30) is False


@pytest.mark.parametrize(
    ("failing", "call", "expected"),
    [
        (
            "copy",
            lambda d: d.copy(1, 2, 3, 4),
            "cuMemcpyHtoDAsync failed: CUDA_ERROR_INVALID_VALUE (1)",
        ),
        (
            "record",
            lambda d: d.record(1, 2),
            "cuEventRecord failed: CUDA_ERROR_INVALID_CONTEXT (201)",
        ),
        ("query", lambda d: d.done(1), "cuEventQuery failed: unknown error (999)"),
    ],
)
def test_an_error_names_the_call_and_the_drivers_name_for_it(failing, call, expected):
    status = {"copy": 1, "record": 201, "query": 999}[failing]
    calls = driver_module.Driver(FakeLibrary(**{failing: status}))
    with pytest.raises(RuntimeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        call(calls)


def test_a_torch_without_cuda_copies_through_torch(monkeypatch):
    driver_module.driver.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", None)
    try:
        assert driver_module.driver() is None
    finally:
        driver_module.driver.cache_clear()
