"""Plans and the budget policy: what stays, what goes, what is prefetched."""

from __future__ import annotations

import pytest
import torch

import ondeck
from ondeck.planning import StageUse, release_schedule, simulate
from ondeck.stage_steps import budget_step

from .helpers import CountingLoader, ProfiledThreeStages, ThreeStages, state, use_profiles

USES = [
    StageUse("Encode", ("text_encoder",)),
    StageUse("Latents", ()),
    StageUse("Denoise", ("transformer",)),
    StageUse("Decode", ("vae",)),
]
SIZES = {"text_encoder": 10, "transformer": 26, "vae": 1}


def test_release_schedule_is_last_holder():
    assert release_schedule(USES) == {
        "Encode": ["text_encoder"],
        "Latents": [],
        "Denoise": ["transformer"],
        "Decode": ["vae"],
    }


def test_release_plan_peaks_at_the_largest_stage():
    stages = simulate(USES, SIZES, policy="release")
    assert max(s.resident_bytes for s in stages) == 26


def test_budget_keeps_everything_when_it_fits():
    stages = simulate(USES, SIZES, policy="budget", budget=40, prefetch=False)
    assert stages[-1].resident == ("text_encoder", "transformer", "vae")


def test_budget_evicts_the_component_used_farthest_away():
    # At Decode (budget 36) something must go: the text encoder is needed next (first
    # stage of the next run), the transformer two stages later, so the transformer goes.
    step = budget_step(
        {"text_encoder", "transformer"},
        3,
        uses=USES,
        nbytes=SIZES,
        budget=36,
        activation={},
        prefetch=False,
    )
    assert step.evict == ("transformer",)
    assert step.load == ("vae",)


def test_budget_counts_activation_headroom():
    step = budget_step(
        {"text_encoder"},
        2,
        uses=USES,
        nbytes=SIZES,
        budget=40,
        activation={"Denoise": 8},
        prefetch=False,
    )
    assert step.evict == ("text_encoder",)


def test_stage_that_cannot_fit_raises_with_the_overflow():
    with pytest.raises(ValueError, match="Denoise.*more than the budget"):
        budget_step(set(), 2, uses=USES, nbytes=SIZES, budget=20, activation={}, prefetch=False)


def test_prefetch_loads_the_next_stage_beside_the_current_one():
    step = budget_step(
        {"text_encoder"}, 0, uses=USES, nbytes=SIZES, budget=40, activation={}, prefetch=True
    )
    assert step.prefetch == ("transformer",)
    step = budget_step(
        {"text_encoder"}, 0, uses=USES, nbytes=SIZES, budget=30, activation={}, prefetch=True
    )
    assert step.prefetch == ()  # would not fit beside the running text encoder


def test_prefetch_after_the_last_stage_loads_the_next_runs_first_components():
    # Decoding (VAE, 1, plus 8 of activations) leaves room for the text encoder (10)
    # within 30: it is loaded during decoding for the next run's first stage.
    step = budget_step(
        {"vae"}, 3, uses=USES, nbytes=SIZES, budget=30, activation={"Decode": 8}, prefetch=True
    )
    assert step.prefetch == ("text_encoder",)
    stages = simulate(
        USES, SIZES, policy="budget", budget=30, activation={"Decode": 8}, prefetch=True, runs=2
    )
    assert [s.resident for s in stages if s.name == "Decode"] == [("text_encoder", "vae")] * 2


def test_a_small_component_does_not_lift_the_peak_when_components_move():
    # 37 GiB of components do not fit 32 at once, so they move every run. The VAE (1 of
    # 32: small) kept through denoising would lift the peak above denoising's own need
    # (26 + 2): it is dropped there and loaded again at decoding.
    activation = {"Encode": 0, "Latents": 0, "Denoise": 2, "Decode": 8}
    step = budget_step(
        {"transformer", "vae"},
        2,
        uses=USES,
        nbytes=SIZES,
        budget=32,
        activation=activation,
        prefetch=True,
    )
    assert step.evict == ("vae",)
    assert step.prefetch == ()  # not prefetched back during denoising either
    stages = simulate(
        USES, SIZES, policy="budget", budget=32, activation=activation, prefetch=True, runs=3
    )
    denoising = [s for s in stages if s.name == "Denoise"]
    assert all(s.resident == ("transformer",) for s in denoising)
    assert max(s.resident_bytes + (s.activation_bytes or 0) for s in stages) == 28


def test_a_large_component_is_prefetched_even_if_it_lifts_the_peak():
    # With a budget of 38, the transformer (26) is prefetched beside the text encoder:
    # the peak rises above denoising's own 26, but it saves the largest load of a run.
    step = budget_step(
        {"text_encoder"}, 0, uses=USES, nbytes=SIZES, budget=38, activation={}, prefetch=True
    )
    assert step.prefetch == ("transformer",)


