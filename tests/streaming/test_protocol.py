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
