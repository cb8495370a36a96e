"""Run a list of Wan 2.1 14B-shaped modes, each in its own process, and tabulate them."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GiB, later_seconds, out_dir, ready_wan14b_folder, run_child  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_suite(
    name: str, modes: list[dict], *, folder: str, runs: int = 3, timeout: float = 420
) -> list[dict]:
    """``modes``: dicts with ``mode`` and optional ``memory_gib``, ``budget_gib``,
    ``host_cache_gib``, ``png``. Returns the result rows and writes ``{name}.json``."""
    path, sizes = ready_wan14b_folder(Path(folder))
    rows = []
    for spec in modes:
        options = {key: spec.get(key) for key in ("memory_gib", "budget_gib", "host_cache_gib")}
        args = wan_modes_command(path, spec["mode"], runs, png=spec.get("png"), **options)
        row = run_child(args, timeout=timeout)
        row["label"] = spec.get("label") or f"{spec['mode']} @ {spec.get('memory_gib') or 139} GiB"
        rows.append(row)
        print(summary_line(row), flush=True)
        (out_dir() / f"{name}.json").write_text(
            json.dumps(
                {"folder_bytes": sizes, "rows": rows, "date": time.strftime("%Y-%m-%d")},
                indent=2,
                default=str,
            )
        )
    print()
    print_table(rows)
    return rows


def wan_modes_command(
    path: Path, mode: str, runs: int, *, extra=(), png: str | None = None, **options
) -> list[str]:
    """The wan_modes.py command line of one mode: ``options`` (``memory_gib=24``, ...)
    become flags where set, ``png`` a timeline file in $OUT."""
    command = [str(HERE / "wan_modes.py"), "--folder", str(path), "--mode", mode]
    command += ["--runs", str(runs), *extra]
    for key, value in options.items():
        if value:
            command += [f"--{key.replace('_', '-')}", str(value)]
    if png:
        command += ["--png", str(out_dir() / png)]
    return command


@dataclass(frozen=True)
class Mode:
    """One mode of a comparison: a wan_modes.py mode, on a device emulated at
    ``memory_gib`` (None: the whole card), with the seconds it takes on an H200."""

    wan_mode: str
    memory_gib: int | None
    expected_seconds: float
    extra: tuple[str, ...] = ()


@dataclass
class Comparison:
    """What a comparison ran: rows in order, modes skipped for time, the folder."""

    path: Path
    sizes: dict[str, int]
    started: float
    rows: list[dict] = field(default_factory=list)
    skipped: list[tuple[str, float, float]] = field(default_factory=list)

    def write(self, filename: str, **extra) -> Path:
        """The rows so far, the folder's sizes and the skipped modes, with ``extra``, as
        JSON in ``$OUT``."""
        document = {
            "folder_bytes": self.sizes,
            "rows": self.rows,
            "skipped": [name for name, _, _ in self.skipped],
            **extra,
            "date": time.strftime("%Y-%m-%d"),
        }
        path = out_dir() / filename
        path.write_text(json.dumps(document, indent=2, default=str))
        return path

    def print_total(self, filename: str) -> None:
        print(
            f"\ntotal {time.perf_counter() - self.started:.0f}s; results in {out_dir() / filename}"
        )

    def print_skipped(self, script: str, flags: str = "") -> None:
        if self.skipped:
            names = ",".join(name for name, _, _ in self.skipped)
            print(f"\nskipped for time: {names}; run them with")
            print(f"  python benchmarks/{script} --folder {self.path} --modes {names}{flags}")


def add_comparison_arguments(parser, modes: dict, default_modes: list[str], deadline_s: float):
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b"))
    parser.add_argument(
        "--modes",
        default=",".join(default_modes),
        help=f"comma-separated, in order: {', '.join(modes)}",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=deadline_s)


def run_comparison(
    args,
    names: list[str],
    modes: dict[str, Mode],
    *,
    label: Callable[[str, Mode], str],
    png_prefix: str,
    unavailable: Callable[[str, Mode], str | None] | None = None,
    after_each: Callable[[Comparison], None] | None = None,
) -> Comparison:
    """Run the named modes in order, each in its own process, with the same allocator
    settings; a mode that would not finish before ``args.deadline_s`` (from the start) is
    skipped, and none runs past it. ``unavailable`` names why a mode cannot run at all."""
    # The same allocator settings for every mode; fewer fragments under an emulated cap.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.perf_counter()
    path, sizes = ready_wan14b_folder(Path(args.folder))
    print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}", flush=True)
    result = Comparison(path, sizes, started)
    for name in names:
        mode = modes[name]
        reason = unavailable(name, mode) if unavailable is not None else None
        if reason:
            result.rows.append({"name": name, "label": label(name, mode), "error": reason})
            print(f"{name}: {reason}")
            continue
        left = args.deadline_s - (time.perf_counter() - started)
        if left < mode.expected_seconds:
            result.skipped.append((name, mode.expected_seconds, left))
            print(
                f"{name}: skipped, needs ~{mode.expected_seconds:.0f}s and {max(0, left):.0f}s are left"
            )
            continue
        command = wan_modes_command(
            path,
            mode.wan_mode,
            args.runs,
            extra=mode.extra,
            memory_gib=mode.memory_gib,
            png=f"{png_prefix}-{name}.png" if mode.memory_gib else None,
        )
        row = run_child(command, timeout=max(30.0, left - 5))
        row.update(label=label(name, mode), name=name, runs_asked=args.runs)
        result.rows.append(row)
        print(summary_line(row), flush=True)
        if after_each is not None:
            after_each(result)
    return result


def summary_line(row: dict) -> str:
    if row.get("error") and not row.get("runs"):
        return f"{row['label']}: ERROR {row['error'][:300]}"
    runs = row.get("runs", [])
    times = ", ".join(f"{r['seconds']:.1f}" for r in runs)
    error = f"  ERROR {row['error'][:200]}" if row.get("error") else ""
    return f"{row['label']}: runs {times} s, peak alloc {row.get('peak_allocated_bytes', 0) / GiB:.1f} GiB{error}"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':<38} {'run 1 s':>8} {'runs 2-3 s':>10} {'peak alloc':>10} {'peak RSS':>9} "
        f"{'exposed s':>9} {'loaded/run':>10} {'pred/meas peak':>15}"
    )
    for row in rows:
        runs = row.get("runs", [])
        if not runs:
            print(f"{row['label']:<38} failed: {row.get('error', '')[:90]}")
            continue
        exposed = [r.get("exposed_load_seconds") for r in runs[1:]]
        loaded = [r.get("bytes_loaded") for r in runs[1:]]
        exposed_text = (
            f"{sum(exposed) / len(exposed):.2f}" if exposed and None not in exposed else "-"
        )
        loaded_text = (
            f"{sum(loaded) / len(loaded) / GiB:.1f}G" if loaded and None not in loaded else "-"
        )
        peaks = "-"
        if row.get("predicted_peak_bytes") is not None:
            peaks = f"{row['predicted_peak_bytes'] / GiB:.2f}/{row.get('measured_resident_peak_bytes', 0) / GiB:.2f}"
        print(
            f"{row['label']:<38} {runs[0]['seconds']:>8.1f} {later_seconds(row):>10.1f} "
            f"{row['peak_allocated_bytes'] / GiB:>9.1f}G {row['peak_rss_bytes'] / GiB:>8.1f}G "
            f"{exposed_text:>9} {loaded_text:>10} {peaks:>15}"
        )
