"""Under ``release`` on the diffusers path, a call's last turn loads the next call's first
components (as many, in turn order, as keep the call's peak), and they are still there
when the next call starts: it loads none of them again, and its output is diffusers'.

Activations are given per turn through the policy's ``activation_estimate``, as a GPU run
measures them (the CPU measures none)."""

from __future__ import annotations

import numpy as np
import pytest

import ondeck.diffusers
from ondeck.planning import release_residency
from ondeck.policy import ReleasePolicy, _view

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run


def with_activations(monkeypatch, last_turn) -> None:
    """Every turn takes one byte of activations, the last ``last_turn(snapshot)``."""

    def estimate(self, source, budget=None):
        uses = _view(source).uses
        needs = {use.name: 1 for use in uses}
        needs[uses[-1].name] = last_turn(_view(source))
        return needs, "given by the test"

    monkeypatch.setattr(ReleasePolicy, "activation_estimate", estimate)


def open_release(folder):
    pipe = ondeck.diffusers.from_pretrained(folder, device="cpu", policy="release", progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def loads(pipe, run_number: int) -> list[str]:
    return [
        event.name
        for event in pipe.ondeck.tracker.events
        if event.run == run_number and event.kind == "load"
    ]


def text_encoders(pipe) -> list[str]:
    """The text encoders, in the order a call's turns use them."""
    return [name for name in pipe.ondeck.order if name.startswith("text_encoder")]


@pytest.mark.parametrize("family", ["sd3", "flux", "chroma"])
def test_the_next_calls_text_encoders_load_during_the_last_turn_and_stay(
    family, folders, references, monkeypatch
):
    with_activations(monkeypatch, lambda snapshot: 1)
    pipe = open_release(folders[family])
    for call, expected in enumerate(references[family], start=1):
        assert np.array_equal(run(pipe, ALL_FAMILIES[family]), expected), f"call {call}"
        encoders = text_encoders(pipe)
        assert set(pipe.ondeck.resident()) == set(encoders), f"after call {call}"
    # The second call's encoders were loaded by the first call's last turn: the second
    # call loaded each once, after its transformer, for the third call.
    second = loads(pipe, 2)
    after = second.index("transformer")
    assert all(second.count(name) == 1 for name in encoders), second
    assert all(second.index(name) > after for name in encoders), second


def test_only_the_encoders_that_keep_the_peak_load_early(folders, references, monkeypatch):
    """The last turn's activations leave room for the first encoder beside it, not the
    second: only the first loads early."""
    pipe = open_release(folders["sd3"])
    nbytes = pipe.ondeck.component_bytes()
    first, second = text_encoders(pipe)[:2]

    def leaving_room_for_the_first(snapshot):
        uses = snapshot.uses
        largest = max(
            sum(nbytes[c] for c in held) + 1
            for use, held in zip(uses, release_residency(uses), strict=True)
            if use is not uses[-1]
        )
        last = sum(nbytes[c] for c in release_residency(uses)[-1])
        return largest - last - nbytes[first]

    with_activations(monkeypatch, leaving_room_for_the_first)
    assert nbytes[second] > 0
    assert np.array_equal(run(pipe, ALL_FAMILIES["sd3"]), references["sd3"][0])
    assert set(pipe.ondeck.resident()) == {first}
