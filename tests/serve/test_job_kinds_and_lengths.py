"""Each route finds only the jobs it serves, a video's ``seconds`` says the video it makes,
a model that needs an input image is refused before its job waits, and a call waiting on
a job the shutdown stops is answered in OpenAI's shape."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ondeck.serve.jobs import JobFailed
from ondeck.serve.server import ServeConfig, Server

from .inprocess import call, make_server


@pytest.fixture
def idle(models, tmp_path):
    """A server of Wan and SD3 whose queue is not started: jobs wait."""
    config = ServeConfig(
        models={name: str(models[name]) for name in ("wan", "sd3")},
        device="cpu",
        budget_bytes=2**30,
        steps=2,
        outputs=tmp_path / "outputs",
        shutdown_grace_seconds=0.0,
    )
    server = Server(config, say=lambda *_: None)
    yield server
    for model in server.models.values():
        model.pipeline.close()


def wait_done(server: Server, job_id: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = call(server, "GET", f"/v1/ondeck/jobs/{job_id}").json()
        if state["status"] in ("completed", "failed"):
            return state
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not end")


def test_the_videos_routes_find_no_image_job_and_a_video_job_made_no_image(models, tmp_path):
    server = make_server(models, tmp_path, names=("wan", "sd3"))
    try:
        body = {"model": "sd3", "prompt": "a fox", "size": "32x32"}
        image_job = call(server, "POST", "/v1/ondeck/images", json=body).json()["id"]
        for path in (f"/v1/videos/{image_job}", f"/v1/videos/{image_job}/content"):
            response = call(server, "GET", path)
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "video_not_found"
        body = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}
        video_job = call(server, "POST", "/v1/videos", json=body).json()["id"]
        assert wait_done(server, video_job)["status"] == "completed"
        response = call(server, "GET", f"/v1/ondeck/jobs/{video_job}/image")
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "no_content"  # not "removed by the cap"
        missing = call(server, "GET", "/v1/ondeck/jobs/video_nothing").json()["error"]
        assert (missing["code"], missing["param"]) == ("job_not_found", "job_id")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("asked", "seconds"),
    [
        ({"seconds": "1.3"}, "1.25"),  # fitted to 21 frames at 16 a second
        ({"seconds": " 2 "}, "2"),
        ({"seconds": "1e-9"}, "0.25"),  # the fewest frames Wan makes: 5
        ({"seconds": "4", "frames": 5}, "0.25"),  # the frames asked for win
    ],
)
def test_a_videos_seconds_are_those_of_the_frames_it_makes(idle, asked, seconds):
    body = {"model": "wan", "prompt": "a fox", "size": "32x32", **asked}
    response = call(idle, "POST", "/v1/videos", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["seconds"] == seconds


@pytest.mark.parametrize(
    ("field", "said"),
    [({"guidance_scale": float("nan")}, "finite"), ({"size": "\uff16\uff14x64"}, "WIDTHxHEIGHT")],
)
def test_a_nan_guidance_and_a_size_in_other_digits_are_refused_as_such(idle, field, said):
    body = {"model": "sd3", "prompt": "a fox", "size": "32x32", **field}
    response = call(idle, "POST", "/v1/ondeck/images", content=json.dumps(body).encode())
    assert response.status_code == 400, response.text
    assert said in response.json()["error"]["message"]


def test_a_model_that_needs_an_input_image_is_refused_before_its_job_waits(idle):
    idle.models["wan"].takes_image = idle.models["wan"].needs_image = True
    body = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}
    response = call(idle, "POST", "/v1/videos", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input_reference" and "input_reference" in error["message"]
    idle.models["sd3"].takes_image = idle.models["sd3"].needs_image = True
    body = {"model": "sd3", "prompt": "a fox", "size": "32x32"}
    assert call(idle, "POST", "/v1/ondeck/images", json=body).status_code == 400
    assert not idle.queue.jobs  # nothing was queued


def test_an_image_call_whose_job_outlasts_the_shutdowns_grace_is_answered_503(idle):
    """The running job stops only at its next step, which may come after the HTTP server
    has stopped waiting: its caller is answered when the grace is over."""
    running, release = threading.Event(), threading.Event()

    def slow_run(job, upcoming):  # a step that takes longer than anyone waits
        job.start()
        running.set()
        release.wait(30)
        job.fail(JobFailed(409, "cancelled", "stopped by shutdown"))

    idle._run = slow_run
    idle.start()
    answers = []
    body = {"model": "sd3", "prompt": "a fox", "size": "32x32"}
    caller = threading.Thread(
        target=lambda: answers.append(call(idle, "POST", "/v1/images/generations", json=body))
    )
    caller.start()
    try:
        assert running.wait(30)
        idle.begin_shutdown()  # a grace of 0 s: over at once
        caller.join(10)
        assert answers, "the waiting call was not answered after the grace"
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json()["error"]["code"] == "server_shutdown"
    finally:
        release.set()
        caller.join(30)
        idle.stop()
