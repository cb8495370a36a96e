"""Reads into CUDA memory, with the device busy: what the CPU suite can only fake.

Work queued on the caller's stream before a read holds the read's device copies back
(they start after it). Each ring slot and host-cache buffer is then still waiting for
its copy when the reader would like it back: only waiting for the copy's event keeps
its bytes intact. These tests keep the stream busy on purpose, so a reader that reused
a slot too early, or copied before the caller's kernels were done, would deliver wrong
bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ondeck.loading import (
    ComponentLoader,
    HostCache,
    ReadJob,
    process_pool,
    read_header,
    read_into,
)

from .conftest import keep_stream_busy, settle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RING_SLOT_BYTES = 64 * 2**10
RING_SLOTS = 4


@pytest.fixture(params=["processes", "threads"])
def readers(request, monkeypatch) -> str:
    monkeypatch.setenv("ONDECK_READ_PROCESSES", "1" if request.param == "processes" else "0")
    yield request.param
    process_pool.close_shared()


def random_file(path, nbytes: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "a": torch.randint(0, 256, (nbytes // 2,), dtype=torch.uint8, generator=generator),
        "b": torch.randn(nbytes // 8, generator=generator),  # float32: nbytes / 2
    }
    save_file(tensors, str(path))
    return tensors


def read_to_cuda(path, readers: str, **options) -> tuple[dict[str, torch.Tensor], str]:
    infos = read_header(path).tensors
    jobs = [
        ReadJob(info, torch.empty(info.shape, dtype=info.dtype, device="cuda"))
        for info in infos.values()
    ]
    stats = read_into(jobs, progress=False, **options)
    return {job.info.name: job.destination for job in jobs}, stats.readers


def test_ring_slots_are_reused_only_after_their_copies_finished(tmp_path, readers):
    # 4 MiB through a ring of 4 x 64 KiB: every slot is read into 16 times, and each time
    # its last copy is held back behind the busy stream.
    tensors = random_file(tmp_path / "w.safetensors", 4 * 2**20)
    keep_stream_busy()
    loaded, used = read_to_cuda(
        tmp_path / "w.safetensors",
        readers,
        buffer_bytes=RING_SLOT_BYTES,
        buffer_count=RING_SLOTS,
        threads=2,
    )
    torch.cuda.synchronize()
    assert used == readers
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].cpu(), tensor), name


def test_a_read_into_memory_just_freed_waits_for_the_kernels_that_read_it(tmp_path, readers):
    nbytes = 16 * 2**20  # a block of its own in torch's allocator
    generator = torch.Generator().manual_seed(1)
    data = torch.randn(nbytes // 4, generator=generator)
    save_file({"w": data}, str(tmp_path / "w.safetensors"))
    info = read_header(tmp_path / "w.safetensors").tensors["w"]

    settle()
    old = torch.ones(nbytes // 4, device="cuda")
    keep_stream_busy()
    doubled = old * 2  # queued behind the busy kernel: reads ``old`` later
    address = old.data_ptr()
    del old  # its block goes back to the allocator for this stream, and is reused at once
    destination = torch.empty(nbytes // 4, device="cuda")
    assert destination.data_ptr() == address, "the test needs the freed block reused"

    stats = read_into([ReadJob(info, destination)], progress=False, buffer_bytes=2**20)
    torch.cuda.synchronize()
    assert stats.readers == readers
    assert torch.equal(doubled.cpu(), torch.full((nbytes // 4,), 2.0)), "read its memory early"
    assert torch.equal(destination.cpu(), data)


def test_host_cache_reload_on_a_busy_stream_equals_the_first_load(tiny_folder):
    cache = HostCache(budget_bytes=2**30)
    assert cache.pin, "pinned by default where CUDA is"
    loader = ComponentLoader(tiny_folder, "transformer", device="cuda", host_cache=cache)
    first = {k: v.cpu() for k, v in loader().state_dict().items()}

    keep_stream_busy()
    second = loader()
    torch.cuda.synchronize()
    assert loader.last_source == "host cache"
    assert (cache.hits, cache.misses) == (1, 1)
    assert all(p.device.type == "cuda" for p in second.parameters())
    for name, tensor in second.state_dict().items():
        assert torch.equal(tensor.cpu(), first[name]), name


def test_host_cache_serves_a_pipelines_reloads_with_the_same_frames(tiny_folder):
    from ondeck.pipelines.wan import WanTextToVideo

    cache = HostCache(budget_bytes=2**30)
    pipe = WanTextToVideo.from_folder(
        tiny_folder,
        policy="release",
        device="cuda",
        dtype=torch.float32,
        progress=False,
        host_cache=cache,
    )
    shape = dict(height=32, width=32, num_frames=5, num_inference_steps=2)
    first = pipe.generate("a fox", seed=0, **shape)
    misses = cache.misses
    pipe.generate("a heron", seed=0, **shape)
    again = pipe.generate("a fox", seed=0, **shape)

    assert misses == 3, "each component read from its files once"
    assert cache.misses == misses and cache.hits >= 3, "reloads came from the host cache"
    # Close, not equal: CUDA kernels need not repeat bit for bit across allocations.
    assert np.abs(again - first).max() < 1e-5