def test_when_everything_fits_small_components_stay():
    stages = simulate(
        USES, SIZES, policy="budget", budget=48, activation={"Denoise": 2, "Decode": 8}, runs=2
    )
    assert all(s.resident == ("text_encoder", "transformer", "vae") for s in stages[4:])


def budget_pipeline(loaders=None, *, budget, prefetch=False):
    return ThreeStages(
        loaders or {n: CountingLoader(32) for n in ("encoder", "denoiser", "decoder")},
        policy="budget",
        budget=budget,
        prefetch=prefetch,
    )


ONE = (32 * 32 + 32) * 4


def test_budget_policy_loads_nothing_on_the_second_run_when_everything_fits():
    pipe = budget_pipeline(budget=10 * ONE)
    for proxy in pipe.deferred.values():
        object.__setattr__(proxy, "_ondeck_spec", ondeck.ComponentSpec(nbytes=ONE))
    pipe(state())
    loaded = pipe.tracker.bytes_loaded
    pipe(state())
    assert pipe.tracker.bytes_loaded == loaded == 3 * ONE
    assert all(ondeck.is_loaded(p) for p in pipe.deferred.values())


def with_sizes(pipe):
    for proxy in pipe.deferred.values():
        object.__setattr__(proxy, "_ondeck_spec", ondeck.ComponentSpec(nbytes=ONE))
    return pipe


def test_budget_policy_never_exceeds_its_budget():
    pipe = with_sizes(budget_pipeline(budget=2 * ONE))
    for _ in range(3):
        pipe(state())
    assert pipe.tracker.peak_resident_bytes <= 2 * ONE
    assert pipe.tracker.peak_resident_bytes == pipe.plan().peak_bytes


def test_budget_too_small_fails_before_any_load():
    loaders = {n: CountingLoader(32) for n in ("encoder", "denoiser", "decoder")}
    pipe = with_sizes(budget_pipeline(loaders, budget=ONE // 2))
    with pytest.raises(ondeck.BudgetError, match="Encode.*more than the budget") as caught:
        pipe(state())
    assert caught.value.plan is not None
    assert [loader.calls for loader in loaders.values()] == [0, 0, 0]


def test_prefetch_loads_the_next_component_off_the_stage_thread():
    loaders = {n: CountingLoader(32, delay=0.05) for n in ("encoder", "denoiser", "decoder")}
    pipe = with_sizes(budget_pipeline(loaders, budget=10 * ONE, prefetch=True))
    pipe(state())
    exposed_by_stage = {s.stage: s.exposed_load_seconds for s in pipe.tracker.stages}
    # Encode loads its own component; the others were prefetched while earlier stages ran.
    assert exposed_by_stage["Encode"] >= 0.04
    loads = [e for e in pipe.tracker.events if e.kind == "load"]
    assert [e.name for e in loads] == ["encoder", "denoiser", "decoder"]
    assert pipe.tracker.peak_resident_bytes == pipe.plan().peak_bytes


def test_auto_chooses_release_when_components_do_not_fit(monkeypatch):
    from ondeck import policy as policy_module

    monkeypatch.setattr(
        policy_module, "auto_budget_bytes", lambda device, host_memory=None: (ONE, False)
    )
    pipe = with_sizes(
        ThreeStages({n: CountingLoader(32) for n in ("encoder", "denoiser", "decoder")})
    )
    # Sizes were unknown at construction, so auto could not prove they fit.
    assert pipe.policy.name == "release"


def test_auto_chooses_budget_when_everything_fits(monkeypatch):
    from ondeck import policy as policy_module

    monkeypatch.setattr(
        policy_module, "auto_budget_bytes", lambda device, host_memory=None: (10 * ONE, True)
    )
    loaders = {}
    for name in ("encoder", "denoiser", "decoder"):
        loaders[name] = ondeck.LazyModule(
            name, CountingLoader(32), spec=ondeck.ComponentSpec(cls=torch.nn.Linear, nbytes=ONE)
        )
    pipe = ThreeStages(loaders)
    assert pipe.policy.name == "budget"
    assert "fit" in pipe.policy.reason


def test_stored_activation_profile_shapes_the_first_run(monkeypatch, tmp_path):
    store = use_profiles(monkeypatch, tmp_path / "profiles.json")
    store.record("three", {"width": 32}, "Decode", 2 * ONE)
    pipe = with_sizes(
        ProfiledThreeStages(
            {n: CountingLoader(32) for n in ("encoder", "denoiser", "decoder")},
            policy="budget",
            budget=3 * ONE,
            prefetch=False,
        )
    )
    pipe(state())
    # Decode needs its own component plus two components' worth of activations, so the
    # other two were evicted before it ran, on the very first run.
    decode = [e for e in pipe.tracker.events if e.kind == "release"]
    assert {e.name for e in decode} >= {"encoder", "denoiser"}
    assert pipe.plan().activation_bytes["Decode"] == 2 * ONE
