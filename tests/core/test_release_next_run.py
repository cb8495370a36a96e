"""Under ``release``, the last stage loads the next run's first components in the
background when that keeps the run's peak; otherwise every component goes after its stage."""

from __future__ import annotations

import time

import pytest
import torch

import ondeck
from ondeck.policy import ReleasePolicy

from .helpers import ProfiledThreeStages, use_profiles

ONE = 2**20
SHAPE = {"width": 32}


class Loader:
    """Builds the same Linear on any thread (no global random state), and fails on demand."""

    def __init__(self, seed: int):
        self.seed = seed
        self.calls = 0
        self.fail_next = False
        self.seconds = 0.0  # how long a load takes
        self.spans: list[tuple[float, float]] = []  # each load's start and end

    def __call__(self) -> torch.nn.Linear:
        if self.fail_next:
            self.fail_next = False
            raise OSError("the disk went away")
        self.calls += 1
        started = time.perf_counter()
        time.sleep(self.seconds)
        self.spans.append((started, time.perf_counter()))
        module = torch.nn.Linear(32, 32)
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        return module


def pipeline(monkeypatch, tmp_path, activations: dict[str, int] | None, **policy):
    store = use_profiles(monkeypatch, tmp_path / "profiles.json")
    for stage, nbytes in (activations or {}).items():
        store.record("three", SHAPE, stage, nbytes)
    loaders = {name: Loader(seed) for seed, name in enumerate(("encoder", "denoiser", "decoder"))}
    components = {
        name: ondeck.LazyModule(
            name, loader, spec=ondeck.ComponentSpec(cls=torch.nn.Linear, nbytes=ONE)
        )
        for name, loader in loaders.items()
    }
    return ProfiledThreeStages(components, policy=ReleasePolicy(**policy)), loaders


def run(pipe):
    return pipe({"x": torch.ones(2, 32)})["x"]


def resident(pipe) -> set[str]:
    return set(pipe.resident())


def test_the_encoder_loads_during_the_last_stage_when_the_denoiser_needs_more(
    monkeypatch, tmp_path
):
    # Decode holds 1 MiB + 1 MiB of activations; Denoise 1 MiB + 8 MiB: the encoder's
    # 1 MiB beside the decoder stays under the largest stage's peak.
    pipe, loaders = pipeline(
        monkeypatch, tmp_path, {"Encode": ONE, "Denoise": 8 * ONE, "Decode": ONE}
    )
    first = run(pipe)
    assert resident(pipe) == {"encoder"}  # loaded ahead for the next run
    assert loaders["encoder"].calls == 2  # for this run's Encode, then for the next run
    second = run(pipe)
    assert torch.equal(first, second)
    assert loaders["encoder"].calls == 3  # the second run's Encode found it loaded
    assert resident(pipe) == {"encoder"}
    assert pipe.release_all() > 0
    assert resident(pipe) == set()


def test_the_early_load_starts_once_the_last_stages_own_component_is_in(monkeypatch, tmp_path):
    pipe, loaders = pipeline(
        monkeypatch, tmp_path, {"Encode": ONE, "Denoise": 8 * ONE, "Decode": ONE}
    )
    loaders["decoder"].seconds = 0.05
    run(pipe)
    ((_, decoder_in),) = loaders["decoder"].spans
    early_start, _ = loaders["encoder"].spans[-1]
    assert decoder_in <= early_start  # never two loads at once, competing for the disk


def test_nothing_loads_early_when_it_would_raise_the_peak(monkeypatch, tmp_path):
    # The decoder's stage is the largest: the encoder beside it would raise the peak.
    pipe, loaders = pipeline(
        monkeypatch, tmp_path, {"Encode": ONE, "Denoise": ONE, "Decode": 8 * ONE}
    )
    run(pipe)
    assert resident(pipe) == set()


def test_nothing_loads_early_while_an_activation_is_unknown(monkeypatch, tmp_path):
    pipe, _ = pipeline(monkeypatch, tmp_path, None)
    run(pipe)  # the CPU measures no activations: they stay unknown
    assert resident(pipe) == set()


def test_it_can_be_turned_off(monkeypatch, tmp_path):
    pipe, _ = pipeline(
        monkeypatch,
        tmp_path,
        {"Encode": ONE, "Denoise": 8 * ONE, "Decode": ONE},
        prefetch_next_run=False,
    )
    run(pipe)
    assert resident(pipe) == set()


def test_a_failed_early_load_warns_and_the_next_run_loads_it_itself(monkeypatch, tmp_path):
    pipe, loaders = pipeline(
        monkeypatch, tmp_path, {"Encode": ONE, "Denoise": 8 * ONE, "Decode": ONE}
    )
    run(pipe)  # ends with the encoder loaded ahead
    loaders["encoder"].fail_next = True
    with pytest.warns(UserWarning, match="ahead of the run failed.*disk went away"):
        run(pipe)  # its last stage loads the encoder early, and that load fails
    assert resident(pipe) == set()
    run(pipe)  # loads it for its own Encode, and ahead again
    assert resident(pipe) == {"encoder"}


def test_nothing_loads_ahead_after_a_run_the_caller_says_is_the_last(monkeypatch, tmp_path):
    pipe, loaders = pipeline(
        monkeypatch, tmp_path, {"Encode": ONE, "Denoise": 8 * ONE, "Decode": ONE}
    )
    pipe.more_runs = False
    first = run(pipe)
    assert resident(pipe) == set()
    assert loaders["encoder"].calls == 1  # for this run's Encode only
    pipe.more_runs = True
    assert torch.equal(run(pipe), first)
    assert resident(pipe) == {"encoder"}  # another run expected: loaded ahead again
