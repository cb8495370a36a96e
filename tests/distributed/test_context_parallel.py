"""Context parallelism over two CPU processes (gloo): each rank computes half the sequence.

What runs here is diffusers' own engine (the transformer's ``_cp_plan`` hooks and the
Ulysses all-to-all in its native attention) over gloo, with ondeck's plumbing around
it: the set-up, the hooks re-attached after every reload, FSDP2 shards, the policies
(block streaming too), the CLI and the merged report. Ring attention needs an attention backend with
log-sum-exp, which only CUDA has: it is not run here. The GPU figures come from
``benchmarks/context_parallel.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ondeck
from ondeck import ComponentSpec, LazyModule
from ondeck.loading import ModelFolder
from ondeck.parallel import (
    BF16_FRAME_TOLERANCE,
    ContextParallel,
    ContextParallelError,
    check_matching_devices,
    compare_frames,
    exchange_bytes_per_call,
    resolve_parallel,
    split_sequences,
)
from ondeck.pipelines.wan import WanTextToVideo

from .test_sharded import WORLD_SIZE, needs_gloo, run_ranks, torchrun

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)
# 32x32 pixels, 5 frames: 2 latent frames of 4x4, patches of 1x2x2.
TOKENS = 2 * 2 * 2


def _single(folder, dtype):
    pipe = WanTextToVideo.from_folder(
        folder, policy="release", dtype=dtype, device="cpu", progress=False
    )
    return pipe.generate("a fox", negative_prompt="blurry", seed=7, **SHAPE)


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    from ondeck.embedded import build_wan_folder

    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def six_block_folder(tmp_path_factory):
    """The tiny folder with a wider six-block transformer, the largest component, as
    tests/streaming builds it: some blocks stay resident, the others stream."""
    from streaming.conftest import build_six_block_folder

    return build_six_block_folder(tmp_path_factory.mktemp("wan-six") / "tiny6")


@pytest.fixture(scope="module")
def one_process(wan_folder, six_block_folder):
    """Frames from ordinary single-process runs: Wan stages in float32 and bf16, and the
    diffusers integration."""
    import ondeck.diffusers

    pipe = ondeck.diffusers.from_pretrained(
        wan_folder, torch_dtype=torch.float32, device="cpu", policy="release", progress=False
    )
    diffusers_frames = pipe(
        prompt="a fox",
        negative_prompt="blurry",
        generator=torch.Generator().manual_seed(3),
        output_type="np",
        **SHAPE,
    ).frames
    six = WanTextToVideo.from_folder(
        six_block_folder, policy="release", dtype=torch.float32, device="cpu", progress=False
    )
    return {
        "float32": _single(wan_folder, torch.float32),
        "bfloat16": _single(wan_folder, torch.bfloat16),
        "diffusers": diffusers_frames,
        "six blocks": {
            prompt: six.generate(prompt, negative_prompt="blurry", seed=7, **SHAPE)
            for prompt in ("a fox", "a heron")
        },
    }


@pytest.fixture(scope="module")
def ranks(wan_folder, six_block_folder, tmp_path_factory):
    """What each of two ranks saw (context_worker.py)."""
    out = tmp_path_factory.mktemp("context-ranks")
    folders = (str(wan_folder), str(six_block_folder))
    seen = run_ranks("context_worker.py", *folders, out=out, timeout=400)
    for rank, rank_seen in enumerate(seen):
        rank_seen["frames"] = {
            (label, which): np.load(out / f"{label}-{which}-rank{rank}.npy")
            for label in rank_seen["runs"]
            for which in ("first", "second")
        }
        rank_seen["diffusers_frames"] = np.load(out / f"diffusers-rank{rank}.npy")
        rank_seen["streamed_frames"] = {
            prompt: np.load(out / f"streamed-{prompt[2:]}-rank{rank}.npy")
            for prompt in ("a fox", "a heron")
        }
    return seen


# -- pure: arguments, checks, traffic ------------------------------------------------------


def test_a_degree_below_two_is_refused():
    with pytest.raises(ContextParallelError, match="at least 2"):
        ContextParallel(1)


def test_an_unknown_attention_is_refused():
    with pytest.raises(ContextParallelError, match="ulysses"):
        ContextParallel(2, attention="spiral")


def test_parallel_accepts_context_a_degree_or_a_setting(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for key, value in (("RANK", "0"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    assert resolve_parallel(None) is None
    assert resolve_parallel(2).degree == 2
    assert resolve_parallel("context").degree == 4
    setting = ContextParallel(2)
    assert resolve_parallel(setting) is setting
    with pytest.raises(ContextParallelError, match="'tensor'"):
        resolve_parallel("tensor")


def test_parallel_context_outside_torchrun_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ContextParallelError, match="torchrun --nproc-per-node N"):
        resolve_parallel("context")


def test_a_transformer_without_a_plan_is_refused():
    from diffusers import SD3Transformer2DModel

    with pytest.raises(ContextParallelError, match=r"SD3Transformer2DModel.*_cp_plan"):
        ContextParallel(2).check_model("transformer", SD3Transformer2DModel, {})


def test_heads_the_degree_does_not_divide_are_refused(wan_folder):
    spec = ModelFolder.open(wan_folder).spec("transformer")
    heads = spec.config.num_attention_heads
    ContextParallel(heads).check_model("transformer", spec.cls, spec.config)
    with pytest.raises(ContextParallelError, match=f"{heads} attention heads do not split"):
        ContextParallel(heads + 1).check_model("transformer", spec.cls, spec.config)


def test_ring_attention_needs_no_head_split(wan_folder):
    spec = ModelFolder.open(wan_folder).spec("transformer")
    heads = spec.config.num_attention_heads
    ContextParallel(heads + 1, attention="ring").check_model("transformer", spec.cls, spec.config)


def test_a_sequence_the_degree_does_not_divide_is_refused():
    ContextParallel(2).check_sequence("transformer", 14040)
    with pytest.raises(ContextParallelError, match="9 tokens at 32x48, 5 frames"):
        ContextParallel(2).check_sequence("transformer", 9, "32x48, 5 frames")


def test_wan_tokens_are_latent_patches(wan_folder):
    pipe = WanTextToVideo.from_folder(wan_folder, device="cpu", progress=False)
    assert pipe.geometry.tokens(32, 32, 5) == TOKENS
    assert pipe.geometry.tokens(480, 832, 33) == 9 * 30 * 52


def test_mismatched_devices_are_named_by_rank():
    check_matching_devices(["cuda NVIDIA H200 143771 MiB"] * 2)
    with pytest.raises(ContextParallelError, match="rank 1: cuda NVIDIA A100"):
        check_matching_devices(["cuda NVIDIA H200 143771 MiB", "cuda NVIDIA A100 81920 MiB"])


def test_a_pipeline_without_a_planned_model_is_refused_before_loading():
    from diffusers import AutoencoderKLWan, SD3Transformer2DModel

    loads = []
    components = {
        name: LazyModule(name, lambda n=name: loads.append(n), spec=ComponentSpec(cls=cls))
        for name, cls in (("transformer", SD3Transformer2DModel), ("vae", AutoencoderKLWan))
    }
    with pytest.raises(ContextParallelError, match=r"transformer \(SD3Transformer2DModel\)"):
        split_sequences(ContextParallel(2), components, "cpu")
    assert loads == []


def test_ulysses_exchange_per_call_at_14b_shape():
    # 14040 tokens, 40 heads of 128, 40 layers, bf16, 2 ranks: four all-to-alls of
    # 7020 rows of 10240 bytes per layer, half of each leaving the rank.
    nbytes = exchange_bytes_per_call(
        attention="ulysses",
        tokens=14040,
        heads=40,
        head_dim=128,
        layers=40,
        degree=2,
        element_bytes=2,
    )
    assert nbytes == 40 * 4 * 7020 * 10240 // 2
    at_eight = exchange_bytes_per_call(
        attention="ulysses",
        tokens=14040,
        heads=40,
        head_dim=128,
        layers=40,
        degree=8,
        element_bytes=2,
    )
    assert at_eight == 40 * (4 * 1755 * 10240 * 7 // 8)


def test_frame_comparison_applies_the_stated_tolerance():
    reference = np.zeros((1, 5, 8, 8, 3), dtype=np.float32)
    close = reference + BF16_FRAME_TOLERANCE["mean_abs_diff"] / 2
    assert compare_frames(reference, close)["within_tolerance"]
    far = reference.copy()
    far[0, 0, 0, 0, 0] = BF16_FRAME_TOLERANCE["max_abs_diff"] * 2
    assert not compare_frames(reference, far)["within_tolerance"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_rank_that_returns_latents_never_loads_the_vae(wan_folder, prefetch):
    # The ranks that do not write the video ask for latents (the CLI, the benchmark):
    # the budget policy loads each stage's components before it computes, so Decode
    # must say it needs none, or every such rank reads and holds the VAE for nothing.
    pipe = WanTextToVideo.from_folder(
        wan_folder,
        policy="budget",
        budget="1GiB",
        prefetch=prefetch,
        dtype=torch.float32,
        device="cpu",
        progress=False,
    )
    for seed in (1, 2):
        latents = pipe.generate("a fox", seed=seed, output_type="latent", **SHAPE)
        assert latents.dim() == 5
    assert pipe.components["vae"].load_count == 0
    assert "vae" not in [event.name for event in pipe.tracker.events if event.kind == "load"]
    pipe.generate("a fox", seed=3, **SHAPE)
    assert pipe.components["vae"].load_count == 1


def test_context_parallel_outside_torchrun_says_how_to_launch(wan_folder, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ondeck.OndeckError, match="torchrun --nproc-per-node 2"):
        WanTextToVideo.from_folder(wan_folder, parallel=2, device="cpu")


# -- two ranks ----------------------------------------------------------------------------


@needs_gloo
@pytest.mark.parametrize("label", ["float32", "float32+shard", "float32+budget"])
def test_each_rank_computes_half_the_sequence(ranks, label):
    for seen in ranks:
        run = seen["runs"][label]
        assert run["tokens_first"] and set(run["tokens_first"]) == {TOKENS // WORLD_SIZE}


@needs_gloo
def test_hooks_come_back_after_a_release_and_reload(ranks):
    for seen in ranks:
        run = seen["runs"]["float32"]
        assert run["load_count"] == 2  # release freed the transformer between the calls
        assert run["tokens_second"] and set(run["tokens_second"]) == {TOKENS // WORLD_SIZE}


@needs_gloo
def test_budget_keeps_the_hooked_transformer_across_runs(ranks):
    for seen in ranks:
        run = seen["runs"]["float32+budget"]
        assert run["load_count"] == 1
        assert set(run["tokens_second"]) == {TOKENS // WORLD_SIZE}


@needs_gloo
@pytest.mark.parametrize("label", ["float32", "float32+shard", "float32+budget"])
def test_float32_frames_equal_one_process_frames(ranks, one_process, label):
    for seen in ranks:
        for which in ("first", "second"):
            assert np.array_equal(seen["frames"][(label, which)], one_process["float32"])


@needs_gloo
def test_bf16_frames_are_within_the_stated_tolerance(ranks, one_process):
    for seen in ranks:
        compared = compare_frames(one_process["bfloat16"], seen["frames"][("bfloat16", "first")])
        assert compared["within_tolerance"], compared


@needs_gloo
def test_diffusers_pipeline_splits_the_sequence_with_the_same_frames(ranks, one_process):
    for seen in ranks:
        assert seen["diffusers_tokens"] and set(seen["diffusers_tokens"]) == {TOKENS // WORLD_SIZE}
        assert np.array_equal(seen["diffusers_frames"], one_process["diffusers"])


@needs_gloo
def test_streamed_blocks_split_the_sequence_with_the_same_frames(ranks, one_process):
    for seen in ranks:
        streamed = seen["streamed"]
        assert streamed["stats"]["streamed_blocks"] and streamed["stats"]["copies"] > 0
        assert streamed["tokens"] and set(streamed["tokens"]) == {TOKENS // WORLD_SIZE}
        for prompt, frames in seen["streamed_frames"].items():
            # Each rank's products run on half the sequence: the same to float32's
            # rounding (2e-6 of pixels in 0..1), which the tiny VAE now carries out.
            np.testing.assert_allclose(frames, one_process["six blocks"][prompt], atol=1e-5)


@needs_gloo
def test_diffusers_pipeline_refuses_a_sequence_the_ranks_do_not_divide(ranks):
    for seen in ranks:
        message = seen["diffusers_indivisible"]
        assert message.startswith("ContextParallelError: WanTransformer3DModel: a latent grid")
        assert "1 patches, which do not split evenly over 2 ranks" in message


@needs_gloo
def test_release_frees_the_hooked_transformer(ranks):
    for seen in ranks:
        assert seen["parallel_config_once_loaded"] and seen["hooked_once_loaded"]
        assert not seen["module_alive_after_release"]


@needs_gloo
def test_rank_zero_report_shows_the_split_and_every_rank(ranks):
    report = ranks[0]["runs"]["float32+shard"]["report"]
    assert report["context_parallel"] == {"degree": 2, "attention": "ulysses"}
    assert report["sharded"] == ["transformer"]
    assert [summary["rank"] for summary in report["ranks"]] == [0, 1]
    for summary in report["ranks"]:
        assert summary["context_parallel"]["degree"] == WORLD_SIZE
        assert "Denoise" in summary["activation_bytes"]
        assert summary["bytes_read_from_files"]["transformer"] > 0
    assert ranks[1]["runs"]["float32+shard"]["report"] is None


@needs_gloo
def test_each_rank_reads_the_whole_unsharded_transformer_per_load(ranks, wan_folder):
    file_nbytes = ModelFolder.open(wan_folder).file_bytes("transformer")
    report = ranks[0]["runs"]["float32"]["report"]
    for summary in report["ranks"]:
        # Two generations under release: two loads, each reading the whole file.
        assert summary["bytes_read_from_files"]["transformer"] == 2 * file_nbytes


@needs_gloo
def test_generate_command_splits_the_sequence_under_torchrun(wan_folder, tmp_path):
    done = torchrun(
        "-m",
        "ondeck",
        "generate",
        str(wan_folder),
        "--context-parallel",
        "2",
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
    assert "each rank computes 4 of 8 tokens" in done.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (tmp_path / "out" / "video.mp4").stat().st_size > 0
    assert report["context_parallel"]["tokens_per_rank"] == TOKENS // WORLD_SIZE
    assert report["context_parallel"]["exchange_bytes_per_transformer_call"] > 0
    assert [summary["rank"] for summary in report["ranks"]] == [0, 1]


@needs_gloo
def test_generate_command_refuses_a_degree_other_than_the_launch(wan_folder, tmp_path):
    command = ["-m", "ondeck", "generate", str(wan_folder), "--context-parallel", "4"]
    with pytest.raises(AssertionError) as failure:
        torchrun(*command, "--output", "out", cwd=tmp_path)
    assert "launch has 2 process(es): start it with --nproc-per-node 4" in str(failure.value)
    assert not (tmp_path / "out" / "report.json").exists()


@needs_gloo
def test_generate_command_refuses_a_sequence_the_ranks_do_not_divide(wan_folder, tmp_path):
    # 16x16, 1 frame: one latent frame of 2x2, one patch of 2x2: 1 token.
    command = ["-m", "ondeck", "generate", str(wan_folder), "--context-parallel", "2"]
    command += ["--height", "16", "--width", "16", "--frames", "1", "--output", "out"]
    with pytest.raises(AssertionError) as failure:
        torchrun(*command, cwd=tmp_path)
    assert "sequence of 1 tokens at 16x16, 1 frames does not split evenly" in str(failure.value)


def test_cli_refuses_both_spellings_at_once(wan_folder, tmp_path, capsys):
    from ondeck.cli import main

    code = main(
        [
            "generate",
            str(wan_folder),
            "--context-parallel",
            "2",
            "--parallel",
            "context",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    assert "not both" in capsys.readouterr().err


def test_cli_context_parallel_outside_torchrun_says_how_to_launch(
    wan_folder, tmp_path, capsys, monkeypatch
):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    code = main_generate(wan_folder, tmp_path, "--context-parallel", "2")
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert "torchrun --nproc-per-node 2" in err and len(err.splitlines()) == 1


def main_generate(folder, tmp_path, *extra):
    from ondeck.cli import main

    return main(["generate", str(folder), *extra, "--output", str(tmp_path / "out")])
