"""Stopping the server, and ``ondeck generate --server``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import imageio.v2 as imageio
import numpy as np

from .helpers import ROOT, ServerProcess, wait_for

SHAPE = ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2", "--seed", "4"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_sigterm_finishes_the_running_job_fails_the_waiting_and_exits_0(models, tmp_path):
    server = ServerProcess({"wan": models["wan"]}, "--steps", "2", tmp=tmp_path)
    try:
        with server.client() as http:
            body = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}
            running = http.post("/v1/videos", json={**body, "steps": 120}).json()["id"]
            waiting = http.post("/v1/videos", json=body).json()["id"]
            wait_for(lambda: http.get(f"/v1/ondeck/jobs/{running}").json()["step"] >= 1)
            server.process.terminate()
            # While the running job has its grace the server answers: its client follows it
            # and fetches the video; a new job is refused.
            refused = wait_for(
                lambda: (r := http.post("/v1/videos", json=body)).status_code == 503 and r
            )
            wait_for(lambda: http.get(f"/v1/videos/{running}").json()["status"] == "completed")
            video = http.get(f"/v1/videos/{running}/content")
            code = server.process.wait(60)
    finally:
        server.stop()
    assert code == 0, server.output()
    assert refused.json()["error"]["code"] == "server_shutdown"
    assert video.status_code == 200 and video.content[4:8] == b"ftyp"
    outputs = tmp_path / "outputs"
    assert (outputs / running / "video.mp4").read_bytes() == video.content
    assert not (outputs / waiting).exists()
    log = server.output()
    assert f"job {running} (wan) done" in log
    assert f"job {waiting} (wan) server_shutdown" in log
    assert "stopped (1 jobs done, 1 failed)" in log


def test_a_second_stop_signal_stops_at_once_while_the_running_job_has_its_grace(models, tmp_path):
    server = ServerProcess(
        {"wan": models["wan"]}, "--steps", "2", "--shutdown-grace", "600", tmp=tmp_path
    )
    try:
        with server.client() as http:
            body = {"model": "wan", "prompt": "a fox", "size": "256x256", "frames": 33}
            running = http.post("/v1/videos", json={**body, "steps": 200}).json()["id"]
            wait_for(lambda: http.get(f"/v1/ondeck/jobs/{running}").json()["step"] >= 1)
            server.process.terminate()
            wait_for(lambda: "Ctrl-C again stops now" in server.output(), timeout=60)
            assert server.process.poll() is None  # the running job has its 600 s
            server.process.terminate()
            code = server.process.wait(30)
    finally:
        server.stop()
    assert code == 143, server.output()
    assert "stopped without waiting for the running job" in server.output()
    assert not (tmp_path / "outputs" / running / "video.mp4").exists()


def test_a_port_in_use_is_one_error_naming_it(models, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ondeck", "serve", "--device", "cpu", "--port", str(port)]
            + ["--model", f"wan={models['wan']}", "--outputs", str(tmp_path / "outputs")],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"could not listen on http://127.0.0.1:{port}/" in done.stderr
    assert "stopping" not in done.stdout
    # Said before the models are built and planned, not after a long load.
    assert "ondeck: serving" not in done.stdout and "budget" not in done.stdout


def test_a_negative_grace_is_refused(models):
    done = subprocess.run(
        [sys.executable, "-m", "ondeck", "serve", "--shutdown-grace", "-5"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "'-5' is not a number of seconds" in done.stderr


def test_generate_with_server_writes_the_folder_a_local_run_writes(server, models, tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    command = [sys.executable, "-m", "ondeck", "generate"]
    runs = [
        subprocess.Popen(
            [
                *command,
                "wan",
                "--server",
                server.url,
                "--api-key",
                server.api_key,
                "--output",
                str(remote),
                *SHAPE,
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        subprocess.Popen(
            [*command, str(models["wan"]), "--device", "cpu", "--output", str(local), *SHAPE],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    ]
    for run in runs:
        output, _ = run.communicate(timeout=120)
        assert run.returncode == 0, output
    assert sorted(p.name for p in remote.iterdir()) == sorted(p.name for p in local.iterdir())
    frames = [np.stack(imageio.mimread(folder / "video.mp4")) for folder in (remote, local)]
    assert frames[0].shape == frames[1].shape == (5, 32, 32, 3)
    assert np.array_equal(frames[0], frames[1])


def test_generate_with_server_says_what_the_server_refused(server, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ondeck",
            "generate",
            "sora",
            "--server",
            server.url,
            "--api-key",
            server.api_key,
            "--output",
            str(tmp_path / "out"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "does not serve 'sora'" in run.stderr
