"""A pipelined load of the six-block transformer, watched and held from a test."""

from __future__ import annotations

import threading

import torch

from ondeck.loading import reads


def inputs():
    generator = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, generator=generator),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=generator),
        return_dict=False,
    )


def forward(module):
    with torch.no_grad():
        return module(**inputs())[0]


class GatedReads:
    """Holds the reads of chosen groups (by their first tensor's block) until opened.
    On the CPU a pipelined load reads its groups one read each (``read_in_groups``)."""

    def __init__(self, monkeypatch, gated_blocks=(), fail_block=None):
        self.gates = {block: threading.Event() for block in gated_blocks}
        self.fail_block = fail_block
        self.read_blocks: list[int | None] = []
        original = reads.read_into

        def read(jobs, **options):
            block = _block_of(jobs[0].info.name)
            self.read_blocks.append(block)
            gate = self.gates.get(block)
            if gate is not None:
                assert gate.wait(30), "the test never opened a gate"
            if block is not None and block == self.fail_block:
                raise OSError("the disk went away")
            return original(jobs, **options)

        monkeypatch.setattr(reads, "read_into", read)

    def open(self, block):
        self.gates[block].set()

    def open_all(self):
        for gate in self.gates.values():
            gate.set()


def _block_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" and parts[1].isdigit() else None


def forward_in_background(module) -> tuple[list[int], dict, threading.Thread]:
    """A forward of ``module`` on a started thread: the blocks it ran, in order, and its
    output under ``"out"`` once it returns."""
    ran: list[int] = []
    for number, block in enumerate(module.blocks):
        block.register_forward_hook(lambda *_, number=number: ran.append(number))
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", forward(module)))
    worker.start()
    return ran, result, worker


def wait_until(condition, seconds: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition never held")
