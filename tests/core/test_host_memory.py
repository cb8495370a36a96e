"""Host memory: the budget from the machine and its cgroup, the plan's host pool, and
the watch that drops the host cache before it fails a run."""

from __future__ import annotations

import functools

import psutil
import pytest
import torch

import ondeck
from ondeck import memory
from ondeck.host_watch import HostMemoryError, HostWatch
from ondeck.loading.host_cache import HostCache
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

    readings = iter([99, 120, 120, 120])  # a run that starts near its budget is as planned
    watch = HostWatch(100, lambda: relieved.append(2) or 0, rss=lambda: next(readings))
    watch.sample()
    assert relieved[-1] == 1
    watch.sample()
    assert relieved[-1] == 2 and watch.exceeded == 120
    with pytest.raises(HostMemoryError, match="more than its host budget"):
        watch.check()


def test_an_excess_gone_by_the_check_does_not_stop_the_run():
    """A sample over the budget after relief, then the buffer is freed: the check reads
    the process again and the run goes on; an excess that comes back stops it."""
    readings = iter([99, 120, 120, 90, 130, 130, 130])
    watch = HostWatch(100, lambda: 0, rss=lambda: next(readings))
    watch.sample()
    watch.sample()
    assert watch.exceeded == 120
    watch.check()
    assert watch.exceeded is None
    watch.sample()
    with pytest.raises(HostMemoryError, match="holds 130 B"):
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


def _v2(tmp_path, leaf: str, files: dict[str, dict[str, str]]):
    (tmp_path / "self").write_text(f"0::/{leaf}\n")
    for relative, contents in files.items():
        folder = tmp_path / "root" / relative
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in contents.items():
            (folder / name).write_text(text)
    return tmp_path / "root", tmp_path / "self"


def test_a_limit_on_a_parent_cgroup_is_read(tmp_path):
    """A job under Slurm, a systemd slice with MemoryMax=, a Kubernetes pod: the limit is
    set on an ancestor of the process's cgroup and the leaf says ``max``. The tightest
    of the cgroup and its ancestors is the one the kernel enforces, and the one planned
    against (it used to be no limit: the machine's available memory)."""
    root, self_cgroup = _v2(
        tmp_path,
        "system.slice/slurmstepd.scope/job_7/step_0/task_0",
        {
            "system.slice/slurmstepd.scope/job_7": {
                "memory.max": f"{8 * GiB}\n",
                "memory.current": f"{2 * GiB}\n",
            },
            "system.slice/slurmstepd.scope/job_7/step_0": {
                "memory.max": "max\n",
                "memory.current": f"{2 * GiB}\n",
            },
            "system.slice/slurmstepd.scope/job_7/step_0/task_0": {
                "memory.max": "max\n",
                "memory.current": f"{2 * GiB}\n",
            },
        },
    )
    found = cgroup_memory(root, self_cgroup)
    assert found is not None and found[0] == 8 * GiB, found
    facts = host_facts(
        available_bytes=200 * GiB,
        process_bytes=GiB,
        cgroup=found,
    )
    assert facts.budget_bytes <= 8 * GiB


def test_a_limit_on_a_parent_cgroup_v1_is_read(tmp_path):
    """cgroup v1 with the hierarchy on: the leaf's memory.limit_in_bytes is the
    "unlimited" value, the parent's is the limit (also in the leaf's memory.stat as
    ``hierarchical_memory_limit``)."""
    (tmp_path / "self").write_text("5:memory:/jobs/one/task\n")
    folder = tmp_path / "root" / "memory" / "jobs" / "one" / "task"
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (folder / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    (folder / "memory.stat").write_text(
        f"cache 0\nrss {GiB}\nhierarchical_memory_limit {8 * GiB}\ntotal_inactive_file 0\n"
    )
    parent = folder.parent
    (parent / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
    (parent / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    found = cgroup_memory(tmp_path / "root", tmp_path / "self")
    assert found is not None and found[0] == 8 * GiB, found


def test_page_cache_charged_to_the_cgroup_leaves_room(tmp_path, monkeypatch):
    """After a first load reads the safetensors files, their page cache is charged to the
    cgroup: memory.current sits near memory.max, though most of it is inactive file
    pages the kernel reclaims first. Those are not counted as used (as kubelet's working
    set does not), so the budget does not collapse to the process's RSS."""
    root, self_cgroup = _v2(
        tmp_path,
        "job",
        {
            "job": {
                "memory.max": f"{16 * GiB}\n",
                "memory.current": f"{15 * GiB}\n",
                "memory.stat": (
                    f"anon {GiB}\nfile {14 * GiB}\nactive_file {GiB}\ninactive_file {13 * GiB}\n"
                ),
            }
        },
    )
    monkeypatch.setattr(
        memory, "cgroup_memory", functools.partial(cgroup_memory, root, self_cgroup)
    )
    facts = host_facts(available_bytes=200 * GiB, process_bytes=GiB)
    assert facts.source == "the cgroup's memory limit"
    # Reclaimable: 13 GiB of inactive file pages; the process could reach ~13 GiB.
    assert facts.budget_bytes >= 8 * GiB, memory.format_bytes(facts.budget_bytes)


def test_a_default_host_cache_fits_the_cgroup(monkeypatch):
    """`HostCache()` in a container limited to 16 GiB on a 256 GiB machine takes half of
    what the cgroup leaves, less the headroom, not half of the machine's available
    memory (124 GiB, past what the kernel allows)."""

    class Memory:
        available = 256 * GiB
        total = 256 * GiB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    monkeypatch.setattr(memory, "cgroup_memory", lambda: (16 * GiB, 2 * GiB))
    host_budget = memory.host_facts().budget_bytes
    assert host_budget < 16 * GiB
    assert HostCache(pin=False).budget_bytes <= host_budget, memory.format_bytes(
        HostCache(pin=False).budget_bytes
    )
