"""What an output folder holds after runs that follow each other, fail part way, or are
given odd names and values: only the files of the run that just ended, each complete,
and a failure before the work where the input alone decides it.

Tiny pipelines built in code (the tiny Wan and the breadth families); ``--server``
against an in-process fake of the server's HTTP API; one real ``ondeck serve``.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import json

import httpx
import pytest
from integrations.breadth_pipelines import ALL_FAMILIES

from ondeck import output

from .helpers import FAST, IMAGE_ARGS, error_lines, listing, run


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families") / "flux"
    ALL_FAMILIES["flux"].build(folder)
    return folder


def generate(capsys, model, out, *more):
    return run(capsys, "generate", model, *FAST, "--policy", "release", "--output", out, *more)


def generate_images(capsys, model, out, *more):
    return run(capsys, "generate", model, *IMAGE_ARGS, "--output", out, *more)


def generate_on_a_full_disk(capsys, model, out, monkeypatch) -> int:
    """A run whose video's encoder finds the disk full; its exit status."""

    def full(path, pixels, fps):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(output, "_encode", full)
        code, _, _ = generate(capsys, model, out)
    return code


# -- files a previous run left ----------------------------------------------------------


def test_a_plot_that_fails_does_not_leave_the_previous_runs_timeline(
    capsys, tiny_model, tmp_path, monkeypatch
):
    """A plot that fails is a warning, and the results are written without it: an
    earlier run's timeline.png goes, so that it does not pass for this run's."""
    from ondeck import timeline

    out = tmp_path / "out"
    out.mkdir()
    (out / "timeline.png").write_bytes(b"the previous run's timeline")

    def broken(*_, **__):
        raise ValueError("matplotlib could not lay out the figure")

    monkeypatch.setattr(timeline, "plot", broken)
    code, _, err = generate(capsys, tiny_model, out)
    assert code == 0, err
    assert listing(out) == {"report.json", "video.mp4"}


def test_a_run_that_succeeds_does_not_keep_an_earlier_runs_frames(
    capsys, tiny_model, tmp_path, monkeypatch
):
    """frames.npy says a run's result could not be written: a later run that writes its
    video removes it."""
    out = tmp_path / "out"
    assert generate_on_a_full_disk(capsys, tiny_model, out, monkeypatch) == 1
    assert (out / "frames.npy").exists()
    code, _, err = generate(capsys, tiny_model, out)
    assert code == 0, err
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}


def test_fewer_images_than_the_previous_run_leave_no_numbered_image_of_it(capsys, flux, tmp_path):
    out = tmp_path / "out"
    code, _, err = generate_images(capsys, flux, out, "--images", "3")
    assert code == 0, err
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 0, err
    # The first run's image-3.png went with the set it belonged to.
    assert listing(out) == {"image-1.png", "image-2.png", "report.json", "timeline.png"}


def test_one_image_after_several_leaves_no_numbered_image_of_the_earlier_run(
    capsys, flux, tmp_path
):
    out = tmp_path / "out"
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 0, err
    code, _, err = generate_images(capsys, flux, out)
    assert code == 0, err
    assert listing(out) == {"image.png", "report.json", "timeline.png"}


def test_files_of_result_names_that_no_run_wrote_are_the_users_and_stay(capsys, flux, tmp_path):
    """A folder of the user's own image.png, image-12.png and video.mp4: no report of an
    earlier run lists them, so a run writing two images there removes none of them."""
    out = tmp_path / "photos"
    out.mkdir()
    own = {"image.png": b"mine", "image-12.png": b"mine too", "video.mp4": b"my video"}
    for name, data in own.items():
        (out / name).write_bytes(data)
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 0, err
    assert all((out / name).read_bytes() == data for name, data in own.items())
    assert {"image-1.png", "image-2.png"} <= listing(out)
    code, _, err = generate_images(capsys, flux, out)
    assert code == 0, err
    # image-1 and image-2 were the earlier run's (its report listed them); image.png is
    # this run's now, the rest still the user's.
    assert listing(out) == {"image.png", "image-12.png", "video.mp4", "report.json", "timeline.png"}
    assert (out / "image-12.png").read_bytes() == b"mine too"


