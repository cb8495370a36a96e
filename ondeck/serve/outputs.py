"""The outputs folder: one folder per job, the oldest removed first past a size cap."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..cli.media import FALLBACK_FPS
from ..output import OutputError, atomic_path, image_names, write_json, write_video

# Every job folder starts with this, and only such folders are ever removed.
JOB_PREFIXES = ("video_", "img_")


class OutputStore:
    def __init__(self, root: str | Path, cap_bytes: int):
        self.root = Path(root)
        self.cap_bytes = int(cap_bytes)
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, job_id: str) -> Path:
        path = self.root / job_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove(self, job_id: str) -> None:
        shutil.rmtree(self.root / job_id, ignore_errors=True)

    def _job_folders(self) -> list[tuple[float, Path, int]]:
        found = []
        for path in self.root.iterdir():
            if not path.is_dir() or not path.name.startswith(JOB_PREFIXES):
                continue
            try:
                files = [f for f in path.iterdir() if f.is_file()]
                nbytes = sum(f.stat().st_size for f in files)
                # A job's age is its report's, written once: a timeline drawn into an old
                # job's folder when first asked for must not make it the newest.
                report = path / "report.json"
                dated = report if report in files else path
                found.append((dated.stat().st_mtime, path, nbytes))
            except OSError:
                continue
        return sorted(found, key=lambda item: item[0])

    def trim(self, keep: set[str] = frozenset(), *, keep_newest: bool = False) -> list[str]:
        """Remove the oldest job folders until the folder is within its cap; returns the
        job ids removed. ``keep`` names folders being written or read now; with
        ``keep_newest`` the newest job's stays too (its client may be about to read it)."""
        folders = self._job_folders()
        total = sum(nbytes for _, _, nbytes in folders)
        if keep_newest and folders:
            keep = {*keep, folders[-1][1].name}
        removed = []
        for _, path, nbytes in folders:
            if total <= self.cap_bytes:
                break
            if path.name in keep:
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= nbytes
            removed.append(path.name)
        return removed

    def finished(self) -> list[tuple[str, dict, dict[str, str], float]]:
        """The job folders an earlier server left whole, oldest first: (job id, its
        report, its files by role as ``write_job_files`` names them, the report's time).
        A folder whose writing was cut short (no report, no video, fewer images than the
        report's ``n``) is left out, and left to the cap."""
        found = []
        for made, path, _ in self._job_folders():
            try:
                report = json.loads((path / "report.json").read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(report, dict):
                continue
            files = {"report": str(path / "report.json")}
            if path.name.startswith("video_"):
                contents = [path / "video.mp4"] if (path / "video.mp4").is_file() else []
            else:
                contents = sorted(path.glob("image*.png"), key=_image_number)
                if len(contents) < int(report.get("n") or 1):
                    contents = []
            if not contents:
                continue
            files.update({content.stem: str(content) for content in contents})
            if (path / "timeline.png").is_file():
                files["timeline"] = str(path / "timeline.png")
            found.append((path.name, report, files, made))
        return found

    def total_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self._job_folders())


def _image_number(path: Path) -> int:
    """image.png first, then image-1.png, image-2.png ... in number order."""
    found = re.fullmatch(r"image(?:-(\d+))?", path.stem)
    return int(found.group(1) or 0) if found else 1 << 30


def write_png(path: Path, pixels: Any) -> Path:
    """An HxWxC float image in [0, 1] as a PNG, renamed into place when complete."""
    with atomic_path(path) as temporary:
        temporary.write_bytes(png_bytes(pixels))
    return path


def png_bytes(pixels: Any) -> bytes:
    import numpy as np
    from PIL import Image

    array = (np.clip(pixels, 0.0, 1.0) * 255).round().astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def write_job_files(
    folder: Path, report: dict, frames: Any, *, kind: str, fps: float = FALLBACK_FPS
) -> dict[str, str]:
    """report.json first, then video.mp4 at ``fps`` (or image.png, image-1.png ... for
    several): what a local ``ondeck generate`` writes, less the timeline
    (``draw_timeline``, on first request). Returns the paths written, by role (the file
    name less its suffix), in order."""
    files = {"report": str(write_json(folder / "report.json", report))}
    if kind == "image":
        for name, batch in zip(image_names(len(frames)), frames, strict=True):
            pixels = batch[0] if batch.ndim == 5 else batch  # B x 1 x H x W x C
            files[name.removesuffix(".png")] = str(write_png(folder / name, pixels[0]))
    else:
        files["video"] = str(write_video(folder / "video.mp4", frames[0], fps=fps))
    return files


def timeline_view(report: dict) -> SimpleNamespace:
    """What ``timeline.plot`` reads, from a job's report.json: its events from the job's
    first one (the tracker's clock started with the pipeline), and the components
    resident when it started drawn as loaded at that moment."""
    start = min((event["seconds"] for event in report["events"]), default=0.0)
    carried = [
        {
            "seconds": start,
            "kind": "load",
            "name": name,
            "nbytes": nbytes,
            "resident_bytes": 0,
            "measured_bytes": None,
            "duration_seconds": 0.0,
            "run": report["runs"],
        }
        for name, nbytes in report.get("resident_at_start", {}).items()
    ]
    return SimpleNamespace(
        device=report["device"],
        events=[
            SimpleNamespace(**{**event, "seconds": event["seconds"] - start})
            for event in carried + report["events"]
        ],
        stages=[SimpleNamespace(**stage) for stage in report["stages"]],
    )


def draw_timeline(folder: Path, tracker_view: Any, *, title: str) -> Path:
    """timeline.png of one job, renamed into place when complete. Drawn when first asked
    for: matplotlib takes longer than many a small job."""
    from ..timeline import plot

    path = folder / "timeline.png"
    try:
        with atomic_path(path) as temporary:
            plot(tracker_view, temporary, title=title)
    except OSError as error:
        raise OutputError(f"could not write {path}: {error.strerror or error}") from error
    return path
