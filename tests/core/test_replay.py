"""Calls on a proxy replay after a reload in their original order, with their own arguments."""

from __future__ import annotations

import pytest
import torch

from ondeck.lazy import ReplayLog

from .helpers import lazy_linear


def reloaded(proxy):
    proxy.release()
    return proxy.materialize()


def test_a_dtype_set_before_a_device_survives_the_reload():
    proxy, _ = lazy_linear()
    proxy.to(torch.float16)
    proxy.to("cpu")
    assert reloaded(proxy).weight.dtype == torch.float16


def test_the_last_of_two_dtypes_wins_after_the_reload():
    proxy, _ = lazy_linear()
    proxy.half()
    proxy.to(torch.float64)
    proxy.eval()
    module = reloaded(proxy)
    assert module.weight.dtype == torch.float64
    assert not module.training


@pytest.mark.parametrize(
    "calls, dtype, training, grad",
    [
        (
            [("requires_grad_", (False,)), ("train", ()), ("bfloat16", ())],
            torch.bfloat16,
            True,
            False,
        ),
        (
            [("eval", ()), ("float", ()), ("train", ()), ("requires_grad_", (True,))],
            torch.float32,
            True,
            True,
        ),
        (
            [
                ("to", (torch.float16,)),
                ("requires_grad_", (False,)),
                ("to", ("cpu", torch.float64)),
            ],
            torch.float64,
            True,
            False,
        ),
        (
            [("double", ()), ("eval", ()), ("to", ("cpu",)), ("half", ())],
            torch.float16,
            False,
            True,
        ),
    ],
)
def test_interleavings_reload_to_the_state_they_left(calls, dtype, training, grad):
    proxy, _ = lazy_linear()
    for method, args in calls:
        getattr(proxy, method)(*args)
    before = proxy.materialize()
    state = (before.weight.dtype, before.training, before.weight.requires_grad)
    assert state == (dtype, training, grad)
    module = reloaded(proxy)
    assert (module.weight.dtype, module.training, module.weight.requires_grad) == state


def test_the_log_keeps_only_what_later_calls_do_not_override():
    log = ReplayLog()
    for _ in range(100):
        log.add("to", ("cpu",), {})
        log.add("eval", (), {})
    log.add("half", (), {})
    log.add("to", ("cpu", torch.float32), {})
    assert [method for method, _, _ in log] == ["eval", "to"]


def test_partial_overrides_keep_both_calls_in_order():
    log = ReplayLog()
    log.add("to", (torch.float16,), {})
    log.add("to", ("cpu",), {})
    assert [args for _, args, _ in log] == [(torch.float16,), ("cpu",)]


def test_replayed_calls_follow_transforms():
    proxy, _ = lazy_linear()
    proxy.add_transform(lambda module: module.double())
    proxy.half()
    assert reloaded(proxy).weight.dtype == torch.float16
