"""What `ondeck generate` leaves on disk: complete files or the previous ones, never partial.

Each file is written under a temporary name beside it and renamed into place; the
report and the timeline come before the video, and a video that cannot be written
keeps the frames as frames.npy and fails the command with one line.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import numpy as np
import pytest

from ondeck import output

from .helpers import FAST, error_lines, listing, run

PREVIOUS = {"report.json": b'{"previous": "run"}', "video.mp4": b"previous complete video"}


@pytest.fixture
def previous_run(tmp_path):
    """An output folder holding a previous run's complete results."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name, content in PREVIOUS.items():
        (folder / name).write_bytes(content)
    return folder


def generate(capsys, model, out, *more):
    return run(capsys, "generate", model, *FAST, "--policy", "release", "--output", out, *more)


def test_a_run_writes_report_timeline_and_video_and_nothing_else(capsys, tiny_model, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = generate(capsys, tiny_model, out)
    assert code == 0, err
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}
    report = json.loads((out / "report.json").read_text())
    assert report["shape"]["frames"] == 5
    assert report["policy_reason"] == "policy 'release' was asked for"  # or auto's choice
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "video.mp4").read_bytes()[4:8] == b"ftyp"
    assert f"ondeck: wrote {out / 'video.mp4'}, {out / 'report.json'}" in stdout
    # A result is readable like any file the user writes (mkstemp's are private).
    assert (out / "video.mp4").stat().st_mode & 0o777 == 0o666 & ~output.current_umask()


def test_report_and_timeline_are_in_place_before_the_video_is_written(
    capsys, tiny_model, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    seen = []
    real = output.write_video

    def watching(path, frames, **options):
        seen.append(listing(out))
        return real(path, frames, **options)

    monkeypatch.setattr(output, "write_video", watching)
    code, _, err = generate(capsys, tiny_model, out)
    assert code == 0, err
    # The run's hold on the folder is there too until the run ends.
    assert seen == [{"report.json", "timeline.png", ".ondeck-run.lock"}]
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}


def fill_the_disk(path, pixels, fps):
    """The encoder gets some bytes out, then the disk is full."""
    path.write_bytes(b"\0\0\0\x18ftypisom partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_the_video_keeps_the_frames_and_fails_with_one_line(
    capsys, tiny_model, previous_run, monkeypatch
):
    monkeypatch.setattr(output, "_encode", fill_the_disk)
    code, stdout, err = generate(capsys, tiny_model, previous_run)
    assert code == 1
    video, frames = previous_run / "video.mp4", previous_run / "frames.npy"
    assert error_lines(err) == [
        f"ondeck: error: could not write {video}: OSError: No space left on device; "
        f"the frames are kept in {frames} (numpy.load)"
    ]
    assert f"wrote {video}" not in stdout
    assert video.read_bytes() == PREVIOUS["video.mp4"]  # the previous video, untouched
    assert np.load(frames).shape == (5, 32, 32, 3)
    assert json.loads((previous_run / "report.json").read_text())["shape"]["steps"] == 2
    assert listing(previous_run) == {"report.json", "timeline.png", "video.mp4", "frames.npy"}


def test_no_ffmpeg_keeps_the_frames_and_says_why(capsys, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-ffmpeg-here"))
    out = tmp_path / "out"
    code, _, err = generate(capsys, tiny_model, out)
    assert code == 1
    assert error_lines(err) == [
        f"ondeck: error: could not write {out / 'video.mp4'}: FileNotFoundError: No such file "
        f"or directory: {tmp_path / 'no-ffmpeg-here'}; the frames are kept in "
        f"{out / 'frames.npy'} (numpy.load)"
    ]
    assert listing(out) == {"report.json", "timeline.png", "frames.npy"}


def test_ctrl_c_during_the_video_write_keeps_the_previous_video(
    capsys, tiny_model, previous_run, monkeypatch
):
    def interrupted(path, pixels, fps):
        path.write_bytes(b"\0\0\0\x18ftypisom four frames of 161")
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "_encode", interrupted)
    code, stdout, err = generate(capsys, tiny_model, previous_run)
    assert code == 130
    assert error_lines(err) == ["ondeck: interrupted"]
    assert (previous_run / "video.mp4").read_bytes() == PREVIOUS["video.mp4"]
    assert listing(previous_run) == {"report.json", "timeline.png", "video.mp4"}


def test_a_failed_report_write_keeps_the_previous_report(
    capsys, tiny_model, previous_run, monkeypatch
):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output, "_write_file", full)
    code, _, err = generate(capsys, tiny_model, previous_run)
    assert code == 1
    assert error_lines(err) == [
        f"ondeck: error: could not write {previous_run / 'report.json'}: No space left on device"
    ]
    assert (previous_run / "report.json").read_bytes() == PREVIOUS["report.json"]
    assert listing(previous_run) == set(PREVIOUS)


