"""One benchmark mode on a Wan 2.1 14B-shaped folder, in its own process.

    python benchmarks/wan_modes.py --folder DIR --mode ondeck-release [--memory-gib 48]

Generates ``--runs`` videos with different prompts (480x832, 33 frames, 4 steps, guidance
on by default) and prints one ``RESULT {json}`` line, last: wall time per run, peak device
memory allocated per run, peak host RSS (over everything, and over the generations
alone), and for ondeck modes the exposed load seconds, bytes loaded per run, predicted
and measured resident peaks. ``ondeck-stream`` is the budget policy on the (emulated)
device, streaming the transformer's blocks that do not fit; it also records the layout
and the bytes streamed per run.

``--memory-gib`` emulates a smaller device (``set_per_process_memory_fraction``); an
ondeck budget mode given no ``--budget-gib`` then plans against that device's free
memory (the automatic budget), recorded as ``budget_bytes``. ``--host-cache-gib`` gives
ondeck a host cache of that size: components it releases are read back from host memory
rather than from the files, e.g. ``--mode ondeck-budget-prefetch --memory-gib 32
--host-cache-gib 64``.

``diffusers-*`` modes are stock ``WanPipeline.from_pretrained`` (VAE float32, the rest
bfloat16). ``mmgp-1`` and ``mmgp-2`` build the same pipeline on the CPU and hand it to
mmgp (the memory manager behind Wan2GP): ``offload.profile(pipe, HighRAM_HighVRAM)``
resp. ``HighRAM_LowVRAM``, with ``quantizeTransformer=False``; mmgp then moves the models
itself. mmgp casts float32 weights to bfloat16 by default; the VAE is kept in float32
like every other mode unless ``--mmgp-vae-bf16`` (mmgp's default) is given. Load and
profile count in ``setup_seconds``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PeakSampler,
    decode_report,
    emit,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

PROMPTS = [
    "a red fox trotting through fresh snow at dawn",
    "a grey heron standing in a misty river",
    "a neon-lit city street in the rain at night",
]
DIFFUSERS_MODES = ("diffusers-eager", "diffusers-model-offload", "diffusers-group-offload")
# mode: mmgp profile_type member
MMGP_MODES = {"mmgp-1": "HighRAM_HighVRAM", "mmgp-2": "HighRAM_LowVRAM"}
# Modes whose pipeline is a diffusers WanPipeline, called as pipe(...).
PIPE_CALL_MODES = (*DIFFUSERS_MODES, *MMGP_MODES)
HOST_CACHES: list = []


def emulate_device(memory_gib: float | None) -> None:
    import torch

    if memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_gib * 2**30 / total))


def diffusers_pipeline(folder: Path, mode: str):
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(folder / "vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch.bfloat16)
    if mode == "diffusers-eager":
        pipe.to("cuda")
    elif mode == "diffusers-model-offload":
        pipe.enable_model_cpu_offload()
    elif mode == "diffusers-group-offload":
        pipe.enable_group_offload(
            onload_device=torch.device("cuda"),
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
        )
    return pipe


def mmgp_pipeline(folder: Path, mode: str, vae_bf16: bool):
    """The diffusers-eager pipeline left on the CPU, then handed to an mmgp profile."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(folder / "vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch.bfloat16)
    # Only now: mmgp replaces safetensors' loading on import, which breaks diffusers
    # 0.42's safe_open if it is imported before the pipeline is loaded.
    from mmgp import offload, profile_type

    if not vae_bf16:
        # mmgp casts every float32 weight to convertWeightsFloatTo (bfloat16 by default);
        # a model's own _convertWeightsFloatTo overrides it and None keeps float32. Not
        # convertWeightsFloatTo=None for every model: mmgp asserts a single dtype per
        # model, and diffusers keeps a few of the transformer's modules in float32.
        pipe.vae._convertWeightsFloatTo = None
    profile = MMGP_MODES[mode]
    offload.profile(pipe, getattr(profile_type, profile), quantizeTransformer=False, verboseLevel=0)
    info = {
        "profile": profile,
        "overrides": {"quantizeTransformer": False, "verboseLevel": 0},
        "vae_float32_kept": not vae_bf16,
        "dtypes": {
            name: sorted({str(p.dtype) for p in getattr(pipe, name).parameters()})
            for name in ("text_encoder", "transformer", "vae")
        },
    }
    try:
        from importlib.metadata import version

        info["version"] = version("mmgp")
    except Exception:
        pass
    return pipe, info


