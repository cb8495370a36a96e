"""Sharding a Wan pipeline across two CPU processes (gloo): same frames, half the weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ondeck
from ondeck.embedded import build_wan_folder
from ondeck.loading import ModelFolder
from ondeck.loading.sharded import rows_of, shard_nbytes, shard_rows, shard_units
from ondeck.pipelines.wan import WanTextToVideo

HERE = Path(__file__).resolve().parent
SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)
WORLD_SIZE = 2


def _distributed_available() -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


needs_gloo = pytest.mark.skipif(
    not _distributed_available(), reason="this torch has no gloo backend or FSDP2"
)


def torchrun(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "ONDECK_PROGRESS": "0"}
    environment.setdefault("NCCL_NVLS_ENABLE", "0")
    environment["TMPDIR"] = str(cwd)  # torchrun's own run folders stay with the test's
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={WORLD_SIZE}", *args]
    done = subprocess.run(
        command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def run_ranks(worker: str, *args: str, out: Path, timeout: float = 120) -> list[dict]:
    """Run ``worker`` (beside this file) on each rank with ``args`` and ``out``; returns
    what each rank wrote to ``out/rank<N>.json``."""
    torchrun(str(HERE / worker), *args, str(out), cwd=out, timeout=timeout)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def one_process(wan_folder):
    """Frames and transformer bytes from an ordinary single-process run."""
    pipe = WanTextToVideo.from_folder(
        wan_folder, policy="release", dtype=torch.float32, device="cpu", progress=False
    )
    frames = pipe.generate("a fox", negative_prompt="blurry", seed=7, **SHAPE)
    return {"frames": frames, "component_bytes": pipe.component_bytes()}


@pytest.fixture(scope="module")
def ranks(wan_folder, tmp_path_factory):
    """What each of two ranks saw running the tiny Wan pipeline sharded (rank_worker.py)."""
    out = tmp_path_factory.mktemp("ranks")
    seen = run_ranks("rank_worker.py", str(wan_folder), out=out)
    for rank_seen in seen:
        rank_seen["host_cache_frames"] = np.load(out / f"host-cache-rank{rank_seen['rank']}.npy")
        rank_seen["frames"] = {
            label: np.load(out / f"{label}-rank{rank_seen['rank']}.npy")
            for label in rank_seen["runs"]
        }
    return seen


# -- pure layout: which rows, which bytes, which blocks ---------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 24, 25])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shard_rows_are_torch_chunk_rows(rows, world_size):
    chunks = torch.arange(rows).chunk(world_size)
    for rank in range(world_size):
        first, count = shard_rows(rows, rank, world_size)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(first, first + count)) == expected


def test_rows_of_a_tensor_are_one_byte_range(wan_folder):
    info = ModelFolder.open(wan_folder).tensors("transformer")["blocks.0.attn1.to_q.weight"]
    row_nbytes = info.nbytes // info.shape[0]
    part = rows_of(info, 5, 3)
    assert part.shape == (3, *info.shape[1:])
    assert (part.start, part.end) == (info.start + 5 * row_nbytes, info.start + 8 * row_nbytes)
    assert part.path == info.path


def test_each_transformer_block_is_its_own_shard_unit(wan_folder):
    skeleton = ModelFolder.open(wan_folder).skeleton("transformer", torch.float32)
    units = shard_units(skeleton.module)
    assert units == list(skeleton.module.blocks)


def test_a_rank_is_predicted_to_hold_about_half(wan_folder):
    skeleton = ModelFolder.open(wan_folder).skeleton("transformer", torch.float32)
    assert 0.45 < shard_nbytes(skeleton, 2) / skeleton.nbytes < 0.55


# -- without a process group ------------------------------------------------------------


def test_sharding_without_a_process_group_says_how_to_launch(wan_folder, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ondeck.OndeckError, match="torchrun"):
        WanTextToVideo.from_folder(wan_folder, shard=("transformer",), device="cpu")


def test_sharding_an_unknown_component_is_refused(wan_folder):
    with pytest.raises(ValueError, match="tokenizer"):
        WanTextToVideo.from_folder(wan_folder, shard=("tokenizer",), device="cpu")


# -- two ranks --------------------------------------------------------------------------


@needs_gloo
@pytest.mark.parametrize("label", ["transformer", "transformer+text_encoder", "pipelined"])
def test_sharded_frames_equal_one_process_frames(ranks, one_process, label):
    for seen in ranks:
        assert np.array_equal(seen["frames"][label], one_process["frames"])


@needs_gloo
def test_sharded_loads_can_fill_behind_the_compute(ranks):
    """The pipelined run's frames above equal one process's although its blocks' shards
    arrived while it computed; its loader handed the module over before they were in."""
    for seen in ranks:
        assert seen["pipelined_filling"]


@needs_gloo
def test_a_sharded_load_shards_the_skeleton_its_last_fill_built(ranks):
    """Copying a 14B transformer's skeleton takes about half a second: a pipelined sharded
    load leaves the next load's copy built on its fill's thread, not on the caller's."""
    for seen in ranks:
        assert seen["skeleton_copies_filling"]
        assert all(name.startswith("ondeck-fill") for name in seen["skeleton_copies_filling"])
        # None on the caller's thread (the next fill may already build its own spare).
        assert not [
            n for n in seen["skeleton_copies_next_begin"] if not n.startswith("ondeck-fill")
        ]


