"""The outputs folder's cap, and what importing the package pulls in."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ondeck.serve.jobs import Job, JobQueue
from ondeck.serve.outputs import OutputStore

from .helpers import ROOT, wait_for


def _job_folder(store: OutputStore, name: str, nbytes: int, age: float) -> None:
    folder = store.folder(name)
    (folder / "video.mp4").write_bytes(b"x" * nbytes)
    stamp = time.time() - age
    os.utime(folder, (stamp, stamp))


def test_past_its_cap_the_outputs_folder_loses_its_oldest_jobs_first(tmp_path):
    store = OutputStore(tmp_path, cap_bytes=250)
    _job_folder(store, "video_old", 100, age=30)
    _job_folder(store, "video_mid", 100, age=20)
    _job_folder(store, "video_new", 100, age=10)
    (tmp_path / "notes").mkdir()  # not a job's folder: never removed
    assert store.trim() == ["video_old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "video_mid", "video_new"]


def test_a_folder_being_written_is_kept_past_the_cap(tmp_path):
    store = OutputStore(tmp_path, cap_bytes=50)
    _job_folder(store, "img_writing", 100, age=30)
    _job_folder(store, "img_done", 100, age=10)
    assert store.trim(keep={"img_writing"}) == ["img_done"]


def test_importing_ondeck_and_its_command_line_imports_no_web_framework():
    code = (
        "import sys, ondeck, ondeck.cli, ondeck.serve.cli; "
        "print([m for m in ('fastapi', 'starlette', 'uvicorn', 'pydantic') if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.stdout.strip() == "[]", result.stderr


def test_a_full_queue_refuses_more_and_a_cancelled_waiting_job_never_runs():
    ran: list[str] = []
    queue = JobQueue(lambda job, upcoming: ran.append(job.id), max_waiting=2)
    first, second = (Job(kind="video", model="m", prompt="p", width=8, height=8) for _ in range(2))
    queue.submit(first)
    queue.submit(second)
    try:
        queue.submit(Job(kind="video", model="m", prompt="p", width=8, height=8))
        raise AssertionError("a third job was taken")
    except Exception as error:
        assert "waiting already" in str(error)
    second.cancel()
    assert second.status == "failed" and second.error.status == 409
    queue.start()
    wait_for(lambda: queue.last_finished is first, timeout=10)
    queue.stop(timeout=10)
    assert ran == [first.id]


def test_running_out_of_memory_is_a_503_and_bad_input_a_400():
    import torch

    from ondeck.errors import BudgetError
    from ondeck.serve.server import describe_failure

    assert describe_failure(BudgetError("stage 'Denoise' needs 3 GiB more")).status == 503
    assert (
        describe_failure(torch.OutOfMemoryError("CUDA out of memory")).code == "insufficient_memory"
    )
    assert describe_failure(ValueError("height must be divisible by 16")).status == 400
    assert describe_failure(RuntimeError("something else")).status == 500