def test_an_earlier_runs_images_still_go_after_a_run_that_failed_to_write_between(
    capsys, flux, tmp_path, monkeypatch
):
    """A run whose result is not written keeps the one before it in place; its report
    still names those images, so the next run written removes them."""
    out = tmp_path / "out"
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 0, err

    def full(*_, **__):
        raise output.OutputError("could not write image.png: No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(output, "write_images", full)
        code, _, _ = generate_images(capsys, flux, out, "--images", "3")
    assert code == 1
    assert {"image-1.png", "image-2.png", "frames.npy"} <= listing(out)
    # Of the failed run's names none was written: an image-3.png put there now is the
    # user's, and stays.
    (out / "image-3.png").write_bytes(b"mine")
    code, _, err = generate_images(capsys, flux, out)
    assert code == 0, err
    assert listing(out) == {"image.png", "image-3.png", "report.json", "timeline.png"}


def test_a_run_stopped_while_writing_its_result_leaves_a_report_the_next_run_cleans_by(
    capsys, flux, tmp_path, monkeypatch
):
    """Stopped after its report but before its images are in place (a Ctrl-C, a killed
    process): the report names the earlier run's images and those this one was writing,
    so the next run removes what it does not replace, and keeps the user's own."""
    out = tmp_path / "out"
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 0, err
    (out / "image-3.png").write_bytes(b"mine")

    def stopped(folder, images, **_):
        (out / "image-4.png").write_bytes(b"this run's, half written")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(output, "write_images", stopped)
        code, _, _ = generate_images(capsys, flux, out, "--images", "4")
    assert code == 130
    pending = json.loads((out / "report.json").read_text())["output"]["pending"]
    assert pending == ["image-1.png", "image-2.png", "image-4.png"]
    code, _, err = generate_images(capsys, flux, out)
    assert code == 0, err
    assert listing(out) == {"image.png", "image-3.png", "report.json", "timeline.png"}
    assert "pending" not in json.loads((out / "report.json").read_text())["output"]


# -- a set of images written part way -------------------------------------------------------


def test_a_full_disk_at_the_second_image_keeps_the_previous_set_whole(
    capsys, flux, tmp_path, monkeypatch
):
    """A result that cannot be written leaves the previous one in place: with --images N
    that is the whole set, not a new image-1 beside the old image-2."""
    out = tmp_path / "out"
    out.mkdir()
    previous = {"image-1.png": b"previous image 1", "image-2.png": b"previous image 2"}
    for name, data in previous.items():
        (out / name).write_bytes(data)
    real = output.atomic_path

    @contextlib.contextmanager
    def full_at_the_second(path):
        if str(path).endswith("image-2.png"):
            raise OSError(errno.ENOSPC, "No space left on device")
        with real(path) as temporary:
            yield temporary

    monkeypatch.setattr(output, "atomic_path", full_at_the_second)
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 1
    assert "No space left on device" in err
    assert {name: (out / name).read_bytes() for name in previous} == previous


def test_an_interrupt_between_the_renames_of_a_set_waits_for_the_last(tmp_path, monkeypatch):
    """Ctrl-C landing as the first image of a set is renamed into place is delivered
    once every image is: the folder holds the new set whole, never one new image beside
    the old others."""
    import os
    import signal

    import numpy as np

    out = tmp_path / "out"
    out.mkdir()
    for name in ("image-1.png", "image-2.png", "image-3.png"):
        (out / name).write_bytes(b"previous " + name.encode())
    real = os.replace
    renamed = []

    def replace(source, destination):
        real(source, destination)
        renamed.append(os.path.basename(destination))
        if len(renamed) == 1:
            signal.raise_signal(signal.SIGINT)  # the default handler: KeyboardInterrupt

    monkeypatch.setattr(output.os, "replace", replace)
    images = np.full((3, 4, 4, 3), 200, dtype=np.uint8)
    # Ctrl-C as a terminal delivers it, also where the suite runs in the background (a
    # shell starts background jobs with SIGINT ignored).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            output.write_images(out, images)
    finally:
        signal.signal(signal.SIGINT, before)
    assert sorted(renamed) == ["image-1.png", "image-2.png", "image-3.png"]
    assert not any((out / name).read_bytes().startswith(b"previous") for name in renamed)


def test_a_full_disk_as_the_folders_lock_is_written_names_the_lock(tmp_path, monkeypatch):
    import os

    def full(descriptor, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output.os, "write", full)
    with pytest.raises(output.OutputError) as caught, output.holding_folder(tmp_path):
        pass
    assert str(caught.value) == (
        f"cannot write to {tmp_path / '.ondeck-run.lock'}: No space left on device"
    )
    assert os.listdir(tmp_path) == [], "the lock is removed"


def test_a_folder_in_place_of_a_numbered_image_is_refused_before_the_run(capsys, flux, tmp_path):
    """A folder where one of the --images N files goes is refused before any work, as
    one named image.png is."""
    out = tmp_path / "out"
    (out / "image-2.png").mkdir(parents=True)
    code, _, err = generate_images(capsys, flux, out, "--images", "2")
    assert code == 1
    assert [line for line in error_lines(err) if line.startswith("ondeck:")] == [
        f"ondeck: error: {out / 'image-2.png'} is a folder; the run writes a file there"
    ]
    assert listing(out) == {"image-2.png"}  # nothing written: refused before the work


# -- odd names and values ----------------------------------------------------------------


def test_an_output_folder_whose_name_is_not_utf8_gets_a_successful_run(
    capsys, tiny_model, tmp_path
):
    """A folder name that is not valid UTF-8 is shown escaped in the closing "ondeck:
    wrote PATH" line, on a strict UTF-8 stdout too (pytest's capture is one): the run
    that wrote every file succeeds."""
    out = tmp_path / "out-\udcff-byte"
    code, _, err = generate(capsys, tiny_model, out)
    assert listing(out) == {"report.json", "timeline.png", "video.mp4"}
    assert code == 0, err


def test_a_frame_rate_the_encoder_cannot_take_is_refused_before_the_run(
    capsys, tiny_model, tmp_path
):
    """A frame rate the video encoder cannot take (ffmpeg refuses 1e-6) is a usage
    error before the generation, not a failed write after it."""
    out = tmp_path / "out"
    code, _, err = generate(capsys, tiny_model, out, "--fps", "1e-6")
    assert code == 2, err
    assert not out.exists() or listing(out) == set()


# -- generate --server ----------------------------------------------------------------------


def _png(size: int = 8) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def fake_server(monkeypatch):
    """``generate --server`` against a fake image server: the requests it got."""
    seen: list[tuple[str, dict]] = []
    image = base64.b64encode(_png()).decode()

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        seen.append((path, body))
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "img", "kind": "image"}]})
        if path == "/v1/images/generations":
            n = body.get("n", 1)
            return httpx.Response(
                200, json={"data": [{"b64_json": image}] * n, "ondeck_job": "img_1"}
            )
        if path == "/v1/ondeck/jobs/img_1/report":
            return httpx.Response(200, json={"events": []})
        if path == "/v1/ondeck/jobs/img_1/timeline":
            return httpx.Response(200, content=_png())
        return httpx.Response(404, json={"error": {"message": "no", "code": "x"}})

    real = httpx.Client

    def client(*args, **kwargs):
        return real(*args, transport=httpx.MockTransport(answer), **kwargs)

    monkeypatch.setattr(httpx, "Client", client)
    return seen


