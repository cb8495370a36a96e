"""The real server process driven by the official openai client and by httpx."""

from __future__ import annotations

import base64
import io
import threading

import httpx
import numpy as np
import pytest
from PIL import Image

from .helpers import wait_for

openai = pytest.importorskip("openai")

# The client's notice about OpenAI's own video service, not about this server.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

VIDEO = {"size": "32x32", "frames": 5, "steps": 2}


def openai_client(server, **kwargs):
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, **kwargs
    )


def submit_video(http, model="wan", **fields):
    response = http.post("/v1/videos", json={"model": model, "prompt": "a fox", **VIDEO, **fields})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def wait_finished(http, job_id, timeout=60):
    return wait_for(
        lambda: (
            (v := http.get(f"/v1/videos/{job_id}").json())["status"] in ("completed", "failed")
            and v
        ),
        timeout,
    )


def status(http):
    return http.get("/v1/ondeck/status").json()


def test_models_lists_only_the_models_named_at_start(server):
    models = openai_client(server).models.list()
    assert sorted(m.id for m in models.data) == ["broken", "sd3", "wan", "wan2"]
    assert {m.id: m.kind for m in models.data}["sd3"] == "image"
    # A video model's frame rate, which a request's seconds count in: Wan's is 16.
    assert {m.id: getattr(m, "fps", None) for m in models.data} == {
        "broken": 16.0,
        "sd3": None,
        "wan": 16.0,
        "wan2": 16.0,
    }


def test_the_openai_client_generates_an_image_as_b64_json(server):
    result = openai_client(server).images.generate(
        model="sd3",
        prompt="a red fox",
        size="32x32",
        response_format="b64_json",
        extra_body={"seed": 3},
    )
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.size == (32, 32)
    again = openai_client(server).images.generate(
        model="sd3", prompt="a red fox", size="32x32", extra_body={"seed": 3}
    )
    assert again.data[0].b64_json == result.data[0].b64_json  # same job, same output


def test_the_openai_client_runs_a_video_job_to_its_mp4(server):
    client = openai_client(server)
    video = client.videos.create(
        model="wan", prompt="a fox", size="32x32", seconds="0.25", extra_body={"steps": 2}
    )
    assert video.status in ("queued", "in_progress") and len(video.id) >= 32
    done = client.videos.poll(video.id, poll_interval_ms=100)
    assert done.status == "completed" and done.progress == 100
    content = client.videos.download_content(done.id).read()
    assert content[4:8] == b"ftyp"  # an MP4
    assert client.videos.retrieve(done.id).size == "32x32"


def test_a_concurrent_burst_runs_every_job_once(server):
    results: dict[int, str] = {}
    with server.client() as http:

        def one(index: int) -> None:
            results[index] = submit_video(http, seed=index % 2)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        finished = [wait_finished(http, job_id) for job_id in results.values()]
        assert [v["status"] for v in finished] == ["completed"] * 6
        contents = {
            i: http.get(f"/v1/videos/{job_id}/content").content for i, job_id in results.items()
        }
    assert len(set(results.values())) == 6
    assert contents[0] == contents[2] == contents[4]  # same seed: same video, whatever ran between
    assert contents[1] == contents[3] == contents[5] != contents[0]


def test_cancel_stops_a_running_job_at_its_next_step_and_frees_its_model(server):
    with server.client() as http:
        job_id = submit_video(http, model="wan2", steps=200)
        wait_for(lambda: http.get(f"/v1/ondeck/jobs/{job_id}").json()["step"] >= 1)
        cancelled = http.delete(f"/v1/ondeck/jobs/{job_id}").json()
        assert cancelled == {"id": job_id, "object": "job.cancelled", "cancelled": True}
        video = wait_finished(http, job_id, timeout=20)
        assert video["status"] == "failed" and video["error"]["code"] == "cancelled"
        assert http.get(f"/v1/ondeck/jobs/{job_id}").json()["step"] < 200
        refused = http.get(f"/v1/videos/{job_id}/content")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "cancelled"
        assert status(http)["resident"]["wan2"] == {}