def ondeck_pipeline(folder: Path, mode: str, args):
    import torch

    from ondeck.loading import HostCache
    from ondeck.pipelines.wan import WanTextToVideo

    if mode in ("ondeck-diffusers", "ondeck-diffusers-release"):
        # The general path a user of any family takes: ondeck.diffusers, no policy
        # argument (auto), or release; the VAE in float32 as diffusers eager has it.
        import ondeck.diffusers

        options = {"policy": "release"} if mode.endswith("release") else {}
        if args.host_memory_gib:
            options["host_memory"] = f"{args.host_memory_gib}GiB"
        pipe = ondeck.diffusers.from_pretrained(
            folder,
            torch_dtype={"default": torch.bfloat16, "vae": torch.float32},
            device="cuda",
            progress=False,
            **options,
        )
        return pipe.ondeck
    if mode == "ondeck-default":
        # Exactly what `ondeck generate MODEL_DIR` builds with no flags: auto, no budget.
        return WanTextToVideo.from_folder(
            folder,
            device="cuda",
            dtype=torch.bfloat16,
            progress=False,
            pipelined=False if args.whole_loads else None,
        )
    policy = mode.removeprefix("ondeck-")
    prefetch = policy in ("budget-prefetch", "stream")
    if policy.startswith("budget") or policy == "stream":
        policy = "budget"
    host_cache = HostCache(int(args.host_cache_gib * 2**30)) if args.host_cache_gib else None
    if host_cache is not None:
        HOST_CACHES.append(host_cache)  # its figures go in the result
    if args.whole_loads and policy == "release":
        # As before pipelined loading: each component whole before its stage computes,
        # and nothing loaded ahead of the next run.
        from ondeck.policy import ReleasePolicy

        policy = ReleasePolicy(prefetch_next_run=False)
    return WanTextToVideo.from_folder(
        folder,
        device="cuda",
        dtype=torch.bfloat16,
        policy=policy,
        budget=f"{args.budget_gib}GiB" if args.budget_gib else None,
        prefetch=prefetch,
        host_cache=host_cache,
        progress=False,
        pipelined=False if args.whole_loads else None,
    )


def bytes_streamed(pipe) -> int:
    """Block bytes copied host to device so far (ondeck streaming), 0 otherwise."""
    streaming = getattr(getattr(pipe, "policy", None), "streaming", None)
    if streaming is None:
        return 0
    return sum(stats["bytes_copied"] for stats in streaming.stats().values())


def streaming_summary(plan) -> dict:
    """Per streamed component, the plan's layout and its predicted seconds per pass:
    pinned copies at the copy rate, or, where some blocks are read from the files each
    pass, the slower of the copies and those reads at the plan's read rate."""
    copy_rate = plan.transfer_bytes_per_second or 0
    summary = {}
    for name, layout in plan.streamed.items():
        seconds = layout.transfer_seconds(copy_rate)
        entry = {
            "resident_blocks": len(layout.resident),
            "streamed_blocks": len(layout.streamed),
            "bytes_per_pass": layout.bytes_per_pass,
            "device_bytes": layout.device_bytes,
            "pinned_seconds_per_pass": seconds,
            "bandwidth_bytes_per_second": copy_rate,
            "bandwidth_source": plan.transfer_source,
            "stages": [use.name for use in plan.uses if name in use.components],
        }
        reads = plan.file_reads.get(name)
        if reads is not None:
            read_rate, read_source = plan.read_rates[name]
            seconds = reads.transfer_seconds(layout, copy_rate, read_rate)
            entry.update(
                file_blocks=len(reads.from_files),
                file_bytes_per_pass=reads.file_bytes_per_pass,
                ring_bytes=reads.ring_bytes,
                read_bytes_per_second=read_rate,
                read_source=read_source,
            )
        entry["predicted_seconds_per_pass"] = seconds
        summary[name] = entry
    return summary


def host_summary(plan) -> dict | None:
    """The plan's host pool: its budget and where it came from, and what it predicts."""
    host = plan.host
    if host is None:
        return None
    return {
        "budget_bytes": host.budget_bytes,
        "source": host.source,
        "predicted_peak_bytes": host.peak_bytes,
        "process_bytes": host.process_bytes,
        "growth_bytes": host.growth_bytes,
        "growth_source": host.growth_source,
        "pinned_bytes": host.pinned_bytes,
        "ring_bytes": host.ring_bytes,
        "cache_bytes": host.cache_bytes,
        "fits": host.fits(),
    }


