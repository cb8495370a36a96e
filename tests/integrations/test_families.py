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
def test_each_familys_output_follows_its_latents(family, folders, references):
    """What makes the equality checks here able to fail: another seed gives other
    pixels. A tiny VAE whose random weights decode any latents to the same flat frame
    (or a tiled decode that gives no pixels for a small video) would pass them with a
    wrong transformer."""
    family_type = ALL_FAMILIES[family]
    pipe = family_type.pipeline_type().from_pretrained(folders[family])
    pipe.set_progress_bar_config(disable=True)
    other = np.asarray(run(pipe, family_type, seed=1), dtype=np.float64)
    seeded = np.asarray(references[family][0], dtype=np.float64)
    assert np.abs(other - seeded).mean() > 1e-3, f"{family}: the pixels ignore the latents"


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


@pytest.mark.parametrize("family", ["flux_kontext", "wan_i2v"])
def test_a_vae_encoding_the_input_keeps_the_budget_where_one_large_component_fits(
    family, folders, references
):
    """An image-edit or image-to-video call uses its VAE before the transformer (the
    input image) and after it (the decode). Under a budget that holds the transformer and
    little beside, every call keeps to it and gives diffusers' output: before, the first
    call's VAE jumped to its decode's turn, the transformer loaded outside any turn
    beside every encoder, and the second call was refused."""
    sizes = ondeck.plan(folders[family], policy="release").component_bytes
    budget = max(sizes.values()) + min(sizes.values()) // 2
    pipe = ondeck.diffusers.from_pretrained(
        folders[family], device="cpu", policy="budget", budget=budget, progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    for call, expected in enumerate(references[family], start=1):
        assert np.array_equal(run(pipe, ALL_FAMILIES[family]), expected), f"call {call}"
        report = pipe.ondeck.report()  # its peak covers every call so far
        assert report["peak_resident_bytes"] <= budget, f"call {call}"
        assert "transformer" in [stage["stage"] for stage in report["stages"]], f"call {call}"


@pytest.mark.parametrize("negative", [None, ""])
def test_no_negative_prompt_is_the_pipelines_own_default(negative, folders, monkeypatch):
    """``generate`` with no negative prompt, or an empty one (the command line's and the
    server's default), calls the pipeline without one: QwenImage's "" would turn on its
    true classifier-free guidance, twice the transformer's calls and another image."""
    pipe = load(folders["qwenimage"], "release")
    seen = []
    call = pipe.ondeck.run
    monkeypatch.setattr(pipe.ondeck, "run", lambda f, *a, **k: seen.append(k) or call(f, *a, **k))
    pipe.ondeck.generate(
        "a fox",
        negative_prompt=negative,
        height=32,
        width=32,
        num_inference_steps=1,
        max_sequence_length=16,
    )
    assert len(seen) == 1 and "negative_prompt" not in seen[0]
