"""``ondeck generate --server URL``: the server is asked what a local run with the same
flags asks its pipeline (the pipeline's own size, steps and frames where no flag names
them), the same flags are refused, the output folder is the same, and an interrupted
client cancels its job on the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ondeck.errors import OndeckError
from ondeck.serve.jobs import JobFailed
from tests.cli.helpers import run

from .helpers import ROOT, ServerProcess, wait_for

SMALL = ["--height", "32", "--width", "32"]


class Recorded(OndeckError):
    """Stops a run once what it would ask is recorded: nothing is generated."""


def local_shape(monkeypatch, capsys, folder, tmp_path, *flags) -> dict:
    """The shape (height, width, frames, steps) and seed a local run of ``folder`` with
    ``flags`` would ask its pipeline for."""
    from ondeck.cli import generate

    seen = {}

    def record(args, pipe, shape, extra, watch, main):
        seen.update(vars(shape), seed=args.seed)
        raise Recorded("recorded")

    with monkeypatch.context() as patch:
        patch.setattr(generate, "_run_all", record)
        _, _, err = run(
            capsys, "generate", folder, "--device", "cpu", "--output", tmp_path / "local", *flags
        )
    assert "recorded" in err, err
    return seen


def remote_job(live, capsys, tmp_path, name, *flags) -> tuple[dict, str]:
    """The job (height, width, frames, steps, seed) the server would run for the same
    flags, and the client's stderr; the server refuses the job once it is recorded."""
    seen = {}

    def record(job):
        seen.update(
            height=job.height, width=job.width, frames=job.frames, steps=job.steps, seed=job.seed
        )
        raise JobFailed(400, "recorded", "recorded")

    submit = live.server.submit
    live.server.submit = record
    try:
        _, _, err = run(
            capsys, "generate", name, "--server", live.url, "--output", tmp_path / "remote", *flags
        )
    finally:
        live.server.submit = submit
    return seen, err


def refused_both_ways(models, live_server, name: str, frames: str, tmp_path, capsys) -> str:
    """``generate NAME --frames FRAMES`` locally and with --server: both a usage error
    (exit 2); the remote run's stderr."""
    live = live_server(names=(name,))
    flags = [*SMALL, "--steps", "1", "--frames", frames]
    local, _, local_err = run(
        capsys, "generate", models[name], "--device", "cpu", "--output", tmp_path / "local",
        *flags,
    )  # fmt: skip
    remote, _, remote_err = run(
        capsys, "generate", name, "--server", live.url, "--output", tmp_path / "remote", *flags
    )
    assert local == 2, local_err
    assert remote == local, f"remote exit {remote} ({remote_err.strip()!r}), local exit {local}"
    return remote_err


def test_frames_for_an_image_model_is_refused_as_a_local_run_refuses_it(
    models, live_server, tmp_path, capsys
):
    """`--frames` for an image pipeline is a usage error (exit 2) with --server too, not
    dropped in silence for an image made all the same."""
    remote_err = refused_both_ways(models, live_server, "sd3", "5", tmp_path, capsys)
    assert "argument --frames:" in remote_err and "makes images, not a video" in remote_err
    assert not (tmp_path / "remote" / "image.png").exists()


def test_a_frame_count_the_model_does_not_take_is_refused_as_a_local_run_refuses_it(
    models, live_server, tmp_path, capsys
):
    """Wan takes 4k+1 frames: `--frames 6` is the same usage error (exit 2, the flag
    named) with --server as locally, not the server's error in other words."""
    remote_err = refused_both_ways(models, live_server, "wan", "6", tmp_path, capsys)
    assert "argument --frames:" in remote_err and "num_frames" not in remote_err


