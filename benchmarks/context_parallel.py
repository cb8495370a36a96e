"""Wan 2.1 14B-shaped pipeline on one GPU against context parallelism over two.

    python benchmarks/context_parallel.py [--folder .bench-data/wan14b] [--steps 4]
        [--runs 3] [--gpus 2] [--variants single,context,context-noshard,context-auto]

Builds the 14B-shaped folder once (random weights, real shapes and bytes), reads it into
the page cache, then runs in the same call, each in fresh processes, in bf16 at 480x832,
33 frames, one prompt per run (three prompts):

- ``single``: one process, one GPU;
- ``context``: ``torchrun --nproc-per-node 2``, ``parallel=2`` (diffusers' Ulysses
  context parallelism) with the transformer and the text encoder split by FSDP2, as
  ``ondeck generate MODEL --context-parallel 2 --shard transformer,text_encoder`` runs;
- ``context-noshard``: the same without FSDP2, each rank holding the whole transformer
  and text encoder: the sequence split's cost without the sharding's;
- ``context-auto``: ``context`` under the policy ``ondeck generate`` picks with no
  ``--policy`` (``auto``): where every rank's shares fit its card, nothing reloads
  between runs. ``single`` stays under ``release``, the reference the targets name.
- ``single-cache`` and ``context-cache``: ``single`` and ``context`` with a host cache of
  40 GiB per process (``--host-cache 40GiB``): each process keeps what it read (one
  rank's shares only, under ``context``) in pinned host memory, and later runs reload
  from there instead of the page cache.

Every process runs with ``ONDECK_RESET_PEAKS=1``, as ``ondeck generate`` does. Every
rank times a run over the same span: from a barrier before ``generate`` to a
barrier after it (``seconds``), so the ranks' figures compare; ``own_seconds`` is until
its own ``generate`` returned, the rest its wait for the other ranks. Rank 0 saves its
frames after the closing barrier, outside every rank's span (``save_seconds``).

Per rank and run: wall time, peak device bytes allocated (``torch.cuda.max_memory_
allocated``, reset before each run), each stage's seconds and exposed load seconds (the
tracker's stages; on CUDA the stream is synchronised as each stage ends, so a stage's
seconds hold its own device work), the tracker's load events (name, bytes, seconds),
and the time spent in collectives per stage: diffusers' Ulysses all-to-all, the gather
of the transformer's output, and FSDP2's unshard (its all-gathers as far as the compute
stream waits for them); on CUDA timed with events on the compute stream, so a figure
includes waiting for the other rank to arrive. Per variant, bytes read from the
safetensors files per rank; per context variant and prompt, the largest and mean
absolute difference between its frames and ``single``'s against the tolerance the
README states (``ondeck.parallel.BF16_FRAME_TOLERANCE``). Writes
``$OUT/context_parallel.json`` after every variant and prints, last, a short table and
a per-stage table per variant and rank (run 2).

``--device cpu --folder SMALL_WAN_FOLDER --height 32 --width 32 --frames 5`` runs the
same flow over gloo on a small folder (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Before anything starts NCCL, here and in every process launched from here.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# As `ondeck generate` runs: every stage's activation peak is measured (stages below an
# earlier peak too), which `release` needs to load the next run's text encoder during
# the decode. Without it the decode is never measured and nothing loads ahead.
os.environ.setdefault("ONDECK_RESET_PEAKS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB,
    count_reads,
    emit,
    folder_bytes,
    out_dir,
    parse_modes,
    ready_wan14b_folder,
    run_variant,
)

HERE = Path(__file__).resolve()
PROMPTS = [
    "a red fox trotting through fresh snow at dawn",
    "a grey heron standing in a misty river",
    "a paper boat drifting down a rainy street",
]
# Targets, checked in the table: runs 2-3 time and per-rank peak, each
# against the single GPU measured in the same call.
TIME_TARGET = 0.60
PEAK_TARGET = 0.60
# Enough for one process's weights: the whole pipeline (37.7 GiB) on one GPU, one
# rank's shares (19.1 GiB) under context parallelism.
HOST_CACHE_GIB = 40

# name: (context parallel, split by FSDP2 (None: --shard as given), policy).
# name: (context parallel, components split by FSDP2 (None: --shard), policy, GiB of
# host cache per process)
VARIANTS = {
    "single": (False, (), "release", 0),
    "context": (True, None, "release", 0),
    "context-noshard": (True, (), "release", 0),
    "context-auto": (True, None, "auto", 0),
    "single-cache": (False, (), "release", HOST_CACHE_GIB),
    "context-cache": (True, None, "release", HOST_CACHE_GIB),
}
LABELS = {
    "single": "single (1 GPU)",
    "context": "context, FSDP2",
    "context-noshard": "context, no FSDP2",
    "context-auto": "context, FSDP2, auto",
    "single-cache": "single, host cache",
    "context-cache": "context, host cache",
}
# Where the time in collectives is taken, as (module, class or None, function, kind):
# diffusers' Ulysses all-to-all and the gather of the transformer's output, FSDP2's
# unshard. A name a version lacks is left out (the result lists what was wrapped).
COLLECTIVES = [
    ("diffusers.models.attention_dispatch", None, "_all_to_all_single", "all_to_all"),
    ("diffusers.hooks.context_parallel", "EquipartitionSharder", "unshard", "cp_gather"),
    (
        "diffusers.hooks.context_parallel",
        "PartitionAnythingSharder",
        "unshard_anything",
        "cp_gather",
    ),
    (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "FSDPParamGroup",
        "unshard",
        "fsdp_unshard",
    ),
    (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "FSDPParamGroup",
        "wait_for_unshard",
        "fsdp_unshard",
    ),
]
KINDS = ("all_to_all", "cp_gather", "fsdp_unshard")


class CollectiveClock:
    """Seconds spent in the collectives of ``COLLECTIVES``, per stage, in this process.

    On CUDA, two events on the current stream around each call: what the compute stream
    spent there (the exchange itself, and waiting for the other ranks to reach it),
    with no synchronisation; read by :meth:`take` once the run has synchronised.
    Elsewhere (gloo, whose collectives block), the wall time of the call. A call made
    inside another timed one is not counted twice.
    """

    def __init__(self, cuda: bool, stage_of):
        self.cuda = cuda
        self.stage_of = stage_of
        self.pending: list[tuple] = []
        self.wrapped: list[str] = []
        self._restore: list[tuple] = []
        self._depth = 0

    def install(self) -> CollectiveClock:
        import importlib
        import inspect

        for module_name, owner_name, name, kind in COLLECTIVES:
            try:
                owner = importlib.import_module(module_name)
                if owner_name is not None:
                    owner = getattr(owner, owner_name)
                raw = inspect.getattr_static(owner, name)
            except (ImportError, AttributeError):
                continue
            function = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            timed = self._timed(function, kind, wait=kind == "cp_gather")
            if isinstance(raw, classmethod):
                timed = classmethod(timed)
            elif isinstance(raw, staticmethod):
                timed = staticmethod(timed)
            setattr(owner, name, timed)
            self._restore.append((owner, name, raw))
            self.wrapped.append(f"{module_name}.{owner_name + '.' if owner_name else ''}{name}")
        return self

    def uninstall(self) -> None:
        for owner, name, raw in reversed(self._restore):
            setattr(owner, name, raw)
        self._restore.clear()

    def _timed(self, function, kind: str, *, wait: bool):
        import functools
        import time

        import torch
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        clock = self

        @functools.wraps(function)
        def timed(*args, **kwargs):
            if clock._depth:
                return function(*args, **kwargs)
            clock._depth += 1
            try:
                if clock.cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    start = time.perf_counter()
                result = function(*args, **kwargs)
                # diffusers leaves the output gather pending (funcol's AsyncCollectiveTensor)
                # until first use: wait here, so that its time is this call's.
                if wait and isinstance(result, AsyncCollectiveTensor):
                    result = result.wait()
                if clock.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                else:
                    end = time.perf_counter()
                clock.pending.append((clock.stage_of(), kind, start, end))
                return result
            finally:
                clock._depth -= 1

        return timed

    def take(self) -> dict[str, dict[str, dict[str, float]]]:
        """By stage, by kind: seconds and calls since the last take (after a sync)."""
        found: dict[str, dict[str, dict[str, float]]] = {}
        for stage, kind, start, end in self.pending:
            seconds = start.elapsed_time(end) / 1000 if self.cuda else end - start
            entry = found.setdefault(stage, {}).setdefault(kind, {"seconds": 0.0, "calls": 0})
            entry["seconds"] += seconds
            entry["calls"] += 1
        self.pending.clear()
        return found


def stage_name(pipe) -> str:
    index = getattr(pipe, "current_stage_index", None)
    return pipe.stages[index].name if index is not None else "outside stages"


def synchronise_stage_ends(pipe) -> None:
    """The compute stream is synchronised as each stage ends, so a stage's seconds hold
    its own device work (not the previous stage's, still queued). The current stream
    only: a background load's copies on streams of their own are not waited for."""
    import torch

    tracker = pipe.tracker
    finished = tracker.stage_finished

    def stage_finished(*args, **kwargs):
        torch.cuda.current_stream().synchronize()
        return finished(*args, **kwargs)

    tracker.stage_finished = stage_finished


def run_records(pipe, run_number: int) -> tuple[list[dict], list[dict]]:
    """The tracker's stages and load events of run ``run_number`` (its own count)."""
    stages = [vars(record) for record in pipe.tracker.stages if record.run == run_number]
    events = [
        {
            "kind": event.kind,
            "name": event.name,
            "nbytes": event.nbytes,
            "seconds": event.duration_seconds,
            "at_seconds": event.seconds,
        }
        for event in pipe.tracker.events
        if event.run == run_number
        and event.kind in ("load", "fill", "wait", "release", "stage_start", "stage_end")
    ]
    return stages, events


def barrier(cuda: bool) -> None:
    """Every rank here before any goes on; the device idle too."""
    from ondeck import distributed

    if distributed.is_active():
        import torch.distributed as dist

        dist.barrier()
    if cuda:
        import torch

        torch.cuda.synchronize()


def child(args: argparse.Namespace) -> None:
    """One variant; under torchrun, one rank of it. Rank 0 prints the RESULT line."""
    import numpy as np
    import torch

    from ondeck import distributed
    from ondeck.loading.host_cache import HostCache
    from ondeck.pipelines.wan import WanTextToVideo

    parallel = args.degree if args.degree > 1 else None
    shard = tuple(name for name in args.shard.split(",") if name)
    cuda = args.device == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if parallel:
        distributed.init()
    main = distributed.is_main()
    stacks_after = float(os.environ.get("ONDECK_BENCH_STACKS_AFTER") or 0)
    if stacks_after > 0:
        # A variant that hangs leaves every thread's stack behind, one file per rank.
        import faulthandler

        name = f"stacks-{args.label}-rank{distributed.rank()}.txt"
        stacks = open(out_dir() / name, "w")  # noqa: SIM115 (open until the process ends)
        faulthandler.dump_traceback_later(stacks_after, file=stacks)
        atexit.register(faulthandler.cancel_dump_traceback_later)  # a finished variant
    result: dict = {
        "parallel": parallel,
        "shard": shard,
        "policy": args.policy,
        "rank": distributed.rank(),
        "runs": [],
    }
    clock = None
    try:
        started = time.perf_counter()
        pipe = WanTextToVideo.from_folder(
            args.folder,
            device=args.device,
            dtype=dtype,
            policy=args.policy,
            shard=shard,
            parallel=parallel,
            progress=False,
            host_cache=HostCache(int(args.host_cache_gib * GiB)) if args.host_cache_gib else None,
        )
        result["setup_seconds"] = time.perf_counter() - started
        # Plain loaders (the single variant) do not count what they read: an observer does.
        single_reads = None if parallel else count_reads(pipe)
        clock = CollectiveClock(cuda, lambda: stage_name(pipe)).install()
        result["collectives_wrapped"] = clock.wrapped
        if cuda:
            synchronise_stage_ends(pipe)
        for run, prompt in enumerate(PROMPTS[: args.runs]):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            barrier(cuda)
            clock.take()  # nothing between runs counts
            started = time.perf_counter()
            frames = pipe.generate(
                prompt,
                height=args.height,
                width=args.width,
                num_frames=args.frames,
                num_inference_steps=args.steps,
                seed=run,
                # Rank 0 writes the video; the others ask for latents and decode only
                # their share of the split decode.
                output_type="np" if main else "latent",
            )
            if cuda:
                torch.cuda.synchronize()
            own_seconds = time.perf_counter() - started
            barrier(cuda)
            seconds = time.perf_counter() - started
            peak = None
            if cuda:
                # With ONDECK_RESET_PEAKS=1 the tracker resets the statistics per stage and
                # keeps each stage's peak: the run's is the larger of the two.
                measured = pipe.tracker.run_peak_measured_bytes(pipe.tracker.runs) or 0
                peak = max(torch.cuda.max_memory_allocated(), measured)
            stages, events = run_records(pipe, pipe.tracker.runs)
            row = {
                "prompt": prompt,
                "seconds": seconds,
                "own_seconds": own_seconds,
                "barrier_wait_seconds": seconds - own_seconds,
                "peak_bytes": peak,
                "stages": stages,
                "collectives": clock.take(),
                "events": events,
                "decode_split": decode_split(pipe),
            }
            if main:
                saving = time.perf_counter()
                np.save(Path(args.frames_dir) / f"{args.label}-{run}.npy", frames)
                row["save_seconds"] = time.perf_counter() - saving
            result["runs"].append(row)
        result["summary"] = distributed.rank_summary(pipe)
        if single_reads is not None:
            result["summary"]["bytes_read_from_files"] = single_reads
            result["summary"]["bytes_read_from_files_total"] = sum(single_reads.values())
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if clock is not None:
            clock.uninstall()
    if distributed.is_active():
        gathered = distributed.gather_all(result)
        distributed.shutdown()
        if not main:
            return
        result = {"parallel": parallel, "world_size": len(gathered), "ranks": gathered}
    else:
        result = {"parallel": None, "world_size": 1, "ranks": [result]}
    emit(result)


def decode_split(pipe) -> list[int] | None:
    """The latent columns (or rows) this rank decoded in the last run; None: whole."""
    for stage in pipe.stages:
        slab = getattr(stage, "last_split", None)
        if slab is not None:
            return [slab.dim, slab.start, slab.stop]
    return None


def variant_figures(result: dict) -> dict:
    """Per variant: each run's span (the slowest rank's), the largest per-rank peak,
    each rank's own seconds and bytes read."""
    ranks = result.get("ranks") or []
    if not ranks or any(rank.get("error") for rank in ranks):
        errors = [rank.get("error") for rank in ranks if rank.get("error")]
        return {"error": result.get("error") or (errors[0] if errors else "no result")}
    count = min(len(rank["runs"]) for rank in ranks)
    runs = [max(rank["runs"][index]["seconds"] for rank in ranks) for index in range(count)]
    peaks = [max((run["peak_bytes"] or 0) for run in rank["runs"]) for rank in ranks]
    read = [rank["summary"].get("bytes_read_from_files_total") for rank in ranks]
    return {
        "run_seconds": runs,
        "later_seconds": sum(runs[1:]) / len(runs[1:]) if len(runs) > 1 else runs[0],
        "own_seconds_per_rank": [[run["own_seconds"] for run in rank["runs"]] for rank in ranks],
        "peak_bytes_per_rank": peaks,
        "bytes_read_per_rank": read,
    }


def compare_variants(frames_dir: Path, runs: int, labels: list[str]) -> dict[str, list[dict]]:
    """Each context variant's frames against ``single``'s, per prompt."""
    import numpy as np

    from ondeck.parallel import compare_frames

    compared: dict[str, list[dict]] = {}
    for label in labels:
        if label == "single":
            continue
        found_runs = []
        for run in range(runs):
            single, context = frames_dir / f"single-{run}.npy", frames_dir / f"{label}-{run}.npy"
            if not (single.exists() and context.exists()):
                found_runs.append({"prompt": PROMPTS[run], "note": "frames missing"})
                continue
            found = compare_frames(np.load(single), np.load(context))
            found_runs.append({"prompt": PROMPTS[run], **found})
        compared[label] = found_runs
    return compared


def table(report: dict) -> str:
    variants = report["variants"]
    single = variants.get("single", {}).get("figures", {})
    lines = [f"{'variant':<22} {'runs (s)':<24} {'peak/rank GiB':<16} {'read/rank GiB':<16}"]
    for name, variant in variants.items():
        label = LABELS.get(name, name)
        figures = variant.get("figures") or {}
        if "error" in figures or not figures:
            why = figures.get("error") or variant.get("skipped") or "not run"
            lines.append(f"{label:<22} ERROR {why}"[:300])
            continue
        runs = ", ".join(f"{s:.1f}" for s in figures["run_seconds"])
        peaks = ", ".join(f"{p / GiB:.2f}" for p in figures["peak_bytes_per_rank"])
        read = ", ".join(
            f"{r / GiB:.2f}" if r is not None else "?" for r in figures["bytes_read_per_rank"]
        )
        lines.append(f"{label:<22} {runs:<24} {peaks:<16} {read:<16}")
    cached = variants.get("single-cache", {}).get("figures", {})
    if cached.get("run_seconds") and variants.get("context-cache", {}).get("figures", {}).get(
        "run_seconds"
    ):
        ratio = variants["context-cache"]["figures"]["later_seconds"] / cached["later_seconds"]
        lines.append(f"context-cache against single-cache: runs 2-3 time ratio {ratio:.2f}")
    for name, variant in variants.items():
        figures = variant.get("figures") or {}
        if name == "single" or not single.get("run_seconds") or not figures.get("run_seconds"):
            continue
        time_ratio = figures["later_seconds"] / single["later_seconds"]
        single_peak = max(single["peak_bytes_per_rank"]) or 1
        peak_ratio = max(figures["peak_bytes_per_rank"]) / single_peak
        lines.append(
            f"{name}: runs 2-3 time ratio {time_ratio:.2f} (target <= {TIME_TARGET}); per-rank "
            f"peak ratio {peak_ratio:.2f} (target <= {PEAK_TARGET})"
        )
    for name, found_runs in report.get("frames", {}).items():
        for found in found_runs:
            if "max_abs_diff" in found:
                lines.append(
                    f"{name} frames '{found['prompt'][:28]}': max abs diff "
                    f"{found['max_abs_diff']:.4f}, mean {found['mean_abs_diff']:.5f}, "
                    f"within tolerance: {found['within_tolerance']}"
                )
            else:
                lines.append(f"{name} frames '{found['prompt'][:28]}': {found.get('note')}")
    return "\n".join(lines)


def stage_table(name: str, rank_result: dict, run: int) -> str:
    """Where one rank's run went: its span, then per stage the seconds, exposed loads and
    collectives, and the loads it waited on or ran behind."""
    rank = rank_result.get("rank", 0)
    if rank_result.get("error"):
        return f"{name} rank {rank}: ERROR {rank_result['error'][:300]}"
    runs = rank_result.get("runs") or []
    if not runs:
        return f"{name} rank {rank}: no runs"
    run = min(run, len(runs) - 1)
    row = runs[run]
    saved = f", save {row['save_seconds']:.2f}" if "save_seconds" in row else ""
    lines = [
        f"{name} rank {rank}, run {run + 1}: span {row['seconds']:.2f} s (own "
        f"{row['own_seconds']:.2f}, waiting for the other ranks "
        f"{row['barrier_wait_seconds']:.2f}{saved})",
        f"  {'stage':<16} {'seconds':>8} {'exposed load':>13} {'all-to-all':>11} "
        f"{'cp gather':>10} {'fsdp unshard':>13}",
    ]
    collectives = row.get("collectives") or {}

    def columns(stage: str) -> str:
        found = collectives.get(stage, {})
        return " ".join(
            f"{found.get(kind, {}).get('seconds', 0.0):>{width}.2f}"
            for kind, width in zip(KINDS, (11, 10, 13), strict=True)
        )

    for record in row.get("stages") or []:
        lines.append(
            f"  {record['stage']:<16} {record['seconds']:>8.2f} "
            f"{record['exposed_load_seconds']:>13.2f} {columns(record['stage'])}"
        )
    if "outside stages" in collectives:
        lines.append(f"  {'outside stages':<16} {'':>8} {'':>13} {columns('outside stages')}")
    loads = [
        f"{event['kind']} {event['name']} {event['nbytes'] / GiB:.2f} GiB {event['seconds']:.2f} s"
        for event in row.get("events") or []
        if event["kind"] in ("load", "fill", "wait") and event["seconds"] is not None
    ]
    if loads:
        lines.append("  loads: " + "; ".join(loads))
    return "\n".join(lines)


def stage_tables(report: dict, run: int = 1) -> str:
    tables = []
    for name, variant in report["variants"].items():
        for rank_result in variant.get("ranks") or []:
            tables.append(stage_table(name, rank_result, run))
    return "\n".join(tables)


def variant_commands(args: argparse.Namespace, common: list[str]) -> dict[str, list[str]]:
    commands = {}
    for name, (parallel, shard, policy, cache_gib) in VARIANTS.items():
        shard_text = args.shard if shard is None else ",".join(shard)
        child = [str(HERE), *common, "--label", name, "--shard", shard_text, "--policy", policy]
        child += ["--host-cache-gib", str(cache_gib)]
        if parallel:
            launcher = ["-m", "torch.distributed.run", "--standalone"]
            child = [*launcher, f"--nproc-per-node={args.gpus}", *child, "--degree", str(args.gpus)]
        commands[name] = child
    return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=".bench-data/wan14b")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the context variants")
    parser.add_argument("--shard", default="transformer,text_encoder", help="split by FSDP2")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="which to run, comma-separated, in this order: " + ", ".join(VARIANTS),
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--timeout", type=float, default=240, help="most seconds per variant")
    parser.add_argument(
        "--budget", type=float, default=525, help="seconds for the whole call, build included"
    )
    parser.add_argument(
        "--frames-dir",
        help="where the variants' frames go (default: a fresh temporary folder); give the "
        "folder of an earlier call to compare against the single GPU's frames it kept",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="release", help=argparse.SUPPRESS)
    parser.add_argument("--host-cache-gib", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--degree", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--label", help=argparse.SUPPRESS)
    parser.add_argument(
        "--stacks-after",
        type=float,
        default=0,
        help="a variant still running after this many seconds writes every thread's stack "
        "to $OUT/stacks-VARIANT-rankN.txt (0: never)",
    )
    args = parser.parse_args()
    if args.stacks_after > 0:
        if args.stacks_after >= args.timeout:
            print(
                f"--stacks-after {args.stacks_after:g} is not below --timeout "
                f"{args.timeout:g}: a variant that hangs is stopped before its stacks are written",
                file=sys.stderr,
            )
        os.environ["ONDECK_BENCH_STACKS_AFTER"] = str(args.stacks_after)
    if args.child:
        child(args)
        return
    wanted = parse_modes(parser, args.variants, list(VARIANTS), kind="variants")

    import torch

    started = time.perf_counter()
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "device": args.device,
        "torch": torch.__version__,
        "shape": {"height": args.height, "width": args.width, "frames": args.frames},
        "steps": args.steps,
        "dtype": args.dtype,
        "policy": {name: VARIANTS[name][2] for name in wanted},
        "prompts": PROMPTS[: args.runs],
        "variants": {},
    }
    needs_gpus = args.gpus if any(VARIANTS[name][0] for name in wanted) else 1
    if args.device == "cuda" and torch.cuda.device_count() < needs_gpus:
        print(f"needs {needs_gpus} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        sys.exit(1)
    # Built once (kept between calls on a warm machine), then read into the page cache so
    # that every variant starts from the same warm files.
    path, _ = ready_wan14b_folder(Path(args.folder))
    report["folder_bytes"] = folder_bytes(path)
    report["build_seconds"] = time.perf_counter() - started
    print(f"folder {path} ready after {report['build_seconds']:.0f}s", flush=True)
    if args.frames_dir:
        frames_dir = Path(args.frames_dir)
        frames_dir.mkdir(parents=True, exist_ok=True)
    else:
        frames_dir = Path(tempfile.mkdtemp(prefix="ondeck-context-"))
    report["frames_dir"] = str(frames_dir)
    common = ["--child", "--device", args.device, "--dtype", args.dtype, "--folder", str(path)]
    common += ["--height", str(args.height), "--width", str(args.width)]
    common += ["--frames", str(args.frames), "--steps", str(args.steps)]
    common += ["--runs", str(args.runs), "--frames-dir", str(frames_dir)]
    commands = variant_commands(args, common)
    path_json = out_dir() / "context_parallel.json"
    for label in wanted:
        # Each variant gets what is left of the budget, so the call ends within it.
        left = args.budget - (time.perf_counter() - started) - 15
        if left < 60:
            report["variants"][label] = {"skipped": f"{left:.0f}s left of the budget"}
            continue
        result = run_variant(commands[label], timeout=min(args.timeout, left))
        result["command"] = result.pop("args")
        result["figures"] = variant_figures(result)
        report["variants"][label] = result
        print(f"{label}: {json.dumps(result['figures'], default=str)}", flush=True)
        path_json.write_text(json.dumps(report, indent=2, default=str))
    report["frames"] = compare_variants(frames_dir, args.runs, wanted)
    report["total_seconds"] = time.perf_counter() - started
    path_json.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path_json} after {report['total_seconds']:.0f}s")
    print(table(report))
    print(stage_tables(report))


if __name__ == "__main__":
    main()
    from ondeck import distributed

    if distributed.joined():  # a torchrun child: see end_process for why it ends so
        distributed.end_process()
