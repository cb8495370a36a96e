"""The portable read path (threads reading ordinary files with ``readinto``, no
``os.preadv``, no reading processes) loads the same bytes as the fast path."""

from __future__ import annotations

import os

import pytest
import torch

from ondeck.loading import ModelFolder, component_loader, process_pool
from ondeck.loading.chunks import ReadJob
from ondeck.loading.reads import read_into
from ondeck.loading.ring import read_path
from ondeck.loading.safetensors_format import read_header

from .helpers import random_tensor, write_safetensors

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _load(path, buffer_bytes=None):
    header = read_header(path).tensors
    targets = {name: torch.empty(info.shape, dtype=info.dtype) for name, info in header.items()}
    jobs = [ReadJob(info, targets[name]) for name, info in header.items()]
    read_into(jobs, progress=False, buffer_bytes=buffer_bytes)
    return targets


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
        if a[k].numel()
    )


def test_ondeck_read_path_portable_is_the_portable_path(monkeypatch):
    monkeypatch.setenv("ONDECK_READ_PATH", "portable")
    assert read_path() == "portable"
    assert process_pool.acquire(1, 2**20, 2, register=False) is None, "no reading processes"
    monkeypatch.delenv("ONDECK_READ_PATH")
    assert read_path() == ("fast" if hasattr(os, "preadv") else "portable")


def test_without_preadv_the_reader_reads_portably(monkeypatch):
    monkeypatch.delenv("ONDECK_READ_PATH", raising=False)
    monkeypatch.delattr(os, "preadv", raising=False)
    assert read_path() == "portable"


@pytest.mark.parametrize("buffer_bytes", [None, 4096])  # direct reads, and staged ones
def test_every_dtype_loads_the_same_bytes_both_ways(tmp_path, monkeypatch, buffer_bytes):
    tensors = {f"t{i}": random_tensor(dtype, (3, 37), seed=i) for i, dtype in enumerate(DTYPES)}
    tensors["odd"] = random_tensor(torch.float16, (1001,), seed=99)  # leaves the rest unaligned
    tensors["after_odd"] = random_tensor(torch.float32, (5, 7), seed=100)
    tensors["empty"] = torch.empty(0, dtype=torch.float32)
    path = write_safetensors(tmp_path / "all.safetensors", tensors)
    monkeypatch.delenv("ONDECK_READ_PATH", raising=False)
    fast = _load(path, buffer_bytes)
    monkeypatch.setenv("ONDECK_READ_PATH", "portable")

    def no_preadv(*args, **kwargs):
        raise AssertionError("the portable path called os.preadv")

    monkeypatch.setattr(os, "preadv", no_preadv, raising=False)
    portable = _load(path, buffer_bytes)
    assert _same_bytes(fast, portable)
    assert _same_bytes(portable, tensors)


def test_a_sharded_component_loads_the_same_both_ways(wan_folder, monkeypatch):
    folder = ModelFolder.open(wan_folder)

    def state(name):
        module = component_loader(folder, name, device="cpu", progress=False)()
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    for name in ("transformer", "text_encoder", "vae"):
        monkeypatch.delenv("ONDECK_READ_PATH", raising=False)
        fast = state(name)
        monkeypatch.setenv("ONDECK_READ_PATH", "portable")
        assert _same_bytes(fast, state(name)), name


def test_a_file_replaced_under_a_portable_read_is_refused(tmp_path, monkeypatch):
    from ondeck.errors import LoadError

    path = write_safetensors(
        tmp_path / "w.safetensors", {"w": random_tensor(torch.float32, (64, 64))}
    )
    header = read_header(path).tensors
    descriptor = os.open(path, os.O_RDONLY)
    try:
        replacement = tmp_path / "new.safetensors"
        write_safetensors(replacement, {"w": random_tensor(torch.float32, (64, 64), seed=5)})
        os.replace(replacement, path)  # the descriptor still names the old file
        monkeypatch.setenv("ONDECK_READ_PATH", "portable")
        from ondeck.loading import ring

        target = torch.empty(64 * 64 * 4, dtype=torch.uint8)
        with pytest.raises(LoadError, match="changed"):
            info = header["w"]
            ring.pread_exact(descriptor, target.data_ptr(), 16, info.start, info, "w")
    finally:
        os.close(descriptor)


def test_a_host_without_pread_at_all_loads_the_same_bytes(tmp_path, monkeypatch):
    """As on Windows: neither os.preadv nor os.pread; the identity check at the open reads
    the header another way."""
    tensors = {"a": random_tensor(torch.float32, (17, 3)), "b": random_tensor(torch.int8, (9,))}
    path = write_safetensors(tmp_path / "w.safetensors", tensors)
    monkeypatch.delenv("ONDECK_READ_PATH", raising=False)
    monkeypatch.delattr(os, "preadv", raising=False)
    monkeypatch.delattr(os, "pread", raising=False)
    assert _same_bytes(_load(path), tensors)


def test_the_reading_threads_close_their_own_files(tmp_path, monkeypatch):
    """Each portable reading thread opens the files it reads; it closes them as it ends,
    not leaving them to the garbage collector (a ResourceWarning each)."""
    import gc
    import warnings

    monkeypatch.setenv("ONDECK_READ_PATH", "portable")
    path = write_safetensors(tmp_path / "w.safetensors", {"a": torch.randn(1000)})
    jobs = [ReadJob(info, torch.empty(info.shape, dtype=info.dtype)) for info in read_header(path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        read_into(jobs, progress=False)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
