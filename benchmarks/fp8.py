"""fp8 storage, bf16 compute, on one GPU: memory, speed, reload rate and output difference.

    python benchmarks/fp8.py [--folder DIR] [--modes bf16-eager,fp8-full,fp8-16,fp8-8,reload]

The Wan 2.1 14B-shaped folder as ``WanPipeline.save_pretrained`` writes it (bf16 text
encoder and transformer, float32 VAE), 480x832, 33 frames, 4 steps, three prompts per
mode, each mode a process of its own (clean peaks), all in one call:

- ``bf16-eager``: diffusers' WanPipeline, everything on the card (VAE float32): the
  reference for time, resident bytes and latents.
- ``fp8-full``: ``ondeck generate`` with ``--weights fp8`` (text encoder and
  transformer in float8_e4m3fn, computed in bf16) on the whole card.
- ``fp8-16``, ``fp8-8``: the same on a card emulated at 16 and 8 GiB
  (``set_per_process_memory_fraction``); the automatic policy picks what to keep and
  what to stream. Each also plans bf16 at the same budget (no weights read): the
  bytes bf16 would stream per pass beside the bytes fp8 streams.
- ``fp8-16-cache``, ``fp8-8-cache``: the same with a 32 GiB host cache (``--host-cache``):
  components released between runs come back from pinned fp8 bytes in host memory, not
  from the bf16 files.
- ``reload``: the transformer and the text encoder loaded from the page cache, bf16 and
  fp8, five times each (``--reload-attempts``) after a warm-up load, taking turns: file
  GB/s of the whole load and of its read alone (the files hold bf16 either way), and
  the device allocations and the garbage collector's passes each load made. The arms
  fill pipelined, in one read for all groups of blocks, as the pipelines load. Each
  load starts with the allocator's cache empty (new device memory, as a first load),
  but those ``into cached memory``: bf16 and fp8 again, the allocator holding mapped
  memory enough for the module (as a reload in a running pipeline usually finds).
  ``fp8, collector paused``: Python's cyclic collector disabled during the load. A load
  is timed until the module is whole (the loader's call); the next load's skeleton,
  built on the filling's thread after that, is waited for untimed. With ``--phases``,
  each arm's median milliseconds per load in the loader's parts, the read among them.

The latents each run hands to the VAE are kept, and compared per latent frame with
bf16 eager's (max and mean absolute difference). ``fp8-full`` runs one prompt by default
(its resident bytes and the latents the emulated cards must equal; ``--full-runs 3`` for
its time too).

Where the time goes, per mode, run and stage: the stage's seconds, the load seconds it
waited for (the tracker's exposed seconds; bf16 eager: its encode, denoise and decode
timed around diffusers' calls), the bytes loaded per component, the bytes streamed per
component, each stage's measured activations, and the plan's streamed blocks before run
1 and after each run (what the policy decided once activations were measured). Children
run with ONDECK_RESET_PEAKS=1, as ``ondeck generate`` measures. Writes fp8.json to $OUT
and prints the tables last. About 6 minutes on an H200 with the folder already built
(building it adds two to three).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    CollectorClock,
    GiB,
    PeakSampler,
    PhaseClock,
    decode_report,
    emit,
    later_seconds,
    out_dir,
    parse_modes,
    peak_rss_bytes,
    phase_totals,
    ready_wan14b_folder,
    reload_arm_loader,
    run_child,
)

MODES = {
    # mode: (emulated card GiB or None, seconds it takes on an H200 with a warm folder)
    "bf16-eager": (None, 80),
    "fp8-full": (None, 35),  # one prompt unless --full-runs says more
    "fp8-16": (16, 80),
    "fp8-8": (8, 95),
    "fp8-16-cache": (16, 85),
    "fp8-8-cache": (8, 100),
    "reload": (None, 40),
}
SHAPE = dict(height=480, width=832, num_frames=33, num_inference_steps=4)
STORED = ("text_encoder", "transformer")
HOST_CACHE_GIB = {"fp8-16-cache": 32, "fp8-8-cache": 32}  # every mode else reads the files


# -- one mode, in a child process ----------------------------------------------------------


def capture_decode_inputs(module, latents_seen: list) -> None:
    """Keep what each decode call receives (the latents, denormalized, before decode)."""
    decode = module.decode

    def recording(latents, *args, **kwargs):
        latents_seen.append(latents.detach().float().cpu())
        return decode(latents, *args, **kwargs)

    module.decode = recording


class StageClock:
    """bf16 eager's stages, timed around diffusers' own calls: the prompt encoding, and
    the VAE decode with the frames' post-processing (as ondeck's Decode stage does
    both), each synchronized at its end; the denoise is the rest of the run."""

    def __init__(self, pipe) -> None:
        self.seconds: dict[str, float] = {}
        pipe.encode_prompt = self._timed("EncodePrompt", pipe.encode_prompt)
        pipe.vae.decode = self._timed("Decode", pipe.vae.decode)
        processor = pipe.video_processor
        processor.postprocess_video = self._timed("Decode", processor.postprocess_video)

    def _timed(self, stage: str, function):
        import torch

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

        return timed

    def take(self, run_seconds: float) -> list[dict]:
        seconds, self.seconds = self.seconds, {}
        denoise = run_seconds - sum(seconds.values())
        rows = [("EncodePrompt", seconds.get("EncodePrompt", 0.0)), ("Denoise", denoise)]
        rows.append(("Decode", seconds.get("Decode", 0.0)))
        return [{"stage": stage, "seconds": value} for stage, value in rows]


def streamed_by_component(pipe) -> dict[str, int]:
    """Block bytes copied host to device so far, per streamed component."""
    streaming = getattr(getattr(pipe, "policy", None), "streaming", None)
    if streaming is None:
        return {}
    return {name: stats["bytes_copied"] for name, stats in streaming.stats().items()}


def planned_blocks(plan) -> dict[str, list[int]]:
    """``{component: [blocks streamed, blocks]}`` in a plan."""
    return {
        name: [len(layout.streamed), layout.block_count] for name, layout in plan.streamed.items()
    }


def stage_rows(tracker, run: int, streamed: dict[str, int]) -> list[dict]:
    """One run's stages from the tracker: seconds, exposed load seconds, activations, and
    the bytes loaded (and streamed) per component while each stage ran."""
    loaded: dict[str, dict[str, int]] = {}
    # Where each stage's exposed load seconds went: each load's return, waits for a
    # pipelined load's blocks (count and sum), each fill's end, per component.
    timings: dict[str, list] = {}
    stage = None
    for event in tracker.events:
        if event.run != run:
            continue
        if event.kind == "stage_start":
            stage = event.name
        if event.kind in ("load", "wait", "fill"):
            timings.setdefault(stage or "", []).append(
                [event.kind, event.name, round(event.duration_seconds or 0, 4)]
            )
        if event.kind == "load":
            # A load before the first stage, or after the last, counts to the run's first.
            per = loaded.setdefault(stage or "", {})
            per[event.name] = per.get(event.name, 0) + event.nbytes
    rows = []
    for record in (r for r in tracker.stages if r.run == run):
        rows.append(
            {
                "stage": record.stage,
                "seconds": record.seconds,
                "exposed_load_seconds": record.exposed_load_seconds,
                "activation_bytes": record.activation_bytes,
                "allocator_retries": record.allocator_retries,
                "loaded_bytes": loaded.pop(record.stage, {}),
                "load_events": _summarised(timings.pop(record.stage, [])),
            }
        )
    if rows and "" in loaded:
        first = rows[0]["loaded_bytes"]
        for name, nbytes in loaded.pop("").items():
            first[name] = first.get(name, 0) + nbytes
    # Streamed blocks belong to the stage that holds the component; Denoise for Wan.
    for row in rows:
        row["streamed_bytes"] = {}
    holder = next((row for row in rows if row["stage"] == "Denoise"), rows[0] if rows else None)
    if holder is not None:
        holder["streamed_bytes"] = {name: n for name, n in streamed.items() if n}
    return rows


def _summarised(events: list) -> list:
    """Load events in order, each run of waits for one component as one entry."""
    out: list = []
    for kind, name, seconds in events:
        last = out[-1] if out else None
        if kind == "wait" and last is not None and last[0] == "waits" and last[1] == name:
            last[2] += 1
            last[3] = round(last[3] + seconds, 4)
        elif kind == "wait":
            out.append(["waits", name, 1, seconds])
        else:
            out.append([kind, name, seconds])
    return out


def component_nbytes(pipe, names=STORED) -> dict[str, int]:
    from ondeck.lazy import module_nbytes

    return {name: module_nbytes(getattr(pipe, name)) for name in names}


def bf16_eager(folder: Path):
    from wan_modes import diffusers_pipeline

    pipe = diffusers_pipeline(folder, "diffusers-eager")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fp8_pipeline(folder: Path, host_cache_gib: float | None = None):
    import torch

    from ondeck.loading import HostCache
    from ondeck.pipelines.wan import WanTextToVideo

    # What `ondeck generate MODEL_DIR --weights fp8 [--host-cache N]` builds: auto policy,
    # no budget.
    return WanTextToVideo.from_folder(
        folder,
        device="cuda",
        dtype=torch.bfloat16,
        storage_dtype="fp8",
        progress=False,
        host_cache=HostCache(int(host_cache_gib * 2**30)) if host_cache_gib else None,
    )


def bf16_plan_at(folder: Path, budget: int | None) -> dict | None:
    """How bf16 would run at the same budget: planned only, no weights read."""
    import torch

    from ondeck.pipelines.wan import WanTextToVideo

    if budget is None:
        return None
    pipe = WanTextToVideo.from_folder(folder, device="cuda", dtype=torch.bfloat16, progress=False)
    plan = pipe.plan(budget)
    return {
        "fits": plan.fits(),
        "summary": plan.fit_summary(),
        "component_bytes": plan.component_bytes,
        "bytes_per_pass": {name: layout.bytes_per_pass for name, layout in plan.streamed.items()},
        "streamed_blocks": {name: len(layout.streamed) for name, layout in plan.streamed.items()},
    }


def load_phase_targets() -> dict:
    """The parts of a component's load, timed both in runs and in reloads."""
    from ondeck.loading import components, pipelined

    loader = components.ComponentLoader
    return {
        "begin": (loader, "begin"),
        "match tensors": (components, "match_tensors"),
        "allocate": (components, "_allocate"),
        "start filling": (components, "start_filling"),
        "take skeleton": (loader, "_take_skeleton"),
        "install": (components, "_install"),
        "wait for group": (pipelined.Filling, "wait_group"),
        "finish": (components, "_finish"),
    }


