"""``ondeck generate --server URL``: what an interrupted client leaves on the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .helpers import ROOT, ServerProcess, wait_for


def test_interrupting_generate_server_cancels_its_video_job(models, tmp_path):
    """Ctrl-C on `ondeck generate --server URL wan ...` while the video job runs: the
    client cancels the job on its way out, so the server stops it at its next step
    instead of spending its device on a video nobody waits for (an image job is
    cancelled when its caller disconnects)."""
    server = ServerProcess({"wan": models["wan"]}, tmp=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ONDECK_PROGRESS": "1"}
    try:
        client = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ondeck",
                "generate",
                "wan",
                "--server",
                server.url,
                "--api-key",
                server.api_key,
                "--output",
                str(tmp_path / "out"),
                "--height",
                "32",
                "--width",
                "32",
                "--frames",
                "5",
                "--steps",
                "200",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        with server.client() as http:
            running = wait_for(lambda: http.get("/v1/ondeck/status").json()["running"], 60)
            job_id = running["id"]
            client.send_signal(signal.SIGINT)
            at_interrupt = http.get(f"/v1/ondeck/jobs/{job_id}").json()["step"]
            client.communicate(timeout=60)
            assert client.returncode != 0
            job = wait_for(
                lambda: (
                    (j := http.get(f"/v1/ondeck/jobs/{job_id}").json())["status"]
                    in ("completed", "failed")
                    and j
                ),
                120,
            )
    finally:
        if client.poll() is None:
            client.kill()
        server.stop()
    assert job["status"] == "failed" and job["step"] < job["total_steps"], (at_interrupt, job)
