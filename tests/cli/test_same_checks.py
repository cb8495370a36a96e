"""The Python API refuses what the command line refuses, through the same check
(``ondeck.arguments.check_generate_arguments``), with ``ValueError`` naming the
argument; nothing is rounded. Flags that contradict each other are refused too."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
from integrations.tiny_pipelines import FAMILIES

import ondeck.diffusers
from ondeck.arguments import ArgumentError, check_generate_arguments
from ondeck.pipelines.wan import WanTextToVideo

from .helpers import FAST, error_lines, run

WAN_CASES = [
    ({"height": 40}, "height: must be a multiple of 16 for this model, got 40 (try 32 or 48)"),
    ({"width": 8}, "width: must be a multiple of 16 for this model, got 8 (try 16)"),
    ({"num_frames": 0}, "num_frames: must be from 1 to 4097, got 0"),
    ({"num_frames": 6}, "num_frames: must be 4k+1 for this model (1, 5, 9, ...), got 6"),
    ({"guidance_scale": math.nan}, "guidance_scale: must be a finite number, got nan"),
    ({"guidance_scale": math.inf}, "guidance_scale: must be a finite number, got inf"),
    ({"num_inference_steps": 0}, "num_inference_steps: must be from 1 to 10000, got 0"),
    ({"num_inference_steps": 10**9}, "num_inference_steps: must be from 1 to 10000"),
    ({"height": 32.0}, "height: expected a whole number, got 32.0"),
    ({"seed": -1}, "seed: must be from 0 to 18446744073709551615, got -1"),
    ({"num_frames": 129}, "num_frames: 129 is too large for this model"),
    # padded to any length before (a billion tokens exhausted memory)
    ({"max_sequence_length": 4097}, "max_sequence_length: must be from 1 to 4096, got 4097"),
]


@pytest.fixture(scope="module")
def wan(tiny_model):
    return WanTextToVideo.from_folder(tiny_model, device="cpu", policy="release")


@pytest.mark.parametrize("arguments, message", WAN_CASES, ids=[str(a) for a, _ in WAN_CASES])
def test_wan_generate_refuses_what_the_cli_refuses(wan, arguments, message):
    shape = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1}
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        wan.generate("a fox", **{**shape, **arguments})
    assert wan.tracker.bytes_loaded == 0  # refused before anything loaded


@pytest.mark.parametrize(
    "argv, flag_message",
    [
        (["--height", "40"], "--height: must be a multiple of 16 for this model, got 40"),
        (["--frames", "6"], "--frames: must be 4k+1 for this model"),
        (["--steps", "20000"], "--steps: must be from 1 to 10000, got 20000"),
    ],
)
def test_the_cli_says_the_same_with_the_flags_name(
    argv, flag_message, capsys, tiny_model, tmp_path
):
    options = dict(zip(FAST[::2], FAST[1::2], strict=True)) | dict(
        zip(argv[::2], argv[1::2], strict=True)
    )
    flat = [item for pair in options.items() for item in pair]
    code, _, err = run(capsys, "generate", tiny_model, *flat, "--output", tmp_path)
    assert code == 2
    [line] = error_lines(err)
    assert line.startswith(f"ondeck: error: argument {flag_message}")


def test_the_check_is_the_one_both_call(wan, monkeypatch, capsys, tiny_model, tmp_path):
    calls = []

    def refusing(pipeline, **arguments):
        calls.append(arguments)
        raise ArgumentError("height", "refused by the one check")

    monkeypatch.setattr("ondeck.pipelines.wan.check_generate_arguments", refusing)
    monkeypatch.setattr("ondeck.cli.commands.check_generate_arguments", refusing)
    with pytest.raises(ValueError, match="height: refused by the one check"):
        wan.generate("a fox", height=32, width=32, num_frames=5, num_inference_steps=1)
    code, _, err = run(capsys, "generate", tiny_model, *FAST, "--output", tmp_path)
    assert (code, error_lines(err)) == (
        2,
        ["ondeck: error: argument --height: refused by the one check"],
    )
    assert len(calls) == 2


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("flux") / "flux"
    FAMILIES["flux"].build(path)
    return path


@pytest.fixture(scope="module")
def flux(flux_folder):
    return ondeck.diffusers.from_pretrained(flux_folder, device="cpu")


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"height": 7}, "height: must be a multiple of 2 for this model, got 7 (try 6 or 8)"),
        ({"guidance_scale": math.nan}, "guidance_scale: must be a finite number, got nan"),
        ({"num_inference_steps": 0}, "num_inference_steps: must be from 1 to 10000, got 0"),
        # any batch was allocated before (10**8 images exhausted memory)
        (
            {"num_images_per_prompt": 4097},
            "num_images_per_prompt: must be from 1 to 4096, got 4097",
        ),
    ],
)
def test_diffusers_generate_refuses_what_the_cli_refuses(flux, arguments, message):
    shape = {"height": 8, "width": 8, "num_inference_steps": 1}
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        flux.ondeck.generate("a fox", **{**shape, **arguments})
    assert flux.ondeck.tracker.bytes_loaded == 0


def test_images_past_the_bound_are_refused_with_the_flags_name(
    capsys, flux_folder, tmp_path, monkeypatch
):
    monkeypatch.setattr("ondeck.cli.generate._run_all", None)  # never reached
    argv = ["generate", flux_folder, "--device", "cpu", "--steps", "1", "--images", "100000000"]
    code, _, err = run(capsys, *argv, "--output", tmp_path / "o")
    said = [line for line in error_lines(err) if line.startswith("ondeck")]  # not diffusers' bar
    assert (code, said) == (
        2,
        ["ondeck: error: argument --images: must be from 1 to 4096, got 100000000"],
    )


def test_an_allegro_like_pipeline_takes_any_frame_count():
    """Frames k·t+1 only where the pipeline's own default is such a count."""

    class Pipe:
        vae_scale_factor_temporal = 4
        vae_scale_factor_spatial = 8

        def __call__(self, prompt=None, num_frames: int = 88):
            pass

    runtime = SimpleNamespace(pipe=Pipe())  # what check_generate_arguments reads of it
    check_generate_arguments(runtime, num_frames=8)
    Pipe.__call__.__defaults__ = (None, 81)
    with pytest.raises(ArgumentError, match="num_frames: must be 4k\\+1"):
        check_generate_arguments(runtime, num_frames=8)


