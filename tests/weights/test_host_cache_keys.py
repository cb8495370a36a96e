"""The host cache over the weights users bring: what an entry may serve, and what it may
hold."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from ondeck.loading import ComponentLoader, HostCache, ModelFolder
from ondeck.loading.single_file import SingleFileFolder

from .conftest import original_name


@pytest.fixture
def cache_on_cpu(monkeypatch):
    """A host cache that serves CPU loads (it normally refuses them), so its path runs here."""
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    return HostCache(budget_bytes=2**30, pin=False)


STREAMED = tuple(f"blocks.{index}." for index in range(5))


class StreamsFiveBlocks:
    """A placement (ComponentLoader's protocol) that keeps blocks 0-4 in host memory, as
    block streaming does before a re-plan lets them stay on the device."""

    cache_tag = ("streamed blocks", "blocks", (0, 1, 2, 3, 4))

    def destination(self, slot):
        if slot.names[0].startswith(STREAMED):
            return torch.empty(slot.shape, dtype=slot.dtype), False
        return None

    def finish(self, module):
        pass

    def abort(self):
        pass

    def unload(self, module):
        pass


def test_a_placement_change_keeps_the_cache_within_its_budget(base, monkeypatch):
    """A host cache of 0.8x the transformer, whose blocks streamed on the first run and
    load whole after a re-plan: the old placement's entry, whose tensors the new one
    keeps, is not evicted to make room for the rest, and counts until it is replaced, so
    the cache never holds more than its budget (before, it ended at 1.25x)."""
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    folder = ModelFolder.open(base)
    total = sum(info.nbytes for info in folder.tensors("transformer").values())
    cache = HostCache(budget_bytes=int(total * 0.8), pin=False)
    options = dict(dtype=torch.float32, host_cache=cache, progress=False, pipelined=False)

    ComponentLoader(folder, "transformer", placement=StreamsFiveBlocks(), **options)()
    assert 0 < cache.resident_bytes <= cache.budget_bytes
    ComponentLoader(folder, "transformer", **options)()  # the same component, now whole

    assert cache.resident_bytes <= cache.budget_bytes, (
        f"the cache holds {cache.resident_bytes} bytes over a budget of {cache.budget_bytes}"
    )


def test_a_float8_file_as_saved_and_stored_fp8_do_not_share_an_entry(base, float8, cache_on_cpu):
    """Two pipelines over one float8 file sharing a host cache, one as saved (its wide
    layers in the compute dtype) and one with storage_dtype="fp8" (every castable layer in
    fp8): other bytes for the same tensors, so other entries (one key made the second load
    fail copying the first's bytes)."""
    path, _ = float8
    options = dict(dtype=torch.float32, progress=False, pipelined=False)

    def folder():
        return SingleFileFolder(ModelFolder.open(base), {"transformer": path})

    as_saved = ComponentLoader(folder(), "transformer", host_cache=cache_on_cpu, **options)
    as_saved()
    stored = ComponentLoader(
        folder(), "transformer", host_cache=cache_on_cpu, storage_dtype="fp8", **options
    )
    module = stored()

    fresh = ComponentLoader(folder(), "transformer", storage_dtype="fp8", **options)()
    expected, got = fresh.state_dict(), module.state_dict()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_replaced_file_is_not_served_from_memory(base, weights, tmp_path, cache_on_cpu):
    """A transformer file replaced by a fine-tune of the same model (same size) whose
    modification time was kept (rsync -a, tar, a coarse-mtime filesystem): a pipeline
    built anew over it reads the new weights, since the key holds the file's inode and
    its header's hash as well as its size and mtime."""
    path = tmp_path / "transformer.safetensors"
    save_file({original_name(key): tensor for key, tensor in weights.items()}, str(path))
    status = os.stat(path)
    options = dict(dtype=torch.float32, host_cache=cache_on_cpu, progress=False)
    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": path})
    ComponentLoader(folder, "transformer", **options)()

    tuned = {original_name(key): tensor + 1.0 for key, tensor in weights.items()}
    save_file(tuned, str(tmp_path / "tuned.safetensors"))
    os.replace(tmp_path / "tuned.safetensors", path)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(path).st_size == status.st_size

    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": path})
    module = ComponentLoader(folder, "transformer", **options)()

    expected = weights["blocks.0.attn1.to_q.weight"] + 1.0
    assert torch.equal(module.blocks[0].attn1.to_q.weight, expected), "the old file's weights"
