"""The general path on every card: a folder through ``ondeck.diffusers.from_pretrained``
with no policy argument, against diffusers eager in the same call.

    python benchmarks/families.py [--family wan|sd35|hunyuan] [--folder DIR] [--cards full,24,16,8]

``--family sd35``: an SD3.5-Large-shaped folder (an 8B MMDiT, CLIP-L, CLIP-G and T5-XXL
text encoders, random weights, letter tokenizers: no download), 1024x1024, 8 steps,
the same modes and table. ``--family hunyuan``: a HunyuanVideo-shaped folder (the 13B
transformer's 20 double- and 40 single-stream blocks, an 8B Llama and CLIP-L text
encoders, its 3D VAE), 480x848, 33 frames, 4 steps.

Wan 2.1 14B-shaped (``WanPipeline.save_pretrained``'s folder, random weights), 480x832,
33 frames, 4 steps, three prompts per mode, each mode in its own process
(``benchmarks/wan_modes.py --mode ondeck-diffusers``) on a device emulated with
``torch.cuda.set_per_process_memory_fraction``; then ``release`` on the full card.
Prints, last, a table: completed or not, the policy auto chose, runs 2+ (the median of
run 2 and later; runs 2-3 by default) / eager, run 1 / eager's run 1, runs 2+ / the
floor (``floor_ratio``), runs 2+ / the floor counting the resident parts loaded again
each run too (``all_bytes_floor_ratio``, "/all"), the garbage collector's full passes in
runs 2+ (``collector_seconds``, "gc 2+"), peak reserved (sampled), host peak
RSS, how the last run decoded and the plan's transfer floor per pass where blocks stream
(bytes streamed over the measured host-to-device rate). Writes families.json to $OUT.
Each process keeps activation profiles in a fresh folder, so its run 1 is a first-ever
run; ``--profiles DIR`` shares DIR between processes and calls, so a run 1 plans with the
peaks an earlier process measured at its shape, as a later ``ondeck generate`` does.
Each sd35/hunyuan run records the seconds Python's garbage collector took in it (``gc``);
``ONDECK_BENCH_GC_FREEZE=1`` collects and freezes what the set-up left (``gc.freeze``).

``--host-memory 32,16`` (Wan) adds, for each card other than the full one, a run per
host budget given with ``host_memory=``, and ``--cgroup 16`` a run per budget set as a
real cgroup v2 ``memory.max`` around the process (no flag: ondeck reads the limit),
beside the run with the machine's own host budget. A second table compares each:
completed, peak RSS against the budget, streamed blocks read from the files, runs 2+
against eager and against the prediction. The prediction takes the run without a host
limit on the same card and, per streamed component, swaps its per-pass time for the
plan's: a pass costs the slower of its compute (that run's stage seconds per pass) and
the plan's transfer time (pinned copies at the copy rate; blocks from the files at the
plan's read rate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB,
    PeakSampler,
    StackSampler,
    decode_report,
    emit,
    folder_bytes,
    later_seconds,
    median,
    memory_cgroup,
    out_dir,
    peak_reserved,
    peak_rss_bytes,
    ready_wan14b_folder,
    reset_peak_rss,
    rss_bytes,
    run_child,
    wan_modes_command,
    warm_page_cache,
)
from policies import card_label, chosen_policy  # noqa: E402


def transfer_floor(row: dict) -> str:
    """The plan's bytes streamed a pass and their transfer time, as planned after the runs
    (rates measured), else before them."""
    planned = row.get("planned_streaming_after") or row.get("planned_streaming") or {}
    if not planned:
        return "-"
    seconds = sum(part["predicted_seconds_per_pass"] for part in planned.values())
    nbytes = sum(part["bytes_per_pass"] for part in planned.values())
    return f"{nbytes / GiB:.1f}G {seconds * 1000:.0f}ms/pass"


def eager_compute(eager: dict) -> dict[str, float]:
    """Eager's seconds per component, the median of its runs 2+ (none where its runs
    kept no stages: Wan's modes run in a script of their own)."""
    names = {stage[0] for run in eager["runs"] for stage in run.get("stages") or ()}
    return {
        name: median(
            [
                sum(s[1] for s in run.get("stages") or () if s[0] == name)
                for run in eager["runs"][1:]
            ]
        )
        for name in names
    }