def phase_targets(pipe) -> dict:
    """What an ondeck run's loads and releases spend their time in (``PhaseClock``)."""
    from ondeck import executor, lazy
    from ondeck.loading import components
    from ondeck.streaming import streamer

    loader = components.ComponentLoader
    policy = type(pipe.policy)
    return {
        **load_phase_targets(),
        "load whole": (loader, "_load_whole"),
        "cache lookup": (loader, "_cached"),
        "fill placed": (loader, "_fill_placed"),
        "upcast hooks": (loader, "_upcast_for_compute"),
        "arm streaming": (streamer.BlockStreamer, "finish"),
        "disarm streaming": (streamer.BlockStreamer, "unload"),
        "release": (lazy.LazyModule, "release"),
        "prefetch wait": (executor.Executor, "wait_for"),
        "next run wait": (executor.Executor, "_join_next_run"),
        "free cached": (executor, "free_cached_memory"),
        "policy before stage": (policy, "before_stage"),
        "policy after stage": (policy, "after_stage"),
        "policy before load": (policy, "before_load"),
    }


def run_pipeline(args) -> dict:
    import torch
    from wan_modes import (
        PROMPTS,
        allocator_counts,
        bytes_streamed,
        emulate_device,
        streaming_summary,
    )

    folder = Path(args.folder)
    emulate_device(args.memory_gib)
    import ondeck.policy

    if args.measured_reserve_mib is not None:
        ondeck.policy.AUTO_MEASURED_HEADROOM_MIN_BYTES = args.measured_reserve_mib << 20
    if args.upcast_reserve_copies is not None:
        ondeck.policy.UPCAST_RESERVE_COPIES = args.upcast_reserve_copies
    result: dict = {"mode": args.child, "memory_gib": args.memory_gib, "runs": []}
    latents_seen: list = []
    started = time.perf_counter()
    clock = None
    if args.child == "bf16-eager":
        pipe = bf16_eager(folder)
        capture_decode_inputs(pipe.vae, latents_seen)
        clock = StageClock(pipe)
    else:
        pipe = fp8_pipeline(folder, args.host_cache_gib)
        result["policy_reason"] = pipe.policy.reason
        result["budget_bytes"] = getattr(pipe.policy, "budget_bytes", None)
        plan = pipe.plan()
        result["plan_summary"] = plan.fit_summary()
        result["planned_component_bytes"] = plan.component_bytes
        result["planned_streaming"] = streaming_summary(plan)
        result["planned_blocks_before_run_1"] = planned_blocks(plan)
        result["bf16_plan"] = bf16_plan_at(folder, result["budget_bytes"])
        pipe.components["vae"].add_transform(
            lambda module: capture_decode_inputs(module, latents_seen) or module
        )
    torch.cuda.synchronize()
    result["setup_seconds"] = time.perf_counter() - started
    phases = PhaseClock(phase_targets(pipe) if args.phases and clock is None else {})
    phases.__enter__()
    kept = []  # the latents of each run's (first) decode
    for run, prompt in enumerate(PROMPTS[: args.runs]):
        torch.cuda.reset_peak_memory_stats()
        phases.take()
        streamed_before = bytes_streamed(pipe)
        by_component_before = streamed_by_component(pipe)
        loaded_before = pipe.tracker.bytes_loaded if hasattr(pipe, "tracker") else 0
        seen_before = len(latents_seen)
        allocator_before = allocator_counts()
        started = time.perf_counter()
        with PeakSampler(torch.cuda.memory_reserved) as sampler:
            if args.child == "bf16-eager":
                generator = torch.Generator("cpu").manual_seed(run)
                pipe(prompt, generator=generator, **SHAPE)
            else:
                pipe.generate(
                    prompt,
                    height=SHAPE["height"],
                    width=SHAPE["width"],
                    num_frames=SHAPE["num_frames"],
                    num_inference_steps=SHAPE["num_inference_steps"],
                    seed=run,
                )
            torch.cuda.synchronize()
        row = {
            "seconds": time.perf_counter() - started,
            "sampled_peak_reserved_bytes": sampler.peak,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "bytes_streamed": bytes_streamed(pipe) - streamed_before,
            "allocator": allocator_counts(since=allocator_before),
        }
        if hasattr(pipe, "tracker"):
            row["bytes_loaded"] = pipe.tracker.bytes_loaded - loaded_before
            row["exposed_load_seconds"] = pipe.tracker.exposed_load_seconds(pipe.tracker.runs)
            streamed = {
                name: nbytes - by_component_before.get(name, 0)
                for name, nbytes in streamed_by_component(pipe).items()
            }
            row["stages"] = stage_rows(pipe.tracker, pipe.tracker.runs, streamed)
            row["budget_bytes"] = getattr(pipe.policy, "budget_bytes", None)  # planned against
            after = pipe.plan()  # with the activations this run measured
            row["plan_after"] = {"summary": after.fit_summary(), "blocks": planned_blocks(after)}
            row["decode"] = decode_report(pipe)
            row["sources"] = {
                name: getattr(loader, "last_source", None) for name, loader in pipe.loaders.items()
            }
        elif clock is not None:
            row["stages"] = clock.take(row["seconds"])
        if phases.targets:
            events = phases.take()
            row["phases"] = phase_totals(events)
            row["phase_events"] = events
        if len(latents_seen) > seen_before:
            kept.append(latents_seen[seen_before])
        result["runs"].append(row)
        print(f"{args.child} run {run + 1}: {row['seconds']:.2f}s", file=sys.stderr, flush=True)
        gc.collect()
    phases.__exit__(None, None, None)
    if args.child == "bf16-eager":
        result["resident_bytes"] = component_nbytes(pipe)
    else:
        measured = pipe.component_bytes()  # measured where loaded, else planned
        result["resident_bytes"] = {name: measured[name] for name in STORED}
        streaming = getattr(pipe.policy, "streaming", None)
        result["streaming"] = streaming.stats() if streaming is not None else {}
    torch.save(kept, args.latents)
    result["latents_file"] = args.latents
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def reload_rates(args) -> dict:
    """Each component, bf16 and fp8, loaded from the page cache: file bytes per second.
    The arms of one component take turns, attempt by attempt, so that a drift of the
    machine during the call reaches all of them alike, and the order of the arms turns
    from one attempt to the next (no arm always follows the same one). Beside each
    load's seconds, its read's alone (the reads, copies and casts, without building the
    module). Every load but those ``into cached memory`` starts with the allocator's
    cache empty, as a first load does; those find mapped memory enough for the module
    in it, as a reload in a running pipeline usually does."""
    import torch
    from wan_modes import allocator_counts

    from ondeck.lazy import module_nbytes
    from ondeck.loading import ModelFolder

    folder = ModelFolder.open(args.folder)
    rows = {}
    phases = PhaseClock(reload_phase_targets() if args.phases else {})
    phases.__enter__()
    arms = (
        "bf16",
        "fp8",
        "fp8, collector paused",
        "bf16, into cached memory",
        "fp8, into cached memory",
    )
    collector = CollectorClock().__enter__()
    for name in STORED:
        loaders = {arm: reload_arm_loader(folder, name, arm) for arm in arms}
        seconds = {arm: [] for arm in arms}
        read_seconds = {arm: [] for arm in arms}
        allocations = {arm: [] for arm in arms}
        collected = {arm: [] for arm in arms}
        timed = {arm: [] for arm in arms}
        stored = {}
        for attempt in range(1 + args.reload_attempts):  # the first starts the processes
            for turn in range(len(arms)):
                arm = arms[(attempt + turn) % len(arms)]
                loader = loaders[arm]
                torch.cuda.empty_cache()
                if arm.endswith("into cached memory"):
                    room = torch.empty(loader.spec.nbytes + 2**30, dtype=torch.uint8, device="cuda")
                    del room
                paused = arm.endswith("collector paused") and gc.isenabled()
                torch.cuda.synchronize()
                before = allocator_counts()
                collector.take()
                phases.take()
                if paused:
                    gc.disable()
                try:
                    started = time.perf_counter()
                    module = loader()
                    torch.cuda.synchronize()
                    elapsed = time.perf_counter() - started
                finally:
                    if paused:
                        gc.enable()
                # The next load's skeleton, built on the filling's thread once this load
                # has ended, is waited for here, untimed: it never overlaps another load.
                for thread in threading.enumerate():
                    if thread.name.startswith("ondeck-fill"):
                        thread.join()
                counts = allocator_counts(before)
                if attempt:
                    seconds[arm].append(elapsed)
                    read_seconds[arm].append(loader.last_read_seconds)
                    allocations[arm].append(counts["num_device_alloc"])
                    collected[arm].append(collector.take())
                    timed[arm].append(phase_totals(phases.take()))
                stored[arm] = module_nbytes(module)  # tied weights once
                del module
                gc.collect()
        file_bytes = folder.file_bytes(name)
        for arm in arms:
            middle = statistics.median(seconds[arm])
            rows[f"{name} {arm}"] = {
                "file_bytes": file_bytes,
                "stored_bytes": stored[arm],
                "seconds": seconds[arm],
                "read_seconds": read_seconds[arm],
                "file_gb_per_second": file_bytes / middle / 1e9,
                "read_gb_per_second": file_bytes / statistics.median(read_seconds[arm]) / 1e9,
                "device_allocations": allocations[arm],
                "collector": collected[arm],
                "readers": loaders[arm].last_readers,
                "phases": median_phases(timed[arm]),
            }
            print(
                f"reload {name} {arm}: {file_bytes / middle / 1e9:.1f} GB/s, "
                f"{allocations[arm]} device allocations",
                file=sys.stderr,
            )
    collector.__exit__()
    phases.__exit__(None, None, None)
    return {"mode": "reload", "reload": rows}


