"""The embedded default: built once under a lock, rebuilt when incomplete, and worth a look."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil

import numpy as np
import pytest

from ondeck.embedded import EMBEDDED_VERSION, MARKER, build_wan_folder, embedded_default
from ondeck.output import OutputError
from ondeck.pipelines.wan import WanTextToVideo

from .helpers import error_lines, listing, run

TINY = "wan-embedded-tiny"


def _build_after_barrier(root, barrier, results):
    barrier.wait()  # both processes ask at the same moment
    path, built = embedded_default(root, preset="tiny")
    results.put((str(path), built))


def test_two_first_runs_at_once_build_it_once_and_leave_nothing_stray(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    processes = [
        context.Process(target=_build_after_barrier, args=(tmp_path, barrier, results))
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sorted(built for _, built in outcomes) == [False, True]
    assert {path for path, _ in outcomes} == {str(tmp_path / TINY)}
    assert listing(tmp_path) == {TINY, f"{TINY}.lock"}
    assert embedded_default(tmp_path, preset="tiny") == (tmp_path / TINY, False)


def _truncate(path):
    """Half the file, as an interrupted copy or a full disk leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _overwrite_start(path):
    """Zeros over the safetensors header's length and the header's start: same size."""
    with open(path, "r+b") as file:
        file.write(bytes(16))


def _garble(path):
    """The same number of bytes, no longer JSON."""
    path.write_bytes(b"{" + b" " * (path.stat().st_size - 1))


@pytest.fixture
def built(tmp_path):
    path, was_built = embedded_default(tmp_path, preset="tiny")
    assert was_built
    return path


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda f: shutil.rmtree(f / "tokenizer"), "is incomplete (tokenizer is missing)"),
        (lambda f: (f / MARKER).unlink(), f"is incomplete (no {MARKER}; an interrupted build?)"),
        (
            lambda f: [p.unlink() for p in (f / "vae").glob("*.safetensors")],
            "is incomplete (no weights in vae/)",
        ),
        (
            lambda f: (f / MARKER).write_text(json.dumps({"preset": "tiny", "seed": 0})),
            "is from an older ondeck",
        ),
        (
            lambda f: _truncate(next((f / "transformer").glob("*.safetensors"))),
            "is damaged (transformer/diffusion_pytorch_model.safetensors has changed size)",
        ),
        (
            lambda f: _garble(f / "vae" / "config.json"),
            "is damaged (vae/config.json is missing or unreadable)",
        ),
        (
            lambda f: _overwrite_start(next((f / "text_encoder").glob("*.safetensors"))),
            "is damaged (text_encoder/model.safetensors is missing or unreadable)",
        ),
        (
            lambda f: (f / "scheduler" / "scheduler_config.json").unlink(),
            "is incomplete (scheduler/scheduler_config.json is missing)",
        ),
    ],
    ids=[
        "no-tokenizer",
        "no-marker",
        "no-vae-weights",
        "older-version",
        "truncated-weights",
        "broken-config",
        "overwritten-weights-header",
        "no-scheduler",
    ],
)
def test_a_half_built_or_old_cache_is_rebuilt_with_one_line(damage, reason, built, tmp_path):
    damage(built)
    said = []
    path, was_built = embedded_default(tmp_path, preset="tiny", say=said.append)
    assert (path, was_built) == (built, True)
    assert said == [f"ondeck: the embedded default in {built} {reason}; rebuilding it"]
    assert (path / "tokenizer").is_dir() and (path / MARKER).is_file()
    assert json.loads((path / MARKER).read_text())["version"] == EMBEDDED_VERSION
    assert listing(tmp_path) == {TINY, f"{TINY}.lock"}


def test_leftovers_of_a_killed_build_are_removed(built, tmp_path):
    (tmp_path / f".{TINY}.abc123.partial" / "vae").mkdir(parents=True)
    (tmp_path / f".{TINY}.def456.old").mkdir()
    shutil.rmtree(built / "tokenizer")
    embedded_default(tmp_path, preset="tiny")
    assert listing(tmp_path) == {TINY, f"{TINY}.lock"}


def test_a_cache_that_cannot_be_written_says_where_and_what_to_set(tmp_path):
    with pytest.raises(OutputError, match="set ONDECK_CACHE to a writable folder") as caught:
        embedded_default("/proc/ondeck-cache", preset="tiny")
    assert "cannot write the embedded default under /proc/ondeck-cache" in str(caught.value)


