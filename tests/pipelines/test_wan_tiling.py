"""Decoding in tiles when whole frames would not fit what the budget or device leaves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ondeck.embedded import build_wan_folder
from ondeck.pipelines.wan import Decode, WanTextToVideo, decode_tiles
from ondeck.tiles import estimated_need, smallest_tiles, tiles_for

SHAPE = dict(height=64, width=64, num_frames=5, num_inference_steps=2)


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")


def wan(folder, policy, **options):
    return WanTextToVideo.from_folder(
        folder, policy=policy, dtype=torch.float32, device="cpu", progress=False, **options
    )


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """Activation profiles of this test alone."""
    import ondeck.profiles

    monkeypatch.setattr(
        ondeck.profiles, "_default", ondeck.profiles.ActivationProfiles(tmp_path / "profiles.json")
    )


def as_if_decode_measured(pipe, nbytes: int) -> None:
    """Record a whole-frame decode of ``nbytes`` at SHAPE, as an earlier run would have."""
    pipe.set_plan_shape(height=SHAPE["height"], width=SHAPE["width"], frames=SHAPE["num_frames"])
    pipe.record_activation(decode_stage(pipe).name, nbytes)


def decode_stage(pipe) -> Decode:
    return next(stage for stage in pipe.stages if isinstance(stage, Decode))


@pytest.mark.parametrize("height, width", [(480, 832), (720, 1280), (64, 64)])
@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.2, 0.06])
def test_tiles_are_no_larger_than_asked_and_stride_whole_latent_pixels(height, width, fraction):
    tiles = decode_tiles(height, width, fraction)
    if tiles is None:
        assert (height, width) == (64, 64) and fraction < 0.2  # too small a frame to split so
        return
    assert tiles.area <= fraction
    assert tiles.area == pytest.approx(
        min(tiles.height, height) * min(tiles.width, width) / (height * width)
    )
    assert tiles.stride_height % 8 == 0 and tiles.stride_width % 8 == 0
    assert tiles.height >= tiles.stride_height and tiles.width >= tiles.stride_width
    # The strides cover the frame in at most the tiles counted.
    assert math.ceil(height / tiles.stride_height) * math.ceil(width / tiles.stride_width) <= (
        tiles.count
    )


def test_fewest_tiles_first_split_along_the_longer_side():
    tiles = decode_tiles(480, 832, 0.7)
    assert tiles.count == 2
    assert tiles.height == 480 and tiles.width < 832
    assert decode_tiles(480, 832, 1e-4) is None


def test_no_tile_advances_by_less_than_two_latent_pixels():
    """A side of 16 pixels (two latent pixels) is not split, whatever the room: a tile one
    latent pixel wide gives the VAE's attention a sequence of one, which CUDA's fused
    attention refuses ("query is not correctly aligned")."""
    assert decode_tiles(16, 16, 0.3) is None  # four tiles of 8x8 would be a quarter
    assert smallest_tiles(16, 16) is None
    assert tiles_for(16, 16, need=10**9, room=1) is None  # whole frames, then
    split = decode_tiles(16, 64, 0.4)
    assert (split.height, split.stride_width, split.count) == (16, 16, 4)


@pytest.fixture(scope="module")
def whole_frames(wan_folder):
    pipe = wan(wan_folder, "release")
    frames = pipe.generate("a fox", seed=3, **SHAPE)
    assert decode_stage(pipe).last_tiles is None and decode_stage(pipe).last_retries == 0
    return frames


def close(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


def tiled_as_the_vae_tiles(folder, frames, tiles) -> bool:
    """Whether ``frames`` are what the VAE's own tiling gives with ``tiles`` (enabled on a
    pipeline with room for whole frames): a tiled decode differs from whole frames by
    how the tiles blend, which the VAE decides, not ondeck."""

    def tiling(vae):
        vae.enable_tiling(
            tile_sample_min_height=tiles.height,
            tile_sample_min_width=tiles.width,
            tile_sample_stride_height=tiles.stride_height,
            tile_sample_stride_width=tiles.stride_width,
        )
        return vae

    pipe = wan(folder, "release")
    pipe.components["vae"].add_transform(tiling)
    return np.array_equal(frames, pipe.generate("a fox", seed=3, **SHAPE))


def test_decode_runs_in_tiles_when_the_budget_leaves_too_little_room(
    wan_folder, whole_frames, profiles
):
    pipe = wan(wan_folder, "budget", budget="1GiB")
    room = pipe.policy.budget_bytes - pipe.component_bytes()["vae"]
    as_if_decode_measured(pipe, 3 * room)
    frames = pipe.generate("a fox", seed=3, **SHAPE)
    tiles = decode_stage(pipe).last_tiles
    assert tiles is not None and tiles.area <= 0.85 / 3
    assert frames.shape == whole_frames.shape
    assert tiled_as_the_vae_tiles(wan_folder, frames, tiles)
    assert not np.array_equal(frames, whole_frames), "tiles blend otherwise than whole frames"


def test_plan_counts_a_tiled_decode_at_what_fits(wan_folder, profiles):
    pipe = wan(wan_folder, "budget", budget="1GiB")
    budget = pipe.policy.budget_bytes
    as_if_decode_measured(pipe, 3 * budget)
    plan = pipe.plan()
    assert plan.overflow() is None
    assert plan.peak_bytes <= budget
    assert "'Decode' works in pieces to fit" in str(plan)

    fixed = wan(wan_folder, "budget", budget="1GiB", vae_tiling=False)
    fixed.set_plan_shape(height=64, width=64, frames=5)
    # A stored peak never blocks a plan or a run that fits without it: it is set aside,
    # and the run measures again.
    plan = fixed.plan()
    assert plan.profile_set_aside and plan.overflow() is None
    assert "ondeck profiles --clear" in str(plan)
    with pytest.warns(UserWarning, match="set aside in this run"):
        fixed.generate("a fox", seed=3, **SHAPE)


def whole_frames_run_out_of_memory(monkeypatch) -> list[bool]:
    """Make a whole-frame VAE decode run out of memory, a tiled one work; returns the
    decodes attempted (True: in tiles)."""
    from diffusers import AutoencoderKLWan

    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        attempts.append(self.use_tiling)
        if not self.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    return attempts


def test_whole_frame_decode_out_of_memory_is_retried_in_tiles(
    wan_folder, whole_frames, monkeypatch
):
    attempts = whole_frames_run_out_of_memory(monkeypatch)
    pipe = wan(wan_folder, "release")
    frames = pipe.generate("a fox", seed=3, **SHAPE)
    assert attempts == [False, True]
    assert decode_stage(pipe).last_tiles.area <= 0.5
    assert decode_stage(pipe).last_retries == 1
    assert tiled_as_the_vae_tiles(wan_folder, frames, decode_stage(pipe).last_tiles)
    # The VAE is left as it was found: whole frames by default.
    assert pipe.components["vae"].use_tiling is False


def test_a_first_decode_tiles_by_the_vaes_config_instead_of_running_out_first(
    wan_folder, whole_frames, profiles, monkeypatch
):
    """No decode measured or stored yet: whole frames' need is estimated from the VAE's
    config (as the diffusers integration estimates it), so a decode with too little
    room tiles at once instead of first running out of memory in whole frames."""
    attempts = whole_frames_run_out_of_memory(monkeypatch)
    pipe = wan(wan_folder, "budget", budget="1500KiB")
    stage = decode_stage(pipe)
    latent_shape = (1, 16, 2, SHAPE["height"] // 8, SHAPE["width"] // 8)
    estimate = estimated_need(pipe.components["vae"].config, latent_shape, 4)
    assert estimate > pipe.policy.budget_bytes  # whole frames cannot fit
    frames = pipe.generate("a fox", seed=3, **SHAPE)
    assert attempts == [True]  # in tiles from the first attempt
    assert stage.last_retries == 0 and stage.last_tiles is not None
    assert tiled_as_the_vae_tiles(wan_folder, frames, stage.last_tiles)
    # With room for the estimate, whole frames are tried first, as before.
    attempts.clear()
    wan(wan_folder, "budget", budget="1GiB").generate("a fox", seed=3, **SHAPE)
    assert attempts[0] is False


def test_tiles_that_fit_once_room_is_made_are_planned_again_no_finer(
    wan_folder, whole_frames, profiles, monkeypatch
):
    """A first decode in estimated tiles runs out of memory only because of what the
    policy kept beside it: once that goes the same tiles fit. What the run stores plans
    those tiles (or coarser ones) in the room made, not finer ones from the failed
    attempt's room."""
    from diffusers import AutoencoderKLWan

    from ondeck.lazy import is_loaded

    pipe = wan(wan_folder, "budget", budget="1500KiB")
    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        others = [n for n in ("text_encoder", "transformer") if is_loaded(pipe.deferred[n])]
        attempts.append((self.use_tiling, bool(others)))
        if others and not attempts[:-1]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    decode_measures(pipe, monkeypatch, 123)  # the failed attempt's peak: not a need
    pipe.generate("a fox", seed=3, **SHAPE)
    stage = decode_stage(pipe)
    assert attempts == [(True, True), (True, False)] and stage.last_retries == 1
    first = stage.last_tiles
    assert pipe.activation_need(stage.name) is not None  # what the run stored
    pipe.generate("a fox", seed=4, **SHAPE)
    assert stage.last_retries == 0 and stage.last_tiles.area >= first.area


