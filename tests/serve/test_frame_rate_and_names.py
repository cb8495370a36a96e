"""A served video model's frame rate is its own, and so are its size, steps and frame
count where a request names none; a job's files are named as a local run's: a request's
seconds count in the model's frames, its video plays at that rate, and several images
are image-1.png ... image-N.png."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ondeck.serve.jobs import JobFailed
from ondeck.serve.outputs import write_job_files
from ondeck.serve.server import ServeConfig, Server

from .helpers import wait_for
from .inprocess import call, make_server


@pytest.fixture(scope="module")
def ltx_server(ltx_folder):
    server = Server(
        ServeConfig(models={"ltx": str(ltx_folder)}, device="cpu", budget_bytes=2**30),
        say=lambda *_: None,
    )
    yield server
    for model in server.models.values():  # never started: nothing else to stop
        model.pipeline.close()


def test_seconds_count_in_the_models_own_frames_a_second(ltx_server):
    model = ltx_server.models["ltx"]
    # LTX generates for its call's frame_rate argument, 25 by default (Wan's are 16).
    assert (model.fps, model.fps_from) == (25.0, "LTXPipeline's frame_rate argument")
    assert ltx_server.frames_for(model, "2", None) == 49  # 2 s, 4k+1 frames
    assert ltx_server.frames_for(model, None, 9) == 9
    longest = (ltx_server.config.limits.frames - 1) / 25
    with pytest.raises(JobFailed, match=f"at most {longest:g} .ltx makes 25 frames a second"):
        ltx_server.frames_for(model, str(longest + 1), None)


def asked_of(server, monkeypatch, body: dict) -> dict:
    """The job (width, height, steps, frames) the server would queue for ``body``."""
    seen = {}

    def record(job):
        seen.update(width=job.width, height=job.height, steps=job.steps, frames=job.frames)
        raise JobFailed(400, "recorded", "recorded")

    monkeypatch.setattr(server, "submit", record)
    response = call(server, "POST", "/v1/videos", json=body)
    assert seen, response.text
    return seen


def test_a_request_naming_no_shape_gets_the_models_own(ltx_server, monkeypatch):
    """LTX's own: 704x512, 50 steps and 161 frames (as a local run asks), not Wan's
    832x480 or 4 seconds for every model."""
    asked = asked_of(ltx_server, monkeypatch, {"model": "ltx", "prompt": "a fox"})
    assert asked == {"width": 704, "height": 512, "steps": 50, "frames": 161}


def test_the_models_own_frame_count_is_held_to_the_frames_limit(ltx_server, monkeypatch):
    """Past --max-frames, the most frames the limit allows that LTX's VAE takes (8k+1)."""
    monkeypatch.setattr(ltx_server.config.limits, "frames", 100)
    asked = asked_of(ltx_server, monkeypatch, {"model": "ltx", "prompt": "a fox"})
    assert asked["frames"] == 97


def test_seconds_under_a_limit_shorter_than_the_models_shortest_video_are_refused(
    ltx_server, monkeypatch
):
    """LTX's shortest video is 5 frames (4k+1): under --max-frames 4, seconds (0.1, short
    enough for the limit) are refused, not made 5 frames past it."""
    monkeypatch.setattr(ltx_server.config.limits, "frames", 4)
    model = ltx_server.models["ltx"]
    with pytest.raises(
        JobFailed, match="shortest .* video seconds asks for is 5 frames, past this server.s limit"
    ):
        ltx_server.frames_for(model, "0.1", None)


def test_seconds_are_refused_first_under_a_limit_no_video_length_fits(ltx_server, monkeypatch):
    """Under --max-frames 3 no seconds fit LTX's 5 frames: a request for 1 s is told that,
    not to ask for at most 0.08 s, which would be refused in turn."""
    monkeypatch.setattr(ltx_server.config.limits, "frames", 3)
    model = ltx_server.models["ltx"]
    for seconds in ("1", "0.08"):
        with pytest.raises(JobFailed, match="shortest ltx video seconds asks for is 5 frames"):
            ltx_server.frames_for(model, seconds, None)


