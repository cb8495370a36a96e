"""A result file is whole or not there: a write that fails part way, a PNG that reads
back wrong, frames the encoder cannot take, and the bytes reaching the disk before the
rename. The previous file stays in each case."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

from ondeck import output
from ondeck.output import OutputError
from ondeck.serve import outputs as serve_outputs

PREVIOUS = b"previous complete file"


def test_a_served_image_cut_short_by_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "image.png"
    path.write_bytes(PREVIOUS)
    real = Path.write_bytes

    def half_then_full(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    with pytest.raises(OSError, match="No space"):
        serve_outputs.write_png(path, np.full((8, 8, 3), 0.5))
    monkeypatch.undo()
    assert path.read_bytes() == PREVIOUS
    assert [p.name for p in tmp_path.iterdir()] == ["image.png"]  # no temporary left


def test_a_png_that_reads_back_short_is_not_renamed_into_place(tmp_path, monkeypatch):
    from PIL import Image

    (tmp_path / "image.png").write_bytes(PREVIOUS)
    real = Image.Image.save

    def truncated(self, target, *args, **kwargs):
        buffer = io.BytesIO()
        real(self, buffer, *args, **kwargs)
        Path(target).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])

    monkeypatch.setattr(Image.Image, "save", truncated)
    # Noise, so that half the file holds the whole header and some of the pixels.
    noise = np.random.default_rng(0).integers(0, 256, (1, 64, 64, 3), dtype=np.uint8)
    with pytest.raises(OutputError, match="image.png"):
        output.write_images(tmp_path, noise)
    assert (tmp_path / "image.png").read_bytes() == PREVIOUS
    assert [p.name for p in tmp_path.iterdir()] == ["image.png"]


def test_frames_the_encoder_cannot_take_are_an_output_error_naming_the_file(tmp_path):
    """Four channels: the frames are kept by ``generate`` only on an ``OutputError``."""
    path = tmp_path / "video.mp4"
    path.write_bytes(PREVIOUS)
    with pytest.raises(OutputError, match="video.mp4"):
        output.write_video(path, np.zeros((2, 16, 16, 4), dtype=np.float32))
    assert path.read_bytes() == PREVIOUS


def test_the_bytes_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """Else a crash soon after the rename can leave the name on an empty file."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source, destination):
        events.append(f"replace {os.path.basename(source)}")
        real_replace(source, destination)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("names an open file through /proc")
    monkeypatch.setattr(output.os, "fsync", fsync)
    monkeypatch.setattr(output.os, "replace", replace)
    output.write_text(tmp_path / "report.json", "{}")
    (temporary,) = {event.split()[1] for event in events}
    assert events == [f"fsync {temporary}", f"replace {temporary}"]


def test_trimming_the_served_outputs_leaves_folders_that_are_not_jobs(tmp_path):
    """The cap counts and removes job folders only: a folder of the user's own in the
    outputs root stays, older and larger than any job's."""
    store = serve_outputs.OutputStore(tmp_path, cap_bytes=10)
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "keep.txt").write_bytes(b"x" * 100)
    os.utime(mine, (1, 1))
    job = store.folder("video_" + "0" * 32)
    (job / "report.json").write_bytes(b"y" * 100)
    assert store.trim() == [job.name]
    assert (mine / "keep.txt").exists() and not job.exists()


def test_ctrl_c_while_frames_go_to_the_encoder_ends_it_and_leaves_no_file(tmp_path, monkeypatch):
    import subprocess

    started = []
    real = subprocess.Popen

    class Interrupted:
        def __init__(self, pipe):
            self.pipe, self.writes = pipe, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 2:
                raise KeyboardInterrupt
            return self.pipe.write(data)

        def close(self):
            self.pipe.close()

    def popen(*args, **kwargs):
        process = real(*args, **kwargs)
        if process.stdin is not None:  # the encoder, fed frames (not a version check)
            process.stdin = Interrupted(process.stdin)
            started.append(process)
        return process

    monkeypatch.setattr(subprocess, "Popen", popen)
    path = tmp_path / "video.mp4"
    path.write_bytes(PREVIOUS)
    with pytest.raises(KeyboardInterrupt):
        output.write_video(path, np.zeros((4, 16, 16, 3), dtype=np.float32))
    (process,) = started
    assert process.returncode is not None  # ended and waited for: no encoder left behind
    assert path.read_bytes() == PREVIOUS
    assert [p.name for p in tmp_path.iterdir()] == ["video.mp4"]


def test_a_lock_file_removed_between_its_open_and_its_lock_is_taken_again(tmp_path, monkeypatch):
    """The run before ends (and removes its lock file) between this run's open and its
    flock: the lock then held is on a name no one sees, so a third run would get the
    folder too. The lock is taken again, on the file that is there."""
    fcntl = pytest.importorskip("fcntl")
    lock = tmp_path / ".ondeck-run.lock"
    real = fcntl.flock
    calls = []

    def flock(descriptor, operation):
        calls.append(descriptor)
        if len(calls) == 1:
            lock.unlink()  # the previous holder's end, just now
        return real(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with output.holding_folder(tmp_path):
        assert len(calls) == 2
        held = os.fstat(calls[-1])
        assert os.path.samestat(held, os.stat(lock))
        monkeypatch.undo()
        with pytest.raises(output.FolderInUse):  # a third run is refused
            with output.holding_folder(tmp_path):
                pass