def test_tiles_stride_whole_latent_pixels_of_a_16x_vae():
    from types import SimpleNamespace

    stage = Decode(vae=None, geometry=SimpleNamespace(scale_spatial=16))
    planned = stage._tiles(480, 832, need=10 * 2**30, room=4 * 2**30)
    capped = stage._capped(480, 832, None, 0.3)
    for tiles in (planned, capped):
        assert tiles is not None and tiles.area <= 0.5
        assert tiles.stride_height % 16 == 0 and tiles.stride_width % 16 == 0
    assert stage._capped(480, 832, planned, None) is planned  # no cap: as planned


def test_a_tile_size_that_ran_out_of_memory_is_not_tried_again_next_run(
    wan_folder, whole_frames, monkeypatch
):
    from diffusers import AutoencoderKLWan

    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        # Fits only in tiles of at most a quarter of the frame.
        attempts.append(self.use_tiling)
        area = 1.0
        if self.use_tiling:
            area = self.tile_sample_min_height * self.tile_sample_min_width / (64 * 64)
        if area > 0.6:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    pipe = wan(wan_folder, "release")
    first = pipe.generate("a fox", seed=3, **SHAPE)
    stage = decode_stage(pipe)
    assert stage.last_retries >= 1 and len(attempts) == stage.last_retries + 1
    worked = stage.last_tiles
    attempts.clear()
    second = pipe.generate("a fox", seed=3, **SHAPE)
    assert attempts == [True]  # straight to the tiles that decoded last time
    assert stage.last_retries == 0 and stage.last_tiles == worked
    assert torch.equal(torch.as_tensor(first), torch.as_tensor(second))
    assert tiled_as_the_vae_tiles(wan_folder, second, worked)
    pipe.generate("a fox", seed=3, output_type="latent", **SHAPE)
    assert stage.last_tiles is None and stage.last_retries == 0  # no decode this run