def floor_ratio(row: dict, eager: dict | None) -> str:
    """Runs 2+ over the floor a run streaming by its plan cannot beat: eager's runs 2+,
    each component's turn taken at the slower of eager's compute for it and the
    transfer floor of its streamed blocks in a call under the plan the run ran by
    (``Plan.call_transfer_seconds``; a pass's transfer overlaps its compute)."""
    runs = row.get("runs") or []
    if not eager or len(eager.get("runs") or []) < 2 or len(runs) < 2:
        return "-"
    if "call_transfer_seconds" not in runs[0]:
        return "-"
    compute = eager_compute(eager)
    if not compute:
        return "-"
    ratios = []
    for before, run in zip(runs, runs[1:], strict=False):
        floors = {
            name: seconds
            for name, seconds in before["call_transfer_seconds"].items()
            if math.isfinite(seconds)
        }
        extra = sum(max(0.0, floors.get(name, 0.0) - seconds) for name, seconds in compute.items())
        ratios.append(run["seconds"] / (later_seconds(eager) + extra))
    return f"{median(ratios):.3f}"


def all_bytes_floor_ratio(row: dict, eager: dict | None) -> str:
    """Runs 2+ over a floor that also counts what the floor above leaves out: the parts
    of components loaded again each run (their ``load`` events' bytes), which cross the
    same bus as the streamed blocks. Each component's turn takes the slower of eager's
    compute for it and its streamed and loaded bytes at the plan's transfer rate."""
    runs = row.get("runs") or []
    planned = row.get("planned_streaming_after") or row.get("planned_streaming") or {}
    seconds = sum(part["predicted_seconds_per_pass"] for part in planned.values())
    if not eager or len(eager.get("runs") or []) < 2 or len(runs) < 2 or seconds <= 0:
        return "-"
    rate = sum(part["bytes_per_pass"] for part in planned.values()) / seconds
    compute = eager_compute(eager)
    if not compute:
        return "-"
    ratios = []
    for before, run in zip(runs, runs[1:], strict=False):
        moved = dict(before.get("call_transfer_seconds") or {})
        for event in run.get("events") or []:
            if event[1] == "load" and event[3]:
                moved[event[2]] = moved.get(event[2], 0.0) + event[3] / rate
        extra = sum(
            max(0.0, moved[name] - compute.get(name, 0.0))
            for name in moved
            if math.isfinite(moved[name])
        )
        ratios.append(run["seconds"] / (later_seconds(eager) + extra))
    return f"{median(ratios):.3f}"


def collector_seconds(row: dict) -> str:
    """Seconds of the garbage collector's full passes in runs 2+ (each a scan of every
    object the process holds, 0.2-0.4 s where one lands): where a run's time went that
    is neither the device's nor ondeck's loads; "+S" the seconds of those between them."""
    runs = (row.get("runs") or [])[1:]
    if not runs or any("gc" not in run for run in runs):
        return "-"
    inside = sum(run["gc"].get("full_seconds", 0.0) for run in runs)
    between = sum(run["gc"].get("between_full_seconds", 0.0) for run in runs)
    return f"{inside:.2f}" + (f"+{between:.2f}" if between else "")


def decoded(row: dict) -> str:
    runs = row.get("runs") or []
    last = (runs[-1].get("decode") or {}) if runs else {}
    if not last:
        return "-"
    tiles = last.get("tiles", 0)
    text = "whole" if not tiles else f"{tiles} tiles"
    return text + (f", {last['retries']} retried" if last.get("retries") else "")


