"""What the memory tracker counts as a stage's activations."""

from __future__ import annotations

from ondeck.memory import MemoryTracker

GiB = 2**30


def measured_stage(loading_bytes: int) -> int | None:
    """A stage with 2 GiB resident whose device peak reached 10 GiB."""
    tracker = MemoryTracker(device="cpu")
    tracker._device_peak = lambda: 10 * GiB  # as a CUDA device would report it
    tracker.run_started()
    tracker.loaded("text_encoder", 2 * GiB, 0.1)
    tracker.stage_started("PrepareLatents")
    tracker.compute_started()
    return tracker.stage_finished("PrepareLatents", loading_bytes).activation_bytes


def test_weights_still_arriving_from_a_prefetch_are_not_activations():
    # 6 GiB of a component loading in the background when the stage ended.
    assert measured_stage(6 * GiB) == 2 * GiB
    assert measured_stage(0) == 8 * GiB
