"""Paths and names as users type them: ``--image=~/cat.png`` (the shell leaves that ~
alone), two models of one folder name in one plan, a repo id named as typed, a folder
where an earlier run's image would be, and a size asked of Flux Kontext, whose call
would otherwise make a megapixel."""

from __future__ import annotations

import argparse
import json

import pytest

from ondeck.cli.commands import call_extra
from ondeck.cli.media import media_of, read_input_image
from ondeck.cli.options import UsageError
from ondeck.hub import model_label
from ondeck.output import remove_earlier_results

from .helpers import IMAGE_ARGS, run


def test_an_input_image_path_with_a_tilde_is_the_home_folders(input_image, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(input_image.parent))
    image = read_input_image(f"~/{input_image.name}")
    assert image.size == (16, 16)


def test_a_16_bit_or_float_input_image_keeps_its_range(tmp_path):
    """A 16-bit PNG (a depth map) is scaled from 0..65535 and a float TIFF from 0..1:
    converted plainly, the first turns white and the second black."""
    import numpy as np
    from PIL import Image

    ramp = np.arange(64 * 64, dtype=np.float64).reshape(64, 64) / (64 * 64 - 1)
    deep = tmp_path / "depth.png"
    Image.fromarray(np.rint(ramp * 65535).astype(np.uint16)).save(deep)
    floats = tmp_path / "depth.tiff"
    Image.fromarray(ramp.astype(np.float32)).save(floats)
    for path in (deep, floats):
        read = np.asarray(read_input_image(str(path)), dtype=np.float64)
        assert read.shape == (64, 64, 3)
        assert np.abs(read[..., 0] - ramp * 255).max() <= 1, path.name
    Image.fromarray((ramp * 1000).astype(np.float32)).save(floats)
    with pytest.raises(UsageError, match=r"depth\.tiff: its values run from 0 to 1000"):
        read_input_image(str(floats))


def test_a_folder_named_as_an_earlier_image_is_left_and_the_earlier_images_go(tmp_path):
    (tmp_path / "image-5.png").mkdir()
    (tmp_path / "image-3.png").write_bytes(b"an earlier run's")
    written = [tmp_path / "image-1.png", tmp_path / "image-2.png"]
    for path in written:
        path.write_bytes(b"this run's")
    remove_earlier_results(tmp_path, written, earlier={"image-3.png", "image-5.png"})
    assert (tmp_path / "image-5.png").is_dir()
    assert not (tmp_path / "image-3.png").exists()
    assert all(path.is_file() for path in written)


def test_a_model_is_labelled_by_its_folders_name_or_its_repo_id_as_typed(tmp_path):
    (tmp_path / "flux").mkdir()
    assert model_label(tmp_path / "flux") == "flux"
    assert model_label(f"{tmp_path / 'flux'}/") == "flux"
    assert model_label("black-forest-labs/FLUX.1-dev") == "black-forest-labs/FLUX.1-dev"


