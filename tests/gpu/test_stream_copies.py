"""The order of block streaming's device copies, on a real side stream.

A streamed block computes from a slot; the copy of a later block into that slot is
queued while the block's kernels may still wait on the compute stream. The copy must
wait for them (an event recorded after the block). Here a spinning kernel delays every
block's compute by tens of milliseconds, so a copy that did not wait would land before
the block read its weights, and the block would compute with another block's.

The CPU suite replaces these copies with immediate ones, so only these tests see it.
"""

from __future__ import annotations

import pytest
import torch

from ondeck.loading import ComponentLoader
from ondeck.pipelines.wan import WanTextToVideo
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions, streamer

from .conftest import BUSY_CYCLES, keep_stream_busy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOTS = 2


@pytest.fixture(scope="module")
def six_blocks(tmp_path_factory):
    from streaming.conftest import build_six_block_folder

    return build_six_block_folder(tmp_path_factory.mktemp("wan-six") / "tiny6")


def inputs(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator).cuda(),
        timestep=torch.tensor([500]).cuda(),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator).cuda(),
        return_dict=False,
    )


def streaming_pipe(folder):
    """A pipeline whose plan streams every transformer block through two slots."""
    from streaming.conftest import budget_keeping, transformer_blocks

    budget = budget_keeping(transformer_blocks(folder), resident=0, slots=SLOTS)
    options = StreamOptions(slots=SLOTS, unified=False, unmeasured_activation_fraction=0.0)
    pipe = WanTextToVideo.from_folder(
        folder,
        policy=BudgetPolicy(budget, streaming=options),
        device="cuda",
        dtype=torch.float32,
        progress=False,
    )
    plan = pipe.plan()
    assert len(plan.streamed["transformer"].streamed) == 6, "every block streams"
    return pipe, plan


def streamed_transformer(folder):
    """The transformer with every block streamed through two slots, and the pipeline."""
    pipe, plan = streaming_pipe(folder)
    pipe.policy.streaming.apply(pipe, plan)
    module = pipe.components["transformer"].materialize()
    for block in module.blocks:
        # After ondeck's own pre-hook (registered when the module was armed), so the
        # block's copy has been waited for and the next block's copy queued already.
        block.register_forward_pre_hook(lambda module, args: keep_stream_busy())
    return pipe, module


def run_slowly_and_compare(folder) -> tuple[torch.Tensor, torch.Tensor]:
    pipe, module = streamed_transformer(folder)
    reference = ComponentLoader(folder, "transformer", dtype=torch.float32, device="cuda")()
    try:
        with torch.no_grad():
            ours = module(**inputs())[0]
            theirs = reference(**inputs())[0]
        torch.cuda.synchronize()
        return ours, theirs
    finally:
        pipe.release_all()


