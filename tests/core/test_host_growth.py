"""The host plan keeps a reserve for the process's growth during a run: measured by the
host watch once a run has been watched (its peak less the process at its start, the host
memory ondeck counts on its own aside), estimated from the run's output before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ondeck
from ondeck.host_pool import OUTPUT_HOST_COPIES, output_host_bytes
from ondeck.host_watch import HostMemoryError, HostWatch

from .test_host_memory import Encode

MiB = 2**20
GROWN = 256 * MiB  # what a run of the pipeline below holds on the host at its end


class Grow(Encode):
    """Holds ``GROWN`` bytes of host memory in the state: a run's decoded frames."""

    def forward(self, state):
        state = super().forward(state)
        state["frames"] = np.ones(GROWN, dtype=np.uint8)  # touched: resident
        return state


class Pass(ondeck.Stage):
    def forward(self, state):
        return state


class Growing(ondeck.Pipeline):
    lazy_components = ("encoder",)
    output = 0  # the output's host bytes this pipeline says a run makes

    def create_stages(self):
        return [Grow(self.components["encoder"]), Pass()]

    def output_host_bytes(self) -> int:
        return self.output


def growing(host_memory="4096GiB") -> Growing:
    return Growing(
        {"encoder": lambda: torch.nn.Linear(4, 4)}, policy="release", host_memory=host_memory
    )


def test_the_measured_growth_of_a_run_is_what_the_next_plan_reserves():
    pipe = growing()
    before = pipe.plan().host
    assert before.growth_bytes == 0 and before.growth_source.startswith("estimated")
    pipe({})
    measured = pipe.report()["host_growth_bytes"]
    assert GROWN <= measured < 2 * GROWN
    after = pipe.plan().host
    assert after.growth_bytes == measured
    assert after.growth_source.startswith("measured")
    assert after.peak_bytes == (
        after.process_bytes + measured + after.pinned_bytes + after.ring_bytes + after.cache_bytes
    )
    assert "its growth during a run" in str(pipe.plan())


def test_without_the_reserve_the_plan_would_fit_a_run_that_outgrows_the_budget():
    pipe = growing()
    pipe({})  # measures the growth; its frames are freed with the state
    plan = pipe.plan().host
    # A budget that holds everything the plan counts but half the run's growth.
    counted = plan.pinned_bytes + plan.ring_bytes + plan.cache_bytes
    pipe.host_memory = plan.process_bytes + counted + GROWN // 2
    plan = pipe.plan().host
    assert plan.peak_bytes - plan.growth_bytes <= plan.budget_bytes
    assert not plan.fits(), "the reserve is counted: the plan is over its host budget"
    assert "host: over by" in str(pipe.plan())
    with pytest.raises(HostMemoryError, match="more than its host budget"):
        pipe({})  # and the run says it was right
    assert not ondeck.is_loaded(pipe.components["encoder"])


def test_a_larger_output_than_the_measured_runs_adds_the_difference():
    pipe = growing()
    pipe.output = 10 * MiB
    estimated = pipe.plan().host
    assert estimated.growth_bytes == 10 * MiB
    assert "the decoded output 10.00 MiB" in estimated.growth_source
    pipe({})
    measured = pipe.report()["host_growth_bytes"]
    pipe.output = 30 * MiB
    grown = pipe.plan().host
    assert grown.growth_bytes == measured + 20 * MiB
    assert "20.00 MiB more output" in grown.growth_source


def test_a_decoded_output_is_estimated_as_float32_rgb_copies():
    assert output_host_bytes(480, 832, 81) == OUTPUT_HOST_COPIES * 4 * 3 * 81 * 480 * 832
    assert output_host_bytes(1024, 1024, batch=2) == OUTPUT_HOST_COPIES * 4 * 3 * 2 * 1024**2


def test_the_watch_counts_what_ondeck_holds_apart_from_the_processs_growth():
    readings = iter([100, 180, 260, 150])  # start, a ring allocated, growth, the end
    counted = iter([0, 0, 80, 80, 80, 80, 80, 80])  # read on both sides of each reading
    watch = HostWatch(10**6, lambda: 0, rss=lambda: next(readings), counted=lambda: next(counted))
    watch.sample()
    watch.sample()
    assert watch.growth_bytes == 0, "the ring is ondeck's, counted by the plan on its own"
    watch.sample()
    watch.read()
    assert watch.peak_bytes == 260 and watch.growth_bytes == 80
