"""Exact-size page-locked host memory on a real CUDA device."""

from __future__ import annotations

import gc

import pytest
import torch

from ondeck import memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_exact_pinned_bytes_copy_asynchronously_and_are_unregistered_after():
    nbytes = 3 * 2**20 + 123
    host = memory.pinned_host_bytes(nbytes)
    assert host.numel() == nbytes and host.is_pinned()
    host.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), host)
    pointer = host.data_ptr()
    del host
    gc.collect()
    # Unregistered already: a second unregister of the same pages is refused.
    assert int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0
    # That refusal stays CUDA's last error on this thread until read: cleared, the next
    # kernel launches (uncleared, it failed a later test's first launch).
    memory.consume_cuda_error()
    assert torch.ones(3, device="cuda").sum().item() == 3


def test_a_refused_registration_does_not_fail_the_next_kernel(monkeypatch):
    def refused(pointer, nbytes):
        # What a refusal leaves behind: CUDA's last error set on this thread.
        return int(torch.cuda.cudart().cudaHostUnregister(pointer))  # never registered

    monkeypatch.setattr(memory, "register_host_memory", refused)
    host = memory.pinned_host_bytes(2**20)
    assert host.numel() == 2**20 and host.is_pinned()  # torch's pinned allocator instead
    assert torch.ones(3, device="cuda").sum().item() == 3


def test_a_host_cache_entry_takes_its_bytes_not_the_next_power_of_two():
    from ondeck.loading import HostCache, TensorInfo

    cache = HostCache(budget_bytes=2**30, pin=True)
    infos = [
        TensorInfo(f"t{i}", torch.uint8, (n,), 0, n, "f.safetensors")
        for i, n in enumerate((40 * 2**20 + 4096, 90 * 2**20))
    ]
    buffers = cache.reserve("key", infos)
    assert all(buffer.is_pinned() for buffer in buffers.values())
    cache.commit("key", buffers)
    assert cache.stats()["held_bytes"] == 130 * 2**20 + 4096  # not 256 MiB
