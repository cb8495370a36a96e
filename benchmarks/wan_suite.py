"""Run a list of Wan 2.1 14B-shaped modes, each in its own process, and tabulate them."""

from __future__ import annotations

import json
import sys
import time
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
        args = [
            str(HERE / "wan_modes.py"),
            "--folder",
            str(path),
            "--mode",
            spec["mode"],
            "--runs",
            str(runs),
        ]
        for key in ("memory_gib", "budget_gib", "host_cache_gib"):
            if spec.get(key):
                args += [f"--{key.replace('_', '-')}", str(spec[key])]
        if spec.get("png"):
            args += ["--png", str(out_dir() / spec["png"])]
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
