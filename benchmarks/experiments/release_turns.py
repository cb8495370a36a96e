"""Where a ``release`` call's time goes beside eager's, call by call, on the device.

    python benchmarks/experiments/release_turns.py [--family sd35|hunyuan] [--runs 4]

The SD3.5 Large-shaped (or HunyuanVideo-shaped) folder of ``benchmarks/families.py``,
diffusers eager on the full card and ``ondeck.diffusers.from_pretrained(policy="release")``,
each in its own process, three prompts and more. Every component call is bracketed with
CUDA events and the host clock: per run, each call's device seconds, its host seconds, and
the device's idle time between one call's end and the next one's start. The last run of
each mode is traced with ``torch.profiler`` (host and device): the trace is written to
$OUT, and its summary gives the kernels' and the copies' busy seconds, the compute's idle
gaps over 1 ms with the host calls open during them, and the host's slowest
CUDA API calls (``--trace``). ``--modes`` adds variants of ``release`` to compare (see
``apply_variant``). Writes release_turns.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit, out_dir, run_child, union_of, write_document  # noqa: E402
from families import (  # noqa: E402
    CALLS,
    PROMPTS,
    eager_pipeline,
    family_steps,
    load_events,
    ready_family_folder,
)

GAP_US = 1000


class Calls:
    """Each call of the wrapped methods: name, host start/end, device start/end events."""

    def __init__(self) -> None:
        self.rows: list = []

    def wrap(self, owner, method: str, name: str) -> None:
        """Time every call of ``owner.method``; ``owner`` a class, so that ondeck's proxies,
        which pass attribute reads on to the module they load, call the same wrapper."""
        import torch

        original = getattr(owner, method)

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            start.record()
            try:
                return original(*args, **kwargs)
            finally:
                end.record()
                self.rows.append((name, host, time.perf_counter(), start, end))

        setattr(owner, method, timed)

    def take(self, run_start, run_host: float) -> list[list]:
        """[name, host start, host seconds, device start, device seconds] per call, times
        from the run's start."""
        out = []
        for name, host, host_end, start, end in self.rows:
            out.append(
                [
                    name,
                    round(host - run_host, 4),
                    round(host_end - host, 4),
                    round(run_start.elapsed_time(start) / 1000, 4),
                    round(start.elapsed_time(end) / 1000, 4),
                ]
            )
        self.rows.clear()
        return out


def summarise(trace: dict) -> dict:
    """Busy seconds of kernels and copies, idle gaps with the host calls open in them."""
    kernels, copies, api = [], [], []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        category = event.get("cat", "")
        if category == "kernel":
            kernels.append(span)
        elif category == "gpu_memcpy":
            copies.append(span)
        elif category == "cuda_runtime" or category == "cuda_driver":
            api.append((span, event.get("name", "")))
    busy = union_of(kernels)  # the device computing; copies run beside it
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False) if b[0] - a[1] > GAP_US]
    copying = union_of(copies)
    copy_in_gaps = sum(
        max(0.0, min(b, end) - max(a, start)) for start, end in gaps for a, b in copying
    )
    in_gaps: Counter = Counter()
    for start, end in gaps:
        for (a, b), name in api:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                in_gaps[name] += overlap / 1e6
    slow: Counter = Counter()
    for (a, b), name in api:
        slow[name] += (b - a) / 1e6
    return {
        "kernel_busy_s": sum(b - a for a, b in union_of(kernels)) / 1e6,
        "copy_busy_s": sum(b - a for a, b in union_of(copies)) / 1e6,
        "span_s": (busy[-1][1] - busy[0][0]) / 1e6 if busy else 0,
        "idle_gaps": len(gaps),
        "idle_s": sum(b - a for a, b in gaps) / 1e6,
        "copying_while_idle_s": copy_in_gaps / 1e6,
        "longest_gaps": sorted(
            [[round((a - busy[0][0]) / 1e6, 4), round((b - a) / 1e6, 4)] for a, b in gaps],
            key=lambda g: -g[1],
        )[:12],
        "api_in_gaps_s": {k: round(v, 4) for k, v in in_gaps.most_common(10)},
        "api_total_s": {k: round(v, 4) for k, v in slow.most_common(10)},
    }