# SD3.5 Large's MMDiT: 38 blocks, 8B parameters.
SD35_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
)  # fmt: skip


def build_sd35_folder(path: Path) -> Path:
    """SD3.5 Large's shapes with random bf16 weights, as the pipeline saves them."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        ByT5Tokenizer,
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
    )

    if (path / "model_index.json").exists():
        return path

    def clip(hidden: int, layers: int, heads: int, act: str):
        config = CLIPTextConfig(
            vocab_size=49408, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, projection_dim=hidden,
            max_position_embeddings=77, hidden_act=act, bos_token_id=0, eos_token_id=1,
            pad_token_id=1,
        )  # fmt: skip
        return CLIPTextModelWithProjection(config)

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        vocab.update({f"{c}{suffix}": len(vocab) for c in "abcdefghijklmnopqrstuvwxyz"})
    with torch.device("cuda"):
        parts = dict(
            transformer=SD3Transformer2DModel(**SD35_TRANSFORMER),
            text_encoder=clip(768, 12, 12, "quick_gelu"),
            text_encoder_2=clip(1280, 32, 20, "gelu"),
            text_encoder_3=T5EncoderModel(
                T5Config(
                    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                    num_heads=64, feed_forward_proj="gated-gelu",
                )
            ),
            vae=AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=16,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False,
                use_post_quant_conv=False, sample_size=1024,
            ),
        )  # fmt: skip
    with torch.no_grad():
        for module in parts.values():
            module.to(torch.bfloat16)
            for parameter in module.parameters():
                parameter.normal_(0, 0.02)
    StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        tokenizer=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
        tokenizer_2=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
        tokenizer_3=ByT5Tokenizer(),
        **parts,
    ).save_pretrained(path, max_shard_size="5GB")
    del parts
    torch.cuda.empty_cache()
    return path


def build_hunyuan_folder(path: Path) -> Path:
    """HunyuanVideo's shapes with random bf16 weights, as the pipeline saves them."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTokenizer,
        LlamaConfig,
        LlamaModel,
    )

    if (path / "model_index.json").exists():
        return path
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        vocab.update({f"{c}{suffix}": len(vocab) for c in "abcdefghijklmnopqrstuvwxyz"})
    llama = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=32, bos_token_id=0, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    clip = CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 43 GiB on the device, not 86
    try:
        with torch.device("cuda"):
            parts = dict(
                transformer=HunyuanVideoTransformer3DModel(),  # its default is the 13B
                text_encoder=LlamaModel(llama),
                text_encoder_2=CLIPTextModel(clip),
                vae=AutoencoderKLHunyuanVideo(),
            )
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for module in parts.values():
            for parameter in module.parameters():
                parameter.normal_(0, 0.02)
    HunyuanVideoPipeline(
        tokenizer=ByT5Tokenizer(),
        tokenizer_2=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        **parts,
    ).save_pretrained(path, max_shard_size="5GB")
    del parts
    torch.cuda.empty_cache()
    return path


# Per family: the pipeline class, the call's arguments beyond the prompt, and the output.
CALLS = {
    "sd35": (
        "StableDiffusion3Pipeline",
        dict(height=1024, width=1024, guidance_scale=5.0),
        "images",
    ),
    "hunyuan": (
        "HunyuanVideoPipeline",
        dict(height=480, width=848, num_frames=33, guidance_scale=6.0),
        "frames",
    ),
}


# Runs beyond these come round to the first prompts again: with --prompt-cache, a prompt
# seen before is answered without its encoders.
PROMPTS = [
    "a red fox in fresh snow",
    "a grey heron in a misty river",
    "a neon street",
    "a lighthouse in a storm",
    "a bowl of ripe cherries",
    "an old tram in the fog",
]


