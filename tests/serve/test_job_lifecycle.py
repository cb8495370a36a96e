"""A job's life on a Server driven in-process through its ASGI app: a cancel at any
point before the job completes, cancelled jobs that wait, a shape refused before it
waits, and a job's files read while another request adds its timeline."""

from __future__ import annotations

import threading
from pathlib import Path

from PIL import Image

import ondeck.serve.server as server_module
from ondeck.serve.jobs import Job

from .helpers import wait_for
from .inprocess import Limits, call, make_server

VIDEO = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}


def test_a_video_cancelled_while_its_files_are_written_leaves_no_files(models, tmp_path, gate):
    """A cancel after the last denoising step, while the video decodes or its MP4 is
    written, holds: the job fails as cancelled, nothing is served and its folder goes (the
    cancel used to be ignored once the steps were over)."""
    entered, release = gate
    server = make_server(models, tmp_path)
    try:
        job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
        assert entered.wait(60)
        # Its files are being written, the device thread done with it: a stop now waits
        # for it as for a running job.
        wait_for(lambda: server.queue.current is None)
        assert server.job_in_hand() is server.queue.get(job_id)
        cancelled = call(server, "DELETE", f"/v1/ondeck/jobs/{job_id}")
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        release.set()
        job = server.queue.get(job_id)
        wait_for(lambda: job.done_event.is_set())
        wait_for(lambda: not server._writing)
        after = call(server, "GET", f"/v1/videos/{job_id}")
        content = call(server, "GET", f"/v1/videos/{job_id}/content")
    finally:
        server.stop()
    folder = tmp_path / "outputs" / job_id
    assert after.json()["status"] == "failed" and after.json()["error"]["code"] == "cancelled"
    assert content.status_code == 409 and not folder.exists()
    assert (server.jobs_run, server.jobs_failed) == (0, 1)  # counted once, as it ended


def test_a_job_ends_once_whatever_its_log_line_meets():
    """The count and log line a job's end is told to cannot undo that end (a log whose
    reader has gone raises), and a job over already is not failed again."""
    from ondeck.serve.jobs import JobFailed

    told = []

    def broken_log(job):
        told.append(job.status)
        raise BrokenPipeError

    job = Job(kind="video", model="wan", prompt="a", width=32, height=32, on_finish=broken_log)
    job.complete()
    job.fail(JobFailed(500, "output_failed", "too late"))
    assert (job.status, job.error, told) == ("completed", None, ["completed"])


def hold_device(server):
    """Holds the device thread in its next job's room-making until released (a real
    job runs for minutes)."""
    entered, release = threading.Event(), threading.Event()
    real = server.manager.prepare

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    server.manager.prepare = held
    return entered, release


def test_jobs_cancelled_while_they_wait_give_their_places_in_the_queue_up(models, tmp_path):
    """Jobs cancelled while they wait (DELETE, or an image caller that disconnected,
    behind a proxy's timeout say) no longer count against the queue's limit: with the
    running job busy and the queue empty again, the next request is taken (it used to be
    refused 503 queue_full until the device thread reached the cancelled ones)."""
    server = make_server(models, tmp_path, limits=Limits(waiting_jobs=2))
    entered, release = hold_device(server)
    try:
        call(server, "POST", "/v1/videos", json=VIDEO)  # running, held
        assert entered.wait(60)
        waiting = [call(server, "POST", "/v1/videos", json=VIDEO).json()["id"] for _ in range(2)]
        for job_id in waiting:
            assert call(server, "DELETE", f"/v1/videos/{job_id}").status_code == 200
        assert call(server, "GET", "/v1/ondeck/status").json()["queue"] == []
        response = call(server, "POST", "/v1/videos", json=VIDEO)
        release.set()
    finally:
        release.set()
        server.stop()
    assert response.status_code == 200, response.text


