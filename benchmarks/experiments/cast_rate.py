"""The reader's rate casting bf16 file bytes to fp8 on the device, against copying them.

    python benchmarks/cast_rate.py [--blocks 8] [--attempts 10]

A safetensors file of ``--blocks`` Wan 2.1 14B-shaped transformer blocks (bf16, random;
eight blocks are 5.3 GiB), in the page cache, read through the reading processes into
device tensors with ``reads.read_into``: no module, no pipelining, the read alone.
The block's matrices are the ones fp8 storage casts; its vectors are kept as they are.

Arms, per ring slot size (the chunk the reading processes hand over; 4 MiB is the
default): bf16 (copies into the destinations), fp8 with the default cast staging (two
halves), fp8 with Python's cyclic garbage collector paused during the read, and bf16
and fp8 read in groups, a block a group, as a pipelined load reads
(``reads.read_in_groups``, each group handed over to a callback that does nothing once
its copies and casts are done). More arms on request: ``--torch-copies`` (bf16 and fp8
with their copies issued through torch, not the CUDA driver: ``ring.DRIVER_COPIES``),
``--staging-mib`` and ``--sections`` (other staging sizes, or the staging in more
parts: ``casting.CAST_SECTIONS``), ``--diagnose`` (fp8 with part of the casting left
out, to time that part), ``--nice``. The arms of one ring shape (slot size,
``--ring-slots`` count) take turns, their order turning each attempt, after a warm-up
read each; a ring shape restarts the reading processes, so each shape's arms run
together. Medians of the file bytes' GB/s, and fp8 ÷ bf16 read the same way within
each shape. Beside each read: the collector's pauses (count and seconds, from
``gc.callbacks``), how often the copying thread came back to a staging half whose casts
were not done yet (the copy stream then waits for them), and the copying thread's busy
share. ``--trace``: three more reads per arm under ``torch.profiler``, the copy engine's
timeline (busy share, rate, gaps, the read's time outside the copies' span);
``--profile``: the copying thread under cProfile. Writes cast_rate.json to $OUT; prints
a table last.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import CollectorClock, warm_page_cache, write_document  # noqa: E402

DIM, FFN = 5120, 13824
MiB = 2**20


def block_shapes(dim: int, ffn: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for attn in ("attn1", "attn2"):
        for part in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[f"{attn}.{part}.weight"] = (dim, dim)
            shapes[f"{attn}.{part}.bias"] = (dim,)
        shapes[f"{attn}.norm_q.weight"] = (dim,)
        shapes[f"{attn}.norm_k.weight"] = (dim,)
    shapes["ffn.net.0.proj.weight"] = (ffn, dim)
    shapes["ffn.net.0.proj.bias"] = (ffn,)
    shapes["ffn.net.2.weight"] = (dim, ffn)
    shapes["ffn.net.2.bias"] = (dim,)
    shapes["norm2.weight"] = (dim,)
    shapes["scale_shift_table"] = (1, 6, dim)
    return shapes


def build_file(path: Path, blocks: int, dim: int, ffn: int) -> Path:
    import torch
    from safetensors.torch import save_file

    if path.exists():
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors = {}
    for index in range(blocks):
        for name, shape in block_shapes(dim, ffn).items():
            tensor = torch.randn(shape, device=device, dtype=torch.bfloat16)
            tensors[f"blocks.{index}.{name}"] = tensor.cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def jobs_for(path: Path, arm: str, device):
    import torch

    from ondeck.loading import ReadJob, read_header

    jobs = []
    for info in read_header(path).tensors.values():
        cast = arm.startswith("fp8") and len(info.shape) == 2
        dtype = torch.float8_e4m3fn if cast else info.dtype
        jobs.append(ReadJob(info, torch.empty(info.shape, dtype=dtype, device=device)))
    return jobs


def by_block(jobs) -> list[list]:
    """The jobs in groups of one block each, in file order."""
    groups: dict[str, list] = {}
    for job in jobs:
        groups.setdefault(job.info.name.split(".")[1], []).append(job)
    return list(groups.values())


class Pauses:
    """Per read (``with pauses:``): the collector's passes (``CollectorClock``), the
    copying thread's returns to a staging half, with how many found its casts not done,
    and the copying thread's CPU seconds against its wall seconds (the thread that feeds
    the reading processes and issues every copy and cast)."""

    def __init__(self):
        from ondeck.loading import casting, process_feed

        self.last: dict = {}
        self.collector = CollectorClock().__enter__()
        self._halves = {"cast_waits": 0, "half_returns": 0}
        self._halves.update(copy_thread_cpu_seconds=0.0, copy_thread_seconds=0.0)
        self._original = casting.DeviceCasts._wait_for_casts
        halves, original = self._halves, self._original

        def wait_for_casts(casts, half):
            halves["half_returns"] += 1
            if not casts.cast[half].query():
                halves["cast_waits"] += 1
            return original(casts, half)

        casting.DeviceCasts._wait_for_casts = wait_for_casts
        self._feed = process_feed.feed_claimed
        feed = self._feed

        def feed_claimed(state, pool):
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return feed(state, pool)
            finally:
                halves["copy_thread_cpu_seconds"] += time.thread_time() - cpu
                halves["copy_thread_seconds"] += time.perf_counter() - wall

        process_feed.feed_claimed = feed_claimed

    def __enter__(self):
        self.collector.take()
        for key in self._halves:
            self._halves[key] = 0
        return self

    def __exit__(self, *exc) -> None:
        self.last = {**self.collector.take(), **self._halves}

    def close(self) -> None:
        from ondeck.loading import casting, process_feed

        self.collector.__exit__()
        casting.DeviceCasts._wait_for_casts = self._original
        process_feed.feed_claimed = self._feed


def arm_settings(arm: str, staging):
    """Set the reader's knobs for ``arm``: the cast staging (bytes, or a pair of
    sections and bytes), copies through the driver or torch, the parts a diagnostic arm
    leaves out. Returns what sets them back."""
    from ondeck.loading import casting, ring

    knobs = ((casting, "CAST_STAGING_BYTES"), (casting, "CAST_SECTIONS"), (ring, "DRIVER_COPIES"))
    saved = {(module, knob): getattr(module, knob) for module, knob in knobs}
    sections, nbytes = staging if isinstance(staging, tuple) else (2, staging)
    casting.CAST_STAGING_BYTES = nbytes or saved[casting, "CAST_STAGING_BYTES"]
    casting.CAST_SECTIONS = sections
    ring.DRIVER_COPIES = not arm.endswith("torch copies")
    undo = diagnose(arm)

    def restore() -> None:
        undo()
        for (module, knob), value in saved.items():
            setattr(module, knob, value)

    return restore


def diagnose(arm: str):
    """For the diagnostic arms (``--diagnose``), leave out their part of the casting;
    returns what puts it back."""
    from ondeck.loading import casting

    casts = casting.DeviceCasts
    if arm.endswith("no cast kernels"):
        name, stand_in = "_issue", staticmethod(lambda pending, half: None)
    elif arm.endswith("copies never wait"):
        name, stand_in = "_wait_for_casts", lambda self, half: None
    else:
        return lambda: None
    original = casts.__dict__[name]
    setattr(casts, name, stand_in)
    return lambda: setattr(casts, name, original)


def renice(niceness: int) -> None:
    """Set the reading processes' niceness (they are started by the first read)."""
    import os

    from ondeck.loading import process_pool

    pool = process_pool._shared
    for process in pool._processes if pool is not None else ():
        try:
            os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
        except OSError:
            pass


