"""Host memory: the budget from the machine and its cgroup, the plan's host pool, and
the watch that drops the host cache before it fails a run."""

from __future__ import annotations

import pytest
import torch

import ondeck
from ondeck.host_watch import HostMemoryError, HostWatch
from ondeck.memory import HOST_RESERVE_MIN_BYTES, cgroup_memory, host_facts

GiB = 2**30


def test_a_cgroup_v2_limit_is_read(tmp_path):
    (tmp_path / "self").write_text("0::/jobs/one\n")
    folder = tmp_path / "root" / "jobs" / "one"
    folder.mkdir(parents=True)
    (folder / "memory.max").write_text(f"{16 * GiB}\n")
    (folder / "memory.current").write_text(f"{2 * GiB}\n")
    assert cgroup_memory(tmp_path / "root", tmp_path / "self") == (16 * GiB, 2 * GiB)
    (folder / "memory.max").write_text("max\n")
    assert cgroup_memory(tmp_path / "root", tmp_path / "self") is None


def test_a_cgroup_v1_limit_is_read_and_its_unlimited_value_is_none(tmp_path):
    (tmp_path / "self").write_text("4:cpu,cpuacct:/a\n3:memory:/jobs/one\n")
    folder = tmp_path / "root" / "memory" / "jobs" / "one"
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(f"{32 * GiB}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{3 * GiB}\n")
    assert cgroup_memory(tmp_path / "root", tmp_path / "self") == (32 * GiB, 3 * GiB)
    (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory(tmp_path / "root", tmp_path / "self") is None


def test_the_host_budget_is_the_tighter_of_the_machine_and_the_cgroup():
    machine = host_facts(available_bytes=100 * GiB, process_bytes=2 * GiB, cgroup=None)
    assert machine.source == "available memory"
    assert machine.budget_bytes == 102 * GiB - int(0.10 * 102 * GiB)
    limited = host_facts(
        available_bytes=100 * GiB, process_bytes=2 * GiB, cgroup=(16 * GiB, 6 * GiB)
    )
    assert limited.source == "the cgroup's memory limit"
    assert limited.budget_bytes == 12 * GiB - int(0.10 * 12 * GiB)
    tight = host_facts(available_bytes=GiB, process_bytes=GiB, cgroup=None)
    assert tight.budget_bytes == 2 * GiB - HOST_RESERVE_MIN_BYTES  # 10% is less than 1 GiB


class Encode(ondeck.Stage):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, state):
        state["x"] = self.encoder(torch.ones(1, 4))
        return state


class OneStage(ondeck.Pipeline):
    lazy_components = ("encoder",)

    def create_stages(self):
        return [Encode(self.components["encoder"])]


def test_the_plan_shows_the_host_pool_against_its_budget():
    pipe = OneStage(
        {"encoder": lambda: torch.nn.Linear(4, 4)}, policy="release", host_memory="64GiB"
    )
    text = str(pipe.plan())
    assert "host:" in text and "of a budget of 64.00 GiB (given)" in text
    small = OneStage({"encoder": lambda: torch.nn.Linear(4, 4)}, policy="release", host_memory=1)
    assert "host: over by" in str(small.plan())


def test_the_watch_drops_the_cache_first_and_fails_only_when_that_is_not_enough():
    readings = iter([10, 97, 80])  # start, over the pressure mark, relieved
    relieved = []
    watch = HostWatch(100, lambda: relieved.append(1) or 17, rss=lambda: next(readings))
    watch.sample()
    watch.sample()
    assert relieved == [1] and watch.exceeded is None
    watch.check()  # under the budget after relieving: the run goes on

    readings = iter([99, 120, 120])  # a run that starts near its budget is as planned
    watch = HostWatch(100, lambda: relieved.append(2) or 0, rss=lambda: next(readings))
    watch.sample()
    assert relieved[-1] == 1
    watch.sample()
    assert relieved[-1] == 2 and watch.exceeded == 120
    with pytest.raises(HostMemoryError, match="more than its host budget"):
        watch.check()


def test_near_its_budget_the_watch_drops_nothing_while_the_growth_is_within_the_reserve():
    readings = iter([90, 98, 99, 99])  # a plan that fills its budget, the reserve included
    relieved = []
    watch = HostWatch(100, lambda: relieved.append(1) or 0, rss=lambda: next(readings))
    watch.reserve_bytes = 8
    watch.sample()
    watch.sample()
    assert relieved == [] and watch.growth_bytes == 8
    watch.sample()  # grown past the reserve: what it holds for speed goes
    assert relieved == [1] and watch.exceeded is None


def test_a_run_over_its_host_budget_stops_between_stages():
    pipe = OneStage(
        {"encoder": lambda: torch.nn.Linear(4, 4)}, policy="release", host_memory="1GiB"
    )
    pipe.host_watch = HostWatch(GiB, pipe.relieve_host_memory, rss=lambda: 10 * GiB)
    with pytest.raises(HostMemoryError):
        pipe({})
    assert not ondeck.is_loaded(pipe.components["encoder"]), "nothing left resident"
    assert pipe.report()["host_peak_bytes"] == 10 * GiB