def reload_phase_targets() -> dict:
    """What a reload spends its time in, beside the read (``--phases``)."""
    from ondeck.loading import components, pipelined

    loader = components.ComponentLoader
    return {
        **load_phase_targets(),
        "read in groups": (loader, "_read_in_groups"),
        "next skeleton": (loader, "_pipelined_skeleton"),
        "wait for the fill": (pipelined.Filling, "wait"),
    }


def median_phases(loads: list[dict]) -> dict[str, float]:
    """Each phase's median seconds per load (0 in a load that did not call it)."""
    names = sorted({name for load in loads for name in load})
    return {
        name: statistics.median(load.get(name, {}).get("seconds", 0.0) for load in loads)
        for name in names
    }


def child(args) -> None:
    try:
        result = reload_rates(args) if args.child == "reload" else run_pipeline(args)
    except Exception as error:
        result = {
            "mode": args.child,
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc()[-3000:],
        }
    emit(result)


# -- the parent: every mode, then the comparison ---------------------------------------------


def per_frame_difference(ours: list, reference: list) -> list[dict]:
    """Per prompt, per latent frame: max and mean absolute difference to the reference."""
    prompts = []
    for mine, theirs in zip(ours, reference, strict=False):
        difference = (mine - theirs).abs()[0]  # channels, frames, height, width
        frames = difference.transpose(0, 1).flatten(1)
        prompts.append(
            {
                "max_abs": [float(v) for v in frames.max(dim=1).values],
                "mean_abs": [float(v) for v in frames.mean(dim=1)],
                "reference_mean_abs": float(theirs.abs().mean()),
            }
        )
    return prompts


