"""benchmarks/common.py's PhaseClock: every call timed and named, everything patched back."""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("common", None)
    import common

    yield common
    sys.modules.pop("common", None)


class Base:
    def inherited(self, value):
        return value + 1


class Loader(Base):
    def __init__(self, name):
        self.name = name

    def load(self, value):
        return value * 2

    @staticmethod
    def helper(value):
        return value - 1


class Proxy:
    """Loads on any unknown attribute, as a lazy proxy does: the clock must not ask it."""

    def __init__(self):
        object.__setattr__(self, "_ondeck_name", "vae")

    def __getattr__(self, name):
        raise AssertionError(f"the clock asked the proxy for {name!r}")

    def release(self):
        return 0


def test_the_clock_times_every_call_with_its_component_and_puts_everything_back(common):
    module = types.ModuleType("fake")
    module.work = lambda value: value + 10
    originals = (module.work, vars(Loader)["load"], vars(Loader)["helper"])
    targets = {
        "work": (module, "work"),
        "load": (Loader, "load"),
        "helper": (Loader, "helper"),
        "inherited": (Loader, "inherited"),
        "release": (Proxy, "release"),
    }
    loader = Loader("transformer")
    with common.PhaseClock(targets) as clock:
        assert module.work(1) == 11
        assert loader.load(3) == 6
        assert Loader.helper(3) == 2 and loader.helper(5) == 4
        assert loader.inherited(1) == 2
        assert Proxy().release() == 0
        thread = threading.Thread(target=loader.load, args=(1,), name="side")
        thread.start()
        thread.join()
        events = clock.take()
        assert clock.take() == []  # taken once
    assert (module.work, vars(Loader)["load"], vars(Loader)["helper"]) == originals
    assert "inherited" not in vars(Loader)  # inherited again, not pinned on the class
    assert [(e["phase"], e["component"]) for e in events] == [
        ("work", ""),
        ("load", "transformer"),
        ("helper", ""),
        ("helper", ""),
        ("inherited", "transformer"),
        ("release", "vae"),
        ("load", "transformer"),
    ]
    assert events[-1]["thread"] == "side"
    assert all(e["seconds"] >= 0 and e["start"] >= 0 for e in events)
    totals = common.phase_totals(events)
    assert totals["load transformer"]["calls"] == 2
    assert totals["helper"]["calls"] == 2
    assert totals["work"]["seconds"] == events[0]["seconds"]


def test_totals_only_and_calls_that_raise_still_raise(common):
    module = types.ModuleType("fake")

    def fail():
        raise KeyError("inner")

    module.fail, module.work = fail, lambda value: value + 1
    with common.PhaseClock(
        {"fail": (module, "fail"), "work": (module, "work")}, events=False
    ) as clock:
        assert module.work(1) == 2 and module.work(2) == 3
        try:
            module.fail()
        except KeyError as error:
            assert error.args == ("inner",)
        else:
            raise AssertionError("the wrapped call's error was swallowed")
    assert clock.events == []
    assert clock.counts == {"work": 2, "fail": 1}
    assert set(clock.totals) == {"work", "fail"} and all(t >= 0 for t in clock.totals.values())


def test_read_paths_phases_time_the_reader_and_give_its_copy_back(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.syspath_prepend(str(BENCHMARKS / "experiments"))
    for name in ("common", "read_path"):
        sys.modules.pop(name, None)
    import read_path

    from ondeck.loading import components, ring

    deliver, install = ring.deliver, components._install
    with read_path.Phases(copy=False) as phases:
        assert ring.deliver is not deliver
        assert ring.deliver(None, None, {}, {}) is None  # the reads alone: no copy
    assert ring.deliver is deliver and components._install is install
    assert phases.counts == {"copy issue": 1}
    assert phases.summary(1)["copy issue"]["calls_per_load"] == 1
    for name in ("common", "read_path"):
        sys.modules.pop(name, None)
