"""The timeline's stage labels never overlap, however short the stages, and any name
a folder can have is drawn as it is (not as TeX)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from ondeck import timeline
from ondeck.tracker import Event


def tracker_with(stages: list[tuple[str, float, float]]) -> SimpleNamespace:
    """What the plot reads of a tracker: its events and its device."""
    events = [Event(0.0, "load", "transformer", 2**30, 2**30, duration_seconds=0.01)]
    for name, start, end in stages:
        events.append(Event(start, "stage_start", name, 0, 2**30))
        events.append(Event(end, "stage_end", name, 0, 2**30))
    return SimpleNamespace(events=sorted(events, key=lambda e: e.seconds), device="cpu")


def label_boxes(monkeypatch, tracker, path):
    """The pixel boxes of the stage labels as drawn into ``path``."""
    boxes = []
    real = timeline._label_stages

    def recording(figure, axes, starts):
        real(figure, axes, starts)
        renderer = figure.canvas.get_renderer()
        for text in axes.texts:
            boxes.append((text.get_text(), text.get_window_extent(renderer)))

    monkeypatch.setattr(timeline, "_label_stages", recording)
    timeline.plot(tracker, path)
    return boxes


def test_labels_of_short_stages_do_not_overlap(monkeypatch, tmp_path):
    # Ten stages inside the first percent of a 100 s timeline, as an image model's turns.
    names = ["EncodePrompt", "text_encoder_2", "PrepareLatents", "Denoise", "Decode"] * 2
    stages = [(name, i * 0.1, i * 0.1 + 0.05) for i, name in enumerate(names)]
    tracker = tracker_with([*stages, ("Decode", 99.0, 100.0)])
    boxes = label_boxes(monkeypatch, tracker, tmp_path / "t.png")
    assert len(boxes) == len(stages) + 1
    for (a, first), (b, second) in itertools.combinations(boxes, 2):
        assert not first.overlaps(second), f"{a!r} overlaps {b!r}"
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text", ["run$\\foo$", "a $x$ b", "bad-\udcff-byte", "^_{}%#&"])
def test_any_name_is_drawn_as_it_is(text, tmp_path):
    tracker = tracker_with([(text, 0.0, 1.0)])
    path = timeline.plot(tracker, tmp_path / "t.png", title=f"ondeck: {text}")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_bytes_read_in_the_unit_of_their_size():
    assert timeline.unit_for(48 * 2**30) == ("GiB", 2**30)
    assert timeline.unit_for(300 * 2**20) == ("MiB", 2**20)
    assert timeline.unit_for(700 * 2**10) == ("KiB", 2**10)
    assert timeline.unit_for(12) == ("bytes", 1)


def test_a_tiny_models_plot_reads_in_kib_with_the_budget_drawn(monkeypatch, tmp_path):
    import matplotlib.axes

    tracker = tracker_with([("Denoise", 0.1, 0.9)])
    tracker.events[0].nbytes = 300 * 2**10
    seen = {}
    real = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "set_ylabel",
        lambda axes, label, **kw: seen.setdefault("label", label) and real(axes, label, **kw),
    )
    lines = []
    real_line = matplotlib.axes.Axes.axhline
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "axhline",
        lambda axes, y=0, **kw: lines.append((y, kw.get("label"))) or real_line(axes, y, **kw),
    )
    timeline.plot(tracker, tmp_path / "t.png", budget_bytes=512 * 2**10)
    assert seen["label"] == "resident KiB"
    assert lines == [(512.0, "budget")]
    assert (tmp_path / "t.png").stat().st_size > 0


def test_a_budget_far_above_the_run_is_named_not_drawn(monkeypatch, tmp_path):
    import matplotlib.axes

    tracker = tracker_with([("Denoise", 0.1, 0.9)])
    tracker.events[0].nbytes = 200 * 2**20
    labels, lines = [], []
    real_label, real_line = matplotlib.axes.Axes.set_ylabel, matplotlib.axes.Axes.axhline
    monkeypatch.setattr(
        matplotlib.axes.Axes, "set_ylabel", lambda a, t, **k: labels.append(t) or real_label(a, t)
    )
    monkeypatch.setattr(
        matplotlib.axes.Axes, "axhline", lambda a, y=0, **k: lines.append(y) or real_line(a, y)
    )
    timeline.plot(tracker, tmp_path / "t.png", budget_bytes=75 * 2**30)
    assert labels == ["resident MiB"] and lines == []
