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