def test_mochis_frames_are_6k_plus_1():
    """Mochi names its VAE's frame ratio ``vae_temporal_scale_factor``; 8 frames would
    decode as 7 while the report said 8."""

    class Mochi:
        vae_temporal_scale_factor = 6
        vae_spatial_scale_factor = 8

        def __call__(self, prompt=None, num_frames: int = 19):
            pass

    runtime = SimpleNamespace(pipe=Mochi())
    check_generate_arguments(runtime, num_frames=13)
    with pytest.raises(ArgumentError, match="num_frames: must be 6k\\+1"):
        check_generate_arguments(runtime, num_frames=8)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"width": 528}, "width: 528 is too large for this model: more patches than the "
         "transformer's 32 rotary positions (its rope_max_seq_len); at most 512"),
        ({"num_frames": 129}, "num_frames: 129 is too large for this model"),
    ],
)  # fmt: skip
def test_a_wan_family_on_the_diffusers_path_is_held_to_its_rotary_positions(given, message):
    """Wan 2.2, Wan image-to-video and the other Wan families run on the diffusers path:
    a side past the transformer's rotary positions is refused before anything loads, as
    on ondeck's Wan stages, not by a shape error after every component loaded."""

    class Wan22:
        vae_scale_factor_spatial = 8
        vae_scale_factor_temporal = 4
        transformer = SimpleNamespace(
            config=SimpleNamespace(rope_max_seq_len=32, patch_size=(1, 2, 2))
        )

        def __call__(self, prompt=None, num_frames: int = 81):
            pass

    runtime = SimpleNamespace(pipe=Wan22())
    check_generate_arguments(runtime, width=512, num_frames=125)
    with pytest.raises(ArgumentError) as caught:
        check_generate_arguments(runtime, **given)
    assert str(caught.value).startswith(message)


def test_auraflows_positions_are_a_grid_whose_side_bounds_each_side():
    """AuraFlow's pos_embed_max_size counts a square grid's positions (64: 8 a side):
    a longer side failed with an IndexError after every component loaded."""

    class AuraFlow:
        vae_scale_factor = 2
        transformer = SimpleNamespace(
            config=SimpleNamespace(
                _class_name="AuraFlowTransformer2DModel", pos_embed_max_size=64, patch_size=2
            )
        )

        def __call__(self, prompt=None, height: int = 32, width: int = 32):
            pass

    runtime = SimpleNamespace(pipe=AuraFlow())
    check_generate_arguments(runtime, height=32, width=32)
    with pytest.raises(ArgumentError) as caught:
        check_generate_arguments(runtime, height=36)
    assert str(caught.value).startswith(
        "height: 36 is too large for this model: more than the transformer's 8 positions a "
        "side (the side of its 64-position grid) of 4-pixel patches; at most 32"
    )


@pytest.mark.parametrize("policy", ["eager", "release"])
@pytest.mark.parametrize("command", ["generate", "plan"])
def test_a_budget_with_a_policy_that_ignores_it_is_refused(
    policy, command, capsys, tiny_model, tmp_path
):
    argv = [command, tiny_model, "--device", "cpu", "--policy", policy, "--budget", "1GiB"]
    if command == "generate":
        argv += ["--output", tmp_path / "o"]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert error_lines(err) == [
        f"ondeck: error: argument --budget: --policy {policy} does not use a budget; give "
        "--policy budget or auto with --budget, or leave --budget out"
    ]
