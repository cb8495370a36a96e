"""A process's first call of a transformer that streams: the room kept for its
activations comes from the tokens the call makes, where that is more than the share of
the budget a turn never measured keeps otherwise; an estimate alone never refuses."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from references import in_fresh_tensors

from ondeck import token_room
from ondeck.arguments import shape_rule
from ondeck.integrations.diffusers.call_shape import token_activations
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions

from .conftest import budget_keeping, transformer_blocks
from .test_diffusers_streaming import SHAPE, frames

WAN_14B = {"ffn_dim": 13824, "num_attention_heads": 40, "attention_head_dim": 128}
HUNYUAN = {"num_attention_heads": 24, "attention_head_dim": 128, "mlp_ratio": 4.0, "patch_size": 2}


class VideoPipe:
    """What a video pipeline shows of its shape: its VAE's scales, its transformer's
    patch, and its call's default frame count (81: frames come as 4k+1)."""

    vae_scale_factor_spatial = 8
    vae_scale_factor_temporal = 4
    transformer = SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2)))

    def __call__(self, prompt=None, height=480, width=832, num_frames=81):
        raise NotImplementedError


class ImagePipe:
    vae_scale_factor = 8
    transformer = SimpleNamespace(config=SimpleNamespace(patch_size=2))

    def __call__(self, prompt=None, height=1024, width=1024, num_images_per_prompt=1):
        raise NotImplementedError


def test_tokens_come_from_the_latents_sides_and_frames_times_the_feed_forward_width():
    factor = token_room.ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH
    wan = token_activations(
        VideoPipe(), WAN_14B, dict(height=480, width=832, num_frames=33), torch.bfloat16
    )
    assert wan == int(30 * 52 * 9 * 13824 * factor * 2)  # 480/16, 832/16, (33-1)/4+1
    # No ffn_dim: mlp_ratio times the heads' width (HunyuanVideo), 4 where it has none.
    hunyuan = token_activations(
        VideoPipe(), HUNYUAN, dict(height=480, width=848, num_frames=33), torch.bfloat16
    )
    assert hunyuan == int(30 * 53 * 9 * 4 * 24 * 128 * factor * 2)
    mmdit = {"num_attention_heads": 38, "attention_head_dim": 64, "patch_size": 2}
    sizes = dict(height=1024, width=1024, num_images_per_prompt=2)
    assert token_activations(ImagePipe(), mmdit, sizes, torch.bfloat16) == int(
        2 * 64 * 64 * 4 * 38 * 64 * factor * 2
    )


@pytest.mark.parametrize(
    "config, sizes",
    [
        ({"d_ff": 10240, "d_model": 4096}, dict(height=480, width=832)),  # a text encoder
        ({"attention_head_dim": 8, "block_out_channels": [320]}, dict(height=64, width=64)),
        (WAN_14B, dict(num_frames=33)),  # no frame size
        (None, dict(height=480, width=832)),
    ],
    ids=["text-encoder", "unet", "no-size", "no-config"],
)
def test_no_estimate_where_the_tokens_or_the_width_are_not_known(config, sizes):
    assert token_activations(VideoPipe(), config, sizes, torch.bfloat16) is None


def test_no_estimate_where_the_pipeline_gives_no_scale_or_takes_any_frame_count():
    class NoScale:
        def __call__(self, prompt=None, height=480, width=832):
            raise NotImplementedError

    class AnyCount(VideoPipe):
        def __call__(self, prompt=None, height=480, width=832, num_frames=88):
            raise NotImplementedError

    sizes = dict(height=480, width=832, num_frames=33)
    assert shape_rule(NoScale()).height_step == 1
    assert token_activations(NoScale(), WAN_14B, sizes, torch.bfloat16) is None
    assert shape_rule(AnyCount()).frame_step is None
    assert token_activations(AnyCount(), WAN_14B, sizes, torch.bfloat16) is None


def _budgeted(folder, share: float = 0.1):
    import ondeck.diffusers

    budget = budget_keeping(transformer_blocks(folder), 3)
    # A turn never measured keeps ``share`` of the budget (10% by default).
    options = StreamOptions(unified=False, unmeasured_activation_fraction=share)
    pipe = ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device="cpu", policy=BudgetPolicy(budget, streaming=options)
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.ondeck.set_plan_shape(
        height=SHAPE["height"], width=SHAPE["width"], frames=SHAPE["num_frames"]
    )
    return pipe, budget


