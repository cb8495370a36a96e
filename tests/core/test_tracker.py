"""What the memory tracker measures on a CUDA device, and what it leaves to the caller.

torch's CUDA memory statistics are replaced by a fake allocator that keeps the same
figures (bytes allocated now, peak since the last reset), so these run without a GPU.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from ondeck.tracker import CallTimer, MemoryTracker

from .helpers import ClockEvent

GiB = 2**30


class FakeAllocator:
    """torch.cuda's allocated and peak statistics, driven by hand."""

    def __init__(self):
        self.allocated = 0
        self.peak = 0
        self.resets = 0
        self.retries = 0  # times it freed its cache and tried again
        self.ooms = 0  # of those, the ones that still found no room

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak = self.allocated

    def memory_stats(self, device=None) -> dict:
        return {"num_alloc_retries": self.retries, "num_ooms": self.ooms}


@pytest.fixture
def cuda(monkeypatch) -> FakeAllocator:
    fake = FakeAllocator()
    for name in (
        "memory_allocated",
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "memory_stats",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def stage(tracker: MemoryTracker, cuda: FakeAllocator, name: str, weights: int, scratch: int):
    """A stage that loads ``weights`` before its compute, which then needs ``scratch``."""
    tracker.stage_started(name)
    cuda.allocate(weights)
    tracker.loaded(name, weights, 0.1)
    tracker.compute_started()
    cuda.allocate(scratch)
    cuda.free(scratch)
    record = tracker.stage_finished(name)
    cuda.free(weights)
    tracker.released(name, weights)
    return record


def test_weights_still_arriving_from_a_prefetch_are_not_activations(cuda):
    def activation(loading_bytes: int) -> int | None:
        """A stage with 2 GiB resident whose device peak reached 10 GiB."""
        torch.cuda.reset_peak_memory_stats()  # as the caller may, between the two
        tracker = MemoryTracker(device="cuda:0")
        tracker.run_started()
        cuda.allocate(2 * GiB)
        tracker.loaded("text_encoder", 2 * GiB, 0.1)
        tracker.stage_started("PrepareLatents")
        tracker.compute_started()
        cuda.allocate(8 * GiB)
        record = tracker.stage_finished("PrepareLatents", loading_bytes)
        cuda.free(10 * GiB)
        return record.activation_bytes

    # 6 GiB of a component loading in the background when the stage ended.
    assert activation(6 * GiB) == 2 * GiB
    assert activation(0) == 8 * GiB


def test_the_callers_peak_survives_a_run(cuda):
    cuda.allocate(30 * GiB)  # the caller's own work, before the pipeline runs
    cuda.free(30 * GiB)
    tracker = MemoryTracker(device="cuda:0")
    assert tracker.reset_peaks is False

    tracker.run_started()
    stage(tracker, cuda, "Encode", 4 * GiB, 1 * GiB)
    stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB)

    assert cuda.resets == 0
    assert torch.cuda.max_memory_allocated() == 30 * GiB
    assert tracker.peak_measured_bytes == 30 * GiB


def test_stages_that_raise_the_peak_are_measured_exactly_and_the_others_not_at_all(cuda):
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    records = [
        stage(tracker, cuda, "Encode", 4 * GiB, 1 * GiB),  # peak 5 GiB, a new high
        stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB),  # peak 10 GiB, a new high
        stage(tracker, cuda, "Decode", 1 * GiB, 3 * GiB),  # peak 4 GiB, under 10
    ]

    assert [r.peak_measured_bytes for r in records] == [5 * GiB, 10 * GiB, None]
    assert [r.activation_bytes for r in records] == [1 * GiB, 2 * GiB, None]
    assert tracker.run_peak_measured_bytes(1) == 10 * GiB


