"""A component whose streamed blocks change between loads, with a host cache: the new
placement reads from the files only what the cache does not hold, and the cache keeps
one entry for the component, not one per placement."""

from __future__ import annotations

import pytest
import torch

from ondeck.loading import ComponentLoader, HostCache
from ondeck.streaming import BlockStreamer, StreamLayout, describe_blocks, find_blocks

from .test_protocol import inputs

BLOCK_PREFIX = "blocks."


@pytest.fixture
def cache(monkeypatch):
    """A host cache that serves CPU loads (it refuses them otherwise), so its path runs."""
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    return HostCache(budget_bytes=2**30, pin=False)


def layout(sizes, streamed: tuple[int, ...]) -> StreamLayout:
    resident = tuple(i for i in range(sizes.block_count) if i not in streamed)
    slot_bytes = max(sizes.packed_bytes[i] for i in streamed)
    return StreamLayout(
        sizes.path,
        sizes.block_count,
        resident,
        streamed,
        1,
        slot_bytes,
        sizes.other_bytes + sum(sizes.block_bytes[i] for i in resident) + slot_bytes,
        sum(sizes.packed_bytes[i] for i in streamed),
    )


def block_of(name: str) -> int | None:
    if not name.startswith(BLOCK_PREFIX):
        return None
    return int(name[len(BLOCK_PREFIX) :].split(".")[0])


FEWER_STREAMED = ((0, 1, 2, 3), (0, 1))  # resident blocks 2 and 3 new to the cache
MORE_STREAMED = ((2, 3), (1, 2, 3, 4))  # the resident blocks all in the cache


def placed_loader(folder, cache, pipelined: bool, **options):
    dtype = options.pop("dtype", torch.float32)
    template = ComponentLoader(folder, "transformer", dtype=dtype, **options).template
    sizes, tensors = describe_blocks(template, find_blocks(template.module))
    assert sizes.path == BLOCK_PREFIX.rstrip(".")
    streamer = BlockStreamer("transformer", sizes, tensors, "cpu")
    loader = ComponentLoader(
        folder,
        "transformer",
        dtype=dtype,
        placement=streamer,
        host_cache=cache,
        pipelined=pipelined,
        progress=False,
        **options,
    )
    reference = ComponentLoader(folder, "transformer", dtype=dtype, **options)()
    with torch.no_grad():
        expected = reference(**inputs_in(dtype))[0]
    return loader, streamer, sizes, expected


def inputs_in(dtype: torch.dtype) -> dict:
    return {
        name: value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value
        for name, value in inputs(1).items()
    }


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
@pytest.mark.parametrize(
    "first, then", [FEWER_STREAMED, MORE_STREAMED], ids=["fewer streamed", "more streamed"]
)
def test_a_new_placement_reads_only_what_the_cache_lacks(
    six_block_folder, cache, file_reads, pipelined, first, then
):
    loader, streamer, sizes, expected = placed_loader(six_block_folder, cache, pipelined)

    streamer.use_layout(layout(sizes, first))
    loader.unload(loader())
    first_key = cache.keys()
    assert len(first_key) == 1

    streamer.use_layout(layout(sizes, then))
    file_reads.clear()
    module = loader()

    read_blocks = {block_of(name) for name in file_reads}
    newly_resident = set(first) - set(then)
    # From the files: the blocks now resident that streamed before (the cache never held
    # them). The host copies of blocks streaming now for the first time come from the
    # cache, which held them as resident blocks. Nothing else is read.
    assert read_blocks == newly_resident
    assert loader.last_source.startswith("host cache")
    # One entry for the component: the new placement's, which took the old one's place,
    # holding the resident tensors and no more (the streamed blocks' bytes are freed).
    assert len(cache.keys()) == 1 and cache.keys() != first_key
    entry = cache.get(cache.keys()[0])
    assert not {block_of(name) for name in entry} & set(then)
    assert cache.resident_bytes == sum(tensor.numel() for tensor in entry.values())
    with torch.no_grad():
        torch.testing.assert_close(module(**inputs(1))[0], expected, rtol=0, atol=0)

    # The same placement again: all of it from the cache.
    loader.unload(module)
    file_reads.clear()
    module = loader()
    assert file_reads == [] and loader.last_source == "host cache"
    with torch.no_grad():
        torch.testing.assert_close(module(**inputs(1))[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
def test_stored_fp8_bytes_serve_a_new_placement_that_needs_no_more(
    six_block_folder, cache, file_reads, pipelined
):
    loader, streamer, sizes, expected = placed_loader(
        six_block_folder, cache, pipelined, dtype=torch.bfloat16, storage_dtype="fp8"
    )
    first, then = MORE_STREAMED
    streamer.use_layout(layout(sizes, first))
    loader.unload(loader())
    streamer.use_layout(layout(sizes, then))
    file_reads.clear()
    module = loader()
    # The host copies of the blocks streaming for the first time come from the stored
    # entry too: nothing is read (or cast) again.
    assert set(then) - set(first) and file_reads == []
    assert len(cache.keys()) == 1
    with torch.no_grad():
        torch.testing.assert_close(module(**inputs_in(torch.bfloat16))[0], expected, rtol=0, atol=0)

    # Resident blocks the stored entry lacks: read whole again (stored bytes are kept from
    # a whole read), and still one entry.
    loader.unload(module)
    streamer.use_layout(layout(sizes, FEWER_STREAMED[1]))
    module = loader()
    assert len(cache.keys()) == 1
    with torch.no_grad():
        torch.testing.assert_close(module(**inputs_in(torch.bfloat16))[0], expected, rtol=0, atol=0)


def test_a_component_no_longer_streamed_reads_only_its_streamed_blocks(
    six_block_folder, cache, file_reads
):
    loader, streamer, sizes, expected = placed_loader(six_block_folder, cache, False)
    streamer.use_layout(layout(sizes, (1, 4)))
    loader.unload(loader())
    loader.placement = None  # it fits whole now
    file_reads.clear()
    module = loader()
    assert {block_of(name) for name in file_reads} == {1, 4}
    assert len(cache.keys()) == 1
    with torch.no_grad():
        torch.testing.assert_close(module(**inputs(1))[0], expected, rtol=0, atol=0)


def test_stored_bytes_never_serve_a_load_in_the_file_dtype(six_block_folder, cache, file_reads):
    loader, streamer, sizes, _ = placed_loader(
        six_block_folder, cache, False, dtype=torch.bfloat16, storage_dtype="fp8"
    )
    streamer.use_layout(layout(sizes, (1, 4)))
    loader.unload(loader())
    plain = ComponentLoader(
        six_block_folder, "transformer", dtype=torch.bfloat16, host_cache=cache, progress=False
    )
    file_reads.clear()
    plain()
    assert plain.last_source != "host cache" and not plain.last_source.startswith("host cache")
    assert len(file_reads) == len(plain.folder.tensors("transformer"))
