"""A prompt longer than the text encoder reads is cut by the pipeline: ondeck says so."""

from __future__ import annotations

import warnings

import pytest
import torch

import ondeck.diffusers
from ondeck.embedded import build_wan_folder


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    folder = build_wan_folder(tmp_path_factory.mktemp("prompt") / "wan", preset="tiny")
    pipe = ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device="cpu", policy="release", progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


SIZE = dict(height=16, width=16, num_frames=5, num_inference_steps=1, seed=0)


def test_a_prompt_past_max_sequence_length_is_a_warning(pipe):
    with pytest.warns(
        UserWarning, match=r"the prompt is \d+ tokens and WanPipeline reads the first 8"
    ):
        pipe.ondeck.generate("a fox " * 20, max_sequence_length=8, **SIZE)


def test_a_prompt_within_it_is_not(pipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pipe.ondeck.generate("a fox", max_sequence_length=8, **SIZE)


def test_the_wan_stages_say_so_too(tmp_path):
    from ondeck.pipelines.wan import WanTextToVideo

    folder = build_wan_folder(tmp_path / "wan", preset="tiny")
    pipe = WanTextToVideo.from_folder(folder, device="cpu", progress=False, policy="release")
    with pytest.warns(UserWarning, match=r"the prompt is \d+ tokens and the Wan text encoder"):
        pipe.generate("a fox " * 20, max_sequence_length=8, **SIZE)
