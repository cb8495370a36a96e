"""200 mixed jobs against the real server process, on the CPU: a tenth of them failing,
a twentieth cancelled while they run, the rest video and image jobs of two models that
cannot stay resident together under the budget. Nothing crashes, the process's RSS
grows by at most 50 MiB, after each job the server holds no more than that, and every
good job's output equals the same job run alone. Run by ``make soak``."""

from __future__ import annotations

import random

import pytest

from .conftest import BUDGET
from .helpers import ServerProcess, wait_for

JOBS, FAILING, CANCELLED = 200, 20, 10
SEEDS = (0, 1, 2)
BATCH = 10
MiB = 2**20
RSS_GROWTH_BYTES = 50 * MiB


def submit(http, kind: str, seed: int) -> str:
    if kind == "image":
        body = {"model": "sd3", "prompt": "a fox", "size": "32x32", "seed": seed}
        response = http.post("/v1/ondeck/images", json=body)
    else:
        model = "broken" if kind == "failing" else "wan"
        body = {"model": model, "prompt": "a fox", "size": "32x32", "frames": 5, "seed": seed}
        if kind == "cancelled":
            body["steps"] = 200
        response = http.post("/v1/videos", json=body)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def job(http, job_id: str) -> dict:
    return http.get(f"/v1/ondeck/jobs/{job_id}").json()


def finished(http, job_id: str, timeout: float = 120) -> dict:
    return wait_for(
        lambda: (j := job(http, job_id))["status"] in ("completed", "failed") and j, timeout
    )


def output(http, kind: str, job_id: str) -> bytes:
    path = f"/v1/videos/{job_id}/content" if kind == "video" else f"/v1/ondeck/jobs/{job_id}/image"
    response = http.get(path)
    assert response.status_code == 200, response.text
    return response.content


@pytest.mark.soak
def test_200_mixed_jobs_leave_the_server_as_it_was(models, tmp_path):
    served = {name: models[name] for name in ("wan", "sd3", "broken")}
    server = ServerProcess(served, "--budget", BUDGET, "--steps", "2", tmp=tmp_path)
    try:
        with server.client() as http:
            alone = {}
            for kind in ("video", "image"):
                for seed in SEEDS:
                    job_id = submit(http, kind, seed)
                    assert finished(http, job_id)["status"] == "completed"
                    alone[kind, seed] = output(http, kind, job_id)
            baseline = http.get("/v1/ondeck/status").json()

            chooser = random.Random(0)
            kinds = ["failing"] * FAILING + ["cancelled"] * CANCELLED
            kinds += [chooser.choice(["video", "image"]) for _ in range(JOBS - len(kinds))]
            chooser.shuffle(kinds)
            outcomes: dict[str, int] = {}
            after_each = []
            for first in range(0, JOBS, BATCH):
                batch = [
                    (kind, seed, submit(http, kind, seed))
                    for kind in kinds[first : first + BATCH]
                    for seed in [chooser.choice(SEEDS)]
                ]
                for kind, _, job_id in batch:
                    if kind == "cancelled":
                        wait_for(lambda j=job_id: job(http, j)["step"] >= 1, timeout=120)
                        assert http.delete(f"/v1/videos/{job_id}").status_code == 200
                for kind, seed, job_id in batch:
                    done = finished(http, job_id)
                    if kind in ("video", "image"):
                        same = (
                            done["status"] == "completed"
                            and output(http, kind, job_id) == alone[kind, seed]
                        )
                        outcome = "good, as alone" if same else f"{kind}: {done}"
                    else:
                        code = (done.get("error") or {}).get("code")
                        expected = "non_finite_output" if kind == "failing" else "cancelled"
                        outcome = kind if code == expected else f"{kind}: {done}"
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    after_each.append(
                        wait_for(lambda j=job_id: job(http, j)["memory_after"], timeout=30)
                    )
            assert outcomes == {
                "good, as alone": JOBS - FAILING - CANCELLED,
                "failing": FAILING,
                "cancelled": CANCELLED,
            }
            end = http.get("/v1/ondeck/status").json()
        assert server.process.poll() is None, server.output()
        assert end["jobs_failed"] - baseline["jobs_failed"] == FAILING + CANCELLED
        growth = end["process_rss_bytes"] - baseline["process_rss_bytes"]
        print(
            f"\nserve soak: {JOBS} jobs, {outcomes}; RSS {baseline['process_rss_bytes'] / MiB:.1f}"
            f" -> {end['process_rss_bytes'] / MiB:.1f} MiB, at most "
            f"{max(a['process_rss_bytes'] for a in after_each) / MiB:.1f} MiB after a job"
        )
        assert growth <= RSS_GROWTH_BYTES, f"RSS grew {growth / MiB:.1f} MiB"
        worst = max(after["process_rss_bytes"] for after in after_each)
        assert worst - baseline["process_rss_bytes"] <= RSS_GROWTH_BYTES
        assert all(after["resident_bytes"] <= end["budget_bytes"] for after in after_each)
    finally:
        code = server.stop()
    assert code == 0, server.output()
