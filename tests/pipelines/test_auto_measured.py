"""``auto`` once activations are measured: the reserve for estimates shrinks to a margin.

The device is faked through its one seam, ``ondeck.memory.device_facts``. The Wan
2.1 14B-shaped pipeline is planned from declared sizes (nothing loads): a 16 GiB card,
the fp8 text encoder (5.29 GiB) and transformer (13.58 GiB), the float32 VAE, and the
activations a run measured at 480x832x33 (Denoise about 1.6 GiB, a whole-frame decode
8.6 GiB). Streaming is checked on the tiny Wan folder with the margins scaled down.
"""

from __future__ import annotations

import pytest
import torch

import ondeck
from ondeck import memory
from ondeck import policy as policy_module
from ondeck import profiles as profiles_module
from ondeck.lazy import loader_of
from ondeck.memory import format_bytes
from ondeck.pipelines.wan import Decode, WanTextToVideo
from ondeck.tracker import StageRecord
from tests.core.helpers import Apply, CountingLoader

GIB = 1 << 30
SIZES = {
    "text_encoder": int(5.29 * GIB),
    "transformer": int(13.58 * GIB),
    "vae": int(0.47 * GIB),
}
MEASURED = {
    "EncodePrompt": int(0.2 * GIB),
    "PrepareLatents": 16 << 20,
    "Denoise": int(1.6 * GIB),
    "Decode": int(8.6 * GIB),
}


def fake_card(monkeypatch, total_bytes: int, *, unified: bool = False, free: int | None = None):
    def facts(device=None):
        return memory.DeviceFacts("cuda:9", unified, total_bytes, free or total_bytes)

    monkeypatch.setattr(memory, "device_facts", facts)


class Prepare(ondeck.Stage):
    name = "PrepareLatents"

    def forward(self, state):
        return state


class WanShaped(ondeck.Pipeline):
    lazy_components = tuple(SIZES)

    def create_stages(self):
        c = self.components
        return [
            Apply(c["text_encoder"], "EncodePrompt"),
            Prepare(),
            Apply(c["transformer"], "Denoise"),
            Apply(c["vae"], "Decode"),
        ]


def wan_shaped() -> WanShaped:
    components = {
        name: ondeck.LazyModule(
            name, CountingLoader(8), spec=ondeck.ComponentSpec(cls=torch.nn.Linear, nbytes=nbytes)
        )
        for name, nbytes in SIZES.items()
    }
    return WanShaped(components, device="cpu")


def profiled_wan_shaped(monkeypatch, tmp_path) -> WanShaped:
    """The Wan-shaped pipeline with a stored profile of ``MEASURED`` for runs of width 8."""
    from tests.core.helpers import use_profiles

    store = use_profiles(monkeypatch, tmp_path / "profiles.json")
    for stage, nbytes in MEASURED.items():
        store.record("wan-shaped", {"width": 8}, stage, nbytes)

    class Profiled(WanShaped):
        profile_model = "wan-shaped"

        def profile_shape(self, state):
            return {"width": state["x"].shape[1]}

    return Profiled(wan_shaped().components, device="cpu")


def measure(pipe, activations) -> None:
    """What a run on the card would have recorded, stage by stage."""
    for stage in pipe.stages:
        if isinstance(stage, Decode):
            object.__setattr__(stage, "_decoded", True)  # as after a whole-frame decode
    for index, (stage, nbytes) in enumerate(activations.items()):
        pipe._stage_measured(index, StageRecord(1, stage, 1.0, 0.0, 0, None, nbytes))
    pipe.tracker.runs_completed += 1  # as after the run completed


def resident(plan, run: int) -> dict[str, tuple[str, ...]]:
    return {stage.name: stage.resident for stage in plan.runs if stage.run == run}


