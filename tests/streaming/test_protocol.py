"""The slot protocol with copies that complete late, as on a CUDA side stream.

Copies are queued and run only when something waits for their event (the newest record
of it, as ``cudaStreamWaitEvent`` sees it), in the order issued. A block that computed
without waiting for its copy, or waited for the wrong one, would read stale slot bytes.
"""

from __future__ import annotations

import pytest
import torch

from ondeck.loading import ComponentLoader
from ondeck.streaming import streamer

from .test_wan_streaming import streaming


class LateCopies:
    def __init__(self):
        self.queue: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        self.waits = 0

    def event(self) -> object:
        return object()

    def start_after_current(self) -> None:
        pass

    def copy(self, destination, source, *, after, done) -> None:
        self.queue.append((destination, source, done))

    def wait(self, event, buffers) -> None:
        self.waits += 1
        last = max((i for i, (_, _, done) in enumerate(self.queue) if done is event), default=-1)
        for destination, source, _ in self.queue[: last + 1]:
            destination.copy_(source)
        del self.queue[: last + 1]

    def record(self, event) -> None:
        pass

    def synchronize(self) -> None:
        self.wait(None, [])
        for destination, source, _ in self.queue:
            destination.copy_(source)
        self.queue.clear()

    def retire(self) -> object:
        """The copies queued so far stay queued: the returned event runs them."""
        return _Pending(self)


class _Pending:
    def __init__(self, copies: LateCopies):
        self.copies = copies

    def synchronize(self) -> None:
        self.copies.synchronize()

    def query(self) -> bool:
        """Whether the copies have ended: none has while any is queued."""
        return not self.copies.queue


@pytest.fixture
def late_copies(monkeypatch):
    monkeypatch.setattr(streamer, "_ImmediateCopies", LateCopies)


def inputs(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
        return_dict=False,
    )


def streamed_and_reference(folder, resident: int):
    pipe = streaming(folder, resident=resident)
    plan = pipe.plan()
    pipe.policy.streaming.apply(pipe, plan)
    module = pipe.components["transformer"].materialize()
    reference = ComponentLoader(folder, "transformer", dtype=torch.float32)()
    return pipe, plan.streamed["transformer"], module, reference


@pytest.mark.parametrize("resident", [0, 2, 3])
def test_blocks_wait_for_their_own_copy(six_block_folder, late_copies, resident):
    pipe, layout, module, reference = streamed_and_reference(six_block_folder, resident)
    assert len(layout.streamed) == 6 - resident
    with torch.no_grad():
        for seed in range(3):
            expected = reference(**inputs(seed))[0]
            assert torch.equal(module(**inputs(seed))[0], expected)
    pipe.release_all()


def test_blocks_run_out_of_order_still_compute_on_their_own_weights(six_block_folder, late_copies):
    pipe, layout, module, reference = streamed_and_reference(six_block_folder, 2)
    order = [5, 0, 3, 1, 4, 2]  # streamed blocks neither in list order nor prefetched
    module.blocks = torch.nn.ModuleList([module.blocks[i] for i in order])
    reference.blocks = torch.nn.ModuleList([reference.blocks[i] for i in order])
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(module(**inputs(seed))[0], reference(**inputs(seed))[0])
    pipe.release_all()


def test_slot_views_are_made_when_a_block_first_lands_and_are_ordinary_tensors(
    six_block_folder,
):
    """Arming makes slot 0's views (every streamed block binds there until it runs); a
    block's views into another slot are made when it first lands there, in the pass,
    which may run in inference mode: they must be ordinary parameters all the same."""
    pipe, layout, module, reference = streamed_and_reference(six_block_folder, 2)
    slots = pipe.policy.streaming.streamers["transformer"]._armed.slots
    assert len(slots) >= 2
    assert set(slots[0].bound) == set(layout.streamed)
    assert all(not slot.bound for slot in slots[1:])
    with torch.inference_mode():
        assert torch.equal(module(**inputs(0))[0], reference(**inputs(0))[0])
    assert any(slot.bound for slot in slots[1:])
    made = {id(view) for slot in slots for views in slot.bound.values() for view in views}
    for block in layout.streamed:
        assert not any(tensor.is_inference() for tensor in module.blocks[block].parameters())
    with torch.inference_mode():
        module(**inputs(1))
    again = {id(view) for slot in slots for views in slot.bound.values() for view in views}
    assert again == made  # made once per block and slot
    # Outside inference mode, with autograd on, the same module computes as before.
    assert torch.equal(module(**inputs(2))[0].detach(), reference(**inputs(2))[0].detach())
    pipe.release_all()


def test_released_streamed_tensors_are_meta_placeholders_made_once(six_block_folder):
    pipe, layout, module, _ = streamed_and_reference(six_block_folder, 2)
    block = layout.streamed[0]
    weights = [name for name, _ in module.blocks[block].named_parameters()]
    pipe.release_all()
    first = dict(module.blocks[block].named_parameters())
    assert all(tensor.is_meta for tensor in first.values())
    second_module = pipe.components["transformer"].materialize()
    assert second_module is not module
    pipe.release_all()
    second = dict(second_module.blocks[block].named_parameters())
    assert list(second) == weights
    assert all(second[name] is first[name] for name in weights)  # shared, nothing held


def released_with_copies_in_flight(folder, **options):
    """A pass of a streamed transformer, then its release, with late copies: the pass's
    last blocks leave the next pass's first copies queued."""
    pipe = streaming(folder, resident=2, **options)
    pipe.policy.streaming.apply(pipe, pipe.plan())
    module = pipe.components["transformer"].materialize()
    blocks = pipe.policy.streaming.streamers["transformer"]
    copies = blocks._armed.copies
    with torch.no_grad():
        module(**inputs(0))
    assert copies.queue, "the pass left no copy in flight: nothing below is tested"
    pipe.release_all()
    return blocks, copies


def test_a_release_does_not_wait_for_the_copies_it_leaves_in_flight(six_block_folder, late_copies):
    """The host goes on to queue the next stage's work while the device finishes this
    one's: the device orders the slots' next use after the copies instead."""
    blocks, copies = released_with_copies_in_flight(six_block_folder)
    assert copies.queue
    assert not blocks.armed


def test_host_copies_are_freed_or_changed_only_after_the_copies_reading_them(
    six_block_folder, late_copies
):
    blocks, copies = released_with_copies_in_flight(six_block_folder)
    assert blocks.drop_host_copies() > 0
    assert not copies.queue
    blocks, copies = released_with_copies_in_flight(six_block_folder)
    blocks.use_layout(blocks.layout)
    assert not copies.queue
    blocks, copies = released_with_copies_in_flight(six_block_folder, keep_host_copies=False)
    assert not copies.queue  # the release freed the host copies: it waited for them first