@pytest.mark.parametrize("failure", [OSError(errno.EIO, "I/O error"), KeyboardInterrupt()])
def test_atomic_path_leaves_the_old_file_and_no_temporary_when_the_write_fails(failure, tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old and complete")
    with pytest.raises(type(failure)):
        with output.atomic_path(target) as temporary:
            assert temporary.parent == tmp_path and temporary.suffix == ".json"
            temporary.write_text("new but partial")
            raise failure
    assert target.read_text() == "old and complete"
    assert listing(tmp_path) == {"report.json"}


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_without_proc_the_umask_is_seen_on_a_file_made_and_deleted(umask, tmp_path, monkeypatch):
    """macOS and BSD have no /proc: a written result still gets the mode a plain open()
    gives, the umask seen on a probe file that is not left behind."""
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    before = os.umask(umask)
    try:
        with output.atomic_path(tmp_path / "image.png") as temporary:
            temporary.write_bytes(b"png")
    finally:
        os.umask(before)
    assert (tmp_path / "image.png").stat().st_mode & 0o777 == 0o666 & ~umask
    assert listing(tmp_path) == {"image.png"}


def test_atomic_path_replaces_the_file_when_the_write_completes(tmp_path):
    target = tmp_path / "frames.npy"
    target.write_text("old")
    output.write_frames(target, np.ones((2, 4, 4, 3), dtype=np.float32))
    assert np.load(target).shape == (2, 4, 4, 3)
    assert listing(tmp_path) == {"frames.npy"}


def test_without_imageio_ffmpeg_the_frames_are_kept(capsys, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as if not installed
    out = tmp_path / "out"
    code, _, err = generate(capsys, tiny_model, out)
    assert code == 1
    [line] = error_lines(err)
    assert line.startswith(
        f"ondeck: error: could not write {out / 'video.mp4'}: ImportError: imageio-ffmpeg is "
        "not installed (pip install imageio-ffmpeg)"
    )
    assert line.endswith(f"the frames are kept in {out / 'frames.npy'} (numpy.load)")
    assert listing(out) == {"report.json", "timeline.png", "frames.npy"}


def test_only_the_last_run_of_a_command_expects_no_run_after_it(
    capsys, tiny_model, tmp_path, monkeypatch
):
    """`--runs 3`: the policy loads ahead after the first two runs, and nothing after the
    last one, which no run follows."""
    from ondeck.stages import Pipeline

    seen = []
    run_once = Pipeline._run

    def noting(self, state):
        seen.append(self.more_runs)
        return run_once(self, state)

    monkeypatch.setattr(Pipeline, "_run", noting)
    code, _, err = generate(capsys, tiny_model, tmp_path / "out", "--runs", "3")
    assert code == 0, err
    assert seen == [True, True, False]


@pytest.mark.parametrize("runs", [1, 2])
def test_the_command_freezes_what_the_build_left_out_of_its_runs_collections(
    capsys, tiny_model, tmp_path, monkeypatch, runs
):
    """The command owns its process, so what lives once the pipeline is built is kept out
    of the garbage collector's passes during its runs (``gc.freeze``). Several runs
    collect first; one run, which ends the process, does not spend a full pass on it."""
    import gc

    from ondeck.stages import Pipeline

    frozen, collected = [], []
    run_once, collect = Pipeline._run, gc.collect

    def noting(self, state):
        frozen.append(gc.get_freeze_count())
        return run_once(self, state)

    def counting(*args, **kwargs):
        if not frozen:  # before the first run
            collected.append(args)
        return collect(*args, **kwargs)

    monkeypatch.setattr(Pipeline, "_run", noting)
    monkeypatch.setattr(gc, "collect", counting)
    gc.unfreeze()
    try:
        code, _, err = generate(capsys, tiny_model, tmp_path / "out", "--runs", str(runs))
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector
    assert code == 0, err
    assert len(frozen) == runs
    assert all(count > 10_000 for count in frozen)
    assert bool(collected) == (runs > 1)


def test_an_output_folder_under_tilde_is_in_the_home_folder(
    capsys, tiny_model, tmp_path, monkeypatch
):
    """`--output=~/x` (or a quoted ~, or one from a program: no shell expands it) is the
    folder x in the home folder, as MODEL_DIR, --lora and component files expand ~."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    code, _, err = run(capsys, "generate", tiny_model, *FAST, "--output=~/x")
    assert code == 0, err
    assert (home / "x" / "report.json").is_file()
    assert not (cwd / "~").exists()