def test_the_first_run_plans_with_the_estimates_reserve(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    estimated = 16 * GIB - max(GIB, int(0.08 * 16 * GIB))
    assert pipe.policy.name == "budget"
    assert pipe.plan().budget == estimated
    measure(pipe, {k: v for k, v in MEASURED.items() if k != "Denoise"})  # one stage unknown
    assert pipe.plan().budget == estimated
    assert "once every stage's activations are measured" in pipe.policy.reason


def test_16_gib_keeps_the_fp8_transformer_whole_once_activations_are_measured(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    measure(pipe, MEASURED)
    plan = pipe.plan()
    assert plan.budget == 16 * GIB - int(0.02 * 16 * GIB)
    # 13.58 GiB of transformer and 1.6 GiB of activations fit 15.68 GiB (not 14.72).
    assert plan.fits()
    steady = resident(plan, 2)
    assert steady["Denoise"] == ("transformer",)
    # The next run's text encoder loads while the VAE decodes, beside its activations.
    assert steady["Decode"] == ("text_encoder", "vae")
    assert "transformer" not in steady["EncodePrompt"]
    assert plan.peak_bytes <= plan.budget - MEASURED["Denoise"]


def test_the_same_measurements_overflow_the_estimates_reserve(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    measure(pipe, MEASURED)
    assert pipe.plan(16 * GIB - GIB - int(0.28 * GIB)).overflow()[0] == "Denoise"


def test_a_run_plans_against_the_measured_budget_from_then_on(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    state = {"x": torch.ones(2, 8)}
    pipe(state)  # on the CPU nothing is measured: the estimate's reserve stays
    assert pipe.policy.budget_bytes == pipe.policy.estimated_budget_bytes
    measure(pipe, MEASURED)
    pipe({"x": torch.ones(2, 8)})
    assert pipe.policy.budget_bytes == 16 * GIB - int(0.02 * 16 * GIB)
    pipe.close()


def test_a_bound_within_the_estimates_reserve_counts_as_measured(monkeypatch):
    """A stage whose peak stayed under an earlier one has a bound instead of a
    measurement; within what the estimate keeps for it beyond the measured budget's
    reserve (0.96 GiB here), the runs plan against the measured budget with the bound
    as its need. A larger bound is not used: the stage would plan with less room."""
    fake_card(monkeypatch, 16 * GIB)
    measured = 16 * GIB - int(0.02 * 16 * GIB)
    pipe = wan_shaped()
    measure(pipe, {k: v for k, v in MEASURED.items() if k != "Denoise"})
    pipe.tracker.activation_bounds["Denoise"] = int(0.9 * GIB)
    plan = pipe.plan()
    assert plan.budget == measured
    assert plan.activation_bytes["Denoise"] == int(0.9 * GIB)
    assert "'Denoise' 921.60 MiB" in plan.activation_note

    pipe.tracker.activation_bounds["Denoise"] = 2 * GIB
    plan = pipe.plan()
    assert plan.budget == pipe.policy.estimated_budget_bytes
    assert plan.activation_bytes["Denoise"] is None
    pipe.tracker.activation_bounds["Denoise"] = int(0.9 * GIB)
    measure(pipe, {"Denoise": MEASURED["Denoise"]})  # measured exactly: the bound goes
    plan = pipe.plan()
    assert plan.activation_bytes["Denoise"] == MEASURED["Denoise"]
    assert "at most" not in plan.activation_note


def test_a_streaming_stage_may_count_a_bound_up_to_its_guessed_share_too(monkeypatch):
    """Where the stage's component streams, the first runs keep a tenth of the budget
    for its activations as well (1.47 GiB here): a bound up to both counts."""
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    measure(pipe, {k: v for k, v in MEASURED.items() if k != "Denoise"})
    pipe.tracker.activation_bounds["Denoise"] = 2 * GIB
    streaming = {"transformer": SIZES["transformer"]}  # as a run streaming it leaves it
    monkeypatch.setattr(pipe.policy.streaming, "device_bytes", lambda: streaming)
    assert pipe.plan().activation_bytes["Denoise"] == 2 * GIB
    pipe.tracker.activation_bounds["Denoise"] = int(2.5 * GIB)  # past 0.96 + 1.47 GiB
    assert pipe.plan().activation_bytes["Denoise"] is None


def test_a_replaced_component_leaves_no_bound_behind(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    pipe.tracker.activation_bounds.update(Denoise=GIB, EncodePrompt=GIB)
    pipe.components["transformer"] = torch.nn.Linear(2, 2)
    assert pipe.tracker.activation_bounds == {"EncodePrompt": GIB}


def test_a_stored_profile_of_the_run_shape_counts_as_measured(monkeypatch, tmp_path):
    fake_card(monkeypatch, 24 * GIB)
    pipe = profiled_wan_shaped(monkeypatch, tmp_path)
    estimated = pipe.policy.estimated_budget_bytes
    pipe({"x": torch.ones(2, 8)})
    # The process's first run plans with the stored peaks, keeping the estimate's
    # reserve for what its first calls allocate beside them; the next run trusts them.
    assert pipe.policy.budget_bytes == estimated < 24 * GIB - int(0.02 * 24 * GIB)
    assert pipe.policy.activation_needs(pipe)[0] == MEASURED
    assert "stored" not in pipe.plan().activation_note.split("activations:")[0]
    pipe({"x": torch.ones(2, 8)})
    assert pipe.policy.budget_bytes == 24 * GIB - int(0.02 * 24 * GIB)
    pipe.close()


def test_a_first_run_plans_against_the_measured_budget_where_its_reserve_alone_would_not_fit(
    monkeypatch, tmp_path
):
    """On a 16 GiB card the fp8 transformer (13.58 GiB) and its stored 1.6 GiB fit only
    the measured budget: the first run's larger reserve would set the profile aside (and
    guess), so that run plans against the measured budget, with what is stored."""
    fake_card(monkeypatch, 16 * GIB)
    pipe = profiled_wan_shaped(monkeypatch, tmp_path)
    pipe._profile_shape = {"width": 8}
    assert pipe.policy.current_budget(pipe.snapshot()) == pipe.policy.measured_budget_bytes
    plan = pipe.plan()
    assert plan.fits() and not plan.profile_set_aside
    assert plan.activation_bytes["Denoise"] == MEASURED["Denoise"]
    pipe.close()


def fake_host(monkeypatch, available: int, process: int, cgroup=None) -> None:
    """The machine's readings behind ``memory.host_facts``: available bytes, this
    process's RSS, and a cgroup's (limit, usage) or none."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: available)
    monkeypatch.setattr(memory, "process_rss_bytes", lambda: process)
    monkeypatch.setattr(memory, "cgroup_memory", lambda *a, **k: cgroup)


def test_unified_memory_keeps_the_larger_reserve(monkeypatch):
    fake_card(monkeypatch, 16 * GIB, unified=True)
    fake_host(monkeypatch, 64 * GIB, GIB)
    pipe = wan_shaped()
    measure(pipe, MEASURED)
    assert pipe.plan().budget == 16 * GIB - max(GIB, int(0.08 * 16 * GIB))
    assert "once every stage" not in pipe.policy.reason


def test_on_unified_memory_auto_plans_within_the_host_budget_given(monkeypatch):
    """The device's bytes are the host's: ``host_memory`` bounds what ``auto`` plans to
    hold, less what the process holds already, though the device reports more free."""
    fake_card(monkeypatch, 64 * GIB, unified=True)
    fake_host(monkeypatch, 64 * GIB, GIB)
    assert wan_shaped().plan().budget > 50 * GIB
    pipe = WanShaped(wan_shaped().components, device="cpu", host_memory=12 * GIB)
    assert pipe.plan().budget == 11 * GIB
    assert "streaming" in pipe.policy.reason
    assert "11.00 GiB the host has free" in pipe.policy.reason


def test_a_plan_on_the_cpu_says_its_activations_go_unmeasured(monkeypatch):
    """No peak counter measures activations on the CPU: the plan does not promise that a
    run will."""
    fake_host(monkeypatch, 64 * GIB, GIB)
    text = str(wan_shaped().plan())
    assert "activations: unknown (not measured on cpu)" in text
    assert "run once" not in text


def test_on_unified_memory_auto_plans_within_the_cgroups_limit(monkeypatch):
    """Without a host budget given, a cgroup's limit bounds ``auto``'s plan on unified
    memory, as it bounds the host budget."""
    fake_card(monkeypatch, 64 * GIB, unified=True)
    fake_host(monkeypatch, 64 * GIB, GIB, cgroup=(12 * GIB, 2 * GIB))
    budget = wan_shaped().plan().budget
    assert budget == memory.host_facts().budget_bytes - GIB
    assert budget < 10 * GIB


def test_a_discrete_card_plans_without_the_host_budget(monkeypatch):
    """A card's memory is its own: the host budget does not bound the device's plan."""
    fake_card(monkeypatch, 16 * GIB)
    fake_host(monkeypatch, 4 * GIB, GIB, cgroup=(4 * GIB, 2 * GIB))
    pipe = WanShaped(wan_shaped().components, device="cpu", host_memory=2 * GIB)
    assert pipe.plan().budget == 16 * GIB - max(GIB, int(0.08 * 16 * GIB))


@pytest.fixture
def scaled_margins(monkeypatch):
    """The tiny folder's components are KiB: the reserves' floors go, the fractions stay."""
    monkeypatch.setattr(policy_module, "AUTO_HEADROOM_MIN_BYTES", 0)
    monkeypatch.setattr(policy_module, "AUTO_MEASURED_HEADROOM_MIN_BYTES", 0)


def tiny_wan(folder, monkeypatch, denoise_activation_of_card: float):
    """The tiny Wan pipeline on a card shaped as 16 GiB is for the fp8 14B (the
    transformer 85% of it), Denoise's measured activations taking it to
    ``denoise_activation_of_card`` of the card."""
    sizes = ondeck.plan(folder, policy="release").component_bytes
    total = int(sizes["transformer"] / 0.85)
    fake_card(monkeypatch, total)
    pipe = WanTextToVideo.from_folder(folder, device="cpu", progress=False)
    measure(
        pipe,
        {
            "EncodePrompt": 0,
            "PrepareLatents": 0,
            "Denoise": int(total * denoise_activation_of_card) - sizes["transformer"],
            "Decode": 0,
        },
    )
    return pipe, total


def test_a_measured_stage_that_fits_only_the_margin_keeps_its_component_whole(
    saved_wan_folder, monkeypatch, scaled_margins
):
    pipe, total = tiny_wan(saved_wan_folder, monkeypatch, 0.95)  # above 92%, below 98%
    plan = pipe.plan()
    assert plan.budget == total - int(0.02 * total)
    assert plan.fits() and not plan.streamed


def test_measured_activations_that_do_not_fit_still_stream(
    saved_wan_folder, monkeypatch, scaled_margins
):
    pipe, total = tiny_wan(saved_wan_folder, monkeypatch, 1.2)
    plan = pipe.plan()
    assert plan.budget == total - int(0.02 * total)
    assert "transformer" in plan.streamed and plan.fits()


def retried(pipe, stage: str, retries: int, ooms: int = 0, activation: int | None = None):
    """A run of ``stage`` during which the CUDA allocator retried ``retries`` times."""
    index = [use.name for use in pipe.stage_uses()].index(stage)
    need = MEASURED.get(stage) if activation is None else activation
    record = StageRecord(2, stage, 1.0, 0.0, 0, None, need, retries, ooms)
    pipe._stage_measured(index, record)
    pipe.tracker.runs_completed = max(pipe.tracker.runs_completed, 1)  # a run completed


def test_a_stage_whose_allocator_kept_retrying_plans_with_more_reserve(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    stored: list[tuple[str, int]] = []
    monkeypatch.setattr(pipe, "record_activation", lambda stage, n: stored.append((stage, n)))
    measure(pipe, MEASURED)
    step = policy_module.RETRY_RESERVE_STEP_BYTES

    def need(stage):
        return pipe.policy.activation_needs(pipe)[0][stage]

    # The estimate's reserve a stage at the device's limit keeps (see the next test).
    relief = pipe.policy.measured_budget_bytes - pipe.policy.estimated_budget_bytes
    # A stage that ran out of memory (a tiled decode finding its tiles) learns from that;
    # a few stray retries are no step more.
    retried(pipe, "Decode", 60, ooms=20)
    retried(pipe, "Denoise", policy_module.RETRY_RESERVE_MIN_RETRIES - 1)
    assert (need("Denoise"), need("Decode")) == (MEASURED["Denoise"] + relief, MEASURED["Decode"])
    retried(pipe, "Denoise", 40)
    assert need("Denoise") == MEASURED["Denoise"] + relief + step
    assert need("Decode") == MEASURED["Decode"]  # only the stage that retried
    # 13.58 + 1.6 + 0.96 + 0.5 GiB overflow the measured budget of 15.68; without the
    # reserve kept at the device's limit they fit, and the step stays.
    plan = pipe.plan()
    assert plan.fits() and plan.limit_reserve_dropped and not plan.retry_reserve_dropped
    assert "'Denoise' +512.00 MiB" in plan.activation_note
    for _ in range(3):
        retried(pipe, "Denoise", 40)
    assert need("Denoise") == (
        MEASURED["Denoise"] + relief + policy_module.RETRY_RESERVE_MAX_STEPS * step
    )
    # The profile keeps what was measured, never the reserve.
    assert {n for stage, n in stored if stage == "Denoise"} == {MEASURED["Denoise"]}
    # The reserves would overflow (this transformer cannot stream): the run plans
    # without them rather than refusing.
    pipe.policy.before_run(pipe.snapshot())
    assert pipe.policy.skip_retry_reserve
    plan = pipe.plan()
    assert plan.fits() and resident(plan, 2)["Denoise"] == ("transformer",)


def test_a_stage_that_reached_the_devices_limit_keeps_the_estimates_reserve(monkeypatch):
    """A stage whose allocator retried even once ran at the device's limit with the
    estimate's reserve around it. Once runs plan against the measured budget it keeps
    that reserve, and a step more per run where it kept retrying; the other stages
    plan with the measured margin. Before then every stage has the estimate's."""
    fake_card(monkeypatch, 16 * GIB)
    small = {**MEASURED, "Denoise": int(0.2 * GIB)}
    unmeasured = wan_shaped()
    measure(unmeasured, {stage: n for stage, n in small.items() if stage != "Decode"})
    retried(unmeasured, "Denoise", 1, activation=small["Denoise"])
    assert unmeasured.policy.activation_needs(unmeasured)[0]["Denoise"] == small["Denoise"]
    pipe = wan_shaped()
    measure(pipe, small)
    budget = pipe.plan().budget
    relief = pipe.policy.measured_budget_bytes - pipe.policy.estimated_budget_bytes
    assert budget == pipe.policy.measured_budget_bytes and relief > 0
    retried(pipe, "Denoise", 1, activation=small["Denoise"])
    retried(pipe, "EncodePrompt", 0, activation=small["EncodePrompt"])
    needs = pipe.policy.activation_needs(pipe)[0]
    assert needs["Denoise"] == small["Denoise"] + relief
    assert needs["EncodePrompt"] == small["EncodePrompt"]
    retried(pipe, "Denoise", 40, activation=small["Denoise"])
    # A stage that fits its work to its room (a tiled decode) learns from its own retries.
    decode = pipe.stages[[use.name for use in pipe.stage_uses()].index("Decode")]
    monkeypatch.setattr(decode, "fit_activations", lambda need, room: min(need, room))
    retried(pipe, "Decode", 3)
    assert pipe.snapshot().limit_stages == {"Denoise"}
    plan = pipe.plan()
    assert plan.budget == budget and plan.fits()  # 13.58 + 0.2 + 0.96 + 0.5 of 15.68
    assert f"reached the device's limit: 'Denoise' +{format_bytes(relief)}" in (
        plan.activation_note
    )
    assert "'Denoise' +512.00 MiB" in plan.activation_note
    assert resident(plan, 2)["Denoise"] == ("transformer",)


def test_the_reserve_kept_at_the_devices_limit_goes_where_it_alone_would_make_a_run_refuse(
    monkeypatch,
):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    measure(pipe, MEASURED)
    retried(pipe, "Denoise", 1)  # 13.58 + 1.6 + 0.96 GiB overflow 15.68
    plan = pipe.plan()
    assert plan.fits() and plan.limit_reserve_dropped and not plan.retry_reserve_dropped
    assert plan.budget == pipe.policy.measured_budget_bytes
    pipe.policy.before_run(pipe.snapshot())
    assert pipe.policy.skip_limit_reserve and not pipe.policy.skip_retry_reserve
    assert pipe.policy.activation_needs(pipe)[0]["Denoise"] == MEASURED["Denoise"]


def test_the_retry_reserve_streams_a_block_more_where_streaming_can(
    saved_wan_folder, monkeypatch, scaled_margins
):
    pipe, total = tiny_wan(saved_wan_folder, monkeypatch, 0.95)
    assert not pipe.plan().streamed
    monkeypatch.setattr(policy_module, "RETRY_RESERVE_STEP_BYTES", int(0.05 * total))
    retried(pipe, "Denoise", 40, activation=pipe._measured_activation["Denoise"])
    plan = pipe.plan()
    assert "transformer" in plan.streamed and plan.fits()
    assert not pipe.policy.skip_retry_reserve


def test_the_retry_reserve_goes_before_a_stored_profile_that_fits_without_it(monkeypatch, tmp_path):
    import warnings

    fake_card(monkeypatch, 16 * GIB)
    pipe = profiled_wan_shaped(monkeypatch, tmp_path)
    pipe._profile_shape = {"width": 8}  # as after a run of that shape, sizes as declared
    assert pipe.policy.activation_needs(pipe)[0] == MEASURED  # the stored peaks
    for _ in range(2):
        retried(pipe, "Denoise", 40)  # two steps: 13.58 + 1.6 + 1 GiB overflow 15.68
    plan = pipe.plan()
    assert plan.retry_reserve_dropped and not plan.profile_set_aside
    assert not pipe.policy.skip_retry_reserve  # asking for a plan changes nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "set aside" warning
        pipe.policy.before_run(pipe.snapshot())
    assert pipe.policy.skip_retry_reserve and not pipe.policy.distrust_stored
    assert pipe.policy.activation_needs(pipe)[0]["Denoise"] == MEASURED["Denoise"]
    pipe.close()


def test_a_later_process_plans_with_the_reserves_a_stage_earned_at_the_devices_limit(
    monkeypatch, tmp_path
):
    """The profile keeps what the allocator showed beside the peaks: a pipeline built
    later (another process) plans its first run with the reserves an earlier one's
    stage earned, rather than running out of memory to earn them again."""
    from ondeck.profiles import ActivationProfiles

    fake_card(monkeypatch, 16 * GIB)
    small = {**MEASURED, "Denoise": int(0.2 * GIB)}
    first = profiled_wan_shaped(monkeypatch, tmp_path)
    first._profile_shape = {"width": 8}
    measure(first, small)
    retried(first, "Denoise", 40, activation=small["Denoise"])
    relief = first.policy.measured_budget_bytes - first.policy.estimated_budget_bytes
    step = policy_module.RETRY_RESERVE_STEP_BYTES
    earned = first.policy.activation_needs(first)[0]["Denoise"]
    assert earned == small["Denoise"] + relief + step
    first.close()
    # A new process: the file read afresh, the peaks stored as measured.
    store = ActivationProfiles(tmp_path / "profiles.json")
    monkeypatch.setattr(profiles_module, "_default", store)
    assert store.allocator_evidence("wan-shaped", {"width": 8}).retried_runs == {"Denoise": 1}
    for stage, nbytes in small.items():
        store.record("wan-shaped", {"width": 8}, stage, nbytes)
    later = type(first)(wan_shaped().components, device="cpu")
    later._profile_shape = {"width": 8}
    assert later.snapshot().limit_stages == {"Denoise"}
    # Its first run plans against the estimate's budget, whose reserve holds the one
    # kept at the limit, and with the step the retries earned.
    assert later.policy.activation_needs(later)[0]["Denoise"] == small["Denoise"] + step
    plan = later.plan()
    assert plan.budget == later.policy.estimated_budget_bytes
    assert "'Denoise' +512.00 MiB" in plan.activation_note
    later.tracker.runs_completed = 1  # once a run completed, against the measured budget
    assert later.policy.activation_needs(later)[0]["Denoise"] == earned
    plan = later.plan()
    assert plan.budget == later.policy.measured_budget_bytes
    assert f"reached the device's limit: 'Denoise' +{format_bytes(relief)}" in plan.activation_note
    # Another shape has no evidence of its own, and a clean run there stores none, even
    # where the process's own runs of the first shape retried.
    later._profile_shape = {"width": 16}
    assert not later.snapshot().limit_stages and not later.snapshot().retried_stages
    retried(later, "Denoise", 40, activation=small["Denoise"])
    later._profile_shape = {"width": 32}
    retried(later, "Denoise", 0, activation=small["Denoise"])
    assert store.allocator_evidence("wan-shaped", {"width": 16}).retried_runs == {"Denoise": 1}
    evidence = store.allocator_evidence("wan-shaped", {"width": 32})
    assert not evidence.retried_runs and not evidence.limit
    later.close()


def test_stages_computing_from_stored_layers_plan_with_room_for_their_upcast_copies(
    monkeypatch,
):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    upcast = {"text_encoder": 80 << 20, "transformer": 135 << 20}  # the fp8 Wan 14B's
    for name, nbytes in upcast.items():
        monkeypatch.setattr(loader_of(pipe.deferred[name]), "upcast_bytes", nbytes, raising=False)
    copies = policy_module.UPCAST_RESERVE_COPIES

    def need(stage):
        return pipe.policy.activation_needs(pipe)[0][stage]

    assert need("Denoise") is None  # unmeasured: the estimates' reserve covers it
    measure(pipe, MEASURED)
    assert need("Denoise") == MEASURED["Denoise"] + copies * upcast["transformer"]
    assert need("EncodePrompt") == MEASURED["EncodePrompt"] + copies * upcast["text_encoder"]
    assert need("Decode") == MEASURED["Decode"]  # the VAE is not stored
    plan = pipe.plan()
    assert "'Denoise' +270.00 MiB" in plan.activation_note
    # 13.58 + 1.6 + 0.26 GiB still fit the measured budget of 15.68: the fp8 transformer
    # stays whole on a 16 GiB card.
    assert plan.fits() and not plan.streamed
    assert resident(plan, 2)["Denoise"] == ("transformer",)


def test_the_upcast_reserve_goes_where_it_alone_would_make_a_run_refuse(monkeypatch):
    fake_card(monkeypatch, 16 * GIB)
    pipe = wan_shaped()
    loader = loader_of(pipe.deferred["transformer"])
    monkeypatch.setattr(loader, "upcast_bytes", GIB, raising=False)  # 13.58 + 1.6 + 2
    measure(pipe, MEASURED)
    plan = pipe.plan()
    assert plan.retry_reserve_dropped and plan.fits()
    pipe.policy.before_run(pipe.snapshot())
    assert pipe.policy.skip_retry_reserve
    assert pipe.policy.activation_needs(pipe)[0]["Denoise"] == MEASURED["Denoise"]


def test_a_decode_that_works_in_pieces_keeps_no_bound(saved_wan_folder, monkeypatch):
    """A decode sizes its tiles from its own estimate of whole frames; a bound taken for
    its need would grow them (and a decoder learns from what it is told it measured)."""
    pipe, _ = tiny_wan(saved_wan_folder, monkeypatch, 0.5)
    pipe._profile_shape = {"height": 480, "width": 832, "frames": 33}  # as a run sets it
    for index, stage in enumerate(pipe.stages):
        record = StageRecord(2, stage.name, 1.0, 0.0, 0, None, None, activation_bound_bytes=GIB)
        pipe._stage_measured(index, record)
    names = {stage.name for stage in pipe.stages}
    assert "Decode" in names
    assert set(pipe.tracker.activation_bounds) == names - {"Decode"}


def test_a_stored_profile_leaves_bounds_uncounted_and_unmentioned(monkeypatch, tmp_path):
    fake_card(monkeypatch, 16 * GIB)
    pipe = profiled_wan_shaped(monkeypatch, tmp_path)
    pipe._profile_shape = {"width": 8}  # as a run of width 8 sets it
    pipe.tracker.activation_bounds["Denoise"] = int(0.9 * GIB)
    pipe.tracker.runs_completed = 1  # the run that found the bound
    plan = pipe.plan()
    assert plan.activation_bytes["Denoise"] == MEASURED["Denoise"]
    assert "at most" not in plan.activation_note
    pipe.policy.distrust_stored = True  # the profile set aside: nothing stands in for it
    plan = pipe.plan()
    assert plan.activation_bytes["Denoise"] is None
    assert "at most" not in plan.activation_note
