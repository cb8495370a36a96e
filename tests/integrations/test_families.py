"""Breadth: every family gives plain diffusers' outputs under ``release``, ``budget`` and
``eager``, loads nothing at construction under ``release``, leaves nothing resident
after a ``release`` call, and loads each component at most once per call."""

from __future__ import annotations

import numpy as np
import pytest

import ondeck
import ondeck.diffusers

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run

FAMILY_NAMES = list(ALL_FAMILIES)


def load(path, policy):
    pipe = ondeck.diffusers.from_pretrained(path, device="cpu", policy=policy, progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_counts(pipe) -> dict[str, int]:
    return {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}


def resident(pipe) -> set[str]:
    return {name for name, proxy in pipe.ondeck.deferred.items() if ondeck.is_loaded(proxy)}


def test_the_suite_covers_at_least_twenty_families():
    assert len({family.pipeline_class for family in ALL_FAMILIES.values()}) >= 20


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_release_matches_diffusers_and_loads_each_component_once_per_call(
    family, folders, references
):
    pipe = load(folders[family], "release")
    assert pipe.ondeck.deferred, "the heavy components are deferred"
    assert resident(pipe) == set(), "nothing loads at construction"

    for call, expected in enumerate(references[family], start=1):
        before = load_counts(pipe)
        output = run(pipe, ALL_FAMILIES[family])
        loads = {name: count - before[name] for name, count in load_counts(pipe).items()}
        assert np.array_equal(output, expected), f"{family}: call {call} differs"
        assert set(loads.values()) == {1}, f"{family}: loads in call {call}: {loads}"
        assert resident(pipe) == set(), f"{family}: resident after call {call}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_budget_and_eager_match_diffusers(family, folders, references):
    pipe = load(folders[family], "budget")
    for call, expected in enumerate(references[family], start=1):
        assert np.array_equal(run(pipe, ALL_FAMILIES[family]), expected), f"budget call {call}"
    assert set(load_counts(pipe).values()) == {1}, "with room for all, each loads once"

    pipe = load(folders[family], "eager")
    assert resident(pipe) == set(pipe.ondeck.deferred), "eager loads everything up front"
    assert np.array_equal(run(pipe, ALL_FAMILIES[family]), references[family][0])
    assert set(load_counts(pipe).values()) == {1}
