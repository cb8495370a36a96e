"""Activation peaks measured per stage, remembered per model and shape across processes.

A budget must leave room for activations, which only a run can measure. The first run
of a model at a shape records its per-stage peaks here (in the user's cache folder), so
later runs and ``ondeck plan`` know them before loading anything.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from .memory import format_bytes

__all__ = ["ActivationProfiles", "default_profiles"]


def _shape_key(shape: dict[str, Any]) -> str:
    return ",".join(f"{key}={shape[key]}" for key in sorted(shape))


def _elements(shape: dict[str, Any]) -> int:
    """How much work a shape is, for extrapolating activations between shapes."""
    count = 1
    for key in ("height", "width", "frames", "batch"):
        count *= int(shape.get(key) or 1)
    return count


class ActivationProfiles:
    """``{model key: {shape key: {stage: peak activation bytes}}}`` in a JSON file."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, dict[str, Any]]] = self._read()

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}  # a damaged profile only costs a re-measurement

    def record(self, model: str, shape: dict[str, Any], stage: str, nbytes: int) -> None:
        with self._lock:
            entry = self._data.setdefault(model, {}).setdefault(
                _shape_key(shape), {"shape": shape, "stages": {}}
            )
            entry["stages"][stage] = max(nbytes, entry["stages"].get(stage, 0))
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps(self._data, indent=1))
            partial.replace(self.path)
        except OSError:
            pass  # a read-only cache folder only costs a re-measurement

    def lookup(self, model: str, shape: dict[str, Any]) -> tuple[dict[str, int], str]:
        """Per-stage activation bytes for ``shape``, and a note on where they come from."""
        with self._lock:
            shapes = self._data.get(model, {})
            exact = shapes.get(_shape_key(shape))
            if exact:
                return dict(exact["stages"]), "activations: measured at this shape"
            if not shapes:
                return {}, "activations: unknown (no profile yet; run once to measure them)"
            # Scale the nearest larger (else largest) measured shape by its element count.
            target = _elements(shape)
            candidates = sorted(shapes.values(), key=lambda e: _elements(e["shape"]))
            larger = [e for e in candidates if _elements(e["shape"]) >= target]
            source = larger[0] if larger else candidates[-1]
            ratio = target / max(1, _elements(source["shape"]))
            scaled = {stage: int(n * ratio) for stage, n in source["stages"].items()}
            peak = max(scaled.values(), default=0)
            note = (
                f"activations: extrapolated from {_shape_key(source['shape'])} "
                f"(x{ratio:.2f}, largest stage {format_bytes(peak)})"
            )
            return scaled, note


_default: ActivationProfiles | None = None


def default_profiles() -> ActivationProfiles:
    """The profiles in the user's cache folder (``ONDECK_CACHE`` or ~/.cache/ondeck)."""
    global _default
    if _default is None:
        from .embedded import default_cache_dir

        _default = ActivationProfiles(default_cache_dir() / "activation-profiles.json")
    return _default