def test_a_job_cancelled_while_it_waits_drops_its_decoded_input_image(models, tmp_path):
    """A job's decoded input image (up to 4096x4096 RGB, 48 MiB) goes once the job is
    over, run or not: one cancelled while it waits, which never runs, holds none for the
    time the server keeps it (up to 1000 jobs)."""
    server = make_server(models, tmp_path)
    entered, release = hold_device(server)
    try:
        call(server, "POST", "/v1/videos", json=VIDEO)  # running, held
        assert entered.wait(60)
        job = Job(kind="video", model="wan", prompt="a fox", width=32, height=32, frames=5, steps=2)
        job.input_image = Image.new("RGB", (1024, 1024))
        server.submit(job)
        assert call(server, "DELETE", f"/v1/ondeck/jobs/{job.id}").status_code == 200
        release.set()
        # The device thread reaches the cancelled job and skips it.
        wait_for(lambda: server.queue.current is None and not server.queue.waiting())
        wait_for(lambda: not server.queue._waiting)
        assert server.queue.get(job.id) is job  # the server still keeps the job
    finally:
        release.set()
        server.stop()
    assert job.input_image is None, "the cancelled job still holds its decoded input image"


def test_a_size_the_model_cannot_take_is_refused_before_it_waits(models, tmp_path):
    """A Wan video of 40x40 (Wan needs multiples of 16) is a 400 naming the size, as
    `ondeck generate` refuses it, not a job that fails once the queue reaches it (after
    other models were evicted to make room for it)."""
    server = make_server(models, tmp_path)
    try:
        response = call(server, "POST", "/v1/videos", json={**VIDEO, "size": "40x40"})
    finally:
        server.stop()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "size" and "multiple of 16" in error["message"]


def test_a_cancel_and_the_jobs_end_are_one_or_the_other():
    """A cancel once the job is over changes nothing (the route then deletes it); a job
    cancelled first is not started, nor completed."""
    done = Job(kind="video", model="m", prompt="p", width=8, height=8)
    assert done.start() and done.complete_unless_cancelled()
    assert done.cancel() is False and done.status == "completed" and not done.cancelled
    late = Job(kind="video", model="m", prompt="p", width=8, height=8)
    assert late.start() and late.cancel() is True
    assert late.complete_unless_cancelled() is False and late.status == "in_progress"
    queued = Job(kind="video", model="m", prompt="p", width=8, height=8)
    assert queued.cancel() is True and queued.status == "failed"
    assert queued.start() is False and queued.status == "failed"


def test_the_waiting_images_call_answers_while_another_request_draws_the_jobs_timeline(
    models, tmp_path, monkeypatch
):
    """Another client asks for the job's timeline (GET /v1/ondeck/jobs/ID/timeline: the
    id is in /v1/ondeck/status) just as the waiting call reads its images: the timeline
    is drawn, on the route's worker thread, between two of those reads, and the waiting
    call still answers every image."""
    server = make_server(models, tmp_path, names=("sd3",))
    read_bytes = Path.read_bytes
    drawn = []

    def reading(path: Path) -> bytes:
        data = read_bytes(path)
        if path.name.startswith("image") and not drawn:
            job = next(j for j in server.queue.jobs.values() if j.kind == "image")
            other = threading.Thread(target=lambda: drawn.append(server.timeline(job)))
            other.start()
            other.join()
        return data

    monkeypatch.setattr(Path, "read_bytes", reading)
    try:
        response = call(
            server,
            "POST",
            "/v1/images/generations",
            json={"model": "sd3", "prompt": "a fox", "size": "32x32", "n": 2},
        )
    finally:
        monkeypatch.undo()
        server.stop()
    assert drawn and drawn[0], "the timeline was not drawn"
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2


def test_a_stop_waits_no_longer_than_the_grace_and_its_margin_for_a_step(
    models, tmp_path, monkeypatch
):
    """A step cannot be cut short: where the running job is still in one past its grace
    and the margin, ``stop`` gives up on it and says so; every job is counted once."""
    import time

    monkeypatch.setattr(server_module, "STOP_MARGIN_SECONDS", 0.3)
    server = make_server(models, tmp_path, shutdown_grace_seconds=0.2)
    started, release = threading.Event(), threading.Event()

    def a_step_that_does_not_end(job, upcoming):
        job.start()
        started.set()
        release.wait(30)

    monkeypatch.setattr(server, "_run", a_step_that_does_not_end)
    stuck = server.submit(Job(kind="video", model="wan", prompt="a", width=32, height=32))
    waiting = server.submit(Job(kind="video", model="wan", prompt="b", width=32, height=32))
    assert started.wait(30)
    begun = time.monotonic()
    try:
        assert server.stop() is False
        assert time.monotonic() - begun < 3
    finally:
        release.set()
    assert waiting.error.code == "server_shutdown"
    assert stuck.cancel_event.is_set()  # stopped by the grace, at a next step it never reached
    assert server.status()["jobs_failed"] == 1
