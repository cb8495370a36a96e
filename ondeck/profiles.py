"""Activation peaks measured per stage, remembered per model and shape across processes.

A budget must leave room for activations, which only a run can measure. A stage that
finishes records its peak here (in the user's cache folder), so later runs and
``ondeck plan`` know it before loading anything. Beside each peak is what the CUDA
allocator showed of the stage on that device (``AllocatorEvidence``): a stage that ran at
the device's limit keeps the reserve it earned there in the next process too, rather
than running out of memory once to earn it again. Beside them, where a pipeline learns
its turns from a call (the diffusers path), the turns that call showed: a later
process's first call plans with the components each turn holds, rather than as if each
were done once its turn passed. What is stored can refine a plan, never
make a correct command fail: a stage that raised records nothing, a damaged or foreign
file is ignored with one warning, implausible values are dropped, and the budget policy
measures again rather than obey a stored value that would make it refuse.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arguments import MAX_BATCH, MAX_FRAMES, MAX_SIDE
from .embedded import default_cache_dir
from .errors import OndeckError
from .memory import format_bytes

__all__ = [
    "ActivationProfiles",
    "AllocatorEvidence",
    "MEASURED_AT_SHAPE",
    "default_profiles",
    "plausible_shape",
    "PROFILE_FILE_NAME",
]

PROFILE_FILE_NAME = "activation-profiles.json"
# ``lookup``'s note where what it returns was stored for exactly the shape asked for.
MEASURED_AT_SHAPE = "activations: measured at this shape"
NO_PROFILE = "activations: unknown (no profile yet; run once to measure them)"
FORMAT = "ondeck-activation-profiles"
VERSION = 2
# No stage of any model on any device takes a pebibyte: a larger value is damage.
MAX_PLAUSIBLE_BYTES = 1 << 50
# A profile entry is about 200 bytes; 16 MB holds 80,000 of them and is read on every
# command, so a larger file is not parsed at all.
MAX_PROFILE_FILE_BYTES = 16_000_000
# Runs of a stage whose allocator kept retrying that a profile remembers: no policy
# counts more (``policy.RETRY_RESERVE_MAX_STEPS`` is below it).
MAX_RETRIED_RUNS = 8
# What a shape's numbers may be: the sides and frames generate() accepts, a batch.
SHAPE_BOUNDS = {"height": MAX_SIDE, "width": MAX_SIDE, "frames": MAX_FRAMES, "batch": MAX_BATCH}
MAX_SHAPE_NUMBER = 1 << 20
# No pipeline has more components: more turns than this is damage.
MAX_TURNS = 64

try:
    import fcntl
except ImportError:  # Windows: writes stay atomic, concurrent writers may drop entries
    fcntl = None


def _shape_key(shape: dict[str, Any]) -> str:
    return ",".join(f"{key}={shape[key]}" for key in sorted(shape))


def _elements(shape: dict[str, Any]) -> int:
    """How much work a shape is, for extrapolating activations between shapes."""
    count = 1
    for key in ("height", "width", "frames", "batch"):
        value = shape.get(key)
        count *= value if isinstance(value, int) and value > 0 else 1
    return count


def _plausible_bytes(value: Any) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PLAUSIBLE_BYTES
    )


def plausible_shape(shape: dict[str, Any]) -> bool:
    """Every value a key of ``shape`` may hold: a side, frame count or batch within what
    a run accepts (an absurd one would be extrapolated from), a device name, a flag."""
    for key, value in shape.items():
        if not isinstance(key, str):
            return False
        if isinstance(value, bool) or value is None or isinstance(value, str):
            if key in SHAPE_BOUNDS or (isinstance(value, str) and len(value) > 256):
                return False
            continue
        if not isinstance(value, int):
            return False
        if not 1 <= value <= SHAPE_BOUNDS.get(key, MAX_SHAPE_NUMBER):
            return False
    return True


@dataclass(frozen=True)
class AllocatorEvidence:
    """What the CUDA allocator showed of a model's stages at one shape on one device, in
    any process: ``retried_runs``, per stage, the runs in which it kept retrying
    (``Snapshot.retried_stages``); ``limit``, the stages that reached the device's limit
    (``Snapshot.limit_stages``)."""

    retried_runs: dict[str, int] = field(default_factory=dict)
    limit: frozenset[str] = frozenset()

    def beside(self, retried_runs: Mapping[str, int]) -> dict[str, int]:
        """Per stage, the larger of the runs stored and ``retried_runs`` (this process)."""
        merged = dict(self.retried_runs)
        for stage, runs in retried_runs.items():
            merged[stage] = max(runs, merged.get(stage, 0))
        return merged


def _valid_allocator(value: Any) -> dict[str, dict[str, Any]]:
    """The well-formed allocator evidence of an entry (none where it is damaged)."""
    if not isinstance(value, dict):
        return {}
    kept = {}
    for stage, facts in value.items():
        if not isinstance(facts, dict):
            continue
        runs, limit = facts.get("retried_runs", 0), facts.get("limit", False)
        if isinstance(runs, int) and not isinstance(runs, bool) and 0 <= runs <= MAX_RETRIED_RUNS:
            if isinstance(limit, bool) and (runs or limit):
                kept[stage] = {"retried_runs": runs, "limit": limit}
    return kept


def _valid_turns(value: Any) -> list[list[Any]] | None:
    """The turns of an entry, ``[[name, [held, ...]], ...]``; None where absent or
    damaged (not that shape, a name twice, too many)."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TURNS:
        return None
    turns = []
    for turn in value:
        if not isinstance(turn, list) or len(turn) != 2:
            return None
        name, held = turn
        if not isinstance(name, str) or not isinstance(held, list) or len(held) > MAX_TURNS:
            return None
        if not all(isinstance(other, str) for other in held):
            return None
        turns.append([name, list(held)])
    names = [name for name, _ in turns]
    return turns if len(set(names)) == len(names) else None


