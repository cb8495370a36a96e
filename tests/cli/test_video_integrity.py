"""A video is written only when it is whole: the encoder's exit status and the
container's own frame count decide, not the encoder's word. Otherwise the previous
video stays, the frames are kept as frames.npy, and the command fails with one line.

The encoders here are real programs standing in for ffmpeg (``IMAGEIO_FFMPEG_EXE``):
one that fails half way, one that stops early but says it succeeded, one that writes
nothing. The plot and the folder are the other ways a finished run could be lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ondeck import output

from .helpers import FAST, error_lines, listing, run

PREVIOUS = b"previous complete video"


def generate(capsys, model, out, *more):
    return run(capsys, "generate", model, *FAST, "--policy", "release", "--output", out, *more)


def fake_encoder(tmp_path, body: str):
    """A program named as ffmpeg whose behaviour is ``body`` (Python, with ``args`` the
    command line without the program, ``output`` the file it should write, ``real``
    the real ffmpeg)."""
    import imageio_ffmpeg

    script = tmp_path / "fake-ffmpeg"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys\n"
        f"real = {imageio_ffmpeg.get_ffmpeg_exe()!r}\n"
        "args = sys.argv[1:]\n"
        "output = args[-1]\n" + textwrap.dedent(body)
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def previous(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "video.mp4").write_bytes(PREVIOUS)
    return folder


def assert_kept(previous, err, reason: str) -> None:
    [line] = error_lines(err)
    assert line.startswith(f"ondeck: error: could not write {previous / 'video.mp4'}: ")
    assert reason in line
    assert line.endswith(f"the frames are kept in {previous / 'frames.npy'} (numpy.load)")
    assert (previous / "video.mp4").read_bytes() == PREVIOUS
    assert np.load(previous / "frames.npy").shape == (5, 32, 32, 3)
    assert listing(previous) == {"report.json", "timeline.png", "video.mp4", "frames.npy"}


def test_an_encoder_that_fails_after_writing_part_of_the_file_fails_the_run(
    capsys, tiny_model, previous, tmp_path, monkeypatch
):
    encoder = fake_encoder(
        tmp_path,
        """
        sys.stdin.buffer.read()
        open(output, "wb").write(b"\\0\\0\\0\\x18ftypisom partial")
        sys.stderr.write("av_interleaved_write_frame(): No space left on device\\n")
        sys.exit(1)
        """,
    )
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(encoder))
    code, stdout, err = generate(capsys, tiny_model, previous)
    assert code == 1
    assert_kept(previous, err, "ffmpeg exited with status 1: av_interleaved_write_frame(): No")
    assert "video.mp4" not in stdout


def test_an_encoder_that_stops_early_but_exits_0_fails_the_run(
    capsys, tiny_model, previous, tmp_path, monkeypatch
):
    # A complete MP4 of two frames of the five it was given, and status 0.
    encoder = fake_encoder(
        tmp_path,
        """
        sys.exit(subprocess.run([real, *args[:-1], "-frames:v", "2", output]).returncode)
        """,
    )
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(encoder))
    code, _, err = generate(capsys, tiny_model, previous)
    assert code == 1
    assert_kept(previous, err, "the encoder wrote 2 of 5 frames")


def test_an_encoder_that_writes_nothing_fails_the_run(
    capsys, tiny_model, previous, tmp_path, monkeypatch
):
    encoder = fake_encoder(tmp_path, "sys.stdin.buffer.read()\n")
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(encoder))
    code, _, err = generate(capsys, tiny_model, previous)
    assert code == 1
    assert_kept(previous, err, "ffmpeg wrote 0 bytes")


def test_a_video_cut_short_after_a_complete_header_is_not_complete(tmp_path):
    path = output.write_video(tmp_path / "v.mp4", np.random.rand(5, 16, 16, 3), fps=16)
    assert output.mp4_frame_count(path) == 5
    data = path.read_bytes()
    for cut in (len(data) - 50, len(data) // 2, 40):
        (tmp_path / "cut.mp4").write_bytes(data[:cut])
        with pytest.raises(OSError, match="runs past the end of the file"):
            output.mp4_frame_count(tmp_path / "cut.mp4")


def test_the_video_is_written_at_the_frame_rate_given(tmp_path):
    import imageio_ffmpeg

    path = output.write_video(tmp_path / "v.mp4", np.random.rand(24, 16, 16, 3), fps=24)
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(path))
    assert frames == 24 and seconds == pytest.approx(1.0, abs=0.05)


# -- the plot ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["run$\\foo$", "run$x", "bad-\udcff-byte"])
def test_a_folder_name_matplotlib_cannot_draw_still_gives_the_video_and_timeline(
    name, capsys, tiny_model, tmp_path
):
    folder = tmp_path / name
    folder.symlink_to(tiny_model, target_is_directory=True)
    out = tmp_path / "out"
    code, _, err = generate(capsys, folder, out)
    assert code == 0, err
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}
    assert "warning" not in err


def test_a_plot_that_fails_is_a_warning_and_the_video_is_written(
    capsys, tiny_model, tmp_path, monkeypatch
):
    from ondeck import timeline

    def broken(*_, **__):
        raise ValueError("matplotlib could not lay out the figure")

    monkeypatch.setattr(timeline, "plot", broken)
    out = tmp_path / "out"
    code, stdout, err = generate(capsys, tiny_model, out)
    assert code == 0
    assert error_lines(err) == [
        f"ondeck: warning: could not draw {out / 'timeline.png'} (ValueError: matplotlib could "
        "not lay out the figure); the results are written without it"
    ]
    assert listing(out) == {"report.json", "video.mp4"}
    assert f"wrote {out / 'video.mp4'}, {out / 'report.json'}\n" in stdout


# -- two runs, one folder -----------------------------------------------------------------


def test_a_second_run_into_a_held_folder_is_refused_with_one_line(
    capsys, tiny_model, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    script = (
        "import sys, time\n"
        "from ondeck import output\n"
        "with output.holding_folder(sys.argv[1]):\n"
        "    print('holding', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert holder.stdout.readline() == "holding\n"
        code, _, err = generate(capsys, tiny_model, out)
        assert code == 1
        assert error_lines(err) == [
            f"ondeck: error: {out} is in use by another ondeck run (pid {holder.pid}); wait "
            "for it to finish or give another --output"
        ]
        assert listing(out) == {".ondeck-run.lock"}  # nothing of the refused run
    finally:
        holder.communicate("done\n", timeout=60)
    code, _, err = generate(capsys, tiny_model, out)  # the folder is free again
    assert code == 0, err
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}


def test_a_run_holds_its_folder_from_start_to_end(capsys, tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    seen = []
    real = output.write_json

    def while_running(path, document):
        with pytest.raises(output.FolderInUse):
            with output.holding_folder(out):
                pass
        seen.append(True)
        return real(path, document)

    monkeypatch.setattr("ondeck.cli.generate.write_json", while_running)
    code, _, err = generate(capsys, tiny_model, out)
    assert code == 0, err
    assert seen == [True, True]  # report.json, and again with the files written
    with output.holding_folder(out):  # released at the end
        pass


# -- values that are not finite -------------------------------------------------------------


def test_a_guidance_that_overflows_fails_naming_the_stage_and_keeps_the_frames(
    capsys, tiny_model, previous
):
    code, _, err = generate(capsys, tiny_model, previous, "--guidance", "1e308")
    assert code == 1
    assert error_lines(err) == [
        "ondeck: error: the output is not finite (NaN or infinity), so it is not written; the "
        "first stage whose output was not finite: 'Denoise' (transformer); the frames are kept "
        f"in {previous / 'frames.npy'} (numpy.load)"
    ]
    assert (previous / "video.mp4").read_bytes() == PREVIOUS
    assert not np.isfinite(np.load(previous / "frames.npy")).all()
    report = json.loads((previous / "report.json").read_text())
    assert report["output"]["finite"] is False


def with_nan_weights(model, folder, component: str):
    """A copy of ``model`` whose ``component`` holds NaN in every floating weight."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    [weights] = (folder / component).glob("*.safetensors")
    tensors = load_file(weights)
    save_file(
        {k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in tensors.items()},
        weights,
        metadata={"format": "pt"},
    )
    return folder


@pytest.mark.parametrize(
    "component, stage",
    [("text_encoder", "'EncodePrompt' (text_encoder)"), ("vae", "'Decode' (vae)")],
)
def test_nan_weights_fail_the_run_naming_their_stage(
    component, stage, capsys, tiny_model, tmp_path
):
    model = with_nan_weights(tiny_model, tmp_path / "nan", component)
    out = tmp_path / "out"
    code, _, err = generate(capsys, model, out)
    assert code == 1
    [line] = error_lines(err)
    assert f"the first stage whose output was not finite: {stage};" in line
    assert listing(out) == {"report.json", "timeline.png", "frames.npy"}
