"""A served video model's frame rate is its own, and a job's files are named as a local
run's: a request's seconds count in the model's frames, its video plays at that rate,
and several images are image-1.png ... image-N.png."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ondeck.serve.jobs import JobFailed
from ondeck.serve.outputs import write_job_files
from ondeck.serve.server import ServeConfig, Server

from .helpers import ROOT


@pytest.fixture(scope="module")
def ltx_server(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    import tiny_pipelines

    folder = tmp_path_factory.mktemp("ltx") / "ltx"
    tiny_pipelines.build_ltx(folder)
    server = Server(
        ServeConfig(models={"ltx": str(folder)}, device="cpu", budget_bytes=2**30),
        say=lambda *_: None,
    )
    yield server
    for model in server.models.values():  # never started: nothing else to stop
        model.pipeline.close()


def test_seconds_count_in_the_models_own_frames_a_second(ltx_server):
    model = ltx_server.models["ltx"]
    # LTX generates for its call's frame_rate argument, 25 by default (Wan's are 16).
    assert (model.fps, model.fps_from) == (25.0, "LTXPipeline's frame_rate argument")
    assert ltx_server.frames_for(model, "1", None) == 26
    assert ltx_server.frames_for(model, None, 9) == 9
    longest = ltx_server.config.limits.frames / 25
    with pytest.raises(JobFailed, match=f"at most {longest:g} .ltx makes 25 frames a second"):
        ltx_server.frames_for(model, str(longest + 1), None)


def test_a_jobs_video_plays_at_the_models_rate(ltx_server, tmp_path):
    import imageio_ffmpeg

    model = ltx_server.models["ltx"]
    frames = np.random.default_rng(0).random((1, 9, 16, 16, 3), dtype=np.float32)
    files = write_job_files(tmp_path, {}, frames, kind="video", fps=model.fps)
    _, seconds = imageio_ffmpeg.count_frames_and_secs(files["video"])
    assert seconds == pytest.approx(9 / 25, abs=0.02)


@pytest.mark.parametrize(
    "count, names", [(1, ["image.png"]), (3, ["image-1.png", "image-2.png", "image-3.png"])]
)
def test_a_jobs_images_are_named_as_a_local_runs(tmp_path, count, names):
    images = [np.full((1, 8, 8, 3), i / count, dtype=np.float32) for i in range(count)]
    files = write_job_files(tmp_path, {}, images, kind="image")
    assert [role for role in files if role != "report"] == [n.removesuffix(".png") for n in names]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == names