def test_without_tiling_out_of_memory_in_decode_is_raised(wan_folder, monkeypatch):
    from diffusers import AutoencoderKLWan

    def decode(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    pipe = wan(wan_folder, "release", vae_tiling=False)
    with pytest.raises(torch.OutOfMemoryError):
        pipe.generate("a fox", seed=3, **SHAPE)


def decode_measures(pipe, monkeypatch, nbytes: int) -> None:
    """Make the tracker report ``nbytes`` of activations for every decode (the CPU
    measures none), as a CUDA run would."""
    import dataclasses

    tracker = pipe.tracker
    real = tracker.stage_finished
    name = decode_stage(pipe).name

    def finished(stage, *args, **kwargs):
        record = real(stage, *args, **kwargs)
        if stage == name:
            record = dataclasses.replace(record, activation_bytes=nbytes)
        return record

    monkeypatch.setattr(tracker, "stage_finished", finished)


def test_a_tiled_decode_is_remembered_at_what_whole_frames_would_take(
    wan_folder, profiles, monkeypatch
):
    pipe = wan(wan_folder, "budget", budget="1GiB")
    room = pipe.policy.budget_bytes - pipe.component_bytes()["vae"]
    as_if_decode_measured(pipe, 3 * room)
    tile_peak = 10 * 2**20
    decode_measures(pipe, monkeypatch, tile_peak)
    pipe.generate("a fox", seed=3, **SHAPE)
    tiles = decode_stage(pipe).last_tiles
    assert tiles is not None and tiles.area < 0.5
    # One tile's peak is not the whole frames' need: stored as the tile's over its area.
    assert pipe.activation_need(decode_stage(pipe).name) == int(tile_peak / tiles.area)

    pipe.generate("a fox", seed=3, output_type="latent", **SHAPE)
    # No decode this run: nothing about a decode's need is learnt.
    assert pipe.activation_need(decode_stage(pipe).name) == int(tile_peak / tiles.area)


def test_a_decode_that_ran_out_of_memory_is_remembered_as_needing_more_than_the_room(
    wan_folder, whole_frames, profiles, monkeypatch
):
    attempts = whole_frames_run_out_of_memory(monkeypatch)
    pipe = wan(wan_folder, "budget", budget="1GiB")
    pipe.set_plan_shape(height=SHAPE["height"], width=SHAPE["width"], frames=SHAPE["num_frames"])
    assert pipe.activation_need(decode_stage(pipe).name) is None
    # The failed whole-frame attempt's peak would be the room itself: not a need.
    decode_measures(pipe, monkeypatch, 123)
    pipe.generate("a fox", seed=3, **SHAPE)
    stage = decode_stage(pipe)
    # Whole frames, again once the budget let go of the other components, then tiles.
    assert attempts == [False, False, True] and stage.last_retries == 2
    room = pipe.policy.budget_bytes - pipe.component_bytes()["vae"]
    need = pipe.activation_need(stage.name)
    assert need is not None and need > room  # whole frames needed more than that

    # A new pipeline (a later command) plans tiles from that and does not run out again.
    attempts.clear()
    again = wan(wan_folder, "budget", budget="1GiB")
    frames = again.generate("a fox", seed=3, **SHAPE)
    assert attempts == [True] and decode_stage(again).last_retries == 0
    assert tiled_as_the_vae_tiles(wan_folder, frames, decode_stage(again).last_tiles)


def test_a_decode_out_of_memory_first_frees_what_the_policy_lets_go(
    wan_folder, whole_frames, profiles, monkeypatch
):
    from diffusers import AutoencoderKLWan

    from ondeck.lazy import is_loaded

    pipe = wan(wan_folder, "budget", budget="1GiB")
    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        # Whole frames fit only once nothing else is on the device.
        others = [n for n in ("text_encoder", "transformer") if is_loaded(pipe.deferred[n])]
        attempts.append((self.use_tiling, others))
        if others:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    frames = pipe.generate("a fox", seed=3, **SHAPE)
    # Everything fits the budget, so the budget kept the other components for the next
    # run: they go, and whole frames decode.
    assert attempts == [(False, ["text_encoder", "transformer"]), (False, [])]
    stage = decode_stage(pipe)
    assert stage.last_tiles is None and stage.last_retries == 1
    assert close(frames, whole_frames) < 1e-6


@pytest.mark.parametrize("height, width", [(64, 64), (256, 256)])
def test_first_tiles_keep_a_safety_share_of_the_room_free(height, width):
    """Whole frames needing twice the room: tiles of at most TILE_SAFETY of half the frame,
    where half the frame alone would leave nothing for what the estimate does not see."""
    from types import SimpleNamespace

    from ondeck.tiles import TILE_SAFETY

    room = 2**30
    assert decode_tiles(height, width, 0.5).area > TILE_SAFETY / 2  # half is not enough
    stage = Decode(vae=None, geometry=SimpleNamespace(scale_spatial=8))
    for tiles in (
        tiles_for(height, width, 2 * room, room),
        stage._tiles(height, width, 2 * room, room),
    ):
        assert tiles is not None and tiles.area <= TILE_SAFETY * room / (2 * room)


def test_the_estimated_need_counts_the_widest_level_of_the_vae():
    shape = (1, 4, 8, 8)  # an image's latents: 64x64 pixels at 8x
    need = {
        tuple(channels): estimated_need(
            {"spatial_compression_ratio": 8, "block_out_channels": channels}, shape, 2
        )
        for channels in ([32, 32], [32, 128], [128, 32], [128, 128])
    }
    assert need[(32, 128)] == need[(128, 32)] == need[(128, 128)] == 4 * need[(32, 32)]
    wan_like = {"scale_factor_spatial": 8, "base_dim": 32, "dim_mult": [1, 2, 4, 4]}
    assert estimated_need(wan_like, shape, 2) == need[(128, 128)]


def test_a_wan_config_without_a_spatial_scale_compresses_once_per_downsampling_level():
    """Wan's VAE halves each side at every level, whether that level also halves time:
    ``temperal_downsample`` [False, True, True] is 8x per side. (diffusers 0.42's
    AutoencoderKLWan always has ``scale_factor_spatial`` in its config; an older config
    read as it is has only this.)"""
    from ondeck.tiles import spatial_scale

    assert spatial_scale({"temperal_downsample": [False, True, True]}) == 8
    assert spatial_scale({"temperal_downsample": [False, False, False, True]}) == 16


def test_out_of_memory_even_in_the_finest_tiles_is_raised_after_a_few_attempts(
    wan_folder, monkeypatch
):
    from diffusers import AutoencoderKLWan

    attempts = []

    def decode(self, *args, **kwargs):
        attempts.append(self.use_tiling)
        if len(attempts) > 50:
            raise AssertionError("the decode is retried without end")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    pipe = wan(wan_folder, "release")
    with pytest.raises(torch.OutOfMemoryError, match="even in 8x8 tiles"):
        pipe.generate("a fox", seed=3, **SHAPE)
    assert attempts[0] is False and attempts[-1] is True
    assert len(attempts) <= 10


def test_a_load_that_fails_during_the_decode_is_raised_not_retried_in_tiles(
    wan_folder, monkeypatch
):
    """A LoadError caused by running out of memory is the policy's to handle: the
    decode does not take it for its own and retry in tiles that would have fitted."""
    from diffusers import AutoencoderKLWan

    from ondeck.errors import LoadError

    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        attempts.append(self.use_tiling)
        if not self.use_tiling:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
            except torch.OutOfMemoryError as error:
                raise LoadError("component 'vae': out of memory while loading") from error
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    pipe = wan(wan_folder, "release")
    with pytest.raises(LoadError, match="vae"):
        pipe.generate("a fox", seed=3, **SHAPE)
    assert attempts == [False]
    assert decode_stage(pipe).last_retries == 0


def test_tiles_that_decoded_after_running_out_are_planned_again_with_the_same_room(
    wan_folder, monkeypatch
):
    """The room is as large as when the decode ran out: the tiles it decoded in then are
    where the next run starts, not the whole frames the config's estimate asks for."""
    from diffusers import AutoencoderKLWan

    real_decode = AutoencoderKLWan.decode
    attempts = []

    def decode(self, *args, **kwargs):
        attempts.append(self.use_tiling)  # fits only in tiles of less than half the frame
        area = 1.0
        if self.use_tiling:
            area = self.tile_sample_min_height * self.tile_sample_min_width / (64 * 64)
        if area > 0.4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKLWan, "decode", decode)
    pipe = wan(wan_folder, "release")
    monkeypatch.setattr(pipe, "activation_room", lambda: 2**30)  # whole frames' estimate fits
    pipe.generate("a fox", seed=3, **SHAPE)
    stage = decode_stage(pipe)
    assert attempts[0] is False and stage.last_retries >= 1
    worked = stage.last_tiles
    attempts.clear()
    pipe.generate("a fox", seed=3, **SHAPE)
    assert attempts == [True] and stage.last_retries == 0
    assert stage.last_tiles == worked
