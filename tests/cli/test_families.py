"""`ondeck generate` for every kind of pipeline: images as PNG, videos at the model's
frame rate, the input image of image-to-video and image-edit pipelines, and one line
for a flag the pipeline cannot use. Tiny diffusers pipelines built in code."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from .helpers import error_lines, listing, run

CPU = ["--device", "cpu", "--steps", "2"]


@pytest.fixture
def without_ftfy():
    """Wan's image-to-video pipeline cleans prompts with ftfy, installed or not; without
    it the text passes through (as for plain diffusers in the integration tests)."""
    import diffusers.pipelines.wan.pipeline_wan_i2v as module

    with mock.patch.object(module, "ftfy", SimpleNamespace(fix_text=str), create=True):
        yield


def image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def test_an_image_pipeline_writes_a_png_not_a_video(capsys, family, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys, "generate", family("flux"), *CPU, "--height", "8", "--width", "8", "--output", out
    )
    assert code == 0, err
    assert listing(out) == {"image.png", "report.json", "timeline.png"}
    assert image_size(out / "image.png") == (8, 8)
    assert f"ondeck: wrote {out / 'image.png'}, {out / 'report.json'}" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["output"]["kind"] == "images" and report["output"]["finite"] is True


def test_several_images_are_numbered(capsys, family, tmp_path):
    out = tmp_path / "out"
    argv = ["--height", "8", "--width", "8", "--images", "2", "--output", out]
    code, _, err = run(capsys, "generate", family("flux"), *CPU, *argv)
    assert code == 0, err
    assert listing(out) == {"image-1.png", "image-2.png", "report.json", "timeline.png"}


def test_an_image_to_video_pipeline_takes_its_image_from_the_flag(
    capsys, family, tmp_path, input_image, without_ftfy, monkeypatch
):
    import imageio_ffmpeg

    out = tmp_path / "out"
    shape = ["--height", "16", "--width", "16", "--frames", "5"]
    monkeypatch.chdir(input_image.parent)  # the image named as typed, from its folder
    code, _, err = run(
        capsys, "generate", family("wan_i2v"), *CPU, *shape, "--image", input_image.name,
        "--output", out,
    )  # fmt: skip
    assert code == 0, err
    assert listing(out) == {"video.mp4", "report.json", "timeline.png"}
    report = json.loads((out / "report.json").read_text())["output"]
    assert report["input_image"] == str(input_image.resolve())  # the same from anywhere
    # Wan's pipelines are documented exporting at 16 fps: 5 frames last 5/16 s.
    assert report["fps"] == 16
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(out / "video.mp4"))
    assert frames == 5 and seconds == pytest.approx(5 / 16, abs=0.04)


def test_a_pipeline_that_cleans_prompts_with_ftfy_says_to_install_it(
    capsys, family, tmp_path, input_image, monkeypatch
):
    # diffusers' Wan image-to-video pipeline calls ftfy.fix_text whether or not ftfy is
    # installed; without it the run failed with "NameError: name 'ftfy' is not defined".
    import diffusers.pipelines.wan.pipeline_wan_i2v as module

    monkeypatch.delattr(module, "ftfy", raising=False)
    folder = family("wan_i2v")
    capsys.readouterr()  # what building the folder printed
    out = tmp_path / "new" / "nested" / "out"  # made for the run, and removed with it
    shape = ["--height", "16", "--width", "16", "--frames", "5", "--image", input_image]
    code, _, err = run(capsys, "generate", folder, *CPU, *shape, "--output", out)
    assert (code, [line for line in error_lines(err) if line.startswith("ondeck:")]) == (
        1,
        [
            "ondeck: error: WanImageToVideoPipeline cleans each prompt with the ftfy package "
            "(diffusers calls ftfy.fix_text), which is not installed here: pip install ftfy"
        ],
    )
    assert not (out / "video.mp4").exists()


def test_the_input_image_changes_the_video(capsys, family, tmp_path, input_image, without_ftfy):
    from PIL import Image

    other = tmp_path / "other.png"
    Image.new("RGB", (16, 16), (250, 10, 10)).save(other)
    frames = []
    for image in (input_image, other):
        out = tmp_path / image.stem
        shape = ["--height", "16", "--width", "16", "--frames", "5", "--output", out]
        code, _, err = run(capsys, "generate", family("wan_i2v"), *CPU, *shape, "--image", image)
        assert code == 0, err
        import imageio.v3 as iio

        frames.append(iio.imread(out / "video.mp4"))
    assert not np.array_equal(frames[0], frames[1])


def test_a_pipeline_that_needs_an_image_and_has_none_is_told_the_flag(capsys, family, tmp_path):
    folder = family("wan_i2v")
    capsys.readouterr()  # what building the folder printed
    code, _, err = run(capsys, "generate", folder, *CPU, "--output", tmp_path / "o")
    assert code == 2
    assert error_lines(err) == [
        "ondeck: error: WanImageToVideoPipeline needs an input image: give it with --image PATH"
    ]


def test_the_frame_rate_is_the_models_and_fps_overrides_it(capsys, family, tmp_path):
    import imageio_ffmpeg

    shape = ["--height", "32", "--width", "32", "--frames", "9"]
    for extra, fps in (([], 25), (["--fps", "12"], 12)):
        out = tmp_path / f"out{fps}"
        code, _, err = run(capsys, "generate", family("ltx"), *CPU, *shape, *extra, "--output", out)
        assert code == 0, err
        report = json.loads((out / "report.json").read_text())["output"]
        # LTX generates for its call's frame_rate argument, 25 by default.
        assert report["fps"] == fps
        assert report["fps_from"] == ("--fps" if extra else "LTXPipeline's frame_rate argument")
        _, seconds = imageio_ffmpeg.count_frames_and_secs(str(out / "video.mp4"))
        assert seconds == pytest.approx(9 / fps, abs=0.05)


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("flux", ["--fps", "12"], "argument --fps: FluxPipeline makes images, not a video"),
        ("flux", ["--frames", "5"], "argument --frames: FluxPipeline makes images, not a video"),
        ("ltx", ["--images", "2"], "argument --images: LTXPipeline makes a video, not images"),
        ("flux", ["--image", "{image}"], "argument --image: FluxPipeline takes no input image"),
        ("wan", ["--image", "{image}"], "argument --image: WanPipeline takes no input image"),
    ],
)
def test_a_flag_the_pipeline_cannot_use_is_one_line_and_status_2(
    name, argv, message, capsys, family, tmp_path, input_image
):
    argv = [a.format(image=input_image) for a in argv]
    folder = family(name)
    capsys.readouterr()  # what building the folder printed
    code, _, err = run(capsys, "generate", folder, *CPU, *argv, "--output", tmp_path / "o")
    assert code == 2
    assert error_lines(err) == [f"ondeck: error: {message}"]
    assert not (tmp_path / "o" / "report.json").exists()


@pytest.mark.parametrize(
    "content, why", [(b"not an image", "cannot read"), (None, "is not a file")]
)
def test_an_input_image_that_cannot_be_read_is_one_line(
    content, why, capsys, family, tmp_path, monkeypatch
):
    path = tmp_path / "input.png"
    if content is not None:
        path.write_bytes(content)
    forbidden = mock.Mock(side_effect=AssertionError("built before the image was read"))
    monkeypatch.setattr("ondeck.cli.commands.build_pipeline", forbidden)
    code, _, err = run(capsys, "generate", "m", "--image", path, "--output", tmp_path / "o")
    assert code == 2
    [line] = error_lines(err)
    assert line.startswith(f"ondeck: error: argument --image: {why if content else path}")


def test_an_input_image_of_too_many_pixels_is_refused_before_decoding(capsys, tmp_path):
    from PIL import Image

    path = tmp_path / "huge.png"
    # 9000 x 9000 of one colour: a small file that decodes to 243 MB.
    Image.new("L", (9000, 9000)).save(path, optimize=True)
    assert path.stat().st_size < 1_000_000
    code, _, err = run(capsys, "generate", "m", "--image", path, "--output", tmp_path / "o")
    assert code == 2
    assert "is 9000x9000, more than 64 Mpixels" in err


def test_a_second_run_of_a_command_answers_its_prompts_without_encoding_again(
    capsys, family, tmp_path
):
    out = tmp_path / "out"
    argv = ["--height", "8", "--width", "8", "--runs", "2", "--output", out]
    code, _, err = run(capsys, "generate", family("sd3"), *CPU, *argv)
    assert code == 0, err
    kept = json.loads((out / "report.json").read_text())["prompt_cache"]
    # Each of the three encoders: the prompt and the negative prompt once each, then kept.
    assert kept == dict.fromkeys(
        ("text_encoder", "text_encoder_2", "text_encoder_3"), {"hits": 2, "misses": 2, "kept": 2}
    )


def test_a_vae_that_decodes_only_in_tiles_decodes_in_its_own(capsys, family, tmp_path):
    """Allegro's VAE has no decode of whole frames (diffusers raises NotImplementedError
    unless tiling is on, a setting no saved model keeps): the command turns its tiling on
    and writes the video. Its tiles decode only whole: a frame count or side that leaves
    latents past the last tile (grey in the video) is refused naming the ones that fit;
    one that fits (not k·t+1: 24) makes a decoded video, not grey."""
    import imageio.v3 as iio

    folder = family("allegro")
    out = tmp_path / "out"
    for flag, value, told in (
        ("--frames", "8", "--frames: 8 leaves part of the video undecoded"),
        ("--height", "64", "--height: 64 leaves part of the video undecoded"),
    ):
        argv = {"--height": "128", "--width": "128", "--frames": "24", flag: value}
        code, _, err = run(capsys, "generate", folder, *CPU, *_flags(argv), "--output", out)
        assert code == 2 and told in err, err
    argv = ["--height", "128", "--width", "128", "--frames", "24", "--output", out]
    code, _, err = run(capsys, "generate", folder, *CPU, *argv)
    assert code == 0, err
    assert listing(out) == {"video.mp4", "report.json", "timeline.png"}
    video = iio.imread(out / "video.mp4")
    assert len(video) == 24 and video.std() > 1  # decoded, not the grey of zeros


def _flags(values: dict) -> list:
    return [part for flag, value in values.items() for part in (flag, value)]


def test_a_model_whose_own_frame_count_is_kt_plus_1_is_held_to_it(capsys, family, tmp_path):
    """CogVideoX's call gives no default; its transformer's ``sample_frames`` (49) does."""
    argv = ["--height", "16", "--width", "16", "--frames", "8", "--output", tmp_path / "out"]
    code, _, err = run(capsys, "generate", family("cogvideox"), *CPU, *argv)
    assert code == 2
    assert "--frames: must be 4k+1 for this model (1, 5, 9, ...), got 8 (try 5 or 9)" in err


@pytest.mark.parametrize(
    ("family_name", "pipeline_class", "missing"),
    [
        ("sd3", "StableDiffusion3InpaintPipeline", "mask_image"),
        ("flux", "FluxFillPipeline", "mask_image"),
        ("sd_controlnet", "StableDiffusionControlNetImg2ImgPipeline", "control_image"),
    ],
)
def test_a_pipeline_needing_an_input_no_flag_gives_is_refused_before_it_is_built(
    capsys, family, tmp_path, input_image, family_name, pipeline_class, missing
):
    """An inpainting pipeline's mask, a ControlNet img2img pipeline's control image: one
    line naming it, status 2, before anything loads (the call failed at the end with
    diffusers' "Input is in incorrect format")."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(family(family_name), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": pipeline_class}))
    capsys.readouterr()  # what building the folder printed
    out = tmp_path / "new" / "nested" / "out"  # made for the run, and removed with it
    argv = ["--image", input_image, "--height", "16", "--width", "16", "--output", out]
    code, _, err = run(capsys, "generate", folder, *CPU, *argv)
    assert code == 2
    (line,) = error_lines(err)
    assert f"{pipeline_class} needs a {missing} besides its image" in line
    assert not (tmp_path / "new").exists()


def test_the_report_holds_what_reproduces_the_run(capsys, family, tmp_path):
    """The seed, the negative prompt, the guidance, true CFG, the image count and dtype
    asked for, beside the prompt and the shape: the same command again makes the same
    images."""
    out = tmp_path / "out"
    argv = ["--height", "8", "--width", "8", "--seed", "7", "--negative-prompt", "blurry"]
    argv += ["--true-cfg", "1.5", "--images", "2", "--dtype", "fp32"]
    code, _, err = run(
        capsys, "generate", family("flux"), *CPU, *argv, "--guidance", "2.5", "--output", out
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert (report["seed"], report["negative_prompt"], report["guidance"]) == (7, "blurry", 2.5)
    assert (report["true_cfg"], report["images"], report["dtype"]) == (1.5, 2, "fp32")
    assert report["files"] == {"components": {}, "loras": []}