def summarise(rows: dict, latents: dict) -> dict:
    import torch

    summary: dict = {}
    eager = rows.get("bf16-eager")
    eager_seconds = later_seconds(eager) if eager and eager.get("runs") else None
    summary["eager_seconds"] = eager_seconds
    if eager and "resident_bytes" in eager and "fp8-full" in rows:
        bf16 = sum(eager["resident_bytes"].values())
        fp8 = sum(rows["fp8-full"].get("resident_bytes", {}).values() or [0])
        summary["resident_bytes"] = {
            "bf16": bf16,
            "fp8": fp8,
            "ratio": fp8 / bf16 if bf16 else None,
        }
    reference = latents.get("bf16-eager")
    for mode, row in rows.items():
        if not mode.startswith("fp8") or not row.get("runs"):
            continue
        entry = {
            "later_seconds": later_seconds(row),
            "vs_eager": later_seconds(row) / eager_seconds if eager_seconds else None,
            "streamed_per_run": [r["bytes_streamed"] for r in row["runs"]],
        }
        bf16_plan = row.get("bf16_plan") or {}
        entry["bf16_bytes_per_pass"] = sum((bf16_plan.get("bytes_per_pass") or {}).values())
        entry["fp8_bytes_per_pass"] = sum(
            layout["bytes_per_pass"] for layout in (row.get("planned_streaming") or {}).values()
        )
        if reference is not None and mode in latents:
            entry["latent_difference"] = per_frame_difference(latents[mode], reference)
        if mode != "fp8-full" and "fp8-full" in latents and mode in latents:
            same = [
                bool(torch.equal(a, b))
                for a, b in zip(latents[mode], latents["fp8-full"], strict=False)
            ]
            entry["latents_equal_fp8_full"] = same
        summary[mode] = entry
    if "reload" in rows:
        summary["reload"] = rows["reload"].get("reload")
    return summary


