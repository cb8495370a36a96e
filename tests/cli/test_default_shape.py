"""With no --height, --width, --frames or --steps, a run asks its pipeline's own: the
call's defaults where its signature gives them, nothing where the call computes its own
(an image pipeline's size), and the embedded default's small shape for it."""

from __future__ import annotations

import pytest

from ondeck.errors import OndeckError

from .helpers import run


class Recorded(OndeckError):
    """Stops a run once its shape is recorded: nothing is generated."""


@pytest.fixture
def shape_of(monkeypatch, capsys, tmp_path):
    """The shape (height, width, frames, steps) a run of ``folder`` would ask for."""
    from ondeck.cli import generate

    def shape(folder, *flags) -> dict:
        seen = {}

        def record(args, pipe, shape, extra, watch, main):
            seen.update(vars(shape))
            raise Recorded("recorded")

        monkeypatch.setattr(generate, "_run_all", record)
        model = [] if folder is None else [folder]  # None: the embedded default
        _, _, err = run(
            capsys, "generate", *model, "--device", "cpu", "--output", tmp_path / "out", *flags
        )
        assert "recorded" in err, err
        return seen

    return shape


def test_ltx_runs_at_its_own_size_and_frame_count(shape_of, family):
    """LTXPipeline's call: 512x704 and 161 frames (not Wan's 480x832)."""
    assert shape_of(family("ltx")) == {"height": 512, "width": 704, "frames": 161, "steps": 50}


def test_mochi_runs_its_own_steps_and_computes_its_own_size(shape_of, family):
    """MochiPipeline's call: 64 steps and 19 frames; its size it computes itself (its
    default_height and default_width), so none is passed."""
    assert shape_of(family("mochi")) == {"height": None, "width": None, "frames": 19, "steps": 64}


def test_a_wan_folder_runs_wans_own_frames_and_steps(shape_of, tiny_model):
    """ondeck's own Wan stages take WanPipeline's defaults: 81 frames, 50 steps (and
    480x832, more than the tiny model's rotary positions span: a size is given here)."""
    shape = shape_of(tiny_model, "--height", "32", "--width", "32")
    assert shape == {"height": 32, "width": 32, "frames": 81, "steps": 50}


def test_a_flag_replaces_only_its_own_value(shape_of, family):
    assert shape_of(family("ltx"), "--height", "64", "--steps", "3") == {
        "height": 64, "width": 704, "frames": 161, "steps": 3,
    }  # fmt: skip


def test_the_embedded_default_runs_at_its_small_shape(shape_of, cache, monkeypatch):
    """`ondeck generate` with no model (`make run`): a shape its random weights make in
    seconds, whatever a real Wan's defaults."""
    from ondeck import embedded

    real = embedded.embedded_default
    monkeypatch.setattr(embedded, "embedded_default", lambda **kw: real(preset="tiny", **kw))
    assert shape_of(None) == {"height": 192, "width": 320, "frames": 17, "steps": 6}


def test_a_default_the_model_cannot_take_is_said_to_be_the_pipelines_not_the_flags(
    capsys, tiny_model, tmp_path
):
    """No --width given: Wan's own 832 is more than the tiny model's rotary positions
    span, and the line says the value is the pipeline's, not one typed."""
    argv = ["--device", "cpu", "--steps", "2", "--output", tmp_path / "out"]
    code, _, err = run(capsys, "generate", tiny_model, *argv)
    [line] = err.splitlines()
    assert code == 2
    assert line.startswith(
        "ondeck: error: argument --width: 832 (the pipeline's default) is too large for this "
        "model: "
    )
    assert line.endswith("; give a smaller --width")
    code, _, err = run(capsys, "generate", tiny_model, *argv, "--width", "832")
    assert code == 2 and "argument --width: 832 is too large for this model" in err