def test_a_stage_under_an_earlier_peak_is_bounded_by_it(cuda):
    """Its activations cannot have gone past the earlier peak less the fewest weights
    resident while it computed; the least bound over the runs is kept, and a stage
    measured exactly gets none."""
    tracker = MemoryTracker(device="cuda:0")
    encodes = []
    for run in range(2):
        tracker.run_started()
        encodes.append(stage(tracker, cuda, "Encode", 4 * GiB, 1 * GiB))
        denoise = stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB)  # the peak: 10 GiB
        decode = stage(tracker, cuda, "Decode", (1 + run) * GiB, 3 * GiB)
        assert decode.activation_bytes is None
        assert decode.activation_bound_bytes == (9 - run) * GiB
        for record in (encodes[-1], denoise, decode):  # as the pipeline keeps completed ones
            tracker.keep_bound(record)
    # The first run's encode raised the peak; the second stayed under the denoise's.
    assert [e.activation_bound_bytes for e in encodes] == [None, 6 * GiB]
    # The second denoise came back to the peak without raising it: bounded, tightly.
    assert denoise.activation_bound_bytes == 2 * GiB
    assert tracker.activation_bounds == {"Encode": 6 * GiB, "Denoise": 2 * GiB, "Decode": 8 * GiB}


def test_a_bound_counts_only_the_weights_left_after_a_release(cuda):
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB)  # the peak: 10 GiB
    tracker.stage_started("Decode")
    cuda.allocate(3 * GiB)
    tracker.loaded("vae", GiB, 0.1)
    tracker.loaded("transformer", 2 * GiB, 0.1)
    tracker.compute_started()
    cuda.free(2 * GiB)
    tracker.released("transformer", 2 * GiB)  # its bytes may go to activations now
    cuda.allocate(4 * GiB)
    cuda.free(4 * GiB)
    record = tracker.stage_finished("Decode")
    assert record.activation_bound_bytes == 9 * GiB


def test_a_turn_without_a_compute_mark_is_bounded_from_its_first_call(cuda):
    """A diffusers turn loads its component inside the stage and marks no compute: the
    weights in place at its first call are what its activations come on top of."""
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB)  # the peak: 10 GiB
    tracker.stage_started("transformer")
    cuda.allocate(7 * GiB)
    tracker.loaded("transformer", 7 * GiB, 0.1)
    tracker.called("transformer")
    cuda.allocate(GiB)
    cuda.free(GiB)
    assert tracker.stage_finished("transformer").activation_bound_bytes == 3 * GiB
    tracker.stage_started("vae")  # nothing called: no bound
    assert tracker.stage_finished("vae").activation_bound_bytes is None


def test_no_bound_is_kept_from_a_stage_that_ran_out_of_memory(cuda):
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB)  # the peak: 10 GiB
    record = stage(tracker, cuda, "Decode", GiB, 3 * GiB)
    tracker.keep_bound(dataclasses.replace(record, allocator_ooms=1))
    assert tracker.activation_bounds == {}
    tracker.keep_bound(record)
    assert tracker.activation_bounds == {"Decode": 9 * GiB}


def test_a_stage_that_begins_at_the_peak_is_measured(cuda):
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    cuda.allocate(6 * GiB)  # the peak so far is what is allocated now
    record = stage(tracker, cuda, "Encode", 0, 0)
    assert record.peak_measured_bytes == 6 * GiB


def test_reset_peaks_measures_every_stage_and_costs_the_callers_figure(cuda):
    cuda.allocate(30 * GiB)
    cuda.free(30 * GiB)
    tracker = MemoryTracker(device="cuda:0", reset_peaks=True)
    tracker.run_started()
    records = [
        stage(tracker, cuda, "Denoise", 8 * GiB, 2 * GiB),
        stage(tracker, cuda, "Decode", 1 * GiB, 3 * GiB),
    ]

    assert [r.activation_bytes for r in records] == [2 * GiB, 3 * GiB]
    assert tracker.peak_measured_bytes == 30 * GiB, "the tracker itself keeps the old peak"
    assert torch.cuda.max_memory_allocated() == 4 * GiB, "what the caller reads: lowered"


def test_reset_peaks_follows_the_environment(monkeypatch):
    monkeypatch.setenv("ONDECK_RESET_PEAKS", "1")
    assert MemoryTracker(device="cuda:0").reset_peaks is True
    monkeypatch.setenv("ONDECK_RESET_PEAKS", "0")
    assert MemoryTracker(device="cuda:0").reset_peaks is False
    monkeypatch.delenv("ONDECK_RESET_PEAKS")
    assert MemoryTracker(device="cuda:0").reset_peaks is False