def print_table(rows: dict, summary: dict) -> None:
    print(
        "\nfp8 storage (float8_e4m3fn, computed in bf16), Wan 2.1 14B-shaped, 480x832x33, 4 steps"
    )
    resident = summary.get("resident_bytes")
    if resident:
        print(
            f"resident text encoder + transformer: bf16 {resident['bf16'] / GiB:.2f} GiB, "
            f"fp8 {resident['fp8'] / GiB:.2f} GiB ({resident['ratio']:.3f}x)"
        )
    eager = summary.get("eager_seconds")
    print(f"bf16 eager runs 2-3: {eager:.2f} s" if eager else "bf16 eager: no result")
    print(
        f"\n{'mode':<10} {'done':<5} {'runs 2-3 s':>10} {'/ eager':>8} {'streamed/run':>13} "
        f"{'fp8 B/pass':>11} {'bf16 B/pass':>11} {'latent max':>10} {'latent mean':>11}  plan"
    )
    for mode, row in rows.items():
        if not mode.startswith("fp8"):
            continue
        entry = summary.get(mode, {})
        done = bool(row.get("runs")) and not row.get("error")
        done_text = ("yes" if len(row["runs"]) > 1 else "run1") if done else "NO"
        ratio = entry.get("vs_eager")
        streamed = entry.get("streamed_per_run") or [0]
        diffs = entry.get("latent_difference") or []
        worst = max((max(p["max_abs"]) for p in diffs), default=float("nan"))
        mean = max((max(p["mean_abs"]) for p in diffs), default=float("nan"))
        print(
            f"{mode:<10} {done_text:<5} {entry.get('later_seconds', float('nan')):>10.2f} "
            f"{ratio if ratio else float('nan'):>8.2f} {streamed[-1] / GiB:>12.2f}G "
            f"{entry.get('fp8_bytes_per_pass', 0) / GiB:>10.2f}G "
            f"{entry.get('bf16_bytes_per_pass', 0) / GiB:>10.2f}G {worst:>10.4f} {mean:>11.5f}  "
            f"{row.get('plan_summary', row.get('error', ''))[:80]}"
        )
    print_stage_table(rows)
    reload = summary.get("reload") or {}
    if reload:
        print(
            f"\n{'reload from page cache (medians)':<44} {'file GB/s':>9} "
            f"{'/ bf16':>6} {'read GB/s':>9} {'/ bf16':>6} {'stored GiB':>10} "
            f"{'device allocs':>13} {'gc passes/old/ms':>17}"
        )
        for name, entry in reload.items():
            kept = ", into cached memory" if name.endswith(", into cached memory") else ""
            bf16 = reload.get(name.split(" ")[0] + " bf16" + kept, entry)
            ratio = entry["file_gb_per_second"] / bf16["file_gb_per_second"]
            read = entry.get("read_gb_per_second", float("nan"))
            read_ratio = read / bf16.get("read_gb_per_second", float("nan"))
            print(
                f"{name:<44} {entry['file_gb_per_second']:>9.1f} {ratio:>6.3f} "
                f"{read:>9.1f} {read_ratio:>6.3f} "
                f"{entry['stored_bytes'] / GiB:>10.2f} "
                f"{'/'.join(str(n) for n in sorted(set(entry.get('device_allocations', [])))):>13} "
                f"{_collector_medians(entry.get('collector') or []):>17}"
            )
        for name, entry in reload.items():
            if entry.get("phases"):
                shown = ", ".join(
                    f"{phase} {seconds * 1e3:.0f}"
                    for phase, seconds in sorted(entry["phases"].items(), key=lambda i: -i[1])
                )
                print(f"  {name} phases (ms, medians per load): {shown}")