def profile_feed(path: Path, device, arms=("bf16", "fp8")) -> dict[str, list[dict]]:
    """One read per arm with the copying thread (``process_feed.feed_claimed``) under
    cProfile: its functions by own seconds, the largest first. (Calls through the driver
    are ctypes calls: cProfile does not see them apart from their caller.)"""
    import cProfile

    import torch

    from ondeck.loading import process_feed, reads

    original = process_feed.feed_claimed
    profiles = {}
    for arm in arms:
        profiler = cProfile.Profile()

        def feed_claimed(state, pool, profiler=profiler):
            return profiler.runcall(original, state, pool)

        process_feed.feed_claimed = feed_claimed
        try:
            jobs = jobs_for(path, arm, device)
            reads.read_into(jobs, component="blocks", progress=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            process_feed.feed_claimed = original
        profiler.create_stats()
        stats = profiler.stats  # empty when the read ran on threads, not the processes
        rows = [
            {
                "function": f"{Path(file).name}:{line}({name})" if line else name,
                "calls": calls,
                "own_seconds": own,
                "seconds": total,
            }
            for (file, line, name), (_, calls, own, total, _) in stats.items()
        ]
        profiles[arm] = sorted(rows, key=lambda row: row["own_seconds"], reverse=True)[:40]
        del jobs
    return profiles


def trace_reads(path: Path, device, arms: dict, count: int = 3) -> dict[str, dict]:
    """``count`` reads per arm (after the timed ones, arms in turn) under
    ``torch.profiler`` tracing the device alone: the copy engine's timeline
    (``cast_trace.timeline``) and the read's milliseconds outside the copies' span.
    Medians."""
    import json
    import tempfile

    import torch
    from cast_trace import timeline
    from torch.profiler import ProfilerActivity, profile

    from ondeck.loading import reads

    seen: dict[str, list[dict]] = {}
    for _ in range(count):
        for arm, staging in arms.items():
            if arm.endswith(("in groups", "niced", "collector paused")):
                continue
            restore = arm_settings(arm, staging)
            jobs = jobs_for(path, arm, device)
            torch.cuda.synchronize()
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as traced:
                    started = time.perf_counter()
                    reads.read_into(jobs, component="blocks", progress=False)
                    torch.cuda.synchronize()
                    read_ms = (time.perf_counter() - started) * 1e3
            finally:
                restore()
            with tempfile.TemporaryDirectory() as scratch:
                trace_path = Path(scratch) / "trace.json"
                traced.export_chrome_trace(str(trace_path))
                figures = timeline(json.loads(trace_path.read_text()))
            figures.update(read_ms=read_ms, outside_ms=read_ms - figures["span_ms"])
            seen.setdefault(arm, []).append(figures)
            del jobs
    keys = ("read_ms", "span_ms", "outside_ms", "busy_fraction", "gb_per_s_busy", "tail_us")
    keys += ("gaps_over_50us", "kernel_busy_ms")
    return {
        arm: {"reads": done, **{key: statistics.median(r[key] for r in done) for key in keys}}
        for arm, done in seen.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--file", default="/tmp/cast-rate/blocks.safetensors")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--attempts", type=int, default=10)
    parser.add_argument("--slots-mib", default="4", help="ring slot sizes to try, e.g. 4,16")
    parser.add_argument(
        "--ring-slots",
        default="",
        help="ring slot counts to try (default: the reader's), e.g. 24,48",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU check: small tensors")
    parser.add_argument(
        "--torch-copies",
        action="store_true",
        help="also bf16 and fp8 arms whose copies go through torch (ring.DRIVER_COPIES "
        "off), not through the CUDA driver",
    )
    parser.add_argument(
        "--staging-mib",
        default="",
        help="more fp8 arms with these cast staging sizes (casting.CAST_STAGING_BYTES), e.g. 64,128",
    )
    parser.add_argument(
        "--sections",
        default="",
        help="more fp8 arms with the cast staging in this many sections of this many MiB "
        "(casting.CAST_SECTIONS), e.g. 4x8,4x16",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also fp8 arms that leave out part of the casting (their bytes are wrong, "
        "their time tells what that part costs): no cast kernels (nothing issued out of "
        "a full half), and copies that never wait for a half's casts",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="after the timed reads, one read per arm under torch.profiler tracing the "
        "device alone: the copy engine's busy share and idle gaps",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="also bf16 and fp8 arms with the reading processes at this niceness, so the "
        "copying thread wins a busy core (needs the right to lower it again: root)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed reads, one read of bf16 and one of fp8 with the copying "
        "thread under cProfile: its functions by own time (the profiler slows Python "
        "calls, so compare the arms' shares, not the seconds with the timed reads')",
    )
    args = parser.parse_args()

    import torch

    from ondeck.loading import casting, reads

    dim, ffn = (64, 160) if args.tiny else (DIM, FFN)
    path = build_file(Path(args.file), args.blocks, dim, ffn)
    warm_page_cache([str(path)])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nbytes = path.stat().st_size
    default_staging = casting.CAST_STAGING_BYTES
    arms = {
        "bf16": None,
        "fp8": default_staging,
        "fp8, collector paused": default_staging,
        "bf16, in groups": None,
        "fp8, in groups": default_staging,
    }
    if args.torch_copies:
        arms["bf16, torch copies"] = None
        arms["fp8, torch copies"] = default_staging
    for mib in (int(m) for m in args.staging_mib.split(",") if m):
        arms[f"fp8, {mib} MiB staging"] = mib * MiB
    if args.diagnose:
        arms["fp8, no cast kernels"] = default_staging
        arms["fp8, copies never wait"] = default_staging
    for form in (f for f in args.sections.split(",") if f):
        count, mib = (int(n) for n in form.split("x"))
        arms[f"fp8, {count} sections of {mib} MiB"] = (count, count * mib * MiB)
    if args.nice:
        arms["bf16, processes niced"] = None
        arms["fp8, processes niced"] = default_staging
    pauses = Pauses()
    rows: dict[str, dict] = {}
    rings = [int(r) for r in args.ring_slots.split(",") if r] or [None]
    shapes = [(int(s), slots) for s in args.slots_mib.split(",") for slots in rings]
    for slot_mib, slots in shapes:
        shape = f"{slot_mib} MiB slots" if slots is None else f"{slot_mib} MiB x {slots} slots"
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        seen: dict[str, list[dict]] = {arm: [] for arm in arms}
        for attempt in range(1 + args.attempts):  # the first of each arm warms it
            names = list(arms)
            for turn in range(len(names)):
                arm = names[(attempt + turn) % len(names)]
                restore = arm_settings(arm, arms[arm])
                paused = arm.endswith("collector paused") and gc.isenabled()
                renice(args.nice if arm.endswith("niced") else 0)
                try:
                    jobs = jobs_for(path, arm, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    with pauses:
                        if paused:
                            gc.disable()
                        started = time.perf_counter()
                        options = dict(buffer_bytes=slot_mib * MiB, progress=False)
                        options.update(buffer_count=slots)
                        if arm.endswith("in groups"):
                            stats = reads.read_in_groups(
                                by_block(jobs), lambda index: None, component="blocks", **options
                            )
                        else:
                            stats = reads.read_into(jobs, component="blocks", **options)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        elapsed = time.perf_counter() - started
                finally:
                    if paused:
                        gc.enable()
                    restore()
                if attempt:
                    seconds[arm].append(elapsed)
                    seen[arm].append(pauses.last)
                del jobs
            print(f"{shape}, attempt {attempt}: {stats.readers}", flush=True)
        for arm, values in seconds.items():
            median = statistics.median(values)
            rows[f"{arm}, {shape}"] = {
                "shape": shape,
                "seconds": values,
                "gb_per_second": nbytes / median / 1e9,
                "slot_mib": slot_mib,
                "arm": arm,
                "per_read": seen[arm],
            }
    pauses.close()
    traces = trace_reads(path, device, arms) if args.trace else {}
    profiles = profile_feed(path, device) if args.profile else {}
    fields = {"file_bytes": nbytes, "rows": rows, "profiles": profiles, "traces": traces}
    write_document("cast_rate", fields)
    if traces:
        print("\ntraced reads (medians of three per arm): the copy engine over the copies' span")
        print(
            f"{'arm':<36} {'read ms':>8} {'span ms':>8} {'outside':>8} {'busy':>6} "
            f"{'GB/s busy':>9} {'gaps>50us':>9} {'kernel ms':>9} {'tail us':>8}"
        )
        for arm, row in traces.items():
            print(
                f"{arm:<36} {row['read_ms']:8.1f} {row['span_ms']:8.1f} {row['outside_ms']:8.2f} "
                f"{row['busy_fraction']:6.3f} {row['gb_per_s_busy']:9.1f} "
                f"{row['gaps_over_50us']:9.0f} {row['kernel_busy_ms']:9.1f} {row['tail_us']:8.0f}"
            )
    for arm, top in profiles.items():
        print(f"\nthe copying thread under cProfile, {arm}: own seconds, calls, function")
        for row in top[:14]:
            print(f"  {row['own_seconds']:8.4f} {row['calls']:>8} {row['function']}")
    print(f"\n{nbytes / 2**30:.2f} GiB file, medians of {args.attempts} reads per arm")
    print(
        f"{'arm':<36} {'GB/s':>6} {'/ bf16':>7} {'gc':>6} {'gc ms':>9} {'waits/halves':<13} "
        f"{'min ms':>6} {'max ms':>6} {'busy':>5}  (medians per read; busy: the copying "
        "thread's CPU seconds / its seconds)"
    )
    for name, row in rows.items():
        bf16 = "bf16, in groups" if row["arm"].endswith("in groups") else "bf16"
        base = rows[f"{bf16}, {row['shape']}"]["gb_per_second"]
        reads = row["per_read"]
        collections = statistics.median(r["collections"] for r in reads)
        paused_ms = statistics.median(r["collector_seconds"] for r in reads) * 1e3
        waits = statistics.median(r["cast_waits"] for r in reads)
        halves = statistics.median(r["half_returns"] for r in reads)
        shares = [
            r["copy_thread_cpu_seconds"] / r["copy_thread_seconds"]
            for r in reads
            if r["copy_thread_seconds"]
        ]
        busy = statistics.median(shares) if shares else float("nan")  # threads: no feed
        print(
            f"{name:<36} {row['gb_per_second']:>6.1f} {row['gb_per_second'] / base:>7.3f} "
            f"{collections:>6.0f} {paused_ms:>9.2f} {waits:>6.0f}/{halves:<6.0f} "
            f"{min(row['seconds']) * 1e3:>6.1f} {max(row['seconds']) * 1e3:>6.1f} {busy:>5.2f}"
        )


if __name__ == "__main__":
    main()
