"""Where a run on a small card spends its time over eager: one run's device timeline, by stage.

    python benchmarks/experiments/run_trace.py [--family sd35] [--memory-gib 8] [--runs 4]

A family's folder (``families.py``'s builders) through ``ondeck.diffusers.from_pretrained``
with no policy argument, on an emulated card, after a throwaway process has warmed the
device's libraries. The last of ``--runs`` runs is traced: ``torch.profiler`` recording
the device alone (no host operations, so the run's own threads run as untraced), and
every thread's Python stack sampled every 2 ms with its time. A spin kernel launched
right after a synchronisation ties the trace's clock to the host's, so the tracker's
stage and load events fall on the device timeline.

Per stage (the tracker's ``stage_start`` to ``stage_end``): its seconds, the compute
stream's busy seconds, the host-to-device copies' busy seconds, and the compute stream's
idle seconds split by whether copies ran meanwhile (waiting for the bus) or not (waiting
for the host). The longest idle gaps without copies are listed with what the main
thread's stack was while they lasted. Writes run_trace.json to $OUT and prints a table.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import StackSampler, emit, out_dir, run_child, warm_libraries  # noqa: E402
from families import CALLS, PROMPTS, family_steps, ready_family_folder  # noqa: E402

GiB = 1 << 30
GAP_US = 300


def child(args) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * GiB / total))
    import ondeck.diffusers

    pipe = ondeck.diffusers.from_pretrained(
        args.folder, torch_dtype=torch.bfloat16, device="cuda", progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    _, call, _ = CALLS[args.family]
    result: dict = {"runs": []}
    trace_path = Path(tempfile.mkdtemp()) / "trace.json"
    for run in range(args.runs):
        entry = traced_run(
            pipe,
            lambda run=run: pipe(
                PROMPTS[run % len(PROMPTS)],
                num_inference_steps=args.steps,
                generator=torch.Generator("cpu").manual_seed(run),
                output_type="np",
                **call,
            ),
            run + 1,
            trace_path if run == args.runs - 1 else None,
        )
        entry.pop("output")
        result["runs"].append(entry)
        print(f"run {run + 1}: {entry['seconds']:.2f}s", file=sys.stderr, flush=True)
    result["plan_after"] = str(pipe.ondeck.plan())
    result["trace"] = str(trace_path)
    emit(result)


def traced_run(pipe, call, run: int, trace_path: Path | None) -> dict:
    """``call()`` (the pipeline's ``run``-th call), timed from a synchronised device: its
    seconds and the tracker's events of that run, in seconds from its start. With
    ``trace_path``, the device's timeline goes there too (a chrome trace, beginning with
    a spin kernel at the run's start) and the threads' stacks into the entry."""
    import torch

    tracker = pipe.ondeck.tracker
    profiler = stacks = None
    if trace_path is not None:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        profiler.__enter__()
        stacks = StackSampler(interval=0.002, timed=True).__enter__()
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(1000)  # the spin kernel: its start is ``started`` on the device
    output = call()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    events = [
        [
            round(e.seconds + tracker.started_at - started, 5),
            e.kind,
            e.name,
            e.nbytes,
            e.duration_seconds,
        ]
        for e in tracker.events
        if e.run == run
    ]
    entry = {"seconds": seconds, "events": events, "output": output}
    if trace_path is not None:
        stacks.__exit__(None, None, None)
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(trace_path))
        entry["stacks"] = [
            (round(t - started, 5), name, chain) for t, name, chain in stacks.samples
        ]
    return entry


def union_seconds(spans: list[tuple[float, float]], begin: float, end: float) -> float:
    """Seconds of [begin, end] covered by the sorted ``spans``."""
    covered, reach = 0.0, begin
    starts = [s[0] for s in spans]
    index = max(0, bisect.bisect_left(starts, begin) - 256)
    for lo, hi in spans[index:]:
        if lo >= end:
            break
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


KERNEL_KINDS = (
    ("upcast", ("widen",)),
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("conversion", ("copy_kernel", "direct_copy")),
)


def kernel_kind(name: str) -> str:
    """What a kernel does, by its name: ``KERNEL_KINDS``' first match, else "other"."""
    lowered = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def analyse(trace: dict, run: dict) -> dict:
    """The figures the module's docstring lists (trace times in microseconds, turned into
    seconds from the run's start)."""
    device = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    spin = [e for e in device if e.get("cat") == "kernel" and "spin" in e["name"].lower()]
    origin = spin[0]["ts"] if spin else min(e["ts"] for e in device)
    kernels, copies, streams = [], [], Counter()
    for e in device:
        span = ((e["ts"] - origin) / 1e6, (e["ts"] + e["dur"] - origin) / 1e6)
        if e["cat"] == "kernel" and "spin" not in e["name"].lower():
            stream = e.get("args", {}).get("stream")
            kernels.append((*span, stream, kernel_kind(e["name"])))
            streams[stream] += e["dur"]
        elif e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]:
            copies.append((*span, e.get("args", {}).get("bytes", 0)))
    compute = streams.most_common(1)[0][0] if streams else None
    lane = sorted((k for k in kernels if k[2] == compute), key=lambda k: k[0])
    busy = []  # the compute stream's busy spans, merged
    for lo, hi, _, _ in lane:
        if busy and lo <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], hi))
        else:
            busy.append((lo, hi))
    copy_spans = sorted((lo, hi) for lo, hi, _ in copies)
    stages, opened = [], {}
    for at, kind, name, _, _ in run["events"]:
        if kind == "stage_start":
            opened[name] = at
        elif kind == "stage_end" and name in opened:
            stages.append((opened.pop(name), at, name))
    main_stacks = [
        (t, chain) for t, thread, chain in run.get("stacks", []) if thread == "MainThread"
    ]
    stack_times = [t for t, _ in main_stacks]
    rows, gaps = [], []
    for begin, end, name in stages:
        gpu = union_seconds(busy, begin, end)
        bus = union_seconds(copy_spans, begin, end)
        idle_bus = idle_host = 0.0
        edges = [(begin, begin)] + [s for s in busy if s[1] > begin and s[0] < end] + [(end, end)]
        for (_, previous_end), (next_start, _) in zip(edges, edges[1:], strict=False):
            lo, hi = max(previous_end, begin), min(next_start, end)
            if hi - lo <= 0:
                continue
            copying = union_seconds(copy_spans, lo, hi)
            idle_bus += copying
            idle_host += hi - lo - copying
            if hi - lo - copying > GAP_US / 1e6:
                first = bisect.bisect_left(stack_times, lo)
                last = bisect.bisect_right(stack_times, hi)
                seen = Counter(chain for _, chain in main_stacks[first:last])
                gaps.append(
                    {
                        "stage": name,
                        "at_s": round(lo, 4),
                        "ms": round((hi - lo) * 1000, 2),
                        "bus_ms": round(copying * 1000, 2),
                        "main_thread": [f"{n}x {c}" for c, n in seen.most_common(3)],
                    }
                )
        kinds: Counter = Counter()
        counts: Counter = Counter()
        for lo, hi, _, kind in lane:
            if begin <= lo < end:
                kinds[kind] += min(hi, end) - lo
                counts[kind] += 1
        rows.append(
            {
                "kinds": {k: round(v, 4) for k, v in sorted(kinds.items())},
                "kernels": dict(sorted(counts.items())),
                "stage": name,
                "start_s": round(begin, 4),
                "seconds": round(end - begin, 4),
                "gpu_busy_s": round(gpu, 4),
                "copy_busy_s": round(bus, 4),
                "idle_copying_s": round(idle_bus, 4),
                "idle_no_copy_s": round(idle_host, 4),
            }
        )
    copied = sum(c[2] for c in copies)
    copy_busy = union_seconds(copy_spans, -1.0, 1e9)
    return {
        "stages": rows,
        "gaps": sorted(gaps, key=lambda g: -g["ms"])[:40],
        "copies": {
            "bytes": copied,
            "busy_s": round(copy_busy, 4),
            "rate_gbps": round(copied / copy_busy / 1e9, 2) if copy_busy else None,
        },
        "gpu_busy_s": round(union_seconds(busy, -1.0, 1e9), 4),
        "last_kernel_s": round(max((k[1] for k in kernels), default=0.0), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["sd35", "hunyuan"], default="sd35")
    parser.add_argument("--folder")
    parser.add_argument("--memory-gib", type=float, default=8)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = family_steps(args.family)
    if args.child:
        child(args)
        return
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    folder = ready_family_folder(args.family, args.folder)
    warm_libraries()
    command = [__file__, "--child", "--family", args.family, "--folder", str(folder)]
    command += ["--runs", str(args.runs), "--steps", str(args.steps)]
    command += ["--memory-gib", str(args.memory_gib)]
    result = run_child(command, timeout=600)
    if "runs" not in result:
        print(json.dumps(result, indent=2)[-4000:])
        sys.exit(1)
    traced = result["runs"][-1]
    summary = analyse(json.loads(Path(result.pop("trace")).read_text()), traced)
    result["trace_summary"] = summary
    result["command"] = "python benchmarks/experiments/run_trace.py " + " ".join(sys.argv[1:])
    result["date"] = time.strftime("%Y-%m-%d")
    (out_dir() / "run_trace.json").write_text(json.dumps(result, indent=2, default=str))
    print(result["plan_after"])
    print("\nruns:", ", ".join(f"{r['seconds']:.2f}" for r in result["runs"]))
    print(
        f"copies: {summary['copies']}; device busy {summary['gpu_busy_s']} s, "
        f"last kernel ends at {summary['last_kernel_s']} s"
    )
    print(
        f"{'stage':16s} {'start':>7s} {'s':>7s} {'gpu':>7s} {'copy':>7s} {'idle+bus':>8s} "
        f"{'idle':>7s}"
    )
    for row in summary["stages"]:
        print(
            f"{row['stage']:16s} {row['start_s']:7.3f} {row['seconds']:7.3f} "
            f"{row['gpu_busy_s']:7.3f} {row['copy_busy_s']:7.3f} {row['idle_copying_s']:8.3f} "
            f"{row['idle_no_copy_s']:7.3f}  "
            + " ".join(f"{kind} {sec:.3f}" for kind, sec in row["kinds"].items())
        )
    for gap in summary["gaps"][:15]:
        print(
            f"  {gap['stage']:14s} at {gap['at_s']:.3f}s {gap['ms']:6.2f} ms idle "
            f"({gap['bus_ms']:.2f} ms copying): {gap['main_thread'][:2]}"
        )


if __name__ == "__main__":
    main()