class Spans:
    """Host seconds of named library functions, by thread: (name, thread, start, seconds)."""

    def __init__(self) -> None:
        self.rows: list = []

    def wrap(self, owner, method: str, label: str) -> None:
        import threading

        original = getattr(owner, method)

        def spanned(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                who = getattr(args[0], "name", None) if args else None
                if who is None and args:
                    try:
                        who = object.__getattribute__(args[0], "_ondeck_name")
                    except AttributeError:
                        who = None
                self.rows.append(
                    (f"{label} {who}", threading.current_thread().name, started,
                     time.perf_counter() - started)
                )  # fmt: skip

        setattr(owner, method, spanned)

    def take(self, run_host: float) -> list[list]:
        out = [[n, t, round(s - run_host, 4), round(d, 4)] for n, t, s, d in self.rows]
        self.rows.clear()
        return out


def apply_variant(variant: str) -> None:
    """The variants compared: ``no-spare`` builds a pipelined load's skeleton when it
    starts instead of on the filling's thread after the last load; ``largest-first``
    starts the next run's largest component first, then the rest in turn order;
    ``own-stream`` loads the next run's components with a stream of their own current
    (their memory from that stream's pool, their copies fenced on it, not on the
    computing stream's queued decode), each tensor then marked used on the computing
    stream so that the allocator reuses none of it before that stream is past it."""
    from ondeck.executor import Executor
    from ondeck.loading.components import ComponentLoader

    if "own-stream" in variant:
        import threading

        import torch

        from ondeck.lazy import LazyModule

        materialize = LazyModule.materialize
        streams: dict = {}

        def on_own_stream(self, *, complete: bool = True):
            if threading.current_thread().name != "ondeck-next-run":
                return materialize(self, complete=complete)
            device = torch.cuda.current_device()
            computing = torch.cuda.default_stream(device)
            own = streams.setdefault(device, torch.cuda.Stream(device))
            with torch.cuda.stream(own):
                module = materialize(self, complete=complete)
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.device.type == "cuda":
                    tensor.record_stream(computing)
            return module

        LazyModule.materialize = on_own_stream

    if "no-spare" in variant:
        ComponentLoader._prepare_spare = lambda self, template: None
    if "largest-first" in variant:
        original = Executor._start_next_run

        def largest_first(self, names, after=()):
            if names:
                deferred = self.pipeline.deferred
                big = max(names, key=lambda n: deferred[n].spec.nbytes or 0)
                names = (big, *(n for n in names if n != big))
            return original(self, names, after)

        Executor._start_next_run = largest_first


def child(args) -> None:
    import torch

    import ondeck.diffusers
    from ondeck.lazy import LazyModule
    from ondeck.loading.components import ComponentLoader

    spans = Spans()
    if args.child != "eager":
        apply_variant(args.child)
        spans.wrap(LazyModule, "release", "release")
        spans.wrap(ComponentLoader, "begin", "begin")
        spans.wrap(ComponentLoader, "_prepare_spare", "spare")
        spans.wrap(ComponentLoader, "_take_skeleton", "skeleton")

    _, call, output = CALLS[args.family]
    if args.child == "eager":
        pipe = eager_pipeline(args.family, args.folder)
    else:
        pipe = ondeck.diffusers.from_pretrained(
            args.folder,
            torch_dtype=torch.bfloat16,
            device="cuda",
            progress=False,
            policy="release",
        )
    pipe.set_progress_bar_config(disable=True)
    calls = Calls()
    index = json.loads((Path(args.folder) / "model_index.json").read_text())
    for name, entry in index.items():
        if not isinstance(entry, list) or entry[0] is None:
            continue
        if name.startswith(("text_encoder", "transformer", "vae")):
            cls = getattr(importlib.import_module(entry[0]), entry[1])
            method = "decode" if name == "vae" else "forward"
            if getattr(getattr(cls, method), "timed", False):
                continue  # two components of one class (CLIP-L, CLIP-G) share a timer
            calls.wrap(cls, method, entry[1])
            getattr(cls, method).timed = True
    result: dict = {"mode": args.child, "runs": []}
    steps = family_steps(args.family)
    for run in range(args.runs):
        traced = run == args.runs - 1 and args.trace
        profiler = None
        if traced:
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            profiler.__enter__()
        torch.cuda.synchronize()
        run_start = torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        run_start.record()
        getattr(
            pipe(
                PROMPTS[run % len(PROMPTS)],
                num_inference_steps=steps,
                generator=torch.Generator("cpu").manual_seed(run),
                output_type="np",
                **call,
            ),
            output,
        )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - host
        row = {
            "seconds": seconds,
            "peak_reserved": torch.cuda.max_memory_reserved(),  # the process's so far
            "traced": traced,
            "calls": calls.take(run_start, host),
            "spans": spans.take(host),
        }
        if profiler is not None:
            profiler.__exit__(None, None, None)
            path = out_dir() / f"trace-{args.family}-{args.child}.json"
            profiler.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            row["summary"] = summarise(trace)
            with gzip.open(str(path) + ".gz", "wt") as packed:
                json.dump(trace, packed)
            path.unlink()
        if hasattr(pipe, "ondeck"):
            row["events"] = load_events(pipe.ondeck.tracker, run + 1)
        result["runs"].append(row)
        print(f"{args.child} run {run + 1}: {seconds:.2f}s", file=sys.stderr, flush=True)
    emit(result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["sd35", "hunyuan"], default="sd35")
    parser.add_argument("--folder")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument(
        "--modes", default="eager,release", help="eager, release, release-no-spare, ..."
    )
    parser.add_argument("--trace", action="store_true", help="trace each mode's last run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.folder = args.folder or f"/tmp/{args.family}"
    if args.child:
        child(args)
        return
    path = ready_family_folder(args.family, args.folder)
    rows = []
    for mode in args.modes.split(","):
        command = [__file__, "--family", args.family, "--folder", str(path)]
        command += ["--runs", str(args.runs), "--child", mode] + (["--trace"] if args.trace else [])
        row = run_child(command, timeout=300)
        rows.append(row)
        write_document("release_turns", {"family": args.family, "rows": rows})
        if row.get("error"):
            print(mode, row["error"], row.get("tail", "")[-2000:])
    eager = next((r for r in rows if r.get("mode") == "eager" and r.get("runs")), None)
    eager_later = median_later(eager) if eager else None
    print(f"\n{'mode':<32} {'run':>3} {'s':>6}  per component: calls, device s, host s")
    for row in rows:
        for number, run in enumerate(row.get("runs", []), 1):
            per: dict = {}
            for name, _, host_s, _, device_s in run["calls"]:
                n, d, h = per.get(name, (0, 0.0, 0.0))
                per[name] = (n + 1, d + device_s, h + host_s)
            parts = "  ".join(f"{k[:12]} {n} {d:.3f} {h:.3f}" for k, (n, d, h) in per.items())
            print(f"{row['mode']:<32} {number:>3} {run['seconds']:6.2f}  {parts}")
        last = (row.get("runs") or [{}])[-1]
        if "summary" in last:
            print(f"  traced: {json.dumps(last['summary'])[:1500]}")
    print(f"\n{'mode':<32} {'runs 2+ (median s)':>18} {'/ eager':>8} {'peak reserved':>14}")
    for row in rows:
        later = median_later(row)
        ratio = f"{later / eager_later:.3f}" if later and eager_later else "-"
        peak = max((r.get("peak_reserved") or 0 for r in row.get("runs") or []), default=0)
        print(
            f"{row.get('mode', '?'):<32} {later or float('nan'):>18.3f} {ratio:>8} "
            f"{peak / 2**30:>10.2f} GiB"
        )


def median_later(row: dict) -> float | None:
    seconds = sorted(r["seconds"] for r in (row.get("runs") or [])[1:] if not r.get("traced"))
    return seconds[len(seconds) // 2] if seconds else None


if __name__ == "__main__":
    main()
