"""Decoding in tiles on CUDA: after a real out-of-memory error, and planned ahead, with
the device bytes it saves measured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ondeck.pipelines.wan import Decode, WanTextToVideo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = dict(height=256, width=256, num_frames=5, num_inference_steps=2)


@pytest.fixture(autouse=True)
def profiles(tmp_path, monkeypatch):
    """Activation profiles of this test alone: no other test's measurements plan tiles."""
    import ondeck.profiles

    monkeypatch.setattr(
        ondeck.profiles, "_default", ondeck.profiles.ActivationProfiles(tmp_path / "profiles.json")
    )


def wan(folder, policy, **options) -> WanTextToVideo:
    pipe = WanTextToVideo.from_folder(
        folder, policy=policy, device="cuda", dtype=torch.float32, progress=False, **options
    )
    pipe.tracker.reset_peaks = True  # every stage's activations measured exactly
    return pipe


def decode_stage(pipe) -> Decode:
    return next(stage for stage in pipe.stages if isinstance(stage, Decode))


def decode_activation_bytes(pipe) -> int:
    return [s for s in pipe.tracker.stages if s.stage == decode_stage(pipe).name][
        -1
    ].activation_bytes


def mean_difference(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


@pytest.fixture
def whole_frames(tiny_folder):
    pipe = wan(tiny_folder, "release")
    frames = pipe.generate("a fox", seed=3, **SHAPE)
    assert decode_stage(pipe).last_tiles is None
    return frames, decode_activation_bytes(pipe)


def test_a_whole_frame_decode_out_of_memory_on_cuda_is_retried_in_tiles(
    tiny_folder, whole_frames, monkeypatch
):
    from diffusers import AutoencoderKLWan

    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        attempts.append(self.use_tiling)
        if not self.use_tiling:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # CUDA's own OOM
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    pipe = wan(tiny_folder, "release")
    frames = pipe.generate("a fox", seed=3, **SHAPE)

    assert attempts == [False, True]
    assert decode_stage(pipe).last_tiles.area <= 0.5
    assert mean_difference(frames, whole_frames[0]) < 0.05
    assert pipe.components["vae"].use_tiling is False, "the VAE is left as it was found"


def test_a_planned_tiled_decode_needs_fewer_device_bytes(tiny_folder, whole_frames):
    frames, whole_activation = whole_frames
    pipe = wan(tiny_folder, "budget", budget="1GiB")
    room = pipe.policy.budget_bytes - pipe.component_bytes()["vae"]
    # As if an earlier run had measured a whole-frame decode three times the room left.
    pipe.set_plan_shape(height=SHAPE["height"], width=SHAPE["width"], frames=SHAPE["num_frames"])
    pipe.record_activation(decode_stage(pipe).name, 3 * room)

    tiled = pipe.generate("a fox", seed=3, **SHAPE)

    tiles = decode_stage(pipe).last_tiles
    assert tiles is not None and tiles.area <= 0.85 / 3
    assert mean_difference(tiled, frames) < 0.05
    tiled_activation = decode_activation_bytes(pipe)
    assert 0 < tiled_activation < whole_activation, (tiled_activation, whole_activation)
