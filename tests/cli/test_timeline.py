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
