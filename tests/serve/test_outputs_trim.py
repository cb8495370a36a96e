"""The outputs folder's cap: which job's files go first."""

from __future__ import annotations

from .helpers import wait_for
from .inprocess import call, make_server

VIDEO = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}


def _folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _run(server) -> str:
    job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
    job = server.queue.get(job_id)
    wait_for(lambda: job.done_event.is_set() and not server._writing)
    assert job.status == "completed", job.error and job.error.message
    return job_id


def test_past_the_cap_the_oldest_job_goes_first_though_its_timeline_was_drawn_later(
    models, tmp_path
):
    """Past the cap the oldest jobs' folders go first, by their report's date: a timeline
    drawn into an old job's folder when first asked for (the page and `ondeck generate
    --server` both ask) does not make it the newest, so a newer job's files (whose client
    may be about to download them) stay."""
    server = make_server(models, tmp_path)
    outputs = tmp_path / "outputs"
    try:
        oldest = _run(server)
        newer = _run(server)
        assert call(server, "GET", f"/v1/ondeck/jobs/{oldest}/timeline").status_code == 200
        # A cap that holds the two jobs' folders but not a third.
        server.outputs.cap_bytes = (
            _folder_bytes(outputs / oldest) + _folder_bytes(outputs / newer) + 1
        )
        newest = _run(server)
        kept = {job_id for job_id in (oldest, newer, newest) if (outputs / job_id).exists()}
        newer_content = call(server, "GET", f"/v1/videos/{newer}/content").status_code
    finally:
        server.stop()
    assert newest in kept and len(kept) == 2
    assert oldest not in kept and newer_content == 200


def test_a_timeline_drawn_trims_the_folder_towards_its_cap(models, tmp_path):
    """A timeline is drawn when first asked for, after its job was written: the folder
    is trimmed back towards its cap then, not at the next job's end. Asked of an older
    job, the oldest goes; the job asked about and the newest (whose client may be about
    to read it) stay."""
    server = make_server(models, tmp_path)
    outputs = tmp_path / "outputs"
    try:
        oldest, older, newest = _run(server), _run(server), _run(server)
        server.outputs.cap_bytes = sum(_folder_bytes(outputs / j) for j in (older, newest))
        before = [(outputs / job_id).exists() for job_id in (oldest, older, newest)]
        drawn = call(server, "GET", f"/v1/ondeck/jobs/{older}/timeline").status_code
        after = [(outputs / job_id).exists() for job_id in (oldest, older, newest)]
    finally:
        server.stop()
    assert before == [True, True, True] and drawn == 200
    assert after == [False, True, True]
    assert (outputs / older / "timeline.png").exists()


def test_a_timeline_never_drawn_of_a_job_the_cap_removed_is_content_gone(models, tmp_path):
    """Past the cap, a job's timeline (drawn when first asked for) is gone as its video
    is, not a timeline the job never made."""
    server = make_server(models, tmp_path)
    try:
        first = _run(server)
        server.outputs.cap_bytes = 1
        _run(server)
        answers = [
            call(server, "GET", path).json()["error"]["code"]
            for path in (f"/v1/videos/{first}/content", f"/v1/ondeck/jobs/{first}/timeline")
        ]
    finally:
        server.stop()
    assert answers == ["content_gone", "content_gone"]


def test_a_server_started_again_on_the_folder_answers_for_the_jobs_it_left_whole(models, tmp_path):
    """A job that completed before a restart (a stop during its grace, a crash after its
    files) answers as before: status, video and report. A folder whose writing was cut
    short (its report, no video) stays unknown."""
    first = make_server(models, tmp_path)
    try:
        job_id = _run(first)
        before = call(first, "GET", f"/v1/videos/{job_id}").json()
        video = call(first, "GET", f"/v1/videos/{job_id}/content").content
    finally:
        first.stop()
    cut_short = tmp_path / "outputs" / ("video_" + "0" * 32)
    cut_short.mkdir()
    (cut_short / "report.json").write_text(
        (tmp_path / "outputs" / job_id / "report.json").read_text()
    )

    again = make_server(models, tmp_path)
    try:
        after = call(again, "GET", f"/v1/videos/{job_id}").json()
        content = call(again, "GET", f"/v1/videos/{job_id}/content")
        report = call(again, "GET", f"/v1/ondeck/jobs/{job_id}/report")
        unknown = call(again, "GET", f"/v1/videos/{cut_short.name}")
        listed = [v["id"] for v in call(again, "GET", "/v1/videos").json()["data"]]
    finally:
        again.stop()
    made = after.pop("completed_at")  # the report's time: within moments of the end
    assert abs(made - before.pop("completed_at")) <= 2 and after == before
    assert content.status_code == 200 and content.content == video
    assert report.status_code == 200 and report.json()["prompt"] == VIDEO["prompt"]
    assert unknown.status_code == 404 and listed == [job_id]


def test_an_image_job_comes_back_only_with_every_image_it_made(models, tmp_path):
    first = make_server(models, tmp_path, names=("sd3",))
    body = {"model": "sd3", "prompt": "a fox", "size": "32x32", "n": 2}
    try:
        ids = [call(first, "POST", "/v1/ondeck/images", json=body).json()["id"] for _ in (1, 2)]
        jobs = [first.queue.get(job_id) for job_id in ids]
        wait_for(lambda: all(job.done_event.is_set() for job in jobs) and not first._writing)
    finally:
        first.stop()
    whole, cut_short = ids
    (tmp_path / "outputs" / cut_short / "image-2.png").unlink()

    again = make_server(models, tmp_path, names=("sd3",))
    try:
        image = call(again, "GET", f"/v1/ondeck/jobs/{whole}/image")
        files = call(again, "GET", f"/v1/ondeck/jobs/{whole}").json()["files"]
        unknown = call(again, "GET", f"/v1/ondeck/jobs/{cut_short}")
    finally:
        again.stop()
    assert image.status_code == 200 and image.content[:4] == b"\x89PNG"
    assert files == ["image-1", "image-2", "report"]
    assert unknown.status_code == 404


def test_the_content_of_a_job_that_failed_is_a_conflict_naming_why(models, tmp_path):
    """A GET of a failed job's video is no bad request: 409, its code the job's error."""
    server = make_server(models, tmp_path, budget_bytes=1024)
    try:
        job_id = call(server, "POST", "/v1/videos", json=VIDEO).json()["id"]
        job = server.queue.get(job_id)
        wait_for(lambda: job.done_event.is_set() and not server._writing)
        content = call(server, "GET", f"/v1/videos/{job_id}/content")
    finally:
        server.stop()
    assert job.status == "failed" and job.error.code != "cancelled"
    assert content.status_code == 409
    assert content.json()["error"]["code"] == job.error.code
