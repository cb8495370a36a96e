"""The memory timeline as a PNG: resident bytes per component over time, the device's
allocated bytes, the stages, and when each component was loading. Needs matplotlib,
imported when a plot is drawn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .memory import format_bytes

__all__ = ["plot"]


def plot(
    tracker: Any,
    path: str | os.PathLike,
    *,
    title: str = "ondeck memory timeline",
    budget_bytes: int | None = None,
) -> Path:
    """A PNG: resident bytes per component, stacked, over time, with the stages marked,
    and ``budget_bytes`` (the policy's budget) as a line where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Text from a folder is drawn as given: never TeX (a user's matplotlibrc may ask).
    with matplotlib.rc_context({"text.usetex": False}):
        return _draw(plt, tracker, Path(path), drawable(title), budget_bytes)


def unit_for(largest: float) -> tuple[str, int]:
    """The unit the plot's bytes read in: the largest of GiB, MiB and KiB that ``largest``
    bytes are at least one of (a tiny model reads in KiB, not as 0.0005 GiB)."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "bytes", 1


def drawable(text: str) -> str:
    """``text`` as matplotlib draws it literally: ``$`` would start mathtext (``run$\\foo$``
    fails to parse), and bytes that are not UTF-8 (surrogates in a path) cannot be drawn."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("$", r"\$")


def _draw(plt: Any, tracker: Any, path: Path, title: str, budget: int | None) -> Path:
    end = tracker.events[-1].seconds if tracker.events else 1.0
    names = list(dict.fromkeys(e.name for e in tracker.events if e.kind == "load"))
    on_cuda = str(tracker.device).startswith("cuda")
    seen = [e.nbytes for e in tracker.events if e.kind == "load"]
    seen += [e.measured_bytes or 0 for e in tracker.events if on_cuda]
    largest = max([*seen, 1])
    unit, scale = unit_for(largest)
    # A budget far above what the run held (auto's: the device's free memory) would
    # flatten the plot to nothing: it is said in the legend instead of drawn.
    drawn = budget if budget and budget <= 4 * largest else None
    times = sorted({0.0, end, *(e.seconds for e in tracker.events)})
    sizes: dict[str, list[float]] = {name: [] for name in names}
    current = dict.fromkeys(names, 0.0)
    pending = iter(tracker.events)
    event = next(pending, None)
    for moment in times:
        while event is not None and event.seconds <= moment:
            if event.kind == "load":
                current[event.name] = event.nbytes / scale
            elif event.kind == "release":
                current[event.name] = 0.0
            event = next(pending, None)
        for name in names:
            sizes[name].append(current[name])
    figure, (axes, lanes) = plt.subplots(
        2, 1, figsize=(10, 5.6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if names:
        labels = [drawable(name) for name in names]
        axes.stackplot(times, *[sizes[n] for n in names], labels=labels, step="post", alpha=0.8)
    measured = [(e.seconds, e.measured_bytes) for e in tracker.events if e.measured_bytes]
    if measured and on_cuda:
        axes.plot(
            [t for t, _ in measured],
            [b / scale for _, b in measured],
            "k.",
            markersize=3,
            label="device bytes allocated",
        )
    if drawn:
        axes.axhline(drawn / scale, color="tab:red", linestyle="--", linewidth=1, label="budget")
    elif budget:
        axes.plot([], [], " ", label=f"budget {format_bytes(budget)} (off the scale)")
    _plot_lanes(tracker, lanes, names)
    starts = [e for e in tracker.events if e.kind == "stage_start"]
    for event in starts:
        axes.axvline(event.seconds, color="grey", alpha=0.35, linewidth=0.8)
    axes.set_xlim(0, end)
    lanes.set_xlabel("seconds")
    axes.set_ylabel(f"resident {unit}")
    axes.set_title(title)
    if names or budget:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    try:
        figure.tight_layout()
        _label_stages(figure, axes, [(e.seconds, drawable(e.name)) for e in starts])
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
    return path


def _label_stages(figure: Any, axes: Any, starts: list[tuple[float, str]]) -> None:
    """Each stage's name, level, beside its start line; a name that would run into the
    one before it goes a row lower, so labels never overlap however short the stages.
    The plot's top is raised to leave the rows clear of the data."""
    renderer = figure.canvas.get_renderer()
    bottom, top = axes.get_ylim()
    # A light backing keeps a label readable where the next stage's line runs through it.
    backing = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.1}
    texts = [
        axes.text(
            seconds, top, f" {name}", va="top", ha="left", fontsize=7, clip_on=False, bbox=backing
        )
        for seconds, name in starts
    ]
    right_edge = axes.get_window_extent(renderer).x1
    row_ends: list[float] = []  # the right edge, in pixels, of each row's last label
    rows = []
    for text in texts:
        box = text.get_window_extent(renderer)
        if box.x1 > right_edge:  # a stage near the end: its label ends at its line
            text.set_text(text.get_text().strip() + " ")
            text.set_horizontalalignment("right")
            box = text.get_window_extent(renderer)
        row = next((i for i, right in enumerate(row_ends) if box.x0 > right + 2), None)
        if row is None:
            row_ends.append(box.x1)
            row = len(row_ends) - 1
        row_ends[row] = box.x1
        rows.append(row)
    if not texts:
        return
    line = max(text.get_window_extent(renderer).height for text in texts) * 1.15
    height = axes.get_window_extent(renderer).height
    below_frame = 2.0  # pixels between the axes' top line and the first row's backing
    needed = min(0.9, ((max(rows) + 1) * line + below_frame) / height)  # of the axes' height
    top = bottom + (top - bottom) / (1.0 - needed)
    axes.set_ylim(bottom, top)
    for text, row in zip(texts, rows, strict=True):
        text.set_y(top)
        text.set_transform(axes.transData + _offset(figure, -row * line - below_frame))


def _offset(figure: Any, pixels: float) -> Any:
    from matplotlib.transforms import ScaledTranslation

    return ScaledTranslation(0, pixels / figure.dpi, figure.dpi_scale_trans)


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