class CallTimer:
    """The device seconds of every call of one method, read with CUDA events."""

    def __init__(self, owner, method: str):
        import torch

        self.pairs: list = []
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return original(*args, **kwargs)
            finally:
                end.record()
                self.pairs.append((start, end))

        setattr(owner, method, timed)

    def take(self) -> float:
        seconds = sum(start.elapsed_time(end) for start, end in self.pairs) / 1000
        self.pairs.clear()
        return seconds


def component_timers(pipe) -> dict:
    """A timer per text encoder and transformer call and per VAE decode, of eager's run."""
    timers = {}
    for name, module in pipe.components.items():
        if name.startswith(("text_encoder", "transformer")) and module is not None:
            timers[name] = CallTimer(module, "forward")
    timers["vae"] = CallTimer(pipe.vae, "decode")
    return timers


def eager_pipeline(family: str, folder: str):
    """The family's diffusers pipeline, every component on the GPU in bf16."""
    import diffusers
    import torch

    pipeline_class = CALLS[family][0]
    return (
        getattr(diffusers, pipeline_class)
        .from_pretrained(folder, torch_dtype=torch.bfloat16)
        .to("cuda")
    )


def load_events(tracker, run: int) -> list[list]:
    """The run's loads, fills, releases and waits: [seconds, kind, name, bytes, duration]."""
    return [
        [round(e.seconds, 3), e.kind, e.name, e.nbytes, e.duration_seconds]
        for e in tracker.events
        if e.run == run and e.kind in ("load", "fill", "release", "wait")
    ]


class GcTimer:
    """Seconds Python's cyclic garbage collector held the interpreter, per run, and how
    many of its passes were full ones (the oldest generation), through ``gc.callbacks``.
    Full passes between runs (``inside`` false: after a run's timing, before the next
    one's) are counted apart, as ``between_full_seconds``: a run that pauses the
    collector moves what it would scan there."""

    def __init__(self) -> None:
        import gc

        self.seconds = self.full_seconds = self.between_full_seconds = 0.0
        self.passes = self.full_passes = 0
        self.inside = False
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        if info.get("generation") == 2 and not self.inside:
            self.between_full_seconds += seconds
            return
        self.seconds += seconds
        self.passes += 1
        if info.get("generation") == 2:
            self.full_seconds += seconds
            self.full_passes += 1

    def take(self) -> dict:
        taken = {
            "seconds": round(self.seconds, 4),
            "passes": self.passes,
            "full_seconds": round(self.full_seconds, 4),
            "full_passes": self.full_passes,
            "between_full_seconds": round(self.between_full_seconds, 4),
        }
        self.seconds = self.full_seconds = self.between_full_seconds = 0.0
        self.passes = self.full_passes = 0
        return taken


