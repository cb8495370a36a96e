"""Which stage first made values that are not finite, from hooks on the components."""

from __future__ import annotations

import torch

import ondeck
from ondeck.cli.finite import FiniteWatch


class Scale(torch.nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.tensor(factor))

    def forward(self, x):
        return x * self.factor


class Apply(ondeck.Stage):
    def __init__(self, name, model, before=None):
        super().__init__()
        self.name, self.model, self.before = name, model, before

    def forward(self, state):
        x = state["x"] if self.before is None else self.before(state["x"])
        return {"x": self.model(x)}


def pipeline(first: float, second: float, between=None):
    class Two(ondeck.Pipeline):
        lazy_components = ("encoder", "decoder")

        def create_stages(self):
            c = self.components
            return [Apply("Encode", c["encoder"]), Apply("Decode", c["decoder"], between)]

    return Two({"encoder": lambda: Scale(first), "decoder": lambda: Scale(second)})


def watched_run(pipe) -> str:
    watch = FiniteWatch()
    watch.attach(pipe)
    out = pipe({"x": torch.ones(3)})["x"]
    assert not torch.isfinite(out).all()
    return watch.first_bad_stage(pipe)


def test_the_component_whose_output_is_not_finite_is_named():
    assert watched_run(pipeline(float("nan"), 1.0)) == "'Encode' (encoder)"
    assert watched_run(pipeline(1.0, float("inf"))) == "'Decode' (decoder)"


def test_a_component_handed_values_that_are_not_finite_names_the_stage_before_it():
    # Between the two models (a scheduler step, a guidance combination) the values break.
    pipe = pipeline(1.0, 1.0, between=lambda x: x * float("inf"))
    assert watched_run(pipe) == (
        "the one before 'Decode' (decoder), which was handed values not finite"
    )