def _estimate_at(pipe, monkeypatch, nbytes: int) -> int:
    """Make the estimate of the call SHAPE asks for ``nbytes`` (the tiny transformer's
    tokens make a few kilobytes): the elements per token and width it takes."""
    spec = pipe.ondeck.deferred["transformer"].spec
    one = (
        token_activations(pipe, spec.config, SHAPE, torch.float32)
        / token_room.ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH
    )
    monkeypatch.setattr(token_room, "ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH", nbytes / one)
    return token_activations(pipe, spec.config, SHAPE, torch.float32)


def test_the_first_call_keeps_room_for_its_tokens_and_later_calls_plan_from_measurements(
    six_block_folder, monkeypatch
):
    pipe, budget = _budgeted(six_block_folder)
    guessed = pipe.ondeck.plan()
    assert guessed.reserved_activation_bytes.get("transformer") == int(budget * 0.1)
    need = _estimate_at(pipe, monkeypatch, int(budget * 0.3))
    plan = pipe.ondeck.plan()
    assert plan.activation_bytes["transformer"] == need
    assert "estimated from the call's tokens: 'transformer'" in str(plan)
    assert plan.overflow() is None
    kept = len(plan.streamed["transformer"].resident)
    assert kept < len(guessed.streamed["transformer"].resident)  # fewer blocks beside it
    # Below the share a turn never measured keeps, the share counts, as before.
    _estimate_at(pipe, monkeypatch, int(budget * 0.05))
    below = pipe.ondeck.plan()
    assert below.activation_bytes["transformer"] is None
    assert below.reserved_activation_bytes["transformer"] == int(budget * 0.1)
    _estimate_at(pipe, monkeypatch, int(budget * 0.3))
    frames(pipe)
    assert len(pipe.ondeck.policy.streaming.stats()["transformer"]["resident_blocks"]) == kept
    assert pipe.ondeck.plan().activation_bytes["transformer"] != need  # measured from now on
    pipe.ondeck.forget_measured("transformer")  # nor does the estimate count where none is
    assert pipe.ondeck.plan().activation_bytes["transformer"] is None


def test_the_plan_names_the_estimate_only_where_it_is_what_the_turn_counts(
    six_block_folder, monkeypatch
):
    """A turn that ran out of memory keeps more room than its tokens make: the plan
    counts that room, and its note no longer says the turn was estimated from them."""
    pipe, budget = _budgeted(six_block_folder)
    need = _estimate_at(pipe, monkeypatch, int(budget * 0.2))
    assert "estimated from the call's tokens: 'transformer'" in str(pipe.ondeck.plan())
    pipe.ondeck._oom_room["transformer"] = int(budget * 0.3)  # as after running out once
    plan = pipe.ondeck.plan()
    assert plan.activation_bytes["transformer"] > need
    assert "estimated from the call's tokens" not in str(plan)


def test_an_estimate_alone_never_refuses_a_call(six_block_folder, monkeypatch):
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(six_block_folder, dtype=torch.float32)
    expected = frames(in_fresh_tensors(plain))
    pipe, budget = _budgeted(six_block_folder)
    _estimate_at(pipe, monkeypatch, 2 * budget)
    assert np.array_equal(frames(pipe), expected)  # no plan asked for before the call
    pipe, budget = _budgeted(six_block_folder)
    plan = pipe.ondeck.plan()
    assert plan.overflow() is None
    assert plan.activation_bytes["transformer"] is None  # never measured, as before
    assert pipe.ondeck.plan(budget).overflow() is None  # the budget given, as the policy's
    # Planning without it changed nothing for later: where it fits, it counts again.
    need = _estimate_at(pipe, monkeypatch, int(budget * 0.3))
    assert pipe.ondeck.plan().activation_bytes["transformer"] == need