def test_the_cli_on_an_unwritable_home_is_one_line(capsys, monkeypatch, tmp_path):
    # No ONDECK_CACHE or XDG_CACHE_HOME: the cache goes under HOME, which cannot be written.
    monkeypatch.delenv("ONDECK_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "/proc/no-home")
    code, _, err = run(capsys, "generate", "--device", "cpu", "--output", tmp_path / "out")
    assert code == 1
    assert error_lines(err) == [
        "ondeck: error: cannot write the embedded default under /proc/no-home/.cache/ondeck "
        "(No such file or directory); set ONDECK_CACHE to a writable folder, or give a model "
        "folder"
    ]


def frames_of(folder, seed=0):
    pipe = WanTextToVideo.from_folder(folder, device="cpu", policy="release", progress=False)
    shape = dict(height=64, width=64, num_frames=5, num_inference_steps=2)
    frames = pipe.generate("a fox", seed=seed, **shape)[0]
    pipe.release_all()
    return frames


def spatial_std(frames):
    """Per frame and colour channel, how much the pixels of one frame differ."""
    return np.asarray(frames).std(axis=(1, 2))


def test_small_random_weights_alone_decode_to_a_flat_frame(tmp_path):
    # What the embedded default showed before: the reason for ``vivid``.
    frames = frames_of(build_wan_folder(tmp_path / "plain", preset="tiny", vivid=False))
    assert spatial_std(frames).max() < 0.01


@pytest.fixture(scope="module")
def vivid_tiny(tmp_path_factory):
    return embedded_default(tmp_path_factory.mktemp("vivid"), preset="tiny")[0]


def test_the_embedded_default_shows_seeded_colour_in_every_frame(vivid_tiny):
    frames = frames_of(vivid_tiny)
    assert spatial_std(frames).min() > 0.05  # every frame, every channel
    assert spatial_std(frames).mean() > 0.15
    assert all(frame.max() - frame.min() > 0.5 for frame in frames)
    # Colour, not grey: the channels of a pixel differ.
    assert np.abs(frames[..., 0] - frames[..., 1]).mean() > 0.05


def test_the_embedded_defaults_noise_follows_the_seed(vivid_tiny):
    assert np.array_equal(frames_of(vivid_tiny, seed=1), frames_of(vivid_tiny, seed=1))
    assert np.abs(frames_of(vivid_tiny, seed=1) - frames_of(vivid_tiny, seed=2)).mean() > 0.05


def test_the_default_preset_itself_is_vivid(tmp_path_factory):
    # What `make run` shows (its own shape is slow on a CPU; the scaling does not depend on it).
    folder, _ = embedded_default(tmp_path_factory.mktemp("default"))
    assert spatial_std(frames_of(folder)).min() > 0.05


def test_the_cli_says_what_the_embedded_default_shows(capsys, cache, tmp_path, monkeypatch):
    import ondeck.embedded

    real = ondeck.embedded.embedded_default
    monkeypatch.setattr(ondeck.embedded, "embedded_default", lambda **kw: real(preset="tiny", **kw))
    shape = ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
    code, out, _ = run(capsys, "generate", "--device", "cpu", *shape, "--output", tmp_path / "o")
    assert code == 0
    assert out.splitlines()[-1] == (
        "ondeck: what you see is the embedded default's random weights decoding seeded noise "
        "into colour blotches, not the prompt; give a real model for a real video"
    )
    assert os.path.isdir(cache / TINY)


def test_a_build_that_fails_half_way_leaves_nothing_and_says_so(tmp_path, monkeypatch):
    import ondeck.embedded

    def disk_full(path, **_):
        (path / "tokenizer").mkdir()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ondeck.embedded, "build_wan_folder", disk_full)
    with pytest.raises(OutputError) as caught:
        embedded_default(tmp_path, preset="tiny")
    assert str(caught.value) == (
        f"could not build the embedded default under {tmp_path} (No space left on device); "
        "set ONDECK_CACHE to another folder, or give a model folder"
    )
    assert listing(tmp_path) == {f"{TINY}.lock"}


def test_a_quiet_first_run_builds_the_embedded_default_without_library_bars(
    capsys, cache, tmp_path, monkeypatch
):
    """ONDECK_PROGRESS=0 quiets the libraries' bars before the embedded default is built:
    transformers' "Writing model shards" as it saves the text encoder, too."""
    from transformers.utils import logging as transformers_logging

    import ondeck.embedded

    real = ondeck.embedded.embedded_default
    monkeypatch.setattr(ondeck.embedded, "embedded_default", lambda **kw: real(preset="tiny", **kw))
    monkeypatch.setenv("ONDECK_PROGRESS", "0")
    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as a new process finds it
    try:
        shape = ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
        argv = ["generate", "--device", "cpu", *shape, "--output", tmp_path / "o"]
        code, _, err = run(capsys, *argv)
    finally:
        if not was_on:
            transformers_logging.disable_progress_bar()
    assert code == 0, err
    assert "Writing model shards" not in err
    assert os.path.isdir(cache / TINY)