def family_child(args) -> None:
    """One mode of an sd35 or hunyuan family, in this process: prints its RESULT line."""
    import torch

    if args.memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * GiB / total))

    import ondeck.diffusers
    from ondeck.loading import HostCache

    result: dict = {"mode": args.child, "memory_gib": args.memory_gib, "runs": []}
    reset_peak_rss()
    started = time.perf_counter()
    try:
        pipeline_class, call, output = CALLS[args.family]
        if args.child == "diffusers-eager":
            pipe = eager_pipeline(args.family, args.folder)
            runtime = None
            timers = component_timers(pipe)
        else:
            options = {"policy": "release"} if args.child.endswith("release") else {}
            if args.host_cache_gib == "auto":
                options["host_cache"] = HostCache(elastic=True)
            elif args.host_cache_gib:
                options["host_cache"] = HostCache(int(float(args.host_cache_gib) * GiB))
            if args.prompt_cache:  # as `ondeck generate` has it
                options["prompt_cache"] = True
            pipe = ondeck.diffusers.from_pretrained(
                args.folder, torch_dtype=torch.bfloat16, device="cuda", progress=False, **options
            )
            runtime = pipe.ondeck
            result["policy_reason"] = runtime.policy.reason
            plan = runtime.plan()
            result["predicted_peak_bytes"] = plan.peak_bytes
            if plan.streamed:
                print(plan, file=sys.stderr, flush=True)
                result["planned_streaming"] = {
                    name: {
                        "bytes_per_pass": layout.bytes_per_pass,
                        "predicted_seconds_per_pass": layout.transfer_seconds(
                            plan.transfer_bytes_per_second or 0
                        ),
                    }
                    for name, layout in plan.streamed.items()
                }
        pipe.set_progress_bar_config(disable=True)
        if os.environ.get("ONDECK_BENCH_GC_FREEZE") == "1":
            import gc

            gc.collect()
            gc.freeze()  # what is alive after the set-up is never scanned again
        result["setup_seconds"] = time.perf_counter() - started
        collector = GcTimer()
        # A new prompt each run; past three they come round again.
        prompts = [PROMPTS[run % len(PROMPTS)] for run in range(args.runs)]
        for run, prompt in enumerate(prompts):
            started = time.perf_counter()
            collector.inside = True
            # ONDECK_BENCH_STACKS=N: sample the threads' stacks, N frames deep (at least 4).
            depth = os.environ.get("ONDECK_BENCH_STACKS")
            stacks = StackSampler(depth=max(4, int(depth)), timed=True) if depth else None
            with (
                PeakSampler(torch.cuda.memory_reserved) as sampler,
                warnings.catch_warnings(record=True) as caught,
                stacks or contextlib.nullcontext(),
            ):
                warnings.simplefilter("always")
                images = getattr(
                    pipe(
                        prompt,
                        num_inference_steps=args.steps,
                        generator=torch.Generator("cpu").manual_seed(run),
                        output_type="np",
                        **call,
                    ),
                    output,
                )
                torch.cuda.synchronize()
            collector.inside = False
            row = {
                "seconds": time.perf_counter() - started,
                "sampled_peak_reserved_bytes": sampler.peak,
                "rss_bytes": rss_bytes(),
                "output_mean": float(images.mean()),
                "gc": collector.take(),
            }
            if runtime is None:
                row["stages"] = [[name, timer.take()] for name, timer in timers.items()]
            else:
                row["stages"] = [
                    [s.stage, s.seconds, s.exposed_load_seconds, s.allocator_retries]
                    for s in runtime.tracker.stages
                    if s.run == run + 1
                ]
                row["events"] = load_events(runtime.tracker, run + 1)
                row["loaded_from"] = {
                    name: getattr(loader, "last_source", None)
                    for name, loader in runtime.loaders.items()
                }
                row["decode"] = decode_report(runtime)
                row["exposed_load_seconds"] = runtime.tracker.exposed_load_seconds(run + 1)
                row["seconds_per_call"] = dict(runtime.tracker.seconds_per_call)
                row["load_bytes_per_second"] = dict(runtime.tracker.load_bytes_per_second)
                plan = runtime.plan()
                row["plan_notes"] = list(plan.streaming_notes)
                row["plan_after"] = str(plan)
                row["call_transfer_seconds"] = {
                    name: seconds
                    for name in plan.streamed
                    if (seconds := plan.call_transfer_seconds(name)) is not None
                }
                row["measured_activation"] = dict(runtime.snapshot().measured_activation)
                streaming = getattr(runtime.policy, "streaming", None)
                if streaming is not None:
                    row["streaming"] = streaming.stats()
            if stacks is not None:
                row["stacks"], row["gil_gaps"] = stacks.top(60), stacks.gaps
                row["stack_samples"] = [
                    (round(at - started, 4), thread, chain) for at, thread, chain in stacks.samples
                ]
            row["warnings"] = [str(w.message)[:500] for w in caught]
            result["runs"].append(row)
            print(f"{args.child} run {run + 1}: {row['seconds']:.2f}s", file=sys.stderr)
    except Exception as error:
        import traceback

        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    result["peak_rss_bytes"] = peak_rss_bytes()
    emit(result)