def test_a_plan_of_two_folders_of_one_name_names_each_as_typed(
    family, tmp_path, capsys, monkeypatch
):
    for parent, name in (("one", "flux"), ("two", "sd3")):
        (tmp_path / parent).mkdir()
        (tmp_path / parent / "model").symlink_to(family(name), target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(
        capsys, "plan", "one/model", "two/model/", "--device", "cpu", "--budget", "1GiB"
    )
    assert code == 0, err
    assert "one/model" in out and "two/model" in out
    code, _, err = run(
        capsys, "plan", "one/model", "one/model", "--device", "cpu", "--budget", "1GiB"
    )
    assert code == 2 and "named twice" in err


def test_a_size_asked_of_flux_kontext_is_its_output_area(family):
    media = media_of(family("flux_kontext"))
    assert media.takes_max_area
    args = argparse.Namespace(height=64, width=96, frames=None, steps=2, images=None)
    assert call_extra(args, media, image=None)["max_area"] == 64 * 96
    args = argparse.Namespace(height=None, width=None, frames=None, steps=2, images=None)
    assert "max_area" not in call_extra(args, media, image=None)  # the pipeline's own


def test_one_side_asked_of_flux_kontext_keeps_the_other_its_own(family):
    """Kontext makes a megapixel (its max_area) at the shape of the height and width it
    is given, its own 1024x1024 (here, a tiny one's) for a side not given: ``--width``
    alone must not stretch the other side to fill that area."""
    import ondeck.diffusers

    folder = family("flux_kontext")
    vae = json.loads((folder / "vae" / "config.json").read_text())
    own_side = 128 * 2 ** (len(vae["block_out_channels"]) - 1)  # default_sample_size × scale
    pipe = ondeck.diffusers.from_pretrained(folder, device="cpu")  # nothing loads
    for height, width in ((None, 32), (48, None)):
        args = argparse.Namespace(height=height, width=width, frames=None, steps=2, images=None)
        extra = call_extra(args, media_of(folder), None, pipe)
        assert extra["max_area"] == (height or own_side) * (width or own_side)


def test_a_side_past_sd3s_learned_positions_is_refused_before_anything_loads(family, capsys):
    folder = family("sd3")
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    most = (
        transformer["pos_embed_max_size"]
        * transformer["patch_size"]
        * 2 ** (len(vae["block_out_channels"]) - 1)
    )
    step = transformer["patch_size"] * 2 ** (len(vae["block_out_channels"]) - 1)
    width = most + step
    code, out, err = run(
        capsys, "generate", folder, "--prompt", "a fox", "--width", width, "--height", step,
        "--device", "cpu", "--steps", "2", "--output", folder.parent / "sd3-wide",
    )  # fmt: skip
    assert code == 2, err
    assert "pos_embed_max_size" in err and f"at most {most}" in err
    assert not (folder.parent / "sd3-wide" / "report.json").exists()  # refused before a run


def test_a_report_whose_last_write_fails_is_not_said_to_be_written(
    family, tmp_path, capsys, monkeypatch
):
    import ondeck.cli.generate as generate
    from ondeck.output import OutputError

    writes = []

    def write_json(path, value):
        writes.append(path)
        if len(writes) > 1:  # the report's second write, with the files: the disk is full
            raise OutputError(f"could not write {path}: No space left on device")
        return real(path, value)

    real = generate.write_json
    monkeypatch.setattr(generate, "write_json", write_json)
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "generate", family("flux"), *IMAGE_ARGS, "--output", out)
    assert code == 0, err
    assert "does not say what was written" in err
    wrote = next(line for line in stdout.splitlines() if line.startswith("ondeck: wrote"))
    assert str(out / "image.png") in wrote and "report.json" not in wrote
    assert "files" not in json.loads((out / "report.json").read_text())["output"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--weights", "bogus=fp8"), ("--weights", "scheduler=fp8"), ("--component", "scheduler=x")],
)
def test_a_weights_flag_naming_no_model_is_the_flags_error(family, tmp_path, capsys, flag, value):
    (tmp_path / "x").write_bytes(b"")
    code, _, err = run(
        capsys, "generate", family("flux"), *IMAGE_ARGS,
        flag, value.replace("=x", f"={tmp_path / 'x'}"),
        "--output", tmp_path / "out",
    )  # fmt: skip
    assert code == 2, err
    assert f"argument {flag}: {value.split('=')[0]} is not a model" in err
    assert "transformer" in err  # the models it has


def test_without_guidance_the_pipeline_runs_at_its_own(family, tmp_path, capsys):
    """SD3's own guidance_scale is 7.0: no --guidance makes what --guidance 7 makes, and
    not what another value makes."""
    made = {}
    for name, flags in (("own", []), ("seven", ["--guidance", "7"]), ("five", ["--guidance", "5"])):
        out = tmp_path / name
        code, _, err = run(capsys, "generate", family("sd3"), *IMAGE_ARGS, *flags, "--output", out)
        assert code == 0, err
        made[name] = (out / "image.png").read_bytes()
    assert made["own"] == made["seven"]
    assert made["own"] != made["five"]