def test_deleting_a_running_video_stops_it_and_then_deletes_it(server):
    """DELETE /v1/videos/{id} on a running job answers once the job has stopped at its
    next step and is gone, as OpenAI's delete leaves nothing to read."""
    with server.client() as http:
        job_id = submit_video(http, model="wan2", steps=200)
        wait_for(lambda: http.get(f"/v1/ondeck/jobs/{job_id}").json()["step"] >= 1)
        deleted = http.delete(f"/v1/videos/{job_id}").json()
        assert deleted == {"id": job_id, "object": "video.deleted", "deleted": True}
        gone = http.get(f"/v1/videos/{job_id}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "video_not_found"
        assert status(http)["resident"]["wan2"] == {}


def test_a_client_that_disconnects_stops_its_image_job(server):
    with server.client() as http:
        failed_before = status(http)["jobs_failed"]
        with pytest.raises(httpx.ReadTimeout):
            with server.client(timeout=httpx.Timeout(60, read=1.5)) as impatient:
                impatient.post(
                    "/v1/images/generations",
                    json={"model": "sd3", "prompt": "a fox", "size": "32x32", "steps": 200},
                )
        state = wait_for(
            lambda: (
                (s := status(http))["running"] is None
                and s["jobs_failed"] == failed_before + 1
                and s
            ),
            timeout=30,
        )
        assert state["resident"]["sd3"] == {}


def test_a_failing_job_answers_one_error_and_the_next_job_is_unaffected(server):
    with server.client() as http:
        good = wait_finished(http, submit_video(http, seed=7))
        first = http.get(f"/v1/videos/{good['id']}/content").content
        bad = wait_finished(http, submit_video(http, model="broken"))
        assert bad["status"] == "failed"
        assert bad["error"]["code"] == "non_finite_output"
        assert status(http)["resident"]["broken"] == {}  # what it took is free again
        again = wait_finished(http, submit_video(http, seed=7))
        assert again["status"] == "completed"
        assert http.get(f"/v1/videos/{again['id']}/content").content == first


def test_each_job_says_what_the_server_held_once_it_was_over(server):
    with server.client() as http:
        job_id = submit_video(http, model="broken")
        wait_finished(http, job_id)
        after = wait_for(lambda: http.get(f"/v1/ondeck/jobs/{job_id}").json()["memory_after"])
        state = status(http)
    assert after["resident_bytes"] == state["resident_bytes"] <= state["budget_bytes"]
    assert after["process_rss_bytes"] > 0
    assert after["device_allocated_bytes"] is None  # on the CPU, the host is the device


def test_a_job_says_how_long_its_run_its_device_time_and_its_files_took(server):
    with server.client() as http:
        job_id = submit_video(http)
        wait_finished(http, job_id)
        summary = wait_for(
            lambda: (j := http.get(f"/v1/ondeck/jobs/{job_id}").json())["device_seconds"] and j
        )
    assert 0 < summary["run_seconds"] <= summary["device_seconds"]
    assert summary["write_seconds"] > 0


def test_a_shape_the_model_cannot_take_is_a_400_before_it_queues(server):
    with server.client() as http:
        queued_before = status(http)["jobs_run"]
        response = http.post(
            "/v1/videos", json={"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 201}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "frames"
        assert "too large" in error["message"]
        assert status(http)["jobs_run"] == queued_before


def test_an_unknown_model_or_job_is_a_404_in_openais_error_shape(server):
    client = openai_client(server)
    with pytest.raises(openai.NotFoundError) as found:
        client.images.generate(model="../../etc/passwd", prompt="a fox", size="32x32")
    assert found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.videos.create(model="sora-2", prompt="a fox")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_" + "0" * 32)


def test_an_image_model_on_the_videos_route_is_a_400(server):
    with pytest.raises(openai.BadRequestError):
        openai_client(server).videos.create(model="sd3", prompt="a fox")


def test_a_too_large_body_or_prompt_is_a_413(server):
    with server.client() as http:
        huge = http.post(
            "/v1/videos",
            content=b"{" + b" " * (9 * 2**20) + b"}",
            headers={"content-type": "application/json"},
        )
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
        long = http.post("/v1/videos", json={"model": "wan", "prompt": "a" * 5000, **VIDEO})
        assert long.status_code == 413 and long.json()["error"]["param"] == "prompt"
        side = http.post("/v1/videos", json={"model": "wan", "prompt": "a fox", "size": "9000x32"})
        assert side.status_code == 400 and side.json()["error"]["param"] == "size"


def test_a_missing_or_wrong_key_is_a_401(server):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_job_ids_are_long_random_and_distinct(server):
    with server.client() as http:
        ids = [submit_video(http) for _ in range(3)]
        for job_id in ids:
            wait_finished(http, job_id)
    hex_parts = [job_id.split("_", 1)[1] for job_id in ids]
    assert len(set(ids)) == 3 and all(len(part) == 32 for part in hex_parts)
    assert len({part[:8] for part in hex_parts}) == 3  # not a counter


def test_two_models_alternate_and_eviction_goes_by_next_use(server):
    """wan2 ran last, so least-recently-used would evict wan first; the queue says wan
    comes next and wan2 never: wan2 goes whole, and of wan only its last stage's VAE."""
    prompt = "a fox in the snow"  # not cached yet: every text encoder loads
    with server.client() as http:
        wait_finished(http, submit_video(http, model="wan", prompt=prompt))
        blocker = submit_video(http, model="wan2", steps=30, prompt=prompt)
        wait_for(lambda: http.get(f"/v1/ondeck/jobs/{blocker}").json()["status"] == "in_progress")
        since = max((e["at"] for e in status(http)["evictions"]), default=0)
        image: dict = {}
        thread = threading.Thread(
            target=lambda: image.update(
                http.post(
                    "/v1/images/generations",
                    json={"model": "sd3", "prompt": "a fox", "size": "32x32"},
                ).json()
            )
        )
        thread.start()
        wait_for(lambda: [j["model"] for j in status(http)["queue"]] == ["sd3"])
        after = submit_video(http, model="wan", prompt=prompt)
        thread.join(60)
        assert "data" in image, image
        evicted_for_sd3 = [
            e for e in status(http)["evictions"] if e["for_model"] == "sd3" and e["at"] > since
        ]
        assert {(e["model"], e["component"]) for e in evicted_for_sd3} == {
            ("wan2", "text_encoder"),
            ("wan2", "transformer"),
            ("wan2", "vae"),
            ("wan", "vae"),
        }
        assert all(e["reason"].startswith("next use") for e in evicted_for_sd3)
        assert next(e for e in evicted_for_sd3 if e["model"] == "wan")["reason"].startswith(
            "next use: queued job 1"
        )
        assert wait_finished(http, after)["status"] == "completed"
        state = status(http)
        assert state["resident_bytes"] <= state["budget_bytes"]
        # And back: the image model again gives the same image as the first time.
        second = http.post(
            "/v1/images/generations", json={"model": "sd3", "prompt": "a fox", "size": "32x32"}
        ).json()
        assert second["data"][0]["b64_json"] == image["data"][0]["b64_json"]
        assert status(http)["resident_bytes"] <= state["budget_bytes"]


def test_status_shows_resident_budget_queue_and_the_last_report(server):
    with server.client() as http:
        wait_finished(http, submit_video(http))
        state = status(http)
    assert state["budget_bytes"] == 1800 * 1024
    assert set(state["resident"]) == {"wan", "wan2", "sd3", "broken"}
    assert state["last_job"]["report"]["model"] == "wan"
    assert state["plan"]["all_resident"] is False
    to_sd3 = next(
        s for s in state["plan"]["switch_bytes"] if s["from"] == "wan" and s["to"] == "sd3"
    )
    assert 0 < to_sd3["bytes"] <= 1608380  # at most the whole image model


def test_the_report_and_timeline_of_a_job_are_served(server):
    with server.client() as http:
        job_id = submit_video(http)
        wait_finished(http, job_id)
        report = http.get(f"/v1/ondeck/jobs/{job_id}/report").json()
        timeline = http.get(f"/v1/ondeck/jobs/{job_id}/timeline")
    assert report["shape"] == {"height": 32, "width": 32, "frames": 5, "steps": 2}
    assert timeline.headers["content-type"] == "image/png" and timeline.content[:4] == b"\x89PNG"
    assert np.asarray(Image.open(io.BytesIO(timeline.content))).ndim == 3


def test_a_warm_jobs_timeline_shows_what_stayed_resident_from_before(server):
    from ondeck.serve.outputs import timeline_view

    with server.client() as http:
        # Queued together: nothing runs between them, and the second finds the model in.
        first, second = submit_video(http), submit_video(http)
        for job_id in (first, second):
            wait_finished(http, job_id)
        report = http.get(f"/v1/ondeck/jobs/{second}/report").json()
    assert set(report["resident_at_start"]) == {"text_encoder", "transformer", "vae"}
    loads_at_start = {e.name for e in timeline_view(report).events if e.kind == "load"}
    assert loads_at_start >= {"text_encoder", "transformer", "vae"}
    assert all(e.seconds >= 0 for e in timeline_view(report).events)


def test_an_input_image_is_only_an_inline_image_for_a_model_that_takes_one(server):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "PNG")
    png = base64.b64encode(buffer.getvalue()).decode()
    with server.client() as http:
        fetched = http.post(
            "/v1/videos",
            json={
                "model": "wan",
                "prompt": "a fox",
                **VIDEO,
                "input_reference": {"image_url": "http://169.254.169.254/"},
            },
        )
        assert fetched.status_code == 400 and "data: URL" in fetched.json()["error"]["message"]
        inline = http.post(
            "/v1/videos",
            json={
                "model": "wan",
                "prompt": "a fox",
                **VIDEO,
                "input_reference": {"image_url": f"data:image/png;base64,{png}"},
            },
        )
        assert (
            inline.status_code == 400
            and "takes no input image" in inline.json()["error"]["message"]
        )
        upload = http.post(
            "/v1/videos",
            data={"model": "wan", "prompt": "a fox"},
            files={"input_reference": ("big.png", b"\0" * (5 * 2**20), "image/png")},
        )
        assert upload.status_code == 413