def _collector_medians(loads: list[dict]) -> str:
    if not loads:
        return "-"
    passes = statistics.median(load["collections"] for load in loads)
    oldest = statistics.median(load["oldest_collections"] for load in loads)
    seconds = statistics.median(load["collector_seconds"] for load in loads)
    return f"{passes:.0f}/{oldest:.0f}/{seconds * 1e3:.1f}"


def _gib_by_name(nbytes: dict[str, int]) -> str:
    short = {"text_encoder": "te", "transformer": "tr"}
    return " ".join(f"{short.get(k, k)} {v / GiB:.2f}" for k, v in nbytes.items() if v) or "-"


def print_stage_table(rows: dict) -> None:
    """Per mode, run and stage: seconds, exposed load seconds, GiB loaded and streamed per
    component (te: text encoder, tr: transformer), measured activations; then the plan's
    streamed blocks before run 1 and after each run."""
    print(
        f"\n{'mode':<10} {'run':>3} {'stage':<15} {'s':>7} {'exposed':>7} "
        f"{'act GiB':>7} {'retries':>7}  {'loaded GiB':<22} streamed GiB"
    )
    for mode, row in rows.items():
        for run, entry in enumerate(row.get("runs") or [], start=1):
            for stage in entry.get("stages") or []:
                exposed = stage.get("exposed_load_seconds")
                activation = stage.get("activation_bytes")
                print(
                    f"{mode:<10} {run:>3} {stage['stage'][:15]:<15} {stage['seconds']:>7.2f} "
                    f"{exposed if exposed is not None else float('nan'):>7.2f} "
                    f"{(activation or 0) / GiB if activation is not None else float('nan'):>7.2f} "
                    f"{stage.get('allocator_retries', '-')!s:>7}  "
                    f"{_gib_by_name(stage.get('loaded_bytes') or {}):<22} "
                    f"{_gib_by_name(stage.get('streamed_bytes') or {})}"
                )
    for mode, row in rows.items():
        runs = row.get("runs") or []
        if len(runs) < 3:
            continue
        for stage in runs[2].get("stages") or []:
            if stage.get("load_events"):
                print(f"{mode} run 3 {stage['stage']} loads: {stage['load_events']}")
        if runs[2].get("sources"):
            print(f"{mode} run 3 last sources: {runs[2]['sources']}")
    for mode, row in rows.items():
        runs = row.get("runs") or []
        if runs and runs[-1].get("phases"):
            totals = sorted(runs[-1]["phases"].items(), key=lambda item: -item[1]["seconds"])
            shown = "; ".join(
                f"{name} {t['seconds']:.3f} s/{t['calls']} (longest {t['longest']:.3f})"
                for name, t in totals[:16]
            )
            print(f"{mode} run {len(runs)} phases: {shown}")
    for mode, row in rows.items():
        if "planned_blocks_before_run_1" not in row:
            continue

        def blocks(planned: dict) -> str:
            shown = ", ".join(f"{n} {s}/{c}" for n, (s, c) in planned.items())
            return shown or "none"

        after = [blocks((r.get("plan_after") or {}).get("blocks") or {}) for r in row["runs"]]
        print(
            f"{mode} streamed blocks planned: before run 1 {blocks(row['planned_blocks_before_run_1'])}"
            + "".join(f"; after run {i} {b}" for i, b in enumerate(after, start=1))
        )
        budgets = [r.get("budget_bytes") for r in row["runs"]]
        if any(budgets):
            shown = ", ".join(f"{b / GiB:.2f}" if b else "-" for b in budgets)
            print(f"{mode} budget per run (GiB): {shown}")
        counts = [r.get("allocator") or {} for r in row["runs"]]
        if any(counts):
            shown = "; ".join(
                f"run {i} retries {c.get('num_alloc_retries', 0)}, cudaMalloc "
                f"{c.get('num_device_alloc', 0)}, cudaFree {c.get('num_device_free', 0)}"
                for i, c in enumerate(counts, start=1)
            )
            print(f"{mode} allocator: {shown}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"from {', '.join(MODES)}")
    parser.add_argument("--runs", type=int, default=3, help="prompts per mode (at most 3)")
    parser.add_argument(
        "--full-runs", type=int, default=1, help="prompts for fp8-full (at most --runs)"
    )
    parser.add_argument("--timeout", type=float, default=240, help="seconds per mode")
    parser.add_argument(
        "--reload-attempts", type=int, default=5, help="timed loads per arm in reload"
    )
    # Internal: one mode in this process.
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--memory-gib", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--host-cache-gib", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--latents", help=argparse.SUPPRESS)
    parser.add_argument(
        "--measured-reserve-mib",
        type=int,
        help="what-if: the automatic budget's reserve once activations are measured "
        "(ondeck.policy.AUTO_MEASURED_HEADROOM_MIN_BYTES) for the fp8 modes",
    )
    parser.add_argument(
        "--upcast-reserve-copies",
        type=int,
        help="what-if: the largest upcast copies a stage computing from fp8 layers keeps "
        "room for once its activations are measured (ondeck.policy.UPCAST_RESERVE_COPIES)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time the loads' and releases' parts in the ondeck modes (PhaseClock): "
        "per run, totals and every call",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.runs < 1 or args.runs > 3:
        parser.error("--runs must be from 1 to 3")
    if args.full_runs < 1:
        parser.error("--full-runs must be at least 1")
    if args.child:
        child(args)
        return
    modes = parse_modes(parser, args.modes, MODES)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("ONDECK_PROGRESS", "0")
    os.environ.setdefault("ONDECK_RESET_PEAKS", "1")  # as `ondeck generate` measures
    started = time.perf_counter()
    path, sizes = ready_wan14b_folder(Path(args.folder))
    scratch = Path(tempfile.mkdtemp(prefix="ondeck-fp8-latents-"))
    rows: dict[str, dict] = {}
    latents: dict[str, list] = {}

    def write(summary: dict | None = None) -> None:
        document = {
            "folder_bytes": sizes,
            "shape": SHAPE,
            "rows": rows,
            "summary": summary,
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/fp8.py " + " ".join(sys.argv[1:]),
        }
        (out_dir() / "fp8.json").write_text(json.dumps(document, indent=2, default=str))

    import torch

    for mode in modes:
        memory_gib, _ = MODES[mode]
        command = [str(Path(__file__).resolve()), "--folder", str(path), "--child", mode]
        runs = min(args.runs, args.full_runs) if mode == "fp8-full" else args.runs
        command += ["--runs", str(runs), "--latents", str(scratch / f"{mode}.pt")]
        if memory_gib:
            command += ["--memory-gib", str(memory_gib)]
        if mode in HOST_CACHE_GIB:
            command += ["--host-cache-gib", str(HOST_CACHE_GIB[mode])]
        if args.measured_reserve_mib is not None:
            command += ["--measured-reserve-mib", str(args.measured_reserve_mib)]
        if args.upcast_reserve_copies is not None:
            command += ["--upcast-reserve-copies", str(args.upcast_reserve_copies)]
        if args.phases:
            command += ["--phases"]
        if mode == "reload":
            command += ["--reload-attempts", str(args.reload_attempts)]
        row = run_child(command, timeout=args.timeout)
        rows[mode] = row
        if row.get("latents_file") and Path(row["latents_file"]).exists():
            latents[mode] = torch.load(row["latents_file"])
        runs = ", ".join(f"{r['seconds']:.1f}" for r in row.get("runs", []))
        error = f" ERROR {row['error'][:300]}" if row.get("error") else ""
        print(f"{mode}: runs {runs} s; {row.get('policy_reason', '')}{error}", flush=True)
        if row.get("error") and row.get("tail"):
            print(row["tail"][-1500:])
        write()
    summary = summarise(rows, latents)
    write(summary)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f}s; results in {out_dir() / 'fp8.json'}")
    print_table(rows, summary)


if __name__ == "__main__":
    main()