def test_nothing_is_read_from_cuda_for_a_cpu_device(cuda, monkeypatch):
    def refuse(device=None):
        raise AssertionError("CUDA statistics read for a CPU tracker")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", refuse)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse)
    monkeypatch.setattr(torch.cuda, "memory_stats", refuse)
    tracker = MemoryTracker(device="cpu", reset_peaks=True)
    tracker.run_started()
    record = stage(tracker, cuda, "Encode", GiB, GiB)
    assert (record.peak_measured_bytes, record.activation_bytes) == (None, None)
    assert record.allocator_retries is None


def test_each_stage_counts_the_allocator_retries_made_while_it_ran(cuda):
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    cuda.retries = 40  # before the run: not any stage's
    tracker.stage_started("Denoise")
    cuda.retries += 3
    cuda.ooms += 1
    record = tracker.stage_finished("Denoise")
    assert (record.allocator_retries, record.allocator_ooms) == (3, 1)
    assert stage(tracker, cuda, "Decode", GiB, GiB).allocator_retries == 0


def test_retries_not_counted_at_the_stage_start_are_unknown_not_a_total(cuda, monkeypatch):
    tracker = MemoryTracker(device="cuda:0")
    tracker.run_started()
    cuda.retries = 40

    def unavailable(device=None):
        raise RuntimeError("no statistics")

    monkeypatch.setattr(torch.cuda, "memory_stats", unavailable)
    tracker.stage_started("Denoise")
    monkeypatch.setattr(torch.cuda, "memory_stats", cuda.memory_stats)
    assert tracker.stage_finished("Denoise").allocator_retries is None


def test_a_run_keeps_each_components_quickest_call_and_each_loads_rate():
    """Every call through a component's proxy is timed; after the run each component
    has its quickest call, and each component loaded its load's rate. A run that fails
    keeps the figures of the last one that completed."""
    from .helpers import Apply, ThreeStages, state, three_loaders

    class SlowOnce(torch.nn.Module):  # its second call also waits 50 ms, as for weights
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.fail = False

        def forward(self, x):
            if self.fail:
                raise RuntimeError("the denoiser failed")
            self.calls += 1
            time.sleep(0.05 if self.calls == 2 else 0.002)
            return x

    class TwiceDenoised(ThreeStages):
        def create_stages(self):
            stages = super().create_stages()
            return [stages[0], stages[1], Apply(self.components["denoiser"], "Again"), stages[2]]

    loaders = three_loaders()
    slow = SlowOnce()
    loaders["denoiser"] = lambda: slow
    pipe = TwiceDenoised(loaders, policy="budget", budget="1GiB")
    assert pipe.tracker.call_timer is None, "off CUDA nothing times the calls"
    pipe.tracker.call_timer = CallTimer(ClockEvent)
    pipe(state())
    timed = pipe.tracker.seconds_per_call
    assert set(timed) == {"encoder", "denoiser", "decoder"}
    assert 0.002 <= timed["denoiser"] < 0.04, "the quickest of its two calls"
    assert pipe.snapshot().seconds_per_call == timed
    rates = pipe.tracker.load_bytes_per_second
    assert set(rates) == {"encoder", "decoder"}  # the denoiser's loader reports no bytes
    assert all(rate > 0 for rate in rates.values())
    assert pipe.report()["seconds_per_call"] == timed
    slow.fail = True
    with pytest.raises(RuntimeError, match="the denoiser failed"):
        pipe(state())
    assert pipe.tracker.seconds_per_call == timed


def test_a_timer_pairs_each_return_with_its_call_and_forgets_on_clear():
    timer = CallTimer(ClockEvent)
    timer.started("a")
    timer.started("b")
    timer.ended("b")
    timer.ended("c")  # never started: nothing to pair
    assert set(timer.quickest()) == {"b"}  # "a" never returned
    timer.clear()
    assert timer.quickest() == {}


def test_a_timer_leaves_out_of_a_call_only_the_waits_inside_it():
    timer = CallTimer(ClockEvent)
    before = timer.mark()
    time.sleep(0.02)
    timer.stalled("a", before)  # no call of "a" open: counts nowhere
    timer.started("a")
    time.sleep(0.01)
    waiting = timer.mark()
    time.sleep(0.05)
    timer.stalled("a", waiting)
    timer.stalled("b", timer.mark())  # another component's wait: not "a"'s
    timer.ended("a")
    assert 0.005 < timer.quickest()["a"] < 0.04


