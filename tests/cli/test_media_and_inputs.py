"""What `generate` makes and takes for each pipeline: a video whatever the call names
its frame count, a ControlNet's input image, an input photo upright, component files
only for parts with weights and each once, and no earlier result of the other kind left
beside this run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest

from .helpers import FAST, IMAGE_ARGS, error_lines, listing, run

CPU = ["--device", "cpu", "--steps", "2"]
SQUARE = [*CPU, "--height", "32", "--width", "32"]


@pytest.fixture(scope="session")
def latte(tmp_path_factory) -> Path:
    """A tiny LattePipeline: a text-to-video pipeline whose call counts its frames as
    ``video_length`` (16 by default), not ``num_frames``."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, LattePipeline, LatteTransformer3DModel

    from tests.integrations.tiny_pipelines import _byt5, _t5_encoder

    torch.manual_seed(0)
    transformer = LatteTransformer3DModel(
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8,
        num_attention_heads=3, caption_channels=32, in_channels=4, cross_attention_dim=24,
        out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, video_length=16,
    )  # fmt: skip
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4)
    path = tmp_path_factory.mktemp("latte") / "latte"
    LattePipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=DDIMScheduler(),
    ).save_pretrained(path)
    return path


def test_a_video_pipeline_that_counts_frames_as_video_length_writes_a_video(
    capsys, latte, tmp_path
):
    # LattePipeline (like TextToVideoZero) counts its frames as `video_length`: a video
    # of all 16 frames, not its first frame as image.png.
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", latte, *CPU, "--height", "16", "--width", "16", "--output", out
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())["output"]
    assert (report["kind"], listing(out)) == (
        "video",
        {"video.mp4", "report.json", "timeline.png"},
    )


def test_a_pipeline_class_diffusers_does_not_have_is_not_blamed_on_the_flags(
    capsys, family, tmp_path, input_image
):
    # A folder of a pipeline newer than the installed diffusers: with or without
    # --image, the error names the class, not a flag.
    folder = shutil.copytree(family("flux"), tmp_path / "newer")
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "FluxNewerEditPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    capsys.readouterr()
    code, _, err = run(capsys, "generate", folder, *CPU, "--output", tmp_path / "o")
    assert code == 1 and "is not a diffusers pipeline" in err  # the cause, without --image
    code, _, err = run(
        capsys, "generate", folder, *CPU, "--image", input_image, "--output", tmp_path / "o"
    )
    [line] = error_lines(err)
    assert (code, "is not a diffusers pipeline" in line) == (1, True), line


def test_a_controlnet_pipeline_whose_input_is_control_image_is_told_the_flag(
    capsys, family, tmp_path, monkeypatch
):
    # StableDiffusion3ControlNetPipeline (and FluxControlNetPipeline) take their input as
    # `control_image`: without --image, one line names the flag before anything is built.
    folder = family("sd3_controlnet")
    capsys.readouterr()
    forbidden = mock.Mock(side_effect=AssertionError("built before the flags were checked"))
    monkeypatch.setattr("ondeck.cli.commands.build_pipeline", forbidden)
    code, _, err = run(capsys, "generate", folder, *SQUARE, "--output", tmp_path / "o")
    assert (code, error_lines(err)) == (
        2,
        [
            "ondeck: error: StableDiffusion3ControlNetPipeline needs an input image: "
            "give it with --image PATH"
        ],
    )


def test_a_controlnet_pipeline_whose_input_is_control_image_takes_the_flag(
    capsys, family, tmp_path, input_image
):
    folder = family("sd3_controlnet")
    capsys.readouterr()
    out = tmp_path / "o"
    code, _, err = run(capsys, "generate", folder, *SQUARE, "--image", input_image, "--output", out)
    assert code == 0, err
    assert (out / "image.png").is_file()


def test_the_input_image_is_turned_upright_as_its_exif_orientation_says(tmp_path):
    # A phone photo stores its pixels sideways and says so in EXIF (Orientation 6:
    # rotate 90 degrees): `--image` turns it upright, as diffusers' own `load_image` does.
    from diffusers.utils import load_image
    from PIL import Image

    from ondeck.cli.media import read_input_image

    path = tmp_path / "photo.jpg"
    picture = Image.new("RGB", (30, 20), (200, 50, 50))
    exif = picture.getexif()
    exif[0x0112] = 6
    picture.save(path, exif=exif)
    assert load_image(str(path)).size == (20, 30)
    assert read_input_image(str(path)).size == (20, 30)


@pytest.mark.parametrize("name", ["scheduler", "tokenizer"])
def test_a_component_file_for_a_part_without_weights_is_refused_not_ignored(
    name, capsys, tiny_model, tmp_path
):
    # A scheduler or tokenizer has no weights a file could replace: refused, never a run
    # that ignores the flag.
    weights = tiny_model / "vae" / "diffusion_pytorch_model.safetensors"
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", tiny_model, *FAST, "--component", f"{name}={weights}", "--output", out
    )
    assert code != 0, "the run ignored --component and wrote its output"
    [line] = [line for line in error_lines(err) if line.startswith("ondeck: error:")]
    assert name in line
    assert not (out / "video.mp4").exists()


def test_transformer_and_component_transformer_together_are_refused(capsys, tiny_model, tmp_path):
    # --transformer FILE is --component transformer=FILE: both at once is a usage error.
    weights = tiny_model / "transformer" / "diffusion_pytorch_model.safetensors"
    other = tmp_path / "other.safetensors"
    other.write_bytes(weights.read_bytes())
    code, _, err = run(
        capsys, "generate", tiny_model, *FAST, "--transformer", weights,
        "--component", f"transformer={other}", "--output", tmp_path / "out",
    )  # fmt: skip
    assert code == 2, err


def test_a_video_run_after_an_image_run_leaves_no_image_of_it(capsys, family, tiny_model, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(capsys, "generate", family("flux"), *IMAGE_ARGS, "--output", out)
    assert code == 0, err
    code, _, err = run(capsys, "generate", tiny_model, *FAST, "--output", out)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())["output"]
    assert report["files"] == ["video.mp4"]
    # The earlier run's image.png goes: it would pass for this run's result.
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}