def frames_digest(frames) -> str:
    """SHA-256 of the frames' bytes: equal digests are bit-for-bit equal videos."""
    import hashlib

    import numpy as np

    array = frames.float().cpu().numpy() if hasattr(frames, "cpu") else np.asarray(frames)
    # Hashed where it lies: a copy of the bytes would add to the host peak measured next.
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).hexdigest()


def pinned_allocator_bytes() -> dict:
    """torch's pinned host allocator: bytes in use and bytes it keeps (empty if unknown)."""
    import torch

    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:
        return {}
    return {k: v for k, v in stats.items() if "bytes" in k and k.endswith(("current", "peak"))}


def allocator_counts(since: dict | None = None) -> dict:
    """The CUDA allocator's counts of cudaMalloc/cudaFree calls, retries and out-of-memory
    errors; the change from ``since`` when given."""
    import torch

    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
    return {k: stats.get(k, 0) - (since or {}).get(k, 0) for k in keys}


def restart_peak_rss() -> bool:
    """Reset VmHWM after setup; False where the kernel does not allow it."""
    reset_peak_rss()
    return peak_rss_bytes() <= rss_bytes() + (64 << 20)


def import_component_classes(folder: Path) -> None:
    """Import the class model_index.json names for each component, as every mode's
    set-up would (diffusers' from_pretrained, mmgp's, ondeck's from_folder). Not through
    ondeck's ``ModelFolder.component_class``: the diffusers and mmgp modes import
    nothing of ondeck, and their imports stay theirs alone."""
    import importlib
    import json

    index = json.loads((folder / "model_index.json").read_text())
    for value in index.values():
        if isinstance(value, list) and len(value) == 2 and all(value):
            library, class_name = value
            getattr(importlib.import_module(library), class_name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--memory-gib", type=float, help="emulate a device of this size")
    parser.add_argument("--budget-gib", type=float, help="explicit budget for ondeck-budget")
    parser.add_argument("--host-cache-gib", type=float, default=0)
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        help="ondeck-diffusers modes: the host budget (host_memory=); else the machine's",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--png", help="write the ondeck memory timeline here")
    parser.add_argument(
        "--whole-loads",
        action="store_true",
        help="ondeck modes: load each component whole before computing (no pipelining, "
        "nothing loaded ahead of the next run under release)",
    )
    parser.add_argument(
        "--mmgp-vae-bf16",
        action="store_true",
        help="mmgp modes: let mmgp cast the VAE to bfloat16 (its default); float32 otherwise",
    )
    args = parser.parse_args()

    import torch

    folder = Path(args.folder)
    emulate_device(args.memory_gib)
    result: dict = {"mode": args.mode, "memory_gib": args.memory_gib, "runs": []}
    if args.host_cache_gib:
        result["host_cache_gib"] = args.host_cache_gib
    reset_peak_rss()
    # The component classes' imports, the same for every mode, timed on their own: the
    # launcher counts everything before setup_start_unix as imports.
    started = time.perf_counter()
    import_component_classes(folder)
    result["class_import_seconds"] = time.perf_counter() - started
    result["setup_start_unix"] = time.time()  # imports done; the launcher knows the spawn
    started = time.perf_counter()
    try:
        if args.mode in DIFFUSERS_MODES:
            pipe = diffusers_pipeline(folder, args.mode)
        elif args.mode in MMGP_MODES:
            pipe, result["mmgp"] = mmgp_pipeline(folder, args.mode, args.mmgp_vae_bf16)
        else:
            pipe = ondeck_pipeline(folder, args.mode, args)
            result["construct_seconds"] = time.perf_counter() - started
            result["policy_reason"] = pipe.policy.reason
            result["budget_bytes"] = getattr(pipe.policy, "budget_bytes", None)
            plan = pipe.plan()
            result["plan_seconds"] = time.perf_counter() - started - result["construct_seconds"]
            result["predicted_peak_bytes"] = plan.peak_bytes
            result["planned_host"] = host_summary(plan)
            if plan.streamed:
                result["planned_streaming"] = streaming_summary(plan)
                print(plan, file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        result["setup_seconds"] = time.perf_counter() - started
        result["setup_peak_rss_bytes"] = peak_rss_bytes()
        result["setup_rss_bytes"] = rss_bytes()
        per_run_rss = restart_peak_rss()
        if per_run_rss:
            result["generation_peak_rss_bytes"] = None  # filled in after the runs
        for run in range(args.runs):
            prompt = PROMPTS[run % len(PROMPTS)]  # past three, the prompts come round again
            torch.cuda.reset_peak_memory_stats()
            if per_run_rss and run:
                reset_peak_rss()  # each run's own peak; the generations' is their maximum
            loaded_before = getattr(getattr(pipe, "tracker", None), "bytes_loaded", 0)
            streamed_before = bytes_streamed(pipe)
            allocator_before = allocator_counts()
            started = time.perf_counter()
            with PeakSampler(torch.cuda.memory_reserved) as sampler:
                if args.mode in PIPE_CALL_MODES:
                    generator = torch.Generator("cpu").manual_seed(run)
                    frames = pipe(
                        prompt,
                        height=args.height,
                        width=args.width,
                        num_frames=args.frames,
                        num_inference_steps=args.steps,
                        generator=generator,
                    ).frames
                else:
                    frames = pipe.generate(
                        prompt,
                        height=args.height,
                        width=args.width,
                        num_frames=args.frames,
                        num_inference_steps=args.steps,
                        seed=run,
                    )
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            if run == 0:
                result["first_video_unix"] = time.time()
            # The generation's own host peak, before this script's checks below touch memory.
            generation_peak = peak_rss_bytes() if per_run_rss else None
            row = {
                "seconds": seconds,
                "sampled_peak_reserved_bytes": sampler.peak,
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "frames_shape": list(frames.shape),
                "frames_mean": float(frames.mean()),
                "frames_sha256": frames_digest(frames),
                "rss_bytes": rss_bytes(),
                # What torch's pinned allocator holds (staging buffers, its own cache):
                # host RSS that neither the host cache nor streaming accounts for.
                "pinned_allocator_bytes": pinned_allocator_bytes(),
                # cudaMalloc calls and retries after freeing the cache (each retry waits
                # for the device): an allocator working at its limit.
                "allocator": allocator_counts(since=allocator_before),
            }
            if per_run_rss:
                row["peak_rss_bytes"] = generation_peak
            if hasattr(pipe, "tracker"):
                # With ONDECK_RESET_PEAKS=1 the tracker resets peaks per stage and keeps each
                # stage's peak; without it, torch's figure above already covers the run.
                row["peak_allocated_bytes"] = max(
                    row["peak_allocated_bytes"], pipe.tracker.run_peak_measured_bytes(run + 1) or 0
                )
                row["exposed_load_seconds"] = pipe.tracker.exposed_load_seconds(run + 1)
                row["bytes_loaded"] = pipe.tracker.bytes_loaded - loaded_before
                row["decode"] = decode_report(pipe)
                row["host_growth_bytes"] = pipe.tracker.host_growth_bytes
            streaming = getattr(getattr(pipe, "policy", None), "streaming", None)
            if streaming is not None and streaming.streamers:
                row["bytes_streamed"] = bytes_streamed(pipe) - streamed_before
                row["streaming"] = streaming.stats()
            result["runs"].append(row)
            print(f"{args.mode} run {run + 1}: {row['seconds']:.2f}s", file=sys.stderr, flush=True)
            del frames
            gc.collect()
        result["rss_bytes_after_runs"] = rss_bytes()
        if hasattr(pipe, "plan"):
            # The plan the later runs ran under (a first run's measurements re-plan).
            after = pipe.plan()
            if after.streamed:
                result["planned_streaming_after"] = streaming_summary(after)
            result["planned_host_after"] = host_summary(after)
        if hasattr(pipe, "tracker"):
            result["measured_resident_peak_bytes"] = pipe.tracker.peak_resident_bytes
            result["stages"] = [vars(s) for s in pipe.tracker.stages]
            result["events"] = [vars(e) for e in pipe.tracker.events]
            if HOST_CACHES:
                result["host_cache"] = HOST_CACHES[-1].stats()
            if args.png:
                pipe.tracker.plot(
                    args.png, title=f"ondeck {args.mode} at {args.memory_gib or 139} GiB"
                )
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    if "generation_peak_rss_bytes" in result:
        result["generation_peak_rss_bytes"] = max(
            [peak_rss_bytes()] + [r.get("peak_rss_bytes", 0) for r in result["runs"]]
        )
    result["peak_rss_bytes"] = max(
        [result.get("setup_peak_rss_bytes", 0), peak_rss_bytes()]
        + [r.get("peak_rss_bytes", 0) for r in result["runs"]]
    )
    result["peak_allocated_bytes"] = max(
        [r["peak_allocated_bytes"] for r in result["runs"]] or [torch.cuda.max_memory_allocated()]
    )
    emit(result)


if __name__ == "__main__":
    main()
