"""Running out of device memory, for real: a cap on what this process may reserve
(torch.cuda.set_per_process_memory_fraction), then what a load or a plan does under it."""

from __future__ import annotations

import pytest
import torch

import ondeck
from ondeck.pipelines.wan import WanTextToVideo

from .conftest import settle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=2)


def wan(folder, policy: str, **options) -> WanTextToVideo:
    return WanTextToVideo.from_folder(
        folder, policy=policy, device="cuda", dtype=torch.float32, progress=False, **options
    )


def test_a_load_that_runs_out_of_memory_is_a_load_error_and_frees_what_it_took(
    default_folder, memory_limit
):
    pipe = wan(default_folder, "release")
    baseline = settle()
    memory_limit(16 * 2**20)  # the text encoder alone takes about 80 MiB

    with pytest.raises(ondeck.LoadError) as caught:
        pipe.generate("a fox", seed=0, **SHAPE)
    message, component = str(caught.value), caught.value.component
    del caught  # its traceback's frames may hold what the load took

    assert component == "text_encoder"
    assert "out of memory while loading" in message
    assert not any(ondeck.is_loaded(proxy) for proxy in pipe.deferred.values())
    assert settle() == baseline, "the failed load gave its device memory back"

    torch.cuda.set_per_process_memory_fraction(1.0)
    frames = pipe.generate("a fox", seed=0, **SHAPE)
    assert frames.shape[1:4] == (5, 32, 32), "the next run, with the memory there, works"


def test_a_budget_the_device_cannot_give_fails_before_loading(default_folder, memory_limit):
    baseline = settle()
    memory_limit(16 * 2**20)  # the device now seems to have 16 MiB free
    pipe = wan(default_folder, "budget")  # no budget given: what the device has free

    with pytest.raises(ondeck.BudgetError, match="nothing was loaded"):
        pipe.generate("a fox", seed=0, **SHAPE)
    assert all(proxy.load_count == 0 for proxy in pipe.deferred.values())
    assert settle() == baseline


def test_out_of_memory_inside_a_stage_frees_what_the_stage_does_not_hold_and_retries(
    tiny_folder,
):
    pipe = wan(tiny_folder, "budget", budget="1GiB")
    pipe.generate("a fox", seed=0, **SHAPE)  # everything fits: all three stay resident
    assert all(ondeck.is_loaded(proxy) for proxy in pipe.deferred.values())
    transformer = pipe.deferred["transformer"].materialize()
    failures = []

    def fail_once(module, args):
        if not failures:
            failures.append(True)
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a real CUDA OOM

    handle = transformer.register_forward_pre_hook(fail_once)
    try:
        frames = pipe.generate("a heron", seed=0, **SHAPE)
    finally:
        handle.remove()

    assert failures == [True]
    assert frames.shape[1:4] == (5, 32, 32)
    # To make room, the retry went without what denoising does not hold: the VAE was
    # released and loaded again to decode; the transformer stayed.
    assert pipe.deferred["vae"].load_count == 2
    assert pipe.deferred["transformer"].load_count == 1