def test_a_quiet_plan_prints_nothing_of_the_libraries_own(tmp_path):
    """``ONDECK_PROGRESS=0``: no diffusers bar for the components it lists, and no
    transformers note on a package it falls back from (torchvision, absent here): the
    command's stderr is empty when nothing is wrong."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from integrations.breadth_pipelines import ALL_FAMILIES

    folder = tmp_path / "flux"
    ALL_FAMILIES["flux"].build(folder)
    root = Path(__file__).resolve().parents[2]
    environment = {**os.environ, "PYTHONPATH": str(root), "ONDECK_PROGRESS": "0"}
    environment["ONDECK_CACHE"] = str(tmp_path / "cache")
    environment.pop("TRANSFORMERS_VERBOSITY", None)
    done = subprocess.run(
        [sys.executable, "-m", "ondeck", "plan", str(folder), "--device", "cpu"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("ondeck: auto chose")


@pytest.fixture(scope="module")
def flux_and_sd3(tmp_path_factory):
    from integrations.breadth_pipelines import ALL_FAMILIES

    root = tmp_path_factory.mktemp("true-cfg")
    for name in ("flux", "sd3"):
        ALL_FAMILIES[name].build(root / name)
    return root / "flux", root / "sd3"


def _flags(**given):
    defaults = dict(images=None, frames=None, fps=None, image=None, negative_prompt="")
    return argparse.Namespace(**{**defaults, "guidance": None, "true_cfg": None, **given})


def test_flags_flux_would_ignore_are_said_and_true_cfg_reaches_it(flux_and_sd3):
    """Flux runs a negative prompt only with true CFG, and a transformer without a
    guidance embedding (FLUX.1 [schnell]; this tiny one) ignores guidance_scale: each
    says so in one warning. ``--true-cfg`` passes true_cfg_scale; a pipeline without
    one refuses it."""
    from ondeck.cli.media import check_media_flags

    flux, sd3 = flux_and_sd3
    media = media_of(flux)
    assert (media.true_cfg_default, media.guidance_embedded) == (1.0, False)
    with pytest.warns(UserWarning, match="--negative-prompt changes nothing"):
        check_media_flags(_flags(negative_prompt="blurry"), media)
    with pytest.warns(UserWarning, match="--guidance changes nothing"):
        check_media_flags(_flags(guidance=2.0), media)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_media_flags(_flags(negative_prompt="blurry", true_cfg=4.0), media)
    assert call_extra(_flags(true_cfg=4.0), media, None)["true_cfg_scale"] == 4.0
    with pytest.raises(Exception, match="argument --true-cfg: StableDiffusion3Pipeline has no"):
        check_media_flags(_flags(true_cfg=4.0), media_of(sd3))


def test_inspect_keeps_its_columns_for_long_class_names(capsys, tmp_path):
    """HunyuanVideoTransformer3DModel is longer than the class column was: the columns
    widen to it, and every dtype is written one way (``float32``, as a single file's
    ``float8_e4m3fn``)."""
    from integrations.breadth_pipelines import ALL_FAMILIES

    folder = tmp_path / "hunyuan"
    ALL_FAMILIES["hunyuan_video"].build(folder)
    code, out, _ = run(capsys, "inspect", folder)
    assert code == 0
    weighed = [line for line in out.splitlines()[1:] if line.rstrip().endswith("iB")]
    assert len(weighed) == 5, out  # four models and the sum
    assert len({len(line.rstrip()) for line in weighed}) == 1, out  # sizes right-aligned
    assert "torch." not in out and "HunyuanVideoTransformer3DModel " in out


def test_a_folder_whose_model_index_names_no_class_says_so(capsys, tmp_path):
    from integrations.breadth_pipelines import ALL_FAMILIES

    folder = tmp_path / "flux"
    ALL_FAMILIES["flux"].build(folder)
    index = folder / "model_index.json"
    document = json.loads(index.read_text())
    del document["_class_name"]
    index.write_text(json.dumps(document))
    code, _, err = run(capsys, "plan", folder, "--device", "cpu")
    assert code == 1
    assert "its model_index.json has no _class_name" in err and "'None'" not in err


def test_inspect_refuses_a_folder_that_names_no_pipeline_class(capsys, tmp_path):
    """As plan and generate refuse it: not a listing of "None" and "sum 0 B"."""
    from .helpers import error_lines

    (tmp_path / "model_index.json").write_text('{"_diffusers_version": "0.42.1"}')
    code, out, err = run(capsys, "inspect", tmp_path)
    assert code == 1 and not out
    (line,) = error_lines(err)
    assert "has no _class_name" in line and str(tmp_path) in line


def test_an_empty_model_argument_is_no_folder_not_the_embedded_default(
    capsys, tmp_path, monkeypatch
):
    from .helpers import error_lines

    monkeypatch.setenv("ONDECK_CACHE", str(tmp_path / "cache"))
    code, _, err = run(capsys, "generate", "", "--device", "cpu", "--output", tmp_path / "o")
    assert code == 1
    (line,) = error_lines(err)
    assert "no model_index.json" in line
    assert not (tmp_path / "cache").exists(), "nothing built"


def test_allegros_tiles_are_checked_without_loading_its_vae(family):
    """Reading the tiles off the deferred VAE would load it: a skeleton answers."""
    import ondeck.diffusers
    from ondeck.arguments import ArgumentError, check_generate_arguments

    pipe = ondeck.diffusers.from_pretrained(family("allegro"), device="cpu")
    with pytest.raises(ArgumentError, match="64 leaves part of the video undecoded"):
        check_generate_arguments(pipe, height=64, width=128, num_frames=24)
    check_generate_arguments(pipe, height=144, width=176, num_frames=40)  # whole tiles
    assert pipe.ondeck.tracker.resident == {}


def test_allegro_tiles_under_a_latent_apart_are_not_checked():
    """Tiles closer than a latent pixel apart (a VAE's sample_size just past its fixed
    overlap) leave no size that fits to suggest: no check, not a StopIteration."""
    from types import SimpleNamespace

    from ondeck.arguments import check_generate_arguments

    class AutoencoderKLAllegro:
        config = SimpleNamespace(_class_name="AutoencoderKLAllegro")
        kernel, stride = (24, 124, 124), (16, 4, 44)  # 4 pixels: under one latent's 8

    class AllegroPipeline:
        vae, vae_scale_factor_spatial, vae_scale_factor_temporal = AutoencoderKLAllegro(), 8, 4

        def __call__(self, prompt=None, height=None, width=None, num_frames=88):
            raise NotImplementedError

    check_generate_arguments(AllegroPipeline(), height=64, width=64, num_frames=88)


def test_a_budget_too_small_prints_its_plan_once_and_one_error_line(family, tmp_path, capsys):
    """The plan goes to stdout before the first run; the BudgetError of that run is one
    line on stderr, not the plan a second time."""
    code, out, err = run(
        capsys, "generate", family("sd3"), *IMAGE_ARGS, "--budget", "100KiB",
        "--output", tmp_path / "out",
    )  # fmt: skip
    assert code == 1, err
    assert out.count("does not fit 100.00 KiB") == 1
    assert "stages:" in out
    said = err[err.index("ondeck: error:") :].splitlines()  # the fixture's build logs before
    assert len(said) == 1, err
    assert said[0].startswith("ondeck: error: BudgetError: stage ")
    assert "nothing was loaded" in said[0]
    assert not (tmp_path / "out").exists()
