"""Threads the executor starts load onto the pipeline's GPU, not the first one.

A new thread's current CUDA device is device 0 whatever its starter set; anything a
loader builds on "the current device" (FSDP2 shards there) would land on the wrong GPU
of a rank whose pipeline lives on another."""

from __future__ import annotations

import threading

import pytest
import torch

import ondeck
from ondeck.policy import BudgetPolicy, ReleasePolicy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


class Apply(ondeck.Stage):
    def __init__(self, component, name: str):
        super().__init__()
        self.component = component
        self.name = name

    def forward(self, state):
        state["x"] = self.component(state["x"])
        return state


class ThreeStages(ondeck.Pipeline):
    lazy_components = ("encoder", "denoiser", "decoder")

    def create_stages(self):
        c = self.components
        return [Apply(c["encoder"], "E"), Apply(c["denoiser"], "D"), Apply(c["decoder"], "V")]


def recording_loader(seen: list):
    def load() -> torch.nn.Module:
        seen.append((threading.current_thread().name, torch.cuda.current_device()))
        torch.manual_seed(0)
        return torch.nn.Linear(32, 32).to("cuda")  # the current device, as FSDP2 uses

    return load


# Declared sizes (what plans count), by component.
SIZES = {
    # A budget that holds two of the three beside the measured activations (the CUDA
    # libraries' workspaces, some 33 MiB): each run reloads, the next stage's ahead on
    # the prefetch thread.
    "budget": {"encoder": 2**28, "denoiser": 2**28, "decoder": 2**28},
    # The encoder fits beside the decoder under the denoiser's peak: from run 2 on, the
    # last stage loads it for the next run on the next-run thread.
    "release": {"encoder": 2**20, "denoiser": 2**28, "decoder": 2**20},
}
THREAD = {"budget": "ondeck-prefetch", "release": "ondeck-next-run"}


@pytest.mark.parametrize("kind", ["budget", "release"])
def test_loads_on_executor_threads_use_the_pipelines_device(kind):
    policy = BudgetPolicy(11 * 2**26, prefetch=True) if kind == "budget" else ReleasePolicy()
    seen: list = []
    components = {
        name: ondeck.LazyModule(
            name,
            recording_loader(seen),
            spec=ondeck.ComponentSpec(cls=torch.nn.Linear, nbytes=SIZES[kind][name]),
        )
        for name in ThreeStages.lazy_components
    }
    # As a rank of torchrun does: its GPU made current on the main thread only.
    torch.cuda.set_device(1)
    try:
        pipe = ThreeStages(components, policy=policy)
        pipe.tracker.reset_peaks = True  # every stage measured: release needs them all
        assert pipe.device == torch.device("cuda", 1)
        for _ in range(3):
            out = pipe({"x": torch.ones(2, 32, device="cuda:1")})["x"]
            assert out.device == torch.device("cuda", 1), out.device
        pipe.close()
    finally:
        torch.cuda.set_device(0)
    threads = {name for name, _ in seen}
    assert any(name.startswith(THREAD[kind]) for name in threads), threads
    assert {device for _, device in seen} == {1}, seen


def test_a_pipelined_fill_works_on_the_callers_gpu_when_cuda_is_unnumbered(tmp_path):
    from ondeck.embedded import build_wan_folder
    from ondeck.loading import ComponentLoader

    folder = build_wan_folder(tmp_path / "wan", preset="tiny")
    torch.cuda.set_device(1)
    try:
        loader = ComponentLoader(folder, "transformer", device="cuda", pipelined=True)
        module, filling = loader.begin()
        assert filling is not None and filling.device == torch.device("cuda", 1)
        filling.wait()
        assert {p.device for p in module.parameters()} == {torch.device("cuda", 1)}
    finally:
        torch.cuda.set_device(0)
