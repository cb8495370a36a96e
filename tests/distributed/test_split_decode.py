"""The Wan VAE's decode split across two CPU processes (gloo) against a whole decode."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ondeck.pipelines.split_decode import MAX_SLAB_SHARE, decoder_margin, plan_slab
from ondeck.pipelines.wan import WanTextToVideo

from .test_sharded import WORLD_SIZE, needs_gloo, run_ranks


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """The tiny folder with a VAE whose output depends on its neighbourhood: the random
    initialisation's small weights make the decode almost constant, so a slab's cut
    edges would not show. Convolutions get He-scaled weights instead."""
    from diffusers import AutoencoderKLWan

    from ondeck.embedded import build_wan_folder

    folder = build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")
    vae = AutoencoderKLWan.from_pretrained(Path(folder) / "vae")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.modules.conv._ConvNd):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0, (2 / fan_in) ** 0.5, generator=generator)
    vae.save_pretrained(Path(folder) / "vae")
    return folder


@pytest.fixture(scope="module")
def ranks(wan_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("split-ranks")
    seen = run_ranks("split_decode_worker.py", str(wan_folder), out=out, timeout=300)
    return {"out": out, "seen": seen}


# -- pure: the slabs -------------------------------------------------------------------------


def test_slabs_split_the_longer_side_and_cover_it():
    slabs = [plan_slab(60, 104, rank, 2, 18) for rank in range(2)]
    assert [s.dim for s in slabs] == [-1, -1]
    assert [(s.own_start, s.own_count) for s in slabs] == [(0, 52), (52, 52)]
    assert [(s.start, s.stop) for s in slabs] == [(0, 70), (34, 104)]
    tall = plan_slab(104, 60, 1, 2, 18)
    assert (tall.dim, tall.start, tall.stop) == (-2, 34, 104)


def test_inner_ranks_take_a_margin_on_both_sides():
    slabs = [plan_slab(60, 104, rank, 4, 10) for rank in range(4)]
    assert [(s.start, s.stop) for s in slabs] == [(0, 36), (16, 62), (42, 88), (68, 104)]
    assert sum(s.own_count for s in slabs) == 104


def test_a_frame_too_narrow_for_its_margins_is_not_split():
    assert plan_slab(4, 4, 0, 2, 14) is None
    length = 40
    assert (length / 2 + 14) / length <= MAX_SLAB_SHARE
    assert plan_slab(4, length, 0, 2, 14) is not None
    assert plan_slab(4, 30, 0, 2, 14) is None


@pytest.mark.parametrize("room_share, splits", [(0.9, True), (0.3, False)])
def test_a_rank_splits_where_its_slab_fits_though_whole_frames_do_not(
    wan_folder, monkeypatch, room_share, splits
):
    """Whole frames take more than a rank's room; its slab takes its share of them."""
    from ondeck import distributed
    from ondeck.pipelines import wan_decode

    pipe = WanTextToVideo.from_folder(
        wan_folder, device="cpu", dtype=torch.float32, policy="release", progress=False
    )
    decode = pipe.stages[-1]
    latents = torch.zeros(1, decode.vae.config.z_dim, 2, 4, 40)
    slab = plan_slab(4, 40, 0, 2, decoder_margin(decode.vae))
    need = 10_000
    room = int(need * room_share)
    assert room < need and (math.ceil(need * slab.share) <= room) == splits
    split = []
    kind = type(decode)
    monkeypatch.setattr(kind, "_need", lambda self: need)
    monkeypatch.setattr(kind, "_room", lambda self: room)
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "gather_all", lambda value: [value, True])
    monkeypatch.setattr(wan_decode, "split_decode", lambda vae, x, s: split.append(s))
    decode._forward_split({"latents": latents, "output_type": "latent"}, wants_frames=False)
    assert split == ([slab] if splits else [])


def test_the_wan_decoder_margin_counts_its_convolutions():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        wide = AutoencoderKLWan()
        tiny = AutoencoderKLWan(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    # Wan 2.1's decoder after its attention: 2 convolutions at latent size, 6 per up
    # block at 1, 2, 4 and 8 times it, 3 upsampling convolutions, the output one.
    assert decoder_margin(wide) == 18
    assert decoder_margin(tiny) < decoder_margin(wide)


def test_a_decoder_without_the_wan_attention_is_not_split():
    assert decoder_margin(torch.nn.Linear(2, 2)) is None


# -- two processes -------------------------------------------------------------------------


@needs_gloo
def test_a_split_decode_equals_the_whole_decode(ranks, wan_folder):
    from diffusers import AutoencoderKLWan

    out = ranks["out"]
    vae = AutoencoderKLWan.from_pretrained(Path(wan_folder) / "vae", torch_dtype=torch.float32)
    latents = torch.load(out / "latents.pt")
    with torch.no_grad():
        whole = vae.eval().decode(latents, return_dict=False)[0].numpy()
    slabs = [seen["slab"] for seen in ranks["seen"]]
    assert slabs[0][1] == 0 and slabs[1][2] == 40 and slabs[0][2] < 40  # each a slab
    # The decode depends on neighbours: a change at one latent column moves pixels
    # several columns away, as far as a slab's margin must reach.
    nudged = latents.clone()
    nudged[..., 20] += 5
    with torch.no_grad():
        moved = vae.decode(nudged, return_dict=False)[0].numpy()
    columns = np.abs(moved - whole).max(axis=(0, 1, 2, 3)).reshape(40, -1).max(axis=1)
    assert columns[17] > 1e-4 and columns[23] > 1e-4
    for rank in range(WORLD_SIZE):
        video = np.load(out / f"vae-rank{rank}.npy")
        assert video.shape == whole.shape
        # Float32 on the CPU: only the convolutions' summation order may differ.
        np.testing.assert_allclose(video, whole, atol=1e-6, rtol=0)
        assert ranks["seen"][rank]["vae_forward_restored"]


@needs_gloo
def test_the_pipeline_splits_its_decode_and_a_latents_rank_takes_part(ranks, wan_folder):
    from .test_split_decode import WIDE

    single = WanTextToVideo.from_folder(
        wan_folder, policy="release", dtype=torch.float32, device="cpu", progress=False
    ).generate("a fox", negative_prompt="blurry", seed=7, **WIDE)
    out = ranks["out"]
    for label in ("context", "context+vae shard"):
        rank0, rank1 = (seen[label] for seen in ranks["seen"])
        assert rank0["split"] is not None and rank1["split"] is not None
        assert rank0["split"] != rank1["split"]
        assert rank1["vae_loads"] == 1  # loaded to decode its slab, though it wants latents
        assert rank1["frames_shape"][-2:] == [4, 40]  # latents back
        frames = np.load(out / f"{label}-frames.npy")
        assert frames.shape == single.shape
        np.testing.assert_allclose(frames, single, atol=1e-5, rtol=0)


WIDE = dict(height=32, width=320, num_frames=5, num_inference_steps=2)