def test_a_component_a_run_did_not_call_keeps_its_calls_and_its_time():
    """An encoder whose answers were all kept is not called in that run: its figures
    stay, so the next plan (the next prompt calls it again) does not drop it."""
    tracker = MemoryTracker(device="cpu")
    tracker.call_timer = CallTimer(ClockEvent)
    for calls in (["encoder", "encoder", "denoiser"], ["denoiser", "denoiser"]):
        tracker.run_started()
        for name in calls:
            tracker.called(name)
            tracker.returned(name)
        tracker.run_finished()
    assert tracker.calls_per_run == {"encoder": 2, "denoiser": 2}
    assert set(tracker.seconds_per_call) == {"encoder", "denoiser"}


def test_a_reload_rate_leaves_out_what_only_a_first_load_under_a_plan_does():
    """A load that also page-locked and filled its streamed blocks' host copies: the
    rate a reload reaches counts its device bytes over the rest of its seconds."""
    tracker = MemoryTracker()
    tracker.run_started()
    tracker.loaded("encoder", 4_000, 2.0, setup_seconds=1.5)  # 1.5 s of host copies
    tracker.loaded("vae", 1_000, 0.5)
    tracker.loaded("denoiser", 8_000, 0.1, setup_seconds=0.0)
    tracker.filled("denoiser", 1.0, setup_seconds=0.2)  # a pipelined load ends at its fill
    tracker.run_finished()
    assert tracker.reload_bytes_per_second == pytest.approx(
        {"encoder": 4_000 / 0.5, "vae": 1_000 / 0.5, "denoiser": 8_000 / 0.8}
    )
    # What the plan weighs staying against: the loads as they went.
    assert tracker.load_bytes_per_second == pytest.approx(
        {"encoder": 4_000 / 2.0, "vae": 1_000 / 0.5, "denoiser": 8_000 / 1.0}
    )
    tracker.run_started()
    tracker.loaded("encoder", 4_000, 0.5)  # the reload: host copies held already
    tracker.loaded("vae", 1_000, 0.25, setup_seconds=0.5)  # more than it took: ignored
    tracker.run_finished()
    assert tracker.reload_bytes_per_second["encoder"] == pytest.approx(8_000)
    assert tracker.reload_bytes_per_second["vae"] == pytest.approx(4_000)


def test_load_rates_price_reloading_once_a_later_run_has_loaded_the_component():
    """A process's first run reads files for the first time and page-locks beside its
    loads: its rates stay out of ``later_load_bytes_per_second``, also for a component
    the second run did not load (its rate is still the first run's)."""
    tracker = MemoryTracker(device="cpu")
    tracker.run_started()
    tracker.loaded("text_encoder", GiB, 1.0)
    tracker.loaded("transformer", 2 * GiB, 1.0)
    tracker.run_finished()
    assert tracker.load_bytes_per_second == {"text_encoder": GiB, "transformer": 2 * GiB}
    assert tracker.later_load_bytes_per_second == {}
    tracker.run_started()
    tracker.loaded("transformer", 2 * GiB, 0.5)  # the text encoder stayed resident
    tracker.run_finished()
    assert tracker.later_load_bytes_per_second == {"transformer": 4 * GiB}
    tracker.run_started()
    tracker.loaded("text_encoder", GiB, 0.25)
    tracker.run_finished()
    assert tracker.later_load_bytes_per_second == {"text_encoder": 4 * GiB, "transformer": 4 * GiB}


def test_the_reports_totals_cover_every_run_and_its_timeline_the_last_ones(monkeypatch):
    """``keep_runs`` trims the timeline, not the totals: the seconds computing waited
    for loads and the peak measured at an event stay the whole process's figures."""
    tracker = MemoryTracker(device="cpu", keep_runs=1)
    measured = lambda device: 5 * GiB if tracker.runs == 1 else 1 * GiB  # noqa: E731
    monkeypatch.setattr("ondeck.tracker.measured_device_bytes", measured)
    for _ in range(3):
        tracker.run_started()
        tracker.stage_started("Denoise")
        tracker.waited("transformer", 0.25)
        tracker.stage_finished("Denoise")
        tracker.run_finished()

    report = tracker.to_dict()
    assert [s["run"] for s in report["stages"]] == [3], "the timeline keeps the last run"
    assert report["exposed_load_seconds"] == pytest.approx(0.75)
    assert report["peak_measured_bytes"] == 5 * GiB
    assert report["runs"] == 3