def hold_copies_back(monkeypatch) -> None:
    """Every block's copy waits behind a kernel spinning on the copy stream."""
    original = streamer._DeviceCopies.copy

    def slow_copy(self, destination, source, *, after, done):
        with torch.cuda.stream(self.stream):
            keep_stream_busy(BUSY_CYCLES // 4)
        original(self, destination, source, after=after, done=done)

    monkeypatch.setattr(streamer._DeviceCopies, "copy", slow_copy)


def test_a_slot_is_rewritten_only_after_the_block_that_read_it_computed(six_blocks):
    ours, theirs = run_slowly_and_compare(six_blocks)
    # Close, not equal: the same weights at other addresses may meet other kernels; a
    # block computing with another block's weights is off by far more.
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_same_run_without_that_wait_computes_with_the_wrong_weights(six_blocks, monkeypatch):
    """Proof that the test above can fail: the copy no longer waits for the block."""

    def copy_without_waiting(self, destination, source, *, after, done):
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
            done.record(self.stream)

    monkeypatch.setattr(streamer._DeviceCopies, "copy", copy_without_waiting)
    ours, theirs = run_slowly_and_compare(six_blocks)
    assert not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_device_copies_wait_for_the_compute_that_read_the_slot():
    """The same contract on one slot, without a model."""
    device = torch.device("cuda", torch.cuda.current_device())
    copies = streamer._DeviceCopies(device)
    slot = torch.full((2**20,), 1.0, device=device)
    incoming = torch.full((2**20,), 2.0).pin_memory()
    read_done, copied = copies.event(), copies.event()

    keep_stream_busy()
    seen = slot * 1  # the compute that reads the slot, queued behind the busy kernel
    copies.record(read_done)
    copies.copy(slot, incoming, after=read_done, done=copied)
    copies.wait(copied, [slot])
    after = slot * 1
    torch.cuda.synchronize()

    assert torch.equal(seen.cpu(), torch.full((2**20,), 1.0)), "the copy overtook the read"
    assert torch.equal(after.cpu(), torch.full((2**20,), 2.0)), "the wait saw the copy"


def test_a_streamed_components_timed_call_leaves_out_the_device_waiting_for_copies(
    six_blocks, monkeypatch
):
    """Every block's copy is held back by a kernel spinning on the copy stream, so the
    computing stream waits at each streamed block for tens of milliseconds. The timed
    call is what is left: the transformer's own compute, a small part of those waits."""
    hold_copies_back(monkeypatch)
    pipe, _ = streaming_pipe(six_blocks)
    try:
        pipe.generate(
            "a fox",
            height=16,
            width=16,
            num_frames=5,
            num_inference_steps=2,
            max_sequence_length=16,
        )
        assert len(pipe.plan().streamed["transformer"].streamed) == 6
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        keep_stream_busy(BUSY_CYCLES // 4)
        end.record()
        end.synchronize()
        one_copy = start.elapsed_time(end) / 1000
        assert pipe.tracker.seconds_per_call["transformer"] < one_copy
    finally:
        pipe.release_all()


def released_with_late_copies(folder, monkeypatch) -> list[torch.Tensor]:
    """Every copy held back by a kernel spinning on the copy stream, one pass, then the
    release, which leaves the next pass's first copies queued; then tensors of the slots'
    size made at once, on the computing stream (the slots' memory is the allocator's
    best fit for them), each filled with 7. Returns them once the device is done."""
    hold_copies_back(monkeypatch)
    pipe, plan = streaming_pipe(folder)
    pipe.policy.streaming.apply(pipe, plan)
    module = pipe.components["transformer"].materialize()
    slot_bytes = plan.streamed["transformer"].slot_bytes
    slots = {
        slot.buffer.data_ptr()
        for slot in pipe.policy.streaming.streamers["transformer"]._armed.slots
    }
    with torch.no_grad():
        module(**inputs())
    pipe.release_all()
    fills = [torch.full((slot_bytes // 4,), 7.0, device="cuda") for _ in range(SLOTS)]
    torch.cuda.synchronize()
    if not slots & {fill.data_ptr() for fill in fills}:
        pytest.skip("the allocator gave the new tensors other memory than the slots'")
    return fills


def test_memory_a_release_hands_back_is_written_after_the_copies_left_in_flight(
    six_blocks, monkeypatch
):
    """The release does not wait on the host for its copies in flight: whatever the
    slots' memory goes to next is ordered after them on the device."""
    fills = released_with_late_copies(six_blocks, monkeypatch)
    assert all(bool((fill == 7.0).all()) for fill in fills)


def test_without_that_order_the_late_copies_overwrite_the_new_tensors(six_blocks, monkeypatch):
    """Proof that the test above can fail: the release orders nothing."""
    monkeypatch.setattr(streamer._DeviceCopies, "retire", lambda self: self.copied())
    fills = released_with_late_copies(six_blocks, monkeypatch)
    assert not all(bool((fill == 7.0).all()) for fill in fills)
