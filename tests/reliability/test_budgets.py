"""Budgets that cannot work fail before a single byte is loaded, and say why."""

from __future__ import annotations

import numpy as np
import pytest

import ondeck
from ondeck.memory import format_bytes

from .helpers import LoaderCalls, generate, loaded_names, wan


def sizes(folder) -> dict[str, int]:
    return wan(folder).component_bytes()


def largest_stage(folder) -> tuple[str, int]:
    stage_of = {"text_encoder": "EncodePrompt", "transformer": "Denoise", "vae": "Decode"}
    name, nbytes = max(sizes(folder).items(), key=lambda item: item[1])
    return stage_of[name], nbytes


@pytest.mark.parametrize("short_by", [1, 50_000, "most"])
@pytest.mark.parametrize("policy", ["budget", "auto"])
def test_a_budget_below_the_largest_stage_fails_before_any_load(
    tiny_template, monkeypatch, short_by, policy
):
    stage, needed = largest_stage(tiny_template)
    budget = 1_000 if short_by == "most" else needed - short_by
    calls = LoaderCalls(monkeypatch)
    pipe = wan(tiny_template, policy, budget=budget)
    for _ in range(2):  # refused the same way every time, never half-started
        with pytest.raises(ondeck.BudgetError) as excinfo:
            generate(pipe)
        error = excinfo.value
        message = str(error)
        overflow = needed - budget
        assert f"stage '{stage}' needs {format_bytes(overflow)} more than the budget" in message
        assert "nothing was loaded" in message
        # The plan comes with it: every component, every stage, and the verdict.
        assert str(error.plan) in message
        assert f"does not fit {format_bytes(budget)}: stage '{stage}' overflows by" in message
        assert error.plan.overflow() == (stage, overflow)
    assert calls.total == 0
    assert loaded_names(pipe) == set()
    assert pipe.tracker.bytes_loaded == 0
    assert not [e for e in pipe.tracker.events if e.kind == "load"]


def test_the_overflowing_stage_is_the_worst_one(tiny_template, monkeypatch):
    """Two stages overflow; the error names the one that overflows most."""
    component = sizes(tiny_template)
    budget = component["text_encoder"] - 1  # the encoder and the VAE both overflow
    calls = LoaderCalls(monkeypatch)
    with pytest.raises(ondeck.BudgetError, match="stage 'Decode'"):
        generate(wan(tiny_template, "budget", budget=budget))
    assert calls.total == 0


def test_planning_a_folder_against_a_short_budget_reads_no_weights(tiny_template, monkeypatch):
    stage, needed = largest_stage(tiny_template)
    calls = LoaderCalls(monkeypatch)
    plan = ondeck.plan(tiny_template, budget=needed - 1, device="cpu")
    assert not plan.fits()
    assert plan.overflow() == (stage, 1)
    assert calls.total == 0


def test_a_budget_of_exactly_the_largest_stage_runs_within_it(
    tiny_template, clean_frames, monkeypatch
):
    _, needed = largest_stage(tiny_template)
    pipe = wan(tiny_template, "budget", budget=needed)
    for _ in range(2):
        assert np.array_equal(generate(pipe), clean_frames)
    assert pipe.tracker.peak_resident_bytes <= needed
    assert pipe.plan().peak_bytes == pipe.tracker.peak_resident_bytes


def test_a_short_budget_on_the_default_preset_names_the_denoiser(default_template, monkeypatch):
    component = sizes(default_template)
    budget = component["transformer"] - 10 * 2**20
    calls = LoaderCalls(monkeypatch)
    with pytest.raises(ondeck.BudgetError) as excinfo:
        generate(wan(default_template, "budget", budget=budget))
    assert f"stage 'Denoise' needs {format_bytes(10 * 2**20)} more" in str(excinfo.value)
    assert calls.total == 0