@needs_gloo
def test_with_a_host_cache_each_rank_reloads_its_rows_from_memory(ranks, one_process, tmp_path):
    for seen in ranks:
        first, second = seen["host_cache"]["bytes_read"]
        for name in ("transformer", "text_encoder"):
            assert first[name] > 0
            assert second[name] == first[name], name  # the second run read no file
            assert seen["host_cache"]["sources"][name] == "host cache", name
        assert first["transformer"] < one_process["component_bytes"]["transformer"] * 0.6
        assert np.array_equal(seen["host_cache_frames"], one_process["frames"])


@needs_gloo
def test_each_rank_holds_about_half_the_transformer(ranks, one_process):
    whole = one_process["component_bytes"]["transformer"]
    for seen in ranks:
        held = seen["runs"]["transformer"]["component_bytes"]["transformer"]
        assert 0.45 * whole < held < 0.55 * whole


@needs_gloo
def test_each_rank_reads_only_its_half_of_the_transformer_file(ranks, wan_folder):
    file_nbytes = ModelFolder.open(wan_folder).file_bytes("transformer")
    read = [seen["runs"]["transformer"]["bytes_read"]["transformer"] for seen in ranks]
    assert sum(read) == file_nbytes
    for nbytes in read:
        assert 0.45 * file_nbytes < nbytes < 0.55 * file_nbytes


@needs_gloo
def test_unsharded_components_are_read_whole_on_every_rank(ranks, wan_folder):
    folder = ModelFolder.open(wan_folder)
    for seen in ranks:
        read = seen["runs"]["transformer"]["bytes_read"]
        assert read["text_encoder"] == folder.file_bytes("text_encoder")
        assert read["vae"] == folder.file_bytes("vae")


@needs_gloo
def test_rank_zero_report_merges_every_rank(ranks):
    report = ranks[0]["runs"]["transformer"]["report"]
    assert report["world_size"] == WORLD_SIZE and report["backend"] == "gloo"
    assert report["sharded"] == ["transformer"]
    assert [summary["rank"] for summary in report["ranks"]] == [0, 1]
    for summary, seen in zip(report["ranks"], ranks, strict=True):
        assert summary["bytes_read_from_files"] == seen["runs"]["transformer"]["bytes_read"]
        assert summary["peak_resident_bytes"] > 0
    assert ranks[1]["runs"]["transformer"]["report"] is None


@needs_gloo
def test_the_proxy_is_an_fsdp_module_only_while_loaded(ranks):
    for seen in ranks:
        assert not seen["fsdp_while_unloaded"]
        assert seen["fsdp_once_loaded"]
        assert not seen["fsdp_after_release"]


@needs_gloo
def test_release_frees_the_rank_shard(ranks):
    for seen in ranks:
        assert seen["shard_storage_bytes_loaded"] > 0
        assert seen["released_bytes"] >= seen["shard_storage_bytes_loaded"]
        assert seen["shard_storage_bytes_released"] == 0
        assert not seen["module_alive_after_release"], seen.get("module_referrers")


@needs_gloo
def test_generate_command_shards_under_torchrun(wan_folder, tmp_path):
    torchrun(
        "-m",
        "ondeck",
        "generate",
        str(wan_folder),
        "--shard",
        "transformer",
        "--policy",
        "release",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--steps",
        "2",
        "--output",
        "out",
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (tmp_path / "out" / "video.mp4").stat().st_size > 0
    assert report["world_size"] == WORLD_SIZE and report["sharded"] == ["transformer"]
    file_nbytes = ModelFolder.open(wan_folder).file_bytes("transformer")
    read = [summary["bytes_read_from_files"]["transformer"] for summary in report["ranks"]]
    assert sum(read) == file_nbytes


def test_a_whole_load_never_takes_a_ranks_rows_from_the_host_cache(wan_folder, monkeypatch):
    """One process, one cache: a rank's rows of the transformer are not the transformer
    placed another way."""
    from ondeck.loading import ComponentLoader, HostCache
    from ondeck.loading.sharded import shard_cache_key

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    folder = ModelFolder.open(wan_folder)
    tensors = folder.tensors("transformer")
    rows = [rows_of(info, *shard_rows(info.shape[0], 0, WORLD_SIZE)) for info in tensors.values()]
    key = shard_cache_key(folder, "transformer", 0, WORLD_SIZE)
    buffers = cache.reserve(key, rows)
    for buffer in buffers.values():
        buffer.fill_(7)  # bytes a whole load must never copy in
    cache.commit(key, buffers)
    plain = ComponentLoader(wan_folder, "transformer")()
    loader = ComponentLoader(wan_folder, "transformer", host_cache=cache)
    cached = loader()
    assert loader.last_source != "host cache"
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), cached.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
