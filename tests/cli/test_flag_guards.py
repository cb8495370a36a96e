"""Guards of ``ondeck generate``'s flags that refuse before any work: a frame rate the
encoder cannot take, more images than the pipeline makes per prompt, a float input image
whose values fit no range, a folder as the image, a config's frame rate that is no rate;
and the output folders a failed run made are removed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from ondeck.cli.media import Media, check_media_flags, model_fps
from ondeck.cli.options import UsageError

from .helpers import FAST, error_lines, run

IMAGE_MEDIA = Media(
    pipeline_class="OneImagePipeline",
    video=False,
    fps=16.0,
    fps_from="",
    takes_image=False,
    needs_image=False,
    takes_count=False,
)


def flags(**given) -> SimpleNamespace:
    unset = dict.fromkeys(("images", "frames", "fps", "image", "negative_prompt", "true_cfg"))
    return SimpleNamespace(**{**unset, **given})


@pytest.mark.parametrize("fps", ["0", "1001", "-5"])
def test_a_frame_rate_the_encoder_cannot_take_is_refused_before_loading(capsys, tmp_path, fps):
    code, _, err = run(capsys, "generate", tmp_path / "no-such-model", "--fps", fps)
    assert code == 2
    assert "argument --fps: must be from 0.001 to 1000" in err


def test_more_images_than_a_pipeline_makes_per_prompt_are_refused():
    with pytest.raises(UsageError, match="OneImagePipeline makes one image per prompt"):
        check_media_flags(flags(images=2), IMAGE_MEDIA)
    check_media_flags(flags(images=1), IMAGE_MEDIA)  # one is what it makes
    check_media_flags(flags(images=2), dataclasses.replace(IMAGE_MEDIA, takes_count=True))


def test_a_float_image_outside_both_ranges_is_refused_naming_them(capsys, tiny_model, tmp_path):
    from PIL import Image

    path = tmp_path / "depth.tiff"
    Image.fromarray(np.linspace(-1, 300, 64, dtype=np.float32).reshape(8, 8), mode="F").save(path)
    code, _, err = run(capsys, "generate", tiny_model, *FAST, "--image", path)
    assert code == 2, err
    assert "a float image is read as 0..1 or 0..255" in err and "from -1 to 300" in err


def test_a_folder_given_as_the_image_is_not_a_file(capsys, tiny_model, tmp_path):
    code, _, err = run(capsys, "generate", tiny_model, *FAST, "--image", tmp_path)
    assert code == 2
    assert error_lines(err)[-1].endswith(f"argument --image: {tmp_path} is not a file")


@pytest.mark.parametrize("value", [0, -16, 5000, float("nan"), True])
def test_a_configs_frame_rate_that_is_no_rate_is_passed_over(value):
    fps, where = model_fps(None, {}, [{"fps": value}, {"frame_rate": 24}])
    assert (fps, where) == (24.0, "the config's frame_rate")


def test_a_failed_run_removes_the_output_folders_it_made(capsys, tmp_path):
    """Nothing written, nothing left: not even the empty folders --output named."""
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "model_index.json").write_text("{ not json")
    code, _, err = run(capsys, "generate", broken, "--device", "cpu", "--output",
                       tmp_path / "a" / "b" / "c")  # fmt: skip
    assert code != 0, err
    assert not (tmp_path / "a").exists()