def _valid_models(document: Any) -> tuple[dict[str, dict[str, dict[str, Any]]], int]:
    """The well-formed entries of a profile document, and how many were dropped."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError("not an ondeck activation-profile file")
    if document.get("version") != VERSION:
        raise ValueError(f"format version {document.get('version')!r}, not {VERSION}")
    models = document.get("models")
    if not isinstance(models, dict):
        raise ValueError("'models' is not an object")
    valid: dict[str, dict[str, dict[str, Any]]] = {}
    dropped = 0
    for model, shapes in models.items():
        if not isinstance(shapes, dict):
            dropped += 1
            continue
        for key, entry in shapes.items():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            stages = entry.get("stages") if isinstance(entry, dict) else None
            if not isinstance(shape, dict) or not isinstance(stages, dict):
                dropped += 1
                continue
            if not plausible_shape(shape):
                dropped += 1
                continue
            if _shape_key(shape) != key:
                dropped += 1
                continue
            kept = {stage: n for stage, n in stages.items() if _plausible_bytes(n)}
            dropped += len(stages) - len(kept)
            raw = entry.get("allocator")
            allocator = _valid_allocator(raw)
            given = len(raw) if isinstance(raw, dict) else int(raw is not None)
            dropped += given - len(allocator)
            turns = _valid_turns(entry.get("turns"))
            dropped += int(turns is None and entry.get("turns") is not None)
            if kept or allocator or turns:
                valid.setdefault(model, {})[key] = {"shape": shape, "stages": kept}
                if allocator:
                    valid[model][key]["allocator"] = allocator
                if turns:
                    valid[model][key]["turns"] = turns
    return valid, dropped


def _load(path: Path | None) -> tuple[dict[str, dict[str, dict[str, Any]]], str | None]:
    """The well-formed entries of the file at ``path``, and what was wrong, if anything."""
    if path is None:
        return {}, None
    try:
        if not path.is_file():
            return {}, None
        with open(path, "rb") as file:
            data = file.read(MAX_PROFILE_FILE_BYTES + 1)
        if len(data) > MAX_PROFILE_FILE_BYTES:
            raise ValueError(
                f"larger than {MAX_PROFILE_FILE_BYTES // 10**6} MB, not read; real profiles "
                "are kilobytes"
            )
        text = data.decode("utf-8")
        # NaN and Infinity (not JSON, but Python writes them) are read as the floats they
        # name, so that the entries holding them are dropped and the others kept.
        document = json.loads(text)
        models, dropped = _valid_models(document)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        return {}, f"ignored ({error})"
    if dropped:
        return models, (
            f"ignored {dropped} damaged or implausible entr{'y' if dropped == 1 else 'ies'}"
        )
    return models, None


class ActivationProfiles:
    """``{model key: {shape key: {stage: peak activation bytes}}}`` in a JSON file.

    The file carries a format name and version; it is written to a temporary name of
    this process and renamed into place, under a lock that merges what other processes
    (the ranks of one launch, two commands at once) wrote meanwhile.
    """

    def __init__(self, path: str | os.PathLike | None, *, warn: bool = True):
        """``warn``: what is wrong with the file is a warning as it is read (False: the
        caller says it, from ``problem``, what was wrong when it was last read)."""
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._warned = not warn
        self.problem: str | None = None
        self._data: dict[str, dict[str, dict[str, Any]]] = self._read()

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"activation profiles {self.path}: {message}; measuring again "
                "(`ondeck profiles --clear` deletes the file)",
                stacklevel=4,
            )

    def _read(self) -> dict:
        models, problem = _load(self.path)
        self.problem = problem
        if problem:
            self._warn(problem)
        return models

    def _entry(self, model: str, shape: dict[str, Any]) -> dict[str, Any]:
        """The entry of ``model`` at ``shape``, made empty where there is none (under the
        lock)."""
        return self._data.setdefault(model, {}).setdefault(
            _shape_key(shape), {"shape": dict(shape), "stages": {}}
        )

    def record(self, model: str, shape: dict[str, Any], stage: str, nbytes: int) -> None:
        """Store a finished stage's peak; the newest measurement replaces the old one."""
        if not _plausible_bytes(nbytes):
            return
        with self._lock:
            entry = self._entry(model, shape)
            entry["stages"][stage] = int(nbytes)
            self._write({(model, _shape_key(shape), stage)})

    def record_allocator(
        self, model: str, shape: dict[str, Any], stage: str, *, retried: bool, limit: bool
    ) -> None:
        """Store what the allocator showed of a stage in one run at ``shape``: a run more
        in which it kept retrying (``retried``), and whether it reached the device's
        limit. Stored evidence only grows, as the reserves it earns do."""
        if not retried and not limit:
            return
        with self._lock:
            entry = self._entry(model, shape)
            facts = entry.setdefault("allocator", {}).get(stage, {})
            runs = min(facts.get("retried_runs", 0) + int(retried), MAX_RETRIED_RUNS)
            merged = _merged_facts(facts, {"retried_runs": runs, "limit": bool(limit)})
            if merged == facts:
                return
            entry["allocator"][stage] = merged
            self._write(set())

    def record_turns(
        self, model: str, shape: dict[str, Any], turns: list[tuple[str, tuple[str, ...]]]
    ) -> None:
        """Store the turns a complete call at ``shape`` showed: per turn, its name and the
        components it holds. The newest replaces the old."""
        value = _valid_turns([[name, list(held)] for name, held in turns])
        if value is None:
            return
        with self._lock:
            entry = self._entry(model, shape)
            if entry.get("turns") == value:
                return
            entry["turns"] = value
            self._write(set(), turns={(model, _shape_key(shape))})

    def stored_turns(
        self, model: str, shape: dict[str, Any]
    ) -> list[tuple[str, tuple[str, ...]]] | None:
        """The turns a call of ``model`` at exactly ``shape`` showed; None where none is
        stored."""
        with self._lock:
            entry = self._data.get(model, {}).get(_shape_key(shape)) or {}
            turns = entry.get("turns")
            return [(name, tuple(held)) for name, held in turns] if turns else None

    def allocator_evidence(self, model: str, shape: dict[str, Any]) -> AllocatorEvidence:
        """What the allocator showed of ``model``'s stages at exactly ``shape``."""
        with self._lock:
            return _evidence(self._data.get(model, {}).get(_shape_key(shape)) or {})

    def forget(self, model: str, shape: dict[str, Any], stages: Any) -> None:
        """Drop stored peaks that proved wrong (re-measured on the next run)."""
        with self._lock:
            entry = self._data.get(model, {}).get(_shape_key(shape))
            if entry is None:
                return
            for stage in stages:
                entry["stages"].pop(stage, None)

    def entries(self) -> list[tuple[str, str, dict[str, int]]]:
        """(model, shape key, {stage: bytes}) for every stored peak."""
        with self._lock:
            return [
                (model, key, dict(entry["stages"]))
                for model, shapes in self._data.items()
                for key, entry in shapes.items()
                if entry["stages"]
            ]

    def allocator_entries(self) -> list[tuple[str, str, AllocatorEvidence]]:
        """(model, shape key, evidence) for every shape with allocator evidence."""
        with self._lock:
            return [
                (model, key, _evidence(entry))
                for model, shapes in self._data.items()
                for key, entry in shapes.items()
                if entry.get("allocator")
            ]

    def turn_entries(self) -> list[tuple[str, str, list[tuple[str, tuple[str, ...]]]]]:
        """(model, shape key, turns) for every shape whose call showed a turn holding more
        than its own component."""
        with self._lock:
            return [
                (model, key, [(name, tuple(held)) for name, held in entry["turns"]])
                for model, shapes in self._data.items()
                for key, entry in shapes.items()
                if any(len(held) > 1 for _, held in entry.get("turns") or ())
            ]

    def clear(self) -> bool:
        """Delete every stored profile (the file too); True when there was a file.
        ``OndeckError`` when something is there that cannot be deleted."""
        with self._lock:
            self._data = {}
            if self.path is None:
                return False
            try:
                self.path.unlink()
                return True
            except FileNotFoundError:
                return False
            except OSError as error:  # a folder in its place, a read-only cache folder
                raise OndeckError(
                    f"cannot delete {self.path}: {error.strerror or error}; nothing was deleted"
                ) from None

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        lock_path = self.path.with_name(self.path.name + ".lock")
        if fcntl is None:
            yield
            return
        with open(lock_path, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _write(
        self, changed: set[tuple[str, str, str]], turns: set[tuple[str, str]] = frozenset()
    ) -> None:
        if self.path is None:
            return
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._file_lock():
                # Keep what other processes stored since we read; ours wins where both did.
                merged, _ = _load(self.path)  # damage there was reported when read
                for model, shapes in self._data.items():
                    for key, entry in shapes.items():
                        target = merged.setdefault(model, {}).setdefault(
                            key, {"shape": entry["shape"], "stages": {}}
                        )
                        for stage, nbytes in entry["stages"].items():
                            if (model, key, stage) in changed or stage not in target["stages"]:
                                target["stages"][stage] = nbytes
                        _merge_allocator(target, entry.get("allocator") or {})
                        if entry.get("turns") and ((model, key) in turns or "turns" not in target):
                            target["turns"] = entry["turns"]
                self._data = merged
                document = {"format": FORMAT, "version": VERSION, "models": merged}
                partial.write_text(json.dumps(document, indent=1))
                partial.replace(self.path)
        except OSError:
            pass  # a read-only cache folder only costs a re-measurement
        finally:
            with contextlib.suppress(OSError):
                partial.unlink()

    def lookup(self, model: str, shape: dict[str, Any]) -> tuple[dict[str, int], str]:
        """Per-stage activation bytes for ``shape``, and a note on where they come from."""
        with self._lock:
            shapes = {k: e for k, e in self._data.get(model, {}).items() if e["stages"]}
            exact = shapes.get(_shape_key(shape))
            if exact:
                return dict(exact["stages"]), MEASURED_AT_SHAPE
            if not shapes:
                return {}, NO_PROFILE
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


def _evidence(entry: dict[str, Any]) -> AllocatorEvidence:
    facts = entry.get("allocator") or {}
    return AllocatorEvidence(
        retried_runs={s: f["retried_runs"] for s, f in facts.items() if f["retried_runs"]},
        limit=frozenset(s for s, f in facts.items() if f["limit"]),
    )


def _merged_facts(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {
        "retried_runs": max(old.get("retried_runs", 0), new.get("retried_runs", 0)),
        "limit": bool(old.get("limit")) or bool(new.get("limit")),
    }


def _merge_allocator(target: dict[str, Any], facts: dict[str, dict[str, Any]]) -> None:
    """Fold ``facts`` into ``target``'s allocator evidence (each only grows)."""
    for stage, new in facts.items():
        merged = target.setdefault("allocator", {})
        merged[stage] = _merged_facts(merged.get(stage, {}), new)


_default: ActivationProfiles | None = None
_built_for: Path | None = None


def default_profiles() -> ActivationProfiles:
    """The profiles in the user's cache folder (``ONDECK_CACHE`` or ~/.cache/ondeck)."""
    global _default, _built_for
    path = profiles_path()
    # Follow a change of ONDECK_CACHE; keep profiles someone put in place of the default.
    if _default is None or (_default.path == _built_for and _built_for != path):
        _default, _built_for = ActivationProfiles(path), path
    return _default


def profiles_path() -> Path:
    """Where activation profiles are stored."""
    return default_cache_dir() / PROFILE_FILE_NAME
