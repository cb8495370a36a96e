"""The room a first run keeps for a transformer's tokens, from its config and the call."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ondeck.streaming.layout import UNMEASURED_ACTIVATION_FRACTION
from ondeck.token_room import TokenRoom, feed_forward_width, token_bytes

BUDGET = 10_000


def pipeline(stages: dict[str, set[str]], share: float = 0.0):
    """A pipeline under a budget whose ``stages`` hold the named components."""
    options = SimpleNamespace(unmeasured_activation_fraction=share)
    policy = SimpleNamespace(budget_bytes=BUDGET, streaming=SimpleNamespace(options=options))

    def stages_holding(name: str) -> set[str]:
        return {stage for stage, names in stages.items() if name in names}

    return SimpleNamespace(policy=policy, stages_holding=stages_holding)


def snapshot(stored=None, measured=None, runs=0):
    return SimpleNamespace(
        runs_completed=runs, stored_activation=stored or {}, measured_activation=measured or {}
    )


def test_stored_fp8_weights_compute_in_two_bytes_an_element_at_least():
    assert token_bytes(100, 64, torch.float8_e4m3fn) == token_bytes(100, 64, torch.bfloat16)
    assert token_bytes(100, 64, torch.float32) == 2 * token_bytes(100, 64, torch.bfloat16)


def test_a_config_with_heads_but_no_patch_size_has_no_feed_forward_width():
    heads = {"num_attention_heads": 8, "attention_head_dim": 64}
    assert feed_forward_width(heads) is None, "a UNet's or an encoder's: no tokens of patches"
    assert feed_forward_width({**heads, "patch_size": 2}) == 4 * 8 * 64


def test_an_estimate_counts_only_above_a_tenth_of_the_budget_however_small_the_share():
    stages = {"denoise": {"transformer"}}
    small = BUDGET * UNMEASURED_ACTIVATION_FRACTION / 2
    room = TokenRoom()
    assert (
        room.needs(pipeline(stages, share=0.02), snapshot(), lambda: {"transformer": small}) == {}
    )
    large = BUDGET * UNMEASURED_ACTIVATION_FRACTION * 3
    needs = room.needs(pipeline(stages, share=0.02), snapshot(), lambda: {"transformer": large})
    assert needs == {"denoise": large}


def test_a_stage_measured_or_stored_is_not_estimated():
    stages = {"denoise": {"transformer"}, "refine": {"refiner"}}
    need = BUDGET // 2
    estimates = {"transformer": need, "refiner": need}
    room = TokenRoom()
    assert room.needs(pipeline(stages), snapshot(stored={"denoise": 1}), lambda: estimates) == {
        "refine": need
    }
    assert room.needs(pipeline(stages), snapshot(measured={"refine": 1}), lambda: estimates) == {
        "denoise": need
    }
    assert room.needs(pipeline(stages), snapshot(runs=1), lambda: estimates) == {}, "run 2"


def test_a_stage_of_two_estimated_components_keeps_the_larger_estimate():
    stages = {"denoise": {"high", "low"}}
    estimates = {"high": BUDGET // 2, "low": BUDGET // 3}
    for order in (estimates, dict(reversed(list(estimates.items())))):
        needs = TokenRoom().needs(pipeline(stages), snapshot(), lambda order=order: order)
        assert needs == {"denoise": BUDGET // 2}


def test_the_reserve_for_a_streaming_stage_stands_in_only_where_nothing_is_known():
    from ondeck.streaming import BlockStreaming

    streaming = BlockStreaming()
    streaming.reserved = {"denoise": 1_000, "decode": 2_000}
    merged = streaming.with_reserved({"denoise": 3_000, "decode": None, "encode": 500})
    assert merged == {"denoise": 3_000, "decode": 2_000, "encode": 500}
