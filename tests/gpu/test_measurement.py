"""What a run leaves of the caller's own CUDA memory figures, and what it measures."""

from __future__ import annotations

import pytest
import torch

import ondeck
from ondeck.pipelines.wan import WanTextToVideo

from .conftest import settle
from .test_thread_devices import Apply

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=2)
CALLERS_PEAK_BYTES = 512 * 2**20  # far above anything the tiny pipeline allocates


def wan(folder, **options) -> WanTextToVideo:
    return WanTextToVideo.from_folder(
        folder, policy="release", device="cuda", dtype=torch.float32, progress=False, **options
    )


def callers_own_peak() -> int:
    """The caller's work before the run: a peak well above what the run will reach."""
    settle()
    scratch = torch.empty(CALLERS_PEAK_BYTES, dtype=torch.uint8, device="cuda")
    del scratch
    return torch.cuda.max_memory_allocated()


def test_a_run_leaves_the_callers_peak_figure_alone(tiny_folder, monkeypatch):
    monkeypatch.delenv("ONDECK_RESET_PEAKS", raising=False)
    pipe = wan(tiny_folder)
    before = callers_own_peak()

    pipe.generate("a fox", seed=0, **SHAPE)
    torch.cuda.synchronize()

    assert torch.cuda.max_memory_allocated() >= before
    assert pipe.tracker.peak_measured_bytes >= before


def test_reset_peaks_measures_each_stage_at_the_cost_of_the_callers_figure(tiny_folder):
    pipe = wan(tiny_folder)
    pipe.tracker.reset_peaks = True
    before = callers_own_peak()

    pipe.generate("a fox", seed=0, **SHAPE)
    torch.cuda.synchronize()

    assert torch.cuda.max_memory_allocated() < before, "what README says the caller loses"
    assert pipe.tracker.peak_measured_bytes >= before, "the tracker kept it"
    records = [s for s in pipe.tracker.stages if s.run == pipe.tracker.runs]
    assert records and all(s.activation_bytes is not None for s in records)


def test_a_stage_that_raises_the_device_peak_is_measured_without_resets(tiny_folder, monkeypatch):
    monkeypatch.delenv("ONDECK_RESET_PEAKS", raising=False)
    pipe = wan(tiny_folder)
    settle()
    torch.cuda.reset_peak_memory_stats()  # the caller's choice: the run starts the figure

    pipe.generate("a fox", seed=0, **SHAPE)
    torch.cuda.synchronize()

    encode = pipe.tracker.stages[0]  # the first stage after the reset starts at the peak
    assert encode.stage == pipe.stages[0].name
    assert encode.peak_measured_bytes >= pipe.component_bytes()["text_encoder"]
    measured = [s.peak_measured_bytes for s in pipe.tracker.stages if s.peak_measured_bytes]
    assert max(measured) <= torch.cuda.max_memory_allocated()


class _Busy(torch.nn.Module):
    """Keeps the device busy for ``cycles`` clock cycles a call; the host returns at once."""

    def __init__(self, cycles: int):
        super().__init__()
        self.cycles = cycles
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return x * self.weight


class _TwoStages(ondeck.Pipeline):
    lazy_components = ("busy", "quick")

    def create_stages(self):
        return [Apply(self.components["busy"], "Busy"), Apply(self.components["quick"], "Quick")]


def test_each_components_calls_are_timed_on_the_device():
    """A call through a component is timed by events on the pipeline device's stream: a
    component that keeps the device busy has that time as its quickest call, though the
    host returns from it at once; one that does little has far less."""
    from .conftest import BUSY_CYCLES

    loaders = {
        "busy": lambda: _Busy(BUSY_CYCLES).cuda(),
        "quick": lambda: _Busy(0).cuda(),
    }
    pipe = _TwoStages(loaders, policy="release", device="cuda")
    assert pipe.tracker.call_timer is not None
    for _ in range(2):
        pipe({"x": torch.ones(4, device="cuda")})
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(BUSY_CYCLES)
    end.record()
    end.synchronize()
    busy = start.elapsed_time(end) / 1000
    timed = pipe.tracker.seconds_per_call
    assert set(timed) == {"busy", "quick"}
    assert timed["busy"] >= 0.8 * busy
    assert timed["quick"] < 0.2 * busy
