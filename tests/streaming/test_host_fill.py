"""A pipelined first load hands the module over before its streamed blocks' host copies
hold their weights: a thread fills them in the order they stream, and each block's copy
to the device waits for its own fill."""

from __future__ import annotations

import threading

import pytest
import torch

from ondeck.errors import LoadError
from ondeck.streaming.streamer import BlockStreamer

from .test_host_cache_layouts import block_of, layout, placed_loader
from .test_protocol import inputs

STREAMED = (0, 1, 2, 3)
LAST = STREAMED[-1]


@pytest.fixture
def gated(monkeypatch):
    """The fill of the last streamed block waits until the returned event is set."""
    gate = threading.Event()
    original = BlockStreamer.read_block

    def read_block(self, block, buffer):
        if block == LAST:
            assert gate.wait(30), "the gate was never opened"
        return original(self, block, buffer)

    monkeypatch.setattr(BlockStreamer, "read_block", read_block)
    return gate


def begin(folder):
    loader, streamer, sizes, expected = placed_loader(folder, None, pipelined=True)
    streamer.use_layout(layout(sizes, STREAMED))
    module, filling = loader.begin()
    return loader, streamer, module, filling, expected


def forward(module, filling):
    with torch.no_grad():
        output = module(**inputs(1))[0]
    if filling is not None:
        filling.wait()
    return output


def test_the_module_is_handed_over_before_the_host_copies_are_filled(six_block_folder, gated):
    loader, streamer, module, filling, expected = begin(six_block_folder)
    assert not streamer.region_ready(LAST), "the load waited for every host copy"
    # The last block's copy can only wait for its fill: it holds no weights until then.
    threading.Timer(0.2, gated.set).start()
    torch.testing.assert_close(forward(module, filling), expected, rtol=0, atol=0)
    assert all(streamer.region_ready(block) for block in STREAMED)
    # The pass waited about as long as the gate held the last fill, which took as long.
    assert 0.1 < streamer.stats.host_fill_wait_seconds < streamer.stats.host_fill_seconds
    loader.unload(module)


def test_a_release_waits_for_the_filling_and_keeps_the_copies(six_block_folder, gated, file_reads):
    loader, streamer, module, filling, expected = begin(six_block_folder)
    threading.Timer(0.2, gated.set).start()
    if filling is not None:
        filling.wait()
    loader.unload(module)
    file_reads.clear()
    module, filling = loader.begin()
    assert not {block_of(name) for name in file_reads} & set(STREAMED), "copies read again"
    torch.testing.assert_close(forward(module, filling), expected, rtol=0, atol=0)
    loader.unload(module)


def test_a_failed_fill_fails_the_forward_naming_the_component(
    six_block_folder, monkeypatch, file_reads
):
    original = BlockStreamer.read_block
    failing = {2}

    def read_block(self, block, buffer):
        if block in failing:
            raise OSError("injected read failure")
        return original(self, block, buffer)

    monkeypatch.setattr(BlockStreamer, "read_block", read_block)
    loader, streamer, module, filling, expected = begin(six_block_folder)
    with pytest.raises(LoadError, match="component 'transformer'.*injected read failure"):
        forward(module, filling)
    loader.unload(module)
    # The blocks it did not fill are read again by the next load, which then computes right.
    failing.clear()
    file_reads.clear()
    module, filling = loader.begin()
    torch.testing.assert_close(forward(module, filling), expected, rtol=0, atol=0)
    assert {2, LAST} <= {block_of(name) for name in file_reads}
    loader.unload(module)