def passes_per_run(row: dict, component: str) -> float:
    """The forward passes ``component`` streamed in the last run."""
    runs = row.get("runs") or []
    counts = [(r.get("streaming") or {}).get(component, {}).get("passes", 0) for r in runs]
    return counts[-1] - counts[-2] if len(counts) > 1 else float(counts[-1] if counts else 0)


def stage_seconds(row: dict, names: list[str]) -> float:
    """The last run's seconds in the stages named."""
    stages = row.get("stages") or []
    last = max((s["run"] for s in stages), default=0)
    return sum(s["seconds"] for s in stages if s["run"] == last and s["stage"] in names)


def predicted_seconds(row: dict, reference: dict) -> float | None:
    """Runs 2-3 of ``row`` as the plan predicts them from ``reference`` (the same card,
    no host limit): each streamed component's passes cost the slower of their compute
    and the plan's transfer time, in place of what they cost in the reference."""
    planned_row = row.get("planned_streaming_after") or row.get("planned_streaming")
    if not reference.get("runs") or not planned_row:
        return None
    seconds = later_seconds(reference)
    reference_plan = (
        reference.get("planned_streaming_after") or reference.get("planned_streaming") or {}
    )
    for name, planned in planned_row.items():
        passes = passes_per_run(reference, name)
        if not passes or name not in reference_plan:
            continue
        compute = stage_seconds(reference, planned.get("stages", [])) / passes
        before = max(compute, reference_plan[name]["predicted_seconds_per_pass"])
        seconds += passes * (max(compute, planned["predicted_seconds_per_pass"]) - before)
    return seconds


def print_host_table(rows: list[dict], eager_later: float | None) -> None:
    host_rows = [r for r in rows if r.get("host_label")]
    if not host_rows:
        return
    print(
        f"\n{'card':<8} {'host budget':<16} {'done':<5} {'runs 2+':>8} {'/eager':>7} "
        f"{'/predicted':>10} {'peak RSS':>9} {'<= budget':>9} {'plan host':>9} from files"
    )
    for row in rows:
        if row["mode"] != "ondeck-diffusers" or row["card"] == "full":
            continue
        reference = next(
            (r for r in rows if r["card"] == row["card"] and not r.get("host_label")), {}
        )
        runs = row.get("runs", [])
        later = later_seconds(row) if len(runs) > 1 else None
        predicted = predicted_seconds(row, reference) if row.get("host_label") else None
        budget = row.get("host_budget_bytes")
        rss = row.get("peak_rss_bytes", 0)
        after = row.get("planned_streaming_after") or row.get("planned_streaming") or {}
        files = sum(part.get("file_blocks", 0) for part in after.values())
        host = row.get("planned_host_after") or row.get("planned_host") or {}
        planned_host = host.get("predicted_peak_bytes") or 0
        print(
            f"{card_label(row['card']):<8} {row.get('host_label') or 'machine':<16} "
            f"{'yes' if later and not row.get('error') else 'NO':<5} "
            f"{later or float('nan'):>8.2f} "
            f"{later / eager_later if later and eager_later else float('nan'):>7.3f} "
            f"{later / predicted if later and predicted else float('nan'):>10.3f} "
            f"{rss / GiB:>8.1f}G {('yes' if rss <= budget else 'NO') if budget else '-':>9} "
            f"{planned_host / GiB:>8.1f}G {files} blocks"
        )


def family_steps(family: str) -> int:
    """The denoising steps a family's runs take where none are given."""
    return 4 if family == "hunyuan" else 8


def ready_family_folder(family: str, folder: str | None) -> Path:
    """The sd35 or hunyuan folder (built where missing), its files in the page cache."""
    build = build_sd35_folder if family == "sd35" else build_hunyuan_folder
    path = build(Path(folder or f"/tmp/{family}"))
    warm_page_cache(sorted(str(p) for p in path.glob("*/*.safetensors")))
    return path