def test_the_embedded_default_is_asked_its_small_shape_as_generate_asks_it(tmp_path, monkeypatch):
    """Served as the embedded default (``ondeck serve`` with no model), a request naming
    no shape gets what `ondeck generate` with no model asks: 192x320, 17 frames, 6 steps,
    not the Wan call's own 480x832 and 81 frames of noise."""
    from ondeck.cli.shape import EMBEDDED_SHAPE
    from ondeck.embedded import build_wan_folder

    folder = build_wan_folder(tmp_path / "embedded", preset="tiny")
    config = dict(names=("wan-embedded",), steps=None, budget_bytes=2**30)
    server = make_server({"wan-embedded": folder}, tmp_path, embedded="wan-embedded", **config)
    plain = make_server({"wan-embedded": folder}, tmp_path / "plain", **config)
    try:
        asked = asked_of(server, monkeypatch, {"model": "wan-embedded", "prompt": "a fox"})
        own = plain.models["wan-embedded"].own_shape
    finally:
        server.stop()
        plain.stop()
    assert asked == {"height": 192, "width": 320, "frames": 17, "steps": 6}
    assert asked == dataclasses.asdict(EMBEDDED_SHAPE)
    assert (own.height, own.width, own.frames, own.steps) == (480, 832, 81, 50)


def test_a_frame_count_the_pipeline_computes_itself_is_read_from_its_video(ltx_folder, tmp_path):
    """Where a pipeline's call computes its own frame count (CogVideoX's, from its
    transformer's config), the job asks none: its frames and seconds are those of the
    video made, unknown until then. Here LTX, taken for such a pipeline, makes its 161."""
    server = make_server({"ltx": ltx_folder}, tmp_path, names=("ltx",), budget_bytes=2**30)
    model = server.models["ltx"]
    model.own_shape = dataclasses.replace(model.own_shape, frames=None)
    try:
        body = {"model": "ltx", "prompt": "a fox", "size": "32x32", "steps": 1}
        queued = call(server, "POST", "/v1/videos", json=body).json()
        job = server.queue.get(queued["id"])
        wait_for(job.done_event.is_set)
        done = call(server, "GET", f"/v1/videos/{job.id}").json()
    finally:
        server.stop()
    assert queued["seconds"] is None
    assert (done["status"], job.frames, done["seconds"]) == ("completed", 161, "6.4")


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


def test_seconds_fit_the_frame_counts_the_model_takes(ltx_server):
    """LTX takes 4k+1 frames: a second at 25 frames a second is 25 frames, not the 26
    its VAE would refuse; the longest duration is the most frames' intervals."""
    model = ltx_server.models["ltx"]
    assert ltx_server.frames_for(model, "1", None) == 25
    assert ltx_server.frames_for(model, "0.01", None) == 5  # one interval at least
    most = ltx_server.config.limits.frames
    longest = (most - 1) / 25
    assert ltx_server.frames_for(model, f"{longest:g}", None) <= most
    with pytest.raises(JobFailed, match=f"at most {longest:g} "):
        ltx_server.frames_for(model, f"{longest + 0.1:g}", None)


@pytest.mark.parametrize("name", ["ltx", "wan"])
def test_a_frame_count_the_model_does_not_take_is_refused_not_changed(name, ltx_server, models):
    """Both take 4k+1 frames (Wan's own stages and a diffusers pipeline): 10 is refused
    naming the frames, where it once ran as 9 on Wan."""
    from ondeck.serve.jobs import Job

    server = ltx_server
    if name == "wan":
        config = ServeConfig(models={"wan": str(models["wan"])}, device="cpu", budget_bytes=2**30)
        server = Server(config, say=lambda *_: None)
    model = server.models[name]
    assert server.frames_for(model, None, 10) == 10
    job = Job(id="j", kind="video", model=name, prompt="a fox", width=32, height=32, frames=10)
    try:
        with pytest.raises(JobFailed, match="frames") as refused:
            server.check_shape(model, job)
    finally:
        if server is not ltx_server:
            model.pipeline.close()
    assert refused.value.param == "frames"


def test_an_image_jobs_report_holds_every_images_run(models, tmp_path):
    from .inprocess import call, make_server

    server = make_server(models, tmp_path, names=("sd3",))
    try:
        tracker = server.models["sd3"].pipeline.tracker
        for n in (2, 3):
            tracker.exposed_load_total += 100.0  # as if earlier jobs had waited long
            answer = call(
                server,
                "POST",
                "/v1/images/generations",
                json={"model": "sd3", "prompt": "a fox", "size": "32x32", "n": n},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["data"]) == n
            report = server.last_report
            assert sorted({stage["run"] for stage in report["stages"]}) == list(
                range(report["runs"] - n + 1, report["runs"] + 1)
            ), "every image's run, and none of the job before"
            waited = sum(stage["exposed_load_seconds"] for stage in report["stages"])
            assert report["exposed_load_seconds"] == pytest.approx(waited), "the job's own"
            assert report["peak_measured_bytes"] == max(
                (event["measured_bytes"] or 0 for event in report["events"]), default=0
            )
    finally:
        server.stop()
