"""The memory timeline as a PNG: resident bytes per component over time, the device's
allocated bytes, the stages, and when each component was loading. Needs matplotlib,
imported when a plot is drawn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(tracker: Any, path: str | os.PathLike, *, title: str = "ondeck memory timeline") -> Path:
    """A PNG: resident bytes per component, stacked, over time, with the stages marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = tracker.events[-1].seconds if tracker.events else 1.0
    names = list(dict.fromkeys(e.name for e in tracker.events if e.kind == "load"))
    times = sorted({0.0, end, *(e.seconds for e in tracker.events)})
    sizes: dict[str, list[float]] = {name: [] for name in names}
    current = dict.fromkeys(names, 0.0)
    pending = iter(tracker.events)
    event = next(pending, None)
    for moment in times:
        while event is not None and event.seconds <= moment:
            if event.kind == "load":
                current[event.name] = event.nbytes / 2**30
            elif event.kind == "release":
                current[event.name] = 0.0
            event = next(pending, None)
        for name in names:
            sizes[name].append(current[name])
    figure, (axes, lanes) = plt.subplots(
        2, 1, figsize=(10, 5.6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if names:
        axes.stackplot(times, *[sizes[n] for n in names], labels=names, step="post", alpha=0.8)
    measured = [(e.seconds, e.measured_bytes) for e in tracker.events if e.measured_bytes]
    if measured and str(tracker.device).startswith("cuda"):
        axes.plot(
            [t for t, _ in measured],
            [b / 2**30 for _, b in measured],
            "k.",
            markersize=3,
            label="device bytes allocated",
        )
    _plot_lanes(tracker, lanes, names)
    top = axes.get_ylim()[1]
    starts = [e for e in tracker.events if e.kind == "stage_start"]
    for event in starts:
        axes.axvline(event.seconds, color="grey", alpha=0.35, linewidth=0.8)
        axes.text(event.seconds, top, f" {event.name}", rotation=90, va="top", fontsize=7)
    axes.set_xlim(0, end)
    lanes.set_xlabel("seconds")
    axes.set_ylabel("resident GiB")
    axes.set_title(title)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_lanes(tracker: Any, lanes: Any, names: list[str]) -> None:
    """Below the stack: when stages computed, and when each component was loading
    (dark: before its stage could compute; light: its blocks arriving behind it)."""
    rows = ["stages", *names]
    opened: dict[str, float] = {}
    for event in tracker.events:
        if event.kind == "stage_start":
            opened[event.name] = event.seconds
        elif event.kind == "stage_end" and event.name in opened:
            start = opened.pop(event.name)
            lanes.broken_barh([(start, event.seconds - start)], (0.1, 0.8), color="grey")
        elif event.kind in ("load", "fill") and event.duration_seconds:
            row = rows.index(event.name) if event.name in rows else None
            if row is not None:
                start = event.seconds - event.duration_seconds
                shade = {"load": "tab:red", "fill": "tab:orange"}[event.kind]
                alpha = 0.9 if event.kind == "load" else 0.45
                lanes.broken_barh(
                    [(start, event.duration_seconds)],
                    (row + 0.1, 0.8),
                    color=shade,
                    alpha=alpha,
                )
    lanes.set_yticks([row + 0.5 for row in range(len(rows))], rows, fontsize=7)
    lanes.set_ylim(0, len(rows))
    lanes.invert_yaxis()
