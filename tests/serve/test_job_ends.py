"""How a job ends when something goes wrong at its end: its files not written, its run
raising, a delete while it is written or after, a read before it is done, and the
queue's forgetting of old jobs."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import ondeck.serve.app as app_module
import ondeck.serve.server as server_module
from ondeck.serve.jobs import Job, JobQueue

from .helpers import wait_for
from .inprocess import call, make_server

VIDEO = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}
IMAGE = {"model": "sd3", "prompt": "a fox", "size": "32x32"}


@pytest.fixture
def full_disk(monkeypatch):
    """write_job_files writes part of a job's files, then finds the disk full."""

    def fails(folder, *args, **kwargs):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(server_module, "write_job_files", fails)


def test_a_job_whose_files_cannot_be_written_fails_and_leaves_no_folder(
    models, tmp_path, full_disk
):
    server = make_server(models, tmp_path, names=("wan", "sd3"))
    try:
        job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
        job = server.queue.get(job_id)
        wait_for(lambda: job.done_event.is_set(), timeout=60)
        wait_for(lambda: not server._writing)
        video = call(server, "GET", f"/v1/videos/{job_id}").json()
        content = call(server, "GET", f"/v1/videos/{job_id}/content")
        images = call(server, "POST", "/v1/images/generations", json=IMAGE)
    finally:
        server.stop()
    assert video["status"] == "failed" and video["error"]["code"] == "output_failed"
    assert "No space left on device" in video["error"]["message"]
    assert content.status_code == 409
    assert not (tmp_path / "outputs" / job_id).exists()  # the partial folder went
    assert images.status_code == 500, images.text
    assert images.json()["error"]["code"] == "output_failed"
    assert [p.name for p in (tmp_path / "outputs").iterdir() if p.is_dir()] == []


def test_a_video_read_before_its_files_are_written_is_not_ready(models, tmp_path, gate):
    """409 ``not_ready`` (a client polls again), not 404 (a client gives up)."""
    entered, release = gate
    server = make_server(models, tmp_path)
    try:
        job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
        assert entered.wait(60)
        content = call(server, "GET", f"/v1/videos/{job_id}/content")
        release.set()
        wait_for(lambda: server.queue.get(job_id).status == "completed")
        done = call(server, "GET", f"/v1/videos/{job_id}/content")
    finally:
        server.stop()
    assert content.status_code == 409 and content.json()["error"]["code"] == "not_ready"
    assert done.status_code == 200 and done.content


def test_a_delete_while_the_files_are_written_says_not_deleted(models, tmp_path, gate, monkeypatch):
    """The job cannot stop now: it is not said deleted, and stays listed and found."""
    monkeypatch.setattr(app_module, "DELETE_WAIT_SECONDS", 0.2)
    entered, release = gate
    server = make_server(models, tmp_path)
    try:
        job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
        assert entered.wait(60)
        deleted = call(server, "DELETE", f"/v1/videos/{job_id}")
        found = call(server, "GET", f"/v1/videos/{job_id}")
        listed = [v["id"] for v in call(server, "GET", "/v1/videos").json()["data"]]
        release.set()
    finally:
        server.stop()
    assert deleted.json()["deleted"] is False
    assert found.status_code == 200 and job_id in listed


def test_a_deleted_video_goes_from_the_disk(models, tmp_path):
    server = make_server(models, tmp_path)
    try:
        job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
        job = server.queue.get(job_id)
        wait_for(lambda: job.status == "completed", timeout=60)
        wait_for(lambda: not server._writing)
        folder = tmp_path / "outputs" / job_id
        assert (folder / "video.mp4").exists()
        deleted = call(server, "DELETE", f"/v1/videos/{job_id}")
        found = call(server, "GET", f"/v1/videos/{job_id}")
    finally:
        server.stop()
    assert deleted.json()["deleted"] is True
    assert found.status_code == 404 and not folder.exists()


def job() -> Job:
    return Job(kind="video", model="m", prompt="p", width=8, height=8)


def test_a_run_that_raises_fails_its_job_and_the_queue_goes_on():
    def run(job, upcoming):
        if job.prompt == "boom":
            raise RuntimeError("the run broke")
        job.complete()

    queue = JobQueue(run)
    broken, after = job(), job()
    broken.prompt = "boom"
    queue.submit(broken)
    queue.submit(after)
    queue.start()
    try:
        wait_for(lambda: after.finished, timeout=10)
    finally:
        queue.stop(timeout=10)
    assert broken.status == "failed" and broken.error.status == 500
    assert broken.error.code == "server_error" and "the run broke" in broken.error.message
    assert after.status == "completed"


def test_the_queue_forgets_only_finished_jobs():
    queue = JobQueue(lambda job, upcoming: None, max_kept=2)  # never started: they wait
    waiting = [queue.submit(job()) for _ in range(3)]
    assert all(queue.get(j.id) is j for j in waiting)
    old = job()
    queue.adopt(old)  # a finished job of an earlier server's, past max_kept
    old.complete()
    queue.adopt(job())
    assert queue.get(old.id) is None and all(queue.get(j.id) is j for j in waiting)
    queue.stop(timeout=1)


def test_an_image_gone_before_the_waiting_call_reads_it_is_a_404(models, tmp_path, monkeypatch):
    """Removed by the folder's cap between its writing and its reading: 404
    ``content_gone`` in OpenAI's error shape, not a 500."""
    real = server_module.write_job_files

    def then_trimmed(*args, **kwargs):
        files = real(*args, **kwargs)
        for role, path in files.items():
            if role.startswith("image"):
                Path(path).unlink()
        return files

    monkeypatch.setattr(server_module, "write_job_files", then_trimmed)
    server = make_server(models, tmp_path, names=("sd3",))
    try:
        response = call(server, "POST", "/v1/images/generations", json=IMAGE)
    finally:
        server.stop()
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "content_gone"
