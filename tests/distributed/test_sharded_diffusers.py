"""Sharding the models of a diffusers pipeline other than Wan (Flux: two block lists, a
CLIP and a T5 encoder) across two CPU processes (gloo): the same images, each rank
reading only its rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from integrations.tiny_pipelines import FAMILIES, run

import ondeck.diffusers
from ondeck import OndeckError
from ondeck.loading import ModelFolder

from .diffusers_shard_worker import token_counter
from .test_sharded import WORLD_SIZE, needs_gloo, run_ranks, torchrun

SHARD = ["text_encoder_2", "transformer"]


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux") / "tiny"
    FAMILIES["flux"].build(folder)
    return folder


@pytest.fixture(scope="module")
def ranks(flux_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("flux-ranks")
    seen = run_ranks("diffusers_shard_worker.py", str(flux_folder), out=out)
    for rank_seen in seen:
        rank_seen["images"] = np.load(out / f"images-rank{rank_seen['rank']}.npy")
        rank_seen["context_images"] = np.load(out / f"context-images-rank{rank_seen['rank']}.npy")
    return seen


def test_an_unknown_model_is_refused_naming_the_pipelines_models(flux_folder):
    with pytest.raises(ValueError, match=r"\['tokenizer'\].*text_encoder, text_encoder_2"):
        ondeck.diffusers.from_pretrained(flux_folder, device="cpu", shard=["tokenizer"])


def test_the_command_names_the_folders_models_before_building_anything(
    flux_folder, tmp_path, capsys, monkeypatch
):
    from ondeck import folder_pipelines
    from ondeck.cli import main

    def forbidden(*_, **__):
        raise AssertionError("built before --shard was checked")

    monkeypatch.setattr(folder_pipelines, "pipeline_for_folder", forbidden)
    argv = ["generate", str(flux_folder), "--shard", "unet", "--output", str(tmp_path / "out")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--shard: cannot shard ['unet']; tiny's models are text_encoder, text_encoder_2" in err


def test_a_single_file_or_lora_cannot_be_sharded(flux_folder, tmp_path):
    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(OndeckError, match="cannot be sharded"):
        ondeck.diffusers.from_pretrained(
            flux_folder, device="cpu", shard=["transformer"], loras=[lora]
        )


def test_sharding_without_a_process_group_says_how_to_launch(flux_folder, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(OndeckError, match="torchrun"):
        ondeck.diffusers.from_pretrained(flux_folder, device="cpu", shard=["transformer"])


@needs_gloo
def test_sharded_images_equal_one_process_images(ranks, flux_folder):
    pipe = ondeck.diffusers.from_pretrained(
        flux_folder, torch_dtype=torch.float32, device="cpu", policy="release", progress=False
    )
    expected = np.asarray(run(pipe, FAMILIES["flux"], seed=3))
    for rank_seen in ranks:
        np.testing.assert_array_equal(rank_seen["images"], expected)


@needs_gloo
def test_the_sequence_split_over_the_ranks_gives_one_process_images(ranks, flux_folder):
    pipe = ondeck.diffusers.from_pretrained(
        flux_folder, torch_dtype=torch.float32, device="cpu", policy="release", progress=False
    )
    tokens: list[int] = []
    pipe.transformer.add_transform(token_counter(tokens), reads_weights=False)
    expected = np.asarray(run(pipe, FAMILIES["flux"], seed=3, height=16, width=16))
    (whole,) = set(tokens)
    for rank_seen in ranks:
        assert rank_seen["context_tokens"] == [whole // 2], "each rank computes half the image"
        # float32 attention over split keys sums in another order: not bit for bit.
        np.testing.assert_allclose(rank_seen["context_images"], expected, atol=1e-5)


@needs_gloo
def test_each_rank_loads_fsdp_modules_and_reads_only_its_rows(ranks, flux_folder):
    folder = ModelFolder.open(flux_folder)
    for rank_seen in ranks:
        assert rank_seen["loaded_as_fsdp"] == dict.fromkeys(SHARD, True)
        assert rank_seen["report_sharded"] in (SHARD, None)  # rank 0 gets the report
    assert ranks[0]["report_sharded"] == SHARD
    for name in SHARD:
        read = [rank_seen["bytes_read"][name] for rank_seen in ranks]
        assert sum(read) == folder.file_bytes(name)
        assert max(read) < 0.6 * folder.file_bytes(name)
    for name in ("text_encoder", "vae"):  # not named: read whole on every rank
        assert [seen["bytes_read"][name] for seen in ranks] == [folder.file_bytes(name)] * 2


@needs_gloo
def test_generate_command_shards_an_image_pipeline_under_torchrun(flux_folder, tmp_path):
    torchrun(
        "-m", "ondeck", "generate", str(flux_folder), "--shard", "transformer",
        "--policy", "release", "--height", "16", "--width", "16", "--steps", "2",
        "--device", "cpu", "--output", "out",
        cwd=tmp_path,
    )  # fmt: skip
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (tmp_path / "out" / "image.png").stat().st_size > 0
    assert report["world_size"] == WORLD_SIZE and report["sharded"] == ["transformer"]
    read = [summary["bytes_read_from_files"]["transformer"] for summary in report["ranks"]]
    assert sum(read) == ModelFolder.open(flux_folder).file_bytes("transformer")
