"""GGUF files as the loader reads and checks them: tensor types and byte counts, a file
rewritten in place, a streamed load that fails, the host cache of a text encoder."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import ondeck
from ondeck.errors import LoadError
from ondeck.loading.gguf_file import check_transformers_gguf, read_gguf

from .conftest import frames, load

gguf = pytest.importorskip("gguf")


def write_gguf(path, arrays: dict[str, np.ndarray], arch: str = "wan"):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewritten(path, source) -> None:
    """``path`` rewritten in place with ``source``'s bytes, its modification time moved
    on (a rewrite within the file system's timestamp granularity would keep it)."""
    before = path.stat()
    path.write_bytes(source.read_bytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


def test_an_f16_tensor_loads_as_a_plain_float16_tensor(tmp_path):
    values = np.arange(64, dtype=np.float16).reshape(2, 32)
    path = write_gguf(tmp_path / "f16.gguf", {"blocks.0.q.weight": values})

    tensor = read_gguf(path, "transformer")["blocks.0.q.weight"]

    assert type(tensor) is torch.Tensor and tensor.dtype == torch.float16
    assert torch.equal(tensor, torch.from_numpy(values))


def test_a_tensor_whose_header_byte_count_disagrees_with_its_shape_is_refused(
    tmp_path, monkeypatch
):
    """The reader's byte count for a tensor is not what its shape and type take (here:
    4 bytes short): refused naming the file and the tensor, before anything is read."""
    from ondeck.loading import gguf_file, reads

    path = write_gguf(tmp_path / "short.gguf", {"blocks.0.q.weight": np.ones((2, 32), np.float32)})
    reader_of = gguf_file.gguf_reader

    def miscounting(path, name):
        reader = reader_of(path, name)
        reader.tensors = [tensor._replace(n_bytes=tensor.n_bytes - 4) for tensor in reader.tensors]
        return reader

    monkeypatch.setattr(gguf_file, "gguf_reader", miscounting)
    monkeypatch.setattr(reads, "read_into", lambda *a, **k: pytest.fail("read weights"))
    with pytest.raises(
        LoadError,
        match=r"short\.gguf: tensor 'blocks\.0\.q\.weight' holds 252 bytes where its shape "
        r"needs 256",
    ):
        read_gguf(path, "transformer")


def test_a_gguf_file_rewritten_in_place_with_another_model_is_checked_again(
    text_encoder_gguf, tmp_path
):
    path = tmp_path / "encoder.gguf"
    shutil.copy(text_encoder_gguf, path)
    config = {"model_type": "umt5"}
    check_transformers_gguf(path, "text_encoder", config)  # a umt5 file: accepted

    other = write_gguf(tmp_path / "llama.gguf", {"token_embd.weight": np.ones((4, 8))}, "llama")
    rewritten(path, other)

    with pytest.raises(LoadError, match=r"holds a llama model, and the component is a umt5"):
        check_transformers_gguf(path, "text_encoder", config)


def test_a_streamed_gguf_load_that_fails_keeps_no_host_copies(gguf_base, gguf_file, monkeypatch):
    """The load fails once the streamed blocks' bytes are in their host copies, as the
    module is armed: the copies it filled go with it."""
    from ondeck.streaming.streamer import BlockStreamer

    pipe = load(gguf_base, "streaming", components={"transformer": gguf_file[0]})

    def failing(self, module):
        raise RuntimeError("arming failed (injected)")

    monkeypatch.setattr(BlockStreamer, "finish", failing)
    with pytest.raises(LoadError, match="injected"):
        frames(pipe)

    assert not ondeck.is_loaded(pipe.transformer)
    assert pipe.ondeck.policy.streaming.host_bytes() == 0


@pytest.fixture
def cache_on_cpu(monkeypatch):
    """A host cache that serves CPU loads (it normally refuses them), so its path runs here."""
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    return HostCache(budget_bytes=2**30, pin=False)


def test_a_gguf_text_encoder_rewritten_with_other_weights_is_read_again(
    base, text_encoder_gguf, tmp_path, cache_on_cpu
):
    path = tmp_path / "umt5.gguf"
    shutil.copy(text_encoder_gguf, path)
    pipe = load(base, "release", components={"text_encoder": path}, host_cache=cache_on_cpu)
    loader = object.__getattribute__(pipe.text_encoder, "_ondeck_loader")
    before = frames(pipe)

    other = tmp_path / "other.gguf"
    shutil.copy(path, other)
    reader = gguf.GGUFReader(str(other), "r+")
    (norm,) = [tensor for tensor in reader.tensors if tensor.name == "enc.output_norm.weight"]
    norm.data[:] *= 2
    del reader, norm
    rewritten(path, other)

    assert not np.array_equal(frames(pipe), before)
    assert loader.last_source == "file"


def test_a_cached_text_encoder_lacking_a_tensor_the_model_needs_is_read_from_the_file(
    base, text_encoder_gguf, cache_on_cpu
):
    pipe = load(
        base, "release", components={"text_encoder": text_encoder_gguf}, host_cache=cache_on_cpu
    )
    loader = object.__getattribute__(pipe.text_encoder, "_ondeck_loader")
    expected = frames(pipe)
    key, skeleton, slots = loader._dequantized
    loader._dequantized = (key, skeleton, slots[1:])  # as if the load had not made one

    assert np.array_equal(frames(pipe), expected)
    assert loader.last_source == "file"
