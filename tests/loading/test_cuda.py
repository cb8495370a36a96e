"""The same contracts on a CUDA device: pinned staging, side-stream copies, host cache."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ondeck.errors import LoadError
from ondeck.lazy import module_nbytes
from ondeck.loading import (
    ComponentLoader,
    HostCache,
    ModelFolder,
    ReadJob,
    read_header,
    read_into,
    reads,
    ring,
)

from .helpers import (
    MODELS,
    assert_same_state,
    from_pretrained,
    jobs_for,
    raise_after,
    random_tensor,
    same_bits,
    write_safetensors,
)
from .test_reads import DTYPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True, params=["processes", "threads"])
def readers(request, monkeypatch) -> str:
    """Every contract here holds whether reading processes or threads do the reads."""
    monkeypatch.setenv("ONDECK_READ_PROCESSES", "1" if request.param == "processes" else "0")
    return request.param


def read_to_cuda(path, *, dtype=None, **options) -> dict[str, torch.Tensor]:
    jobs = jobs_for(path, dtype, device="cuda")
    stats = read_into(jobs, progress=False, **options)
    wanted = "threads" if os.environ["ONDECK_READ_PROCESSES"] == "0" else "processes"
    assert stats.readers == wanted
    return {job.info.name: job.destination for job in jobs}


@pytest.mark.parametrize("buffer_bytes", [reads.DEFAULT_BUFFER_BYTES, 64])
def test_every_dtype_reaches_the_gpu_bit_identical(tmp_path, buffer_bytes):
    tensors = {f"t{i}": random_tensor(d, (33, 7), i) for i, d in enumerate(DTYPES)}
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    loaded = read_to_cuda(path, buffer_bytes=buffer_bytes, buffer_count=2, threads=4)
    for name, tensor in load_file(str(path)).items():
        assert loaded[name].device.type == "cuda"
        assert same_bits(loaded[name].cpu(), tensor), name


def test_unaligned_chunked_and_cast_reads_on_the_gpu(tmp_path):
    tensors = {
        "bytes": random_tensor(torch.uint8, (7,), 1),
        "big": torch.randn(1000, 33),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
    }
    path = write_safetensors(tmp_path / "odd.safetensors", tensors, pad=1)
    loaded = read_to_cuda(path, buffer_bytes=4096, buffer_count=2, threads=4)
    for name, tensor in tensors.items():
        assert same_bits(loaded[name].cpu(), tensor), name
    cast = read_to_cuda(path, dtype=torch.float64, buffer_bytes=4096)
    assert torch.equal(cast["big"].cpu(), tensors["big"].double())


def test_non_contiguous_gpu_destination_is_filled(tmp_path):
    tensor = torch.randn(64, 48)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    destination = torch.empty(48, 64, device="cuda").t()
    read_into([ReadJob(read_header(path).tensors["w"], destination)], progress=False)
    assert torch.equal(destination.cpu(), tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_component_on_the_gpu_equals_from_pretrained(wan_template, name, dtype):
    folder = ModelFolder.open(wan_template)
    loaded = ComponentLoader(folder, name, device="cuda", dtype=dtype, buffer_bytes=512)()
    assert all(p.device.type == "cuda" for p in loaded.parameters())
    assert all(b.device.type == "cuda" for b in loaded.buffers())
    assert folder.spec(name, dtype=dtype, device="cuda").nbytes == module_nbytes(loaded)
    assert_same_state(loaded.cpu(), from_pretrained(wan_template, name, dtype))


def test_host_cache_serves_the_second_gpu_load(wan_template):
    cache = HostCache(budget_bytes=2**30)
    loader = ComponentLoader(wan_template, "vae", device="cuda", host_cache=cache)
    first = loader()
    assert loader.last_source in ("page cache", "disk")
    second = loader()
    assert loader.last_source == "host cache"
    assert (cache.hits, cache.misses) == (1, 1)
    assert all(t.is_pinned() for entry in cache._entries.values() for t in entry.values())
    assert_same_state(second.cpu(), first.cpu())


def test_failed_gpu_load_gives_the_memory_back(wan_template, monkeypatch):
    loader = ComponentLoader(wan_template, "transformer", device="cuda")
    loader()  # warm the allocator and any lazy CUDA state
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    raise_after(monkeypatch, ring, "deliver", 10, LoadError("disk vanished"))
    with pytest.raises(LoadError):
        loader()
    gc.collect()
    assert torch.cuda.memory_allocated() == baseline


def test_failed_device_copy_stops_the_read_and_raises(tmp_path, monkeypatch):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(1000, 64)})
    calls = raise_after(monkeypatch, ring, "deliver", 5, RuntimeError("copy engine fault"))
    with pytest.raises(RuntimeError, match="copy engine fault"):
        read_to_cuda(path, buffer_bytes=4096, buffer_count=2, threads=4)
    # Stopped early: not every one of the 63 chunks was copied.
    assert calls["n"] < 60


def test_the_processes_copy_through_the_driver_and_land_as_torch_copies_do(
    tmp_path, readers, monkeypatch
):
    """Through the processes the copying thread queues its copies and marks its slots
    through the CUDA driver (here it must be found); switched off, through torch. Both
    land every byte, a tensor of many chunks among them, and the fp8 casts equal."""
    if readers == "threads":
        pytest.skip("the threads copy through torch")
    from ondeck.loading.driver import Driver, driver

    assert driver() is not None, "the CUDA driver library should load on a CUDA machine"
    calls = {"copy": 0, "record": 0, "done": 0, "wait": 0}
    for name in calls:
        original = getattr(Driver, name)

        def counted(self, *args, name=name, original=original):
            calls[name] += 1
            return original(self, *args)

        monkeypatch.setattr(Driver, name, counted)
    tensors = {f"t{i}": random_tensor(d, (33, 7), i) for i, d in enumerate(DTYPES)}
    tensors["many"] = random_tensor(torch.bfloat16, (5000, 301), 99)
    path = write_safetensors(tmp_path / "d.safetensors", tensors)
    options = dict(progress=False, buffer_bytes=2**16, buffer_count=8, threads=3)
    results = {}
    for through_driver in (True, False):
        monkeypatch.setattr(ring, "DRIVER_COPIES", through_driver)
        before = dict(calls)
        loaded = read_to_cuda(path, **{k: v for k, v in options.items() if k != "progress"})
        kept = {name: calls[name] - before[name] for name in calls}
        fp8 = [
            ReadJob(info, torch.empty(info.shape, dtype=torch.float8_e4m3fn, device="cuda"))
            for info in read_header(path).tensors.values()
            if info.dtype == torch.bfloat16
        ]
        before = dict(calls)
        read_into(fp8, **options)
        cast = {name: calls[name] - before[name] for name in calls}
        if through_driver:
            # Copies, slot events and their queries; the casts' waits too.
            assert min(kept["copy"], kept["record"], kept["done"]) > 0, kept
            assert min(cast.values()) > 0, cast
        else:
            assert max(kept.values()) == max(cast.values()) == 0, (kept, cast)
        results[through_driver] = (loaded, {job.info.name: job.destination for job in fp8})
    for name, tensor in tensors.items():
        assert same_bits(results[True][0][name].cpu(), tensor), name
        assert same_bits(results[False][0][name].cpu(), tensor), name
    for name, cast in results[True][1].items():
        assert same_bits(cast, tensors[name].cuda().to(torch.float8_e4m3fn)), name
        assert same_bits(cast, results[False][1][name]), name
