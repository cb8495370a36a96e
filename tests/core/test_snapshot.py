"""Policies decide from a frozen snapshot alone and return steps; the plan and the run
make the same decisions; the pipeline's snapshot never loads."""

from __future__ import annotations

import dataclasses

import pytest

import ondeck
from ondeck.planning import StageUse, release_residency, simulate
from ondeck.policy import BudgetPolicy, EagerPolicy, ReleasePolicy
from ondeck.snapshot import Snapshot, Steps

from .helpers import ThreeStages, three_loaders

USES = (
    StageUse("Encode", ("text_encoder",)),
    StageUse("Denoise", ("transformer",)),
    StageUse("Decode", ("vae",)),
)
SIZES = {"text_encoder": 10, "transformer": 26, "vae": 1}


def snapshot(resident=(), index=None, uses=USES, **fields) -> Snapshot:
    return Snapshot(
        uses=uses,
        nbytes=SIZES,
        resident=frozenset(resident),
        index=index,
        fit_activations=tuple((lambda need, room: need) for _ in uses),
        **fields,
    )


def test_a_snapshot_cannot_be_changed():
    view = snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.resident = frozenset({"vae"})
    with pytest.raises(TypeError):
        view.nbytes["vae"] = 0


def test_release_frees_after_the_last_holder_as_the_plan_simulates():
    # The text encoder is held again by the last stage: it stays through Denoise.
    uses = (*USES[:2], StageUse("Decode", ("vae", "text_encoder")))
    policy = ReleasePolicy(prefetch_next_run=False)
    residency = release_residency(uses)
    released = [
        policy.after_stage(snapshot(residency[i], i, uses), i, failed=False).release
        for i in range(len(uses))
    ]
    assert released == [(), ("transformer",), ("text_encoder", "vae")]


def test_budget_steps_replay_the_planned_residency():
    policy = BudgetPolicy(40, prefetch=False, streaming=False)
    planned = simulate(list(USES), SIZES, policy="budget", budget=40, prefetch=False)
    resident: set[str] = set()
    for index, stage in enumerate(planned[: len(USES)]):
        steps = policy.before_stage(snapshot(resident, index), index)
        resident = (resident - set(steps.release)) | set(steps.load)
        assert tuple(sorted(resident)) == stage.resident


def test_budget_makes_room_for_an_unplanned_load_by_next_use():
    policy = BudgetPolicy(30, prefetch=False, streaming=False)
    steps = policy.before_load(snapshot({"transformer"}, index=2), "vae")
    assert steps == Steps()  # 27 bytes fit 30
    steps = policy.before_load(snapshot({"text_encoder", "transformer"}, index=2), "vae")
    assert steps.release == ("transformer",)  # needed two stages later, the encoder next


def test_budget_prefetches_nothing_for_a_later_stage_that_will_not_use_it():
    # Encode with the transformer in: the VAE, next after it, is prefetched, unless the
    # snapshot says Decode will do without it (latents out).
    policy = BudgetPolicy(40, prefetch=True, streaming=False)
    steps = policy.before_stage(snapshot({"text_encoder", "transformer"}, index=1), 1)
    assert "vae" in steps.prefetch
    policy = BudgetPolicy(40, prefetch=True, streaming=False)
    view = snapshot({"text_encoder", "transformer"}, index=1, later_unneeded=frozenset({2}))
    steps = policy.before_stage(view, 1)
    assert "vae" not in steps.prefetch + steps.load


def test_eager_loads_everything_and_the_others_nothing_up_front():
    assert EagerPolicy().attached(snapshot()).load == tuple(SIZES)
    assert ReleasePolicy().before_run(snapshot()) == Steps()


def test_a_pipelines_snapshot_loads_nothing_and_names_what_is_resident():
    pipe = ThreeStages(three_loaders(), policy="release")
    view = pipe.snapshot()
    assert [use.name for use in view.uses] == [stage.name for stage in pipe.stages]
    assert view.resident == frozenset() and view.index is None
    assert not any(ondeck.is_loaded(proxy) for proxy in pipe.deferred.values())
    first = next(iter(pipe.deferred))
    pipe.deferred[first].materialize()
    assert pipe.snapshot().resident == {first}
    pipe.close()


def test_the_budget_policy_prefetches_nothing_for_a_run_that_will_not_come():
    # Budget 30 with the decoder resident: after the last stage the text encoder would
    # load for the next run's first stage.
    policy = BudgetPolicy(30)
    activation = {"stored_activation": {"Encode": 1, "Denoise": 1, "Decode": 8}}
    ahead = policy.before_stage(snapshot({"vae"}, 2, **activation), 2)
    assert ahead.prefetch == ("text_encoder",)
    last = policy.before_stage(snapshot({"vae"}, 2, more_runs=False, **activation), 2)
    assert last.prefetch == () and last.prefetch_release == ()
    assert last.load == ahead.load