def test_generate_server_holds_the_output_folder_as_a_local_run_does(capsys, fake_server, tmp_path):
    """A run with --server holds its output folder as a local run does: into a folder
    another run holds, it is refused and writes nothing."""
    out = tmp_path / "out"
    out.mkdir()
    with output.holding_folder(out):
        code, _, err = run(capsys, "generate", "img", "--server", "http://fake", "--output", out)
        written = listing(out) - {".ondeck-run.lock"}
    assert code == 1, "the run into a held folder was not refused"
    assert written == set()


def test_generate_server_with_several_images_writes_them_or_refuses_the_flag(
    capsys, fake_server, tmp_path
):
    """Flags for local runs are refused with --server (exit 2, one line naming them),
    not dropped: one image.png for --images 3 would be a silent wrong answer."""
    out = tmp_path / "out"
    local = (
        ["--images", "3"], ["--fps", "8"], ["--runs", "2"], ["--lora", "style.safetensors"],
        ["--transformer", "t.safetensors"], ["--weights", "fp8"], ["--budget", "8GiB"],
        ["--policy", "release"], ["--device", "cpu"], ["--dtype", "fp16"],
        ["--host-cache", "4GiB"], ["--no-prefetch"], ["--library", "x"],
    )  # fmt: skip
    for flags in local:  # the server loads its models as it was started
        code, _, err = run(
            capsys, "generate", "img", "--server", "http://fake", *flags, "--output", out
        )
        assert code == 2 and f"{flags[0]} cannot be used with --server" in err, (flags, err)
    assert not out.exists() and fake_server == []  # refused before anything is asked


