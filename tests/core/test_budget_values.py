"""A budget a library caller gives is read as the command line reads one: a size of no
bytes, a negative one or one that is not a number is refused when the policy is made,
and a policy that uses no budget is not given one silently."""

from __future__ import annotations

import math

import pytest

from ondeck.memory import parse_bytes
from ondeck.policy import make_policy


@pytest.mark.parametrize("value", [math.nan, math.inf, True])
def test_a_size_that_is_not_bytes_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="a size is a finite number of bytes"):
        parse_bytes(value)


def test_sizes_as_numbers_and_units_are_bytes():
    assert parse_bytes(0) == 0
    assert parse_bytes(1.5e3) == 1500
    assert parse_bytes("2KiB") == 2048


@pytest.mark.parametrize("policy", ["budget", "auto"])
@pytest.mark.parametrize("budget", [0, "0GiB", -5])
def test_a_budget_of_no_bytes_is_refused_when_the_policy_is_made(policy, budget):
    with pytest.raises(ValueError, match="at least one byte"):
        make_policy(policy, budget=budget)


@pytest.mark.parametrize("policy", ["eager", "release"])
def test_a_policy_that_uses_no_budget_refuses_one(policy):
    with pytest.raises(ValueError, match="does not use a budget"):
        make_policy(policy, budget="1GiB")
    assert make_policy(policy).name == policy  # without one, it is made


@pytest.mark.parametrize("budget", [0, "0GiB", -1])
def test_a_budget_policy_made_by_hand_refuses_no_bytes(budget):
    from ondeck.policy import BudgetPolicy

    with pytest.raises(ValueError, match="at least one byte"):
        BudgetPolicy(budget)


def test_a_budget_policy_made_by_hand_needs_its_budget():
    from ondeck.policy import BudgetPolicy

    with pytest.raises(ValueError, match="BudgetPolicy needs a budget"):
        BudgetPolicy(None)
    assert BudgetPolicy("1GiB").budget_bytes == 2**30


@pytest.mark.parametrize("given", [{"budget": "2GiB"}, {"prefetch": False}])
def test_a_policy_object_refuses_what_it_would_ignore(given):
    from ondeck.policy import BudgetPolicy

    with pytest.raises(ValueError, match="is for a policy given by name"):
        make_policy(BudgetPolicy("1GiB"), **given)


def test_a_host_cache_and_a_host_budget_read_sizes_and_refuse_no_bytes(tmp_path):
    from ondeck import Pipeline
    from ondeck.loading import HostCache

    assert HostCache("1GiB", pin=False).cap_bytes == 2**30
    with pytest.raises(ValueError, match="a host cache holds at least one byte"):
        HostCache(0, pin=False)
    with pytest.raises(ValueError, match="host_memory holds at least one byte"):
        Pipeline({}, host_memory=0)


def test_a_plan_for_no_bytes_is_refused():
    from ondeck import Pipeline

    class Empty(Pipeline):
        def create_stages(self):
            return []

    pipe = Empty({}, policy="release", device="cpu")
    assert "release" in str(pipe.plan())
    with pytest.raises(ValueError, match="a budget holds at least one byte"):
        pipe.plan("0GiB")


def test_the_meta_device_is_not_a_device_to_compute_on():
    """``from_pretrained`` resolves its device so (after joining a launch's ranks)."""
    from ondeck.memory import usable_device

    with pytest.raises(ValueError, match="device 'meta' holds no weights"):
        usable_device("meta")


def test_a_host_cache_setting_reads_a_size_as_text():
    from ondeck.loading import HostCache

    assert HostCache.from_setting("1GiB").cap_bytes == 2**30
    assert HostCache.from_setting("0") is None
    assert HostCache.from_setting(0) is None


def test_budget_on_a_device_with_nothing_free_is_made_at_one_byte(monkeypatch):
    """``policy="budget"`` without a budget takes what the device has free; where that
    is nothing (or less, after the reserve), the policy is still made, at one byte,
    whose plan refuses the run as any budget too small does, rather than the budget's
    ValueError when the pipeline is made."""
    from ondeck import policy

    monkeypatch.setattr(policy, "auto_budget_bytes", lambda *a, **k: (-(2**20), False))
    assert make_policy("budget").budget_bytes == 1


def test_prefetch_off_reaches_release_however_it_is_chosen():
    assert make_policy("release").prefetch_next_run
    assert not make_policy("release", prefetch=False).prefetch_next_run
