"""The general path on every card: a folder through ``ondeck.diffusers.from_pretrained``
with no policy argument, against diffusers eager in the same call.

    python benchmarks/families.py [--folder DIR] [--cards full,24,16,8] [--runs 3]

Wan 2.1 14B-shaped (``WanPipeline.save_pretrained``'s folder, random weights), 480x832,
33 frames, 4 steps, three prompts per mode, each mode in its own process
(``benchmarks/wan_modes.py --mode ondeck-diffusers``) on a device emulated with
``torch.cuda.set_per_process_memory_fraction``; then ``release`` on the full card.
Prints, last, a table: completed or not, the policy auto chose, runs 2-3 / eager, run 1
/ eager's run 1, peak reserved (sampled), host peak RSS, how the last run decoded and
the plan's transfer floor per pass where blocks stream (bytes streamed over the measured
host-to-device rate). Writes families.json to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GiB, later_seconds, out_dir, ready_wan14b_folder, run_child  # noqa: E402
from defaults import card_label, chosen_policy, peak_reserved  # noqa: E402
from wan_suite import wan_modes_command  # noqa: E402


def transfer_floor(row: dict) -> str:
    planned = row.get("planned_streaming") or {}
    if not planned:
        return "-"
    seconds = sum(part["predicted_seconds_per_pass"] for part in planned.values())
    nbytes = sum(part["bytes_per_pass"] for part in planned.values())
    return f"{nbytes / GiB:.1f}G {seconds * 1000:.0f}ms/pass"


def decoded(row: dict) -> str:
    runs = row.get("runs") or []
    last = (runs[-1].get("decode") or {}) if runs else {}
    if not last:
        return "-"
    tiles = last.get("tiles", 0)
    text = "whole" if not tiles else f"{tiles} tiles"
    return text + (f", {last['retries']} retried" if last.get("retries") else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved"))
    parser.add_argument("--cards", default="full,24,16,8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-release", action="store_true")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.perf_counter()
    path, sizes = ready_wan14b_folder(Path(args.folder))
    rows: list[dict] = []

    def write() -> None:
        document = {
            "family": "wan2.1-14b",
            "folder_bytes": sizes,
            "rows": rows,
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/families.py " + " ".join(sys.argv[1:]),
        }
        (out_dir() / "families.json").write_text(json.dumps(document, indent=2, default=str))

    plan = [("diffusers-eager", "full")]
    plan += [("ondeck-diffusers", card) for card in args.cards.split(",") if card]
    if not args.no_release:
        plan.append(("ondeck-diffusers-release", "full"))
    for mode, card in plan:
        memory = None if card == "full" else int(card)
        row = run_child(
            wan_modes_command(path, mode, args.runs, memory_gib=memory), timeout=args.timeout
        )
        row.update(mode=mode, card=card)
        rows.append(row)
        runs = ", ".join(f"{r['seconds']:.1f}" for r in row.get("runs", []))
        error = f" ERROR {row['error'][:400]}" if row.get("error") else ""
        print(f"{mode} @ {card_label(card)}: runs {runs} s; {row.get('policy_reason', '')}{error}")
        if row.get("error") and (row.get("tail") or row.get("traceback")):
            print((row.get("traceback") or row.get("tail"))[-1500:])
        write()

    eager = next((r for r in rows if r["mode"] == "diffusers-eager" and r.get("runs")), None)
    eager_later = later_seconds(eager) if eager else None
    eager_first = eager["runs"][0]["seconds"] if eager else None
    print(f"\ntotal {time.perf_counter() - started:.0f}s; results in {out_dir() / 'families.json'}")
    print(
        f"\n{'card':<10} {'mode':<26} {'done':<5} {'policy':<8} {'runs 2-3':>8} {'/eager':>7} "
        f"{'run 1/eager 1':>13} {'reserved':>9} {'RSS':>7} {'decode':<18} transfer floor"
    )
    for row in rows:
        runs = row.get("runs", [])
        done = len(runs) == args.runs and not row.get("error")
        later = later_seconds(row) if runs else None
        ratio = f"{later / eager_later:.3f}" if later and eager_later else "-"
        first = f"{runs[0]['seconds'] / eager_first:.2f}" if runs and eager_first else "-"
        policy = chosen_policy(row) if row["mode"] != "diffusers-eager" else "-"
        print(
            f"{card_label(row['card']):<10} {row['mode']:<26} {'yes' if done else 'NO':<5} "
            f"{policy:<8} {later or float('nan'):>8.2f} {ratio:>7} {first:>13} "
            f"{(peak_reserved(row) or 0) / GiB:>8.1f}G {row.get('peak_rss_bytes', 0) / GiB:>6.1f}G "
            f"{decoded(row):<18} {transfer_floor(row)}"
        )


if __name__ == "__main__":
    main()