# -- ondeck serve: a job over the outputs cap -------------------------------------------------


def test_an_image_call_whose_files_went_past_the_cap_answers_in_openais_shape(tmp_path):
    """A job larger than --outputs-cap keeps its own files until the next job, so the
    waiting /v1/images/generations call reads them (a file already gone would answer
    404 in OpenAI's shape, never HTTP 500 in plain text)."""
    pytest.importorskip("fastapi")
    from serve.helpers import ServerProcess, build_models

    models = build_models(tmp_path / "models")
    server = ServerProcess(
        {"sd3": models["sd3"]}, "--steps", "1", "--outputs-cap", "1", tmp=tmp_path
    )
    try:
        with server.client(timeout=120) as http:
            response = http.post(
                "/v1/images/generations", json={"model": "sd3", "prompt": "x", "size": "32x32"}
            )
    finally:
        assert server.stop() == 0, server.output()
    assert "FileNotFoundError" not in server.output(), server.output()[-1500:]
    assert response.headers.get("content-type", "").startswith("application/json"), (
        response.status_code,
        response.text[:200],
    )
    document = response.json()
    assert document["data"] and base64.b64decode(document["data"][0]["b64_json"])[:4] == (
        b"\x89PNG"
    )


def test_the_report_says_which_files_were_written_or_why_none_was(
    capsys, tiny_model, flux, tmp_path, monkeypatch
):
    """report.json is written before the results, so that a failure still leaves it;
    written again after them, it lists the files, or the error and the kept frames."""
    out = tmp_path / "out"
    assert generate_on_a_full_disk(capsys, tiny_model, out, monkeypatch) == 1
    said = json.loads((out / "report.json").read_text())["output"]
    assert "No space left on device" in said["error"] and said["frames_kept"] == "frames.npy"
    assert "files" not in said

    code, _, err = generate(capsys, tiny_model, out)
    assert code == 0, err
    said = json.loads((out / "report.json").read_text())["output"]
    assert said["files"] == ["video.mp4"] and "error" not in said

    images = tmp_path / "images"
    code, _, err = generate_images(capsys, flux, images, "--images", "2")
    assert code == 0, err
    said = json.loads((images / "report.json").read_text())["output"]
    assert said["files"] == ["image-1.png", "image-2.png"]
