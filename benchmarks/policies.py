"""Residency policies on the Wan 2.1 14B-shaped pipeline, each card emulated.

    python benchmarks/policies.py [--folder DIR] [--cards full,48,32,24,16,12,8] [--runs 3]
    python benchmarks/policies.py --named 139,48,32 [--skip 48:ondeck-eager]

With no ``--named``: the default path on every card, ``ondeck generate MODEL_DIR`` with
no policy flag.

The Wan 2.1 14B-shaped folder exactly as ``WanPipeline.save_pretrained`` writes it,
480x832, 33 frames, 4 steps, three prompts per card. Each card is a process of its own:
``benchmarks/wan_modes.py --mode ondeck-default`` builds the pipeline as the CLI does
with no flags (policy ``auto``, no budget, no host cache) on a device emulated with
``torch.cuda.set_per_process_memory_fraction``. diffusers eager on the full card runs in
the same call, first, as the reference. Writes policies.json to $OUT and prints a table:
completed or not, the policy auto chose, runs 2-3 / eager, the slowest run after the
first over the steady state, peak reserved (sampled), host peak RSS.

``--named SIZES``: each named policy (eager, release, budget, budget with prefetch) at
139 GiB (the whole H200), 48 GiB and 32 GiB, plus auto at 32 GiB, beside diffusers' own
eager pipeline; writes policies.json and the 48 GiB timeline PNG to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB,
    later_seconds,
    median,
    out_dir,
    peak_reserved,
    ready_wan14b_folder,
    run_child,
    run_suite,
    wan_modes_command,
)

CARDS = ["full", "48", "32", "24", "16", "12", "8"]
# --named: the policies run at each size (GiB; 139 is the whole H200)
NAMED = {
    139: ["diffusers-eager", "ondeck-eager", "ondeck-release", "ondeck-budget"],
    48: ["ondeck-release", "ondeck-budget", "ondeck-budget-prefetch"],
    32: ["ondeck-eager", "ondeck-auto"],
}


def card_label(card: str) -> str:
    return "full card" if card == "full" else f"{card} GiB"


def chosen_policy(row: dict) -> str:
    reason = row.get("policy_reason") or ""
    return reason.split("'")[1] if reason.count("'") >= 2 else "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved"))
    parser.add_argument("--cards", default=",".join(CARDS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-eager", action="store_true", help="skip the diffusers reference")
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument("--named", help="sizes for the named policies, e.g. 139,48,32")
    parser.add_argument("--skip", default="", help="with --named: size:mode pairs to leave out")
    args = parser.parse_args()
    if args.named:
        run_named(args)
        return
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.perf_counter()
    path, sizes = ready_wan14b_folder(Path(args.folder))
    index = json.loads((path / "model_index.json").read_text())
    print(f"model_index.json transformer_2: {index.get('transformer_2')}", flush=True)

    rows: list[dict] = []

    def write() -> None:
        document = {
            "folder_bytes": sizes,
            "model_index": index,
            "rows": rows,
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/policies.py " + " ".join(sys.argv[1:]),
        }
        (out_dir() / "policies.json").write_text(json.dumps(document, indent=2, default=str))

    plan: list[tuple[str, str]] = [] if args.no_eager else [("diffusers-eager", "full")]
    plan += [("ondeck-default", card) for card in args.cards.split(",") if card]
    for mode, card in plan:
        memory = None if card == "full" else int(card)
        command = wan_modes_command(path, mode, args.runs, memory_gib=memory)
        row = run_child(command, timeout=args.timeout)
        row.update(mode=mode, card=card)
        rows.append(row)
        runs = ", ".join(f"{r['seconds']:.1f}" for r in row.get("runs", []))
        error = f" ERROR {row['error'][:400]}" if row.get("error") else ""
        print(f"{mode} @ {card_label(card)}: runs {runs} s; {row.get('policy_reason', '')}{error}")
        if row.get("error") and row.get("tail"):
            print(row["tail"][-1500:])
        write()

    eager = next((r for r in rows if r["mode"] == "diffusers-eager" and r.get("runs")), None)
    eager_seconds = later_seconds(eager) if eager else None
    print(f"\ntotal {time.perf_counter() - started:.0f}s; results in {out_dir() / 'policies.json'}")
    print(
        f"\n{'card':<10} {'mode':<16} {'done':<5} {'policy':<8} {'runs 2-3 s':>10} "
        f"{'/ eager':>8} {'max later/steady':>16} {'peak reserved':>13} {'host RSS':>9}"
    )
    for row in rows:
        runs = row.get("runs", [])
        done = len(runs) == args.runs and not row.get("error")
        later = later_seconds(row) if runs else None
        steady = median([r["seconds"] for r in runs[1:]]) if len(runs) > 1 else None
        worst = max((r["seconds"] for r in runs[1:]), default=None)
        ratio = f"{later / eager_seconds:.2f}" if later and eager_seconds else "-"
        worst_text = f"{worst / steady:.2f}" if worst and steady else "-"
        reserved = peak_reserved(row)
        print(
            f"{card_label(row['card']):<10} {row['mode'].removesuffix('-default'):<16} "
            f"{'yes' if done else 'NO':<5} {chosen_policy(row) if row['mode'] != 'diffusers-eager' else '-':<8} "
            f"{later if later else float('nan'):>10.2f} {ratio:>8} {worst_text:>16} "
            f"{(reserved or 0) / GiB:>12.1f}G {row.get('peak_rss_bytes', 0) / GiB:>8.1f}G"
        )


def run_named(args) -> None:
    modes = []
    for size in (int(s) for s in args.named.split(",")):
        for mode in NAMED[size]:
            if f"{size}:{mode}" in args.skip.split(","):
                continue
            spec = {"mode": mode, "memory_gib": None if size == 139 else size}
            if size == 48 and mode == "ondeck-budget-prefetch":
                spec["png"] = "timeline-48gib.png"
            modes.append(spec)
    run_suite("policies", modes, folder=args.folder, runs=args.runs)


if __name__ == "__main__":
    main()
