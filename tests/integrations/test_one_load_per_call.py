"""Under ``release`` each component loads at most once per call, the first call included,
and the components resident together never outweigh the largest one."""

from __future__ import annotations

from collections import Counter

import pytest

import ondeck.diffusers

from .tiny_pipelines import FAMILIES, run


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_each_component_loads_once_per_call(family, folders):
    pipe = ondeck.diffusers.from_pretrained(
        folders[family], device="cpu", policy="release", progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    runtime = pipe.ondeck
    for call in (1, 2):
        before = len(runtime.tracker.events)
        run(pipe, FAMILIES[family])
        loads = Counter(e.name for e in runtime.tracker.events[before:] if e.kind == "load")
        assert set(loads) == set(runtime.deferred), (call, loads)
        assert max(loads.values()) == 1, (call, loads)
        assert not runtime.tracker.resident, call
    largest = max(runtime.component_bytes().values())
    assert runtime.tracker.peak_resident_bytes <= largest