def test_a_turn_planned_by_its_tokens_keeps_the_first_runs_reserve_in_later_runs(
    six_block_folder, monkeypatch, tmp_path
):
    """Its first run no longer reaches the card's limit, which is what kept that reserve:
    later runs, and a later process's, keep it as for a turn whose allocator did."""
    from ondeck.profiles import ActivationProfiles

    monkeypatch.setattr("ondeck.profiles._default", ActivationProfiles(tmp_path / "p.json"))
    pipe, budget = _budgeted(six_block_folder)
    _estimate_at(pipe, monkeypatch, int(budget * 0.3))
    assert "transformer" not in pipe.ondeck.snapshot().limit_stages
    frames(pipe)
    assert "transformer" in pipe.ondeck.snapshot().limit_stages
    later = ActivationProfiles(tmp_path / "p.json")  # as a later process reads it
    [(model, _, evidence)] = later.allocator_entries()
    assert model == pipe.ondeck.profile_model and evidence.limit == {"transformer"}
    unstored, _ = _budgeted(six_block_folder)
    unstored.ondeck.profile_model = None  # nothing stored nor looked up: this process alone
    frames(unstored)
    assert "transformer" in unstored.ondeck.snapshot().limit_stages
    unstored.ondeck.forget_measured("transformer")  # replaced: the reserve was the old one's
    assert "transformer" not in unstored.ondeck.snapshot().limit_stages


def _wan_budgeted(folder, monkeypatch, fraction_of_budget: float):
    """ondeck's own Wan stages under the same budget, with Denoise's estimate for SHAPE
    made ``fraction_of_budget`` of it."""
    from ondeck.pipelines.wan import WanTextToVideo

    budget = budget_keeping(transformer_blocks(folder), 3)
    policy = BudgetPolicy(budget, streaming=StreamOptions(unified=False))
    pipe = WanTextToVideo.from_folder(
        folder, policy=policy, dtype=torch.float32, device="cpu", progress=False
    )
    pipe.set_plan_shape(height=SHAPE["height"], width=SHAPE["width"], frames=SHAPE["num_frames"])
    tokens = pipe.geometry.tokens(SHAPE["height"], SHAPE["width"], SHAPE["num_frames"])
    one = tokens * pipe.components["transformer"].config["ffn_dim"] * 4
    monkeypatch.setattr(
        token_room, "ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH", budget * fraction_of_budget / one
    )
    return pipe, budget


def _wan_frames(pipe):
    return pipe.generate("a fox", negative_prompt="blurry", seed=7, **SHAPE)


def test_wan_stages_denoise_keeps_room_for_its_tokens_in_the_first_run(
    six_block_folder, monkeypatch
):
    pipe, budget = _wan_budgeted(six_block_folder, monkeypatch, 0.05)
    guessed = pipe.plan()  # below the share a stage never measured keeps: as before
    assert guessed.reserved_activation_bytes.get("Denoise") == int(budget * 0.1)
    pipe, budget = _wan_budgeted(six_block_folder, monkeypatch, 0.3)
    plan = pipe.plan()
    assert plan.activation_bytes["Denoise"] == pytest.approx(budget * 0.3, rel=1e-6)
    assert "estimated from the call's tokens: 'Denoise'" in str(plan)
    kept = len(plan.streamed["transformer"].resident)
    assert kept < len(guessed.streamed["transformer"].resident)
    _wan_frames(pipe)
    assert len(pipe.policy.streaming.stats()["transformer"]["resident_blocks"]) == kept
    assert "Denoise" in pipe.snapshot().limit_stages  # later runs keep the first's reserve


def test_wan_stages_run_where_the_estimate_alone_would_refuse(six_block_folder, monkeypatch):
    from ondeck.pipelines.wan import WanTextToVideo

    reference = WanTextToVideo.from_folder(
        six_block_folder, policy="release", dtype=torch.float32, device="cpu", progress=False
    )
    expected = _wan_frames(reference)
    pipe, _ = _wan_budgeted(six_block_folder, monkeypatch, 2.0)
    assert np.array_equal(_wan_frames(pipe), expected)  # no plan asked for before the run
    pipe, _ = _wan_budgeted(six_block_folder, monkeypatch, 2.0)
    plan = pipe.plan()
    assert plan.overflow() is None and plan.activation_bytes["Denoise"] is None


def test_a_larger_share_kept_for_turns_never_measured_is_never_cut_by_an_estimate(
    six_block_folder, monkeypatch
):
    pipe, budget = _budgeted(six_block_folder, share=0.4)
    _estimate_at(pipe, monkeypatch, int(budget * 0.3))
    plan = pipe.ondeck.plan()
    assert plan.activation_bytes["transformer"] is None
    assert plan.reserved_activation_bytes["transformer"] == int(budget * 0.4)