def family_command(
    family: str,
    folder: Path,
    mode: str,
    runs: int,
    steps: int,
    memory: int | None,
    cache=None,
    prompt_cache: bool = False,
) -> list:
    command = [__file__, "--child", mode, "--family", family, "--folder", str(folder)]
    command += ["--runs", str(runs), "--steps", str(steps)]
    command += ["--host-cache-gib", str(cache)] if cache else []
    command += ["--prompt-cache"] if prompt_cache else []
    return command + (["--memory-gib", str(memory)] if memory else [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["wan", "sd35", "hunyuan"], default="wan")
    parser.add_argument("--folder")
    parser.add_argument("--cards", default="full,24,16,8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, help="denoising steps (sd35 8, hunyuan 4)")
    parser.add_argument("--no-release", action="store_true")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--host-memory", default="", help="host budgets in GiB, e.g. 32,16")
    parser.add_argument("--cgroup", default="", help="host budgets in GiB as a cgroup's memory.max")
    parser.add_argument(
        "--profiles",
        help="a folder every ondeck process keeps its activation profiles in (ONDECK_CACHE): "
        "run 1 plans with the peaks an earlier process measured at the same shape; "
        "default: a fresh folder per process, so run 1 is a first-ever run",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--memory-gib", type=float, help=argparse.SUPPRESS)
    parser.add_argument(
        "--host-cache",
        help="sd35/hunyuan: each ondeck mode again with a host cache of this many GiB, or "
        "auto (an elastic one)",
    )
    parser.add_argument("--host-cache-gib", help=argparse.SUPPRESS)
    parser.add_argument(
        "--prompt-cache",
        action="store_true",
        help="sd35/hunyuan: ondeck's encoders keep their answers, as `ondeck generate`'s do",
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = family_steps(args.family)
    if args.child:
        family_child(args)
        return
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.perf_counter()
    if args.family == "wan":
        folder = args.folder or os.environ.get("WAN14B_FOLDER", "/tmp/wan14b-saved")
        path, sizes = ready_wan14b_folder(Path(folder))
    else:
        path = ready_family_folder(args.family, args.folder)
        sizes = folder_bytes(path)
        print(
            f"folder {path}: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in sizes.items() if v)
        )
    rows: list[dict] = []

    def write() -> None:
        document = {
            "family": args.family,
            "folder_bytes": sizes,
            "rows": rows,
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/families.py " + " ".join(sys.argv[1:]),
        }
        (out_dir() / "families.json").write_text(json.dumps(document, indent=2, default=str))

    plan = [] if args.no_eager else [("diffusers-eager", "full", None, False)]
    hosts = [float(gib) for gib in args.host_memory.split(",") if gib]
    cgroups = [float(gib) for gib in args.cgroup.split(",") if gib]
    for card in (card for card in args.cards.split(",") if card):
        plan.append(("ondeck-diffusers", card, None, False))
        if card != "full" and args.family == "wan":
            plan += [("ondeck-diffusers", card, gib, False) for gib in hosts]
            plan += [("ondeck-diffusers", card, gib, True) for gib in cgroups]
    if not args.no_release:
        plan.append(("ondeck-diffusers-release", "full", None, False))
    if args.host_cache and args.family != "wan":
        plan += [
            (mode, card, None, "cache") for mode, card, _, _ in plan if mode != "diffusers-eager"
        ]
    for mode, card, host_gib, in_cgroup in plan:
        cache = args.host_cache if in_cgroup == "cache" else None
        in_cgroup = in_cgroup is True
        memory = None if card == "full" else int(card)
        cgroup = None
        if args.family == "wan":
            host_flag = None if in_cgroup else host_gib
            command = wan_modes_command(
                path, mode, args.runs, memory_gib=memory, host_memory_gib=host_flag
            )
        else:
            command = family_command(
                args.family, path, mode, args.runs, args.steps, memory, cache, args.prompt_cache
            )
        if in_cgroup:
            try:
                cgroup = memory_cgroup(f"ondeck-bench-{host_gib:g}", int(host_gib * GiB))
            except OSError as error:
                rows.append(
                    {
                        "mode": mode,
                        "card": card,
                        "host_label": f"cgroup {host_gib:g}G",
                        "error": f"no cgroup: {error}",
                    }
                )
                print(f"cgroup {host_gib:g} GiB: not made here ({error})")
                continue
        profiles = args.profiles or tempfile.mkdtemp(prefix="ondeck-bench-cache-")
        os.environ["ONDECK_CACHE"] = profiles
        row = run_child(command, timeout=args.timeout, cgroup=cgroup)
        row.update(mode=mode, card=card, profiles="kept" if args.profiles else "fresh")
        if host_gib:
            row["host_label"] = f"{'cgroup' if in_cgroup else 'flag'} {host_gib:g}G"
            row["host_budget_bytes"] = int(host_gib * GiB)
        if cache:
            row["host_label"] = "cache auto" if cache == "auto" else f"cache {float(cache):g}G"
        rows.append(row)
        runs = ", ".join(f"{r['seconds']:.1f}" for r in row.get("runs", []))
        error = f" ERROR {row['error'][:400]}" if row.get("error") else ""
        label = f" host {row['host_label']}" if row.get("host_label") else ""
        print(
            f"{mode} @ {card_label(card)}{label}: runs {runs} s; "
            f"{row.get('policy_reason', '')}{error}"
        )
        if row.get("error") and (row.get("tail") or row.get("traceback")):
            print((row.get("traceback") or row.get("tail"))[-1500:])
        write()

    eager = next((r for r in rows if r["mode"] == "diffusers-eager" and r.get("runs")), None)
    eager_later = later_seconds(eager) if eager else None
    eager_first = eager["runs"][0]["seconds"] if eager else None
    print(f"\ntotal {time.perf_counter() - started:.0f}s; results in {out_dir() / 'families.json'}")
    print(
        f"\n{'card':<10} {'mode':<26} {'done':<5} {'policy':<8} {'runs 2+':>8} {'/eager':>7} "
        f"{'last/eager':>10} {'run 1/eager 1':>13} {'/floor':>7} {'/all':>6} {'gc 2+':>10} {'reserved':>9} "
        f"{'RSS':>7} "
        f"{'decode':<18} transfer floor"
    )
    for row in rows:
        runs = row.get("runs", [])
        done = len(runs) == args.runs and not row.get("error")
        later = later_seconds(row) if runs else None
        ratio = f"{later / eager_later:.3f}" if later and eager_later else "-"
        last = f"{runs[-1]['seconds'] / eager_later:.3f}" if runs and eager_later else "-"
        first = f"{runs[0]['seconds'] / eager_first:.2f}" if runs and eager_first else "-"
        policy = chosen_policy(row) if row["mode"] != "diffusers-eager" else "-"
        mode = row["mode"] + (f" {row['host_label']}" if row.get("host_label") else "")
        print(
            f"{card_label(row['card']):<10} {mode:<26} {'yes' if done else 'NO':<5} "
            f"{policy:<8} {later or float('nan'):>8.2f} {ratio:>7} {last:>10} {first:>13} "
            f"{floor_ratio(row, eager) if row is not eager else '-':>7} "
            f"{all_bytes_floor_ratio(row, eager) if row is not eager else '-':>6} "
            f"{collector_seconds(row):>10} "
            f"{(peak_reserved(row) or 0) / GiB:>8.1f}G {row.get('peak_rss_bytes', 0) / GiB:>6.1f}G "
            f"{decoded(row):<18} {transfer_floor(row)}"
        )
    print_host_table(rows, eager_later)


if __name__ == "__main__":
    main()