def test_one_side_named_is_asked_with_the_models_own_other_side(
    models, live_server, tmp_path, capsys, monkeypatch
):
    """A local run with only --height keeps the pipeline's own width; with --server the
    same, not a refusal."""
    live = live_server(names=("sd3",))
    local = local_shape(monkeypatch, capsys, models["sd3"], tmp_path, "--height", "32")
    remote, err = remote_job(live, capsys, tmp_path, "sd3", "--height", "32")
    assert remote, err
    pipe = live.server.models["sd3"].pipeline.pipe
    own = pipe.default_sample_size * pipe.vae_scale_factor
    assert (local["height"], local["width"]) == (32, None)  # the pipeline computes its own
    assert (remote["height"], remote["width"]) == (32, own)


def test_an_image_models_default_steps_are_the_same_as_a_local_runs(
    models, live_server, tmp_path, capsys, monkeypatch
):
    """Both the pipeline's own (the tiny SD3's call: 28)."""
    live = live_server(names=("sd3",))
    local = local_shape(monkeypatch, capsys, models["sd3"], tmp_path, *SMALL)
    remote, err = remote_job(live, capsys, tmp_path, "sd3", *SMALL)
    assert remote, err
    assert local["steps"] == 28
    assert remote["steps"] == local["steps"], f"remote {remote['steps']} vs local {local['steps']}"


def test_an_image_models_default_size_is_the_pipelines_own_as_in_a_local_run(
    models, live_server, tmp_path, capsys, monkeypatch
):
    """A local run passes no size (the pipeline's own: the tiny SD3's sample size times
    its VAE's scale); the server asks that size, not 1024x1024."""
    live = live_server(names=("sd3",))
    local = local_shape(monkeypatch, capsys, models["sd3"], tmp_path, "--steps", "1")
    remote, err = remote_job(live, capsys, tmp_path, "sd3", "--steps", "1")
    assert remote, err
    pipe = live.server.models["sd3"].pipeline.pipe  # diffusers' pipeline
    own = pipe.default_sample_size * pipe.vae_scale_factor
    assert local["height"] is None and local["width"] is None
    assert (remote["height"], remote["width"]) == (own, own), (
        f"remote asks {remote['width']}x{remote['height']}, local the pipeline's own ({own}x{own})"
    )


def test_a_video_models_default_frame_count_is_the_same_as_a_local_runs(
    models, live_server, tmp_path, capsys, monkeypatch
):
    """Both the pipeline's own (WanPipeline's 81), not 4 seconds' worth."""
    live = live_server(names=("wan",))
    flags = [*SMALL, "--steps", "1"]
    local = local_shape(monkeypatch, capsys, models["wan"], tmp_path, *flags)
    remote, err = remote_job(live, capsys, tmp_path, "wan", *flags)
    assert remote, err
    assert local["frames"] == 81
    assert remote["frames"] == local["frames"], (
        f"remote {remote['frames']} frames vs local {local['frames']}"
    )


def test_a_seed_a_local_run_takes_is_taken_by_the_server(
    models, live_server, tmp_path, capsys, monkeypatch
):
    """--seed takes 0 .. 2**64-1 (what torch's manual_seed takes), on a server too."""
    live = live_server(names=("wan",))
    flags = [*SMALL, "--frames", "5", "--steps", "1", "--seed", str(2**64 - 1)]
    local = local_shape(monkeypatch, capsys, models["wan"], tmp_path, *flags)
    assert local["seed"] == 2**64 - 1
    remote, err = remote_job(live, capsys, tmp_path, "wan", *flags)
    assert remote.get("seed") == 2**64 - 1, f"the server refused it: {err.strip()}"


def test_an_output_folder_under_tilde_is_in_the_home_folder(
    live_server, tmp_path, monkeypatch, capsys
):
    """`--output ~/x` that no shell expanded (quoted, or from a program) is the folder x
    in the home folder, as a local run writes it."""
    live = live_server(names=("wan",))
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    flags = [*SMALL, "--frames", "5", "--steps", "1"]
    code, _, err = run(capsys, "generate", "wan", "--server", live.url, *flags, "--output", "~/x")
    assert code == 0, err
    assert (home / "x" / "video.mp4").is_file()
    assert not (cwd / "~").exists()


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
