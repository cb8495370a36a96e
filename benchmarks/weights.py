"""The weights users bring, on one GPU: single files, stored fp8, GGUF and LoRA.

    python benchmarks/weights.py [--folder DIR] [--modes ...] [--runs 3]
    python benchmarks/weights.py --tiny --device cpu      # a smoke run of every mode

The Wan 2.1 14B-shaped folder (``common.build_wan14b_folder``), and beside it, written
once from its transformer: the transformer as one file in the original repository's key
names (bf16), the same with the blocks' matrices in float8_e4m3fn, a GGUF Q8_0 file
(through the ``gguf`` package), and a rank-32 LoRA on every attention projection. Each
mode runs in a process of its own (clean peaks), ``--runs`` prompts each, 480x832,
33 frames, 4 steps:

- ``eager``: diffusers' WanPipeline on the whole card (VAE float32), the reference.
- ``folder-release``, ``file-release``: ondeck.diffusers with policy release over the
  folder, and with ``components={"transformer": the bf16 original-key file}``.
- ``folder-24``, ``file-24``, ``folder-8``, ``file-8``: the same under the automatic
  policy on a card emulated at 24 and 8 GiB (``set_per_process_memory_fraction``).
- ``fp8file-release``, ``fp8file-8``: the float8 file (stored fp8, computed in bf16).
- ``reload``: the transformer loaded five times from the page cache, from the bf16 file
  and from the float8 file: file GB/s and seconds per load.
- ``gguf-full``, ``gguf-16``, ``gguf-8``: the Q8_0 file through ondeck (auto);
  ``gguf-diffusers``: diffusers' own ``from_single_file`` with a GGUFQuantizationConfig,
  everything on the card.
- ``lora-release``: ``folder-release`` with the LoRA (``loras=``), unfused.
- ``compile-release``: ``folder-release`` with ``compile_repeated_blocks()`` recorded:
  every reload gets a fresh module and compiles again; run 1 and later runs' seconds
  against ``folder-release``'s are the recompile cost per reload.

Targets (runs 2-3 against eager in the same call): a single file within 2% of the folder
(release, 24, 8); the fp8 file's reload rate at least 1.8x the bf16 file's, and its 8 GiB
run at most 1.06x eager; GGUF Q8_0 completes at 16 and 8 GiB (ondeck does not stream GGUF
blocks, so where the whole transformer does not fit it stops with a BudgetError before
loading: the table says so); one LoRA under release at most 1.03x the run without.

Run 1's frames of every mode are compared with eager's (same prompt and seed): the
difference fp8, GGUF and the LoRA make against the bf16 folder, and 0 for a single file
holding the same bf16 weights.

The folder (about 40 GB) and the four files (about 60 GB) need about 100 GB of disk; a
slice of the modes (``--modes``) writes only the files it reads. ``--prepare`` builds them
and stops, so the modes can run in later calls of their own.

Needs diffusers, transformers, gguf and peft where it runs (the writers, the eager
reference and ondeck.diffusers all use them). Writes weights.json to $OUT and prints the
table last.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GiB, emit, out_dir, parse_modes, run_child, write_document  # noqa: E402

MODES = {
    # mode: (emulated card GiB or None, minutes it may take on an H200)
    "eager": (None, 4),
    "folder-release": (None, 4),
    "file-release": (None, 4),
    "folder-24": (24, 5),
    "file-24": (24, 5),
    "folder-8": (8, 6),
    "file-8": (8, 6),
    "fp8file-release": (None, 4),
    "fp8file-8": (8, 6),
    "reload": (None, 4),
    "gguf-full": (None, 5),
    "gguf-16": (16, 5),
    "gguf-8": (8, 5),
    "gguf-diffusers": (None, 5),
    "lora-release": (None, 4),
    "compile-release": (None, 8),
}
SHAPE = dict(height=480, width=832, num_frames=33, num_inference_steps=4)
TINY_SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2)
PROMPTS = [
    "a red fox trotting through fresh snow at dawn",
    "a grey heron standing in a misty river",
    "a neon-lit city street in the rain at night",
]

# diffusers' Wan names -> the original repository's: the inverse of diffusers'
# convert_wan_transformer_to_diffusers, to write a file as users download it.
_TO_ORIGINAL = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"\.norm2\.", ".norm3."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
]


def original_name(key: str) -> str:
    for pattern, replacement in _TO_ORIGINAL:
        key = re.sub(pattern, replacement, key)
    return key


def is_block_matrix(key: str, tensor) -> bool:
    return key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2


# -- the files, written once ---------------------------------------------------------------


def transformer_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted((folder / "transformer").glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def files_needed(modes: list[str]) -> set[str]:
    """The files the chosen modes read: a slice of the modes writes only its own (the
    four beside the folder take about 60 GB)."""
    needed = set()
    for mode in modes:
        source = mode.split("-")[0]
        needed |= {"file": {"bf16"}, "fp8file": {"fp8"}, "gguf": {"gguf"}, "lora": {"lora"}}.get(
            source, set()
        )
        if mode == "reload":
            needed |= {"bf16", "fp8"}
    return needed


def write_files(folder: Path, files: Path, needed: set[str]) -> dict[str, Path]:
    """The single files and the LoRA beside the folder that ``needed`` names (each
    skipped when already there)."""
    import torch
    from safetensors.torch import save_file

    files.mkdir(parents=True, exist_ok=True)
    paths = {
        "bf16": files / "wan2.1_t2v_14B_bf16.safetensors",
        "fp8": files / "wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
        "gguf": files / "wan2.1_t2v_14B-Q8_0.gguf",
        "lora": files / "lora_rank32.safetensors",
    }
    if all(paths[name].exists() for name in needed):
        return paths
    started = time.perf_counter()
    tensors = transformer_tensors(folder)
    if "bf16" in needed and not paths["bf16"].exists():
        renamed = {"model.diffusion_model." + original_name(k): v for k, v in tensors.items()}
        save_file(renamed, str(paths["bf16"]))
        del renamed
    if "fp8" in needed and not paths["fp8"].exists():
        stored = {
            "model.diffusion_model." + original_name(key): (
                tensor.to(torch.float8_e4m3fn) if is_block_matrix(key, tensor) else tensor
            )
            for key, tensor in tensors.items()
        }
        save_file(stored, str(paths["fp8"]))
        del stored
    if "gguf" in needed and not paths["gguf"].exists():
        write_gguf(tensors, paths["gguf"])
    if "lora" in needed and not paths["lora"].exists():
        generator = torch.Generator().manual_seed(0)
        lora = {}
        for key, tensor in tensors.items():
            if re.search(r"\.attn[12]\.to_(q|k|v|out\.0)\.weight$", key):
                layer = key.removesuffix(".weight")
                out_features, in_features = tensor.shape
                lora[f"transformer.{layer}.lora_A.weight"] = (
                    torch.randn(32, in_features, generator=generator) * 0.01
                ).to(torch.bfloat16)
                lora[f"transformer.{layer}.lora_B.weight"] = (
                    torch.randn(out_features, 32, generator=generator) * 0.01
                ).to(torch.bfloat16)
        save_file(lora, str(paths["lora"]))
    print(f"(single files written in {time.perf_counter() - started:.0f}s)", flush=True)
    return paths


def write_gguf(tensors: dict, path: Path) -> None:
    """The blocks' matrices Q8_0, everything else F32, in the original key names (as
    city96's GGUF conversions of Wan name them)."""
    import gguf
    import torch

    writer = gguf.GGUFWriter(str(path), arch="wan")
    for key, tensor in tensors.items():
        array = tensor.to(torch.float32).numpy()
        if is_block_matrix(key, tensor) and array.shape[-1] % 32 == 0:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                original_name(key), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(original_name(key), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_folder(root: Path) -> Path:
    """A six-block tiny Wan folder, widths GGUF blocks divide (the smoke run)."""
    import torch
    from diffusers import WanTransformer3DModel

    from ondeck.embedded import PRESETS, build_wan_folder

    path = root / "tiny"
    if (path / "model_index.json").exists():
        return path
    build_wan_folder(path, preset="tiny")
    config = dict(PRESETS["tiny"]["transformer"], attention_head_dim=32, ffn_dim=128, num_layers=6)
    transformer = WanTransformer3DModel(**config).eval()
    for old in (path / "transformer").glob("*"):
        old.unlink()
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.normal_(0, 0.05)
    transformer.save_pretrained(path / "transformer")
    return path


# -- one mode, in a child process ----------------------------------------------------------


def pipeline_for(mode: str, folder: Path, files: dict[str, str], device: str, tiny: bool = False):
    import torch

    if mode == "eager":
        from diffusers import AutoencoderKLWan, WanPipeline

        vae = AutoencoderKLWan.from_pretrained(folder / "vae", torch_dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch.bfloat16)
        return pipe.to(device)
    if mode == "gguf-diffusers":
        from diffusers import (
            AutoencoderKLWan,
            GGUFQuantizationConfig,
            WanPipeline,
            WanTransformer3DModel,
        )

        transformer = WanTransformer3DModel.from_single_file(
            files["gguf"],
            config=str(folder / "transformer"),
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
            torch_dtype=torch.bfloat16,
            local_files_only=True,
        )
        vae = AutoencoderKLWan.from_pretrained(folder / "vae", torch_dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(
            folder, transformer=transformer, vae=vae, torch_dtype=torch.bfloat16
        )
        return pipe.to(device)
    import ondeck.diffusers

    options: dict = {}
    source = mode.split("-")[0]
    if source in ("file", "fp8file", "gguf"):
        key = {"file": "bf16", "fp8file": "fp8", "gguf": "gguf"}[source]
        options["components"] = {"transformer": files[key]}
    if mode.endswith("release"):
        options["policy"] = "release"
    if mode == "lora-release":
        options["loras"] = [files["lora"]]
    pipe = ondeck.diffusers.from_pretrained(
        folder,
        torch_dtype={"default": torch.bfloat16, "vae": torch.float32},
        device=device,
        progress=False,
        **options,
    )
    if mode == "compile-release":
        # The smoke run checks the replay, not inductor's compile time on a CPU.
        backend = {"backend": "eager"} if tiny else {}
        pipe.transformer.compile_repeated_blocks(fullgraph=True, **backend)
    return pipe


def run_mode(args) -> dict:
    import torch
    from wan_modes import emulate_device

    cuda = args.device.startswith("cuda")
    if cuda:
        emulate_device(MODES[args.child][0])
    folder = Path(args.folder)
    files = json.loads(args.files)
    shape = TINY_SHAPE if args.tiny else SHAPE
    result: dict = {"mode": args.child, "memory_gib": MODES[args.child][0], "runs": []}
    started = time.perf_counter()
    try:
        pipe = pipeline_for(args.child, folder, files, args.device, args.tiny)
    except Exception as error:  # a BudgetError names why; the table shows it
        result["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
        return result
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    runtime = getattr(pipe, "ondeck", None)
    if runtime is not None:
        result["policy_reason"] = runtime.policy.reason
    result["setup_seconds"] = time.perf_counter() - started
    for run, prompt in enumerate(PROMPTS[: args.runs]):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            generator = torch.Generator("cpu").manual_seed(run)
            output = pipe(prompt, generator=generator, **shape)
            if cuda:
                torch.cuda.synchronize()
            if run == 0:  # compared with eager's by the parent
                import numpy as np

                frames_path = Path(args.frames_dir) / f"{args.child}.npy"
                np.save(frames_path, np.asarray(output.frames, dtype=np.float32))
                result["frames_file"] = str(frames_path)
        except Exception as error:
            result["error"] = f"run {run + 1}: {type(error).__name__}: {error}".splitlines()[0]
            break
        row = {"seconds": time.perf_counter() - started}
        if cuda:
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        if runtime is not None:
            loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")
            row["transformer_source"] = getattr(loader, "last_source", None)
            row["transformer_load_seconds"] = getattr(loader, "last_load_seconds", None)
        result["runs"].append(row)
        print(f"{args.child} run {run + 1}: {row['seconds']:.2f}s", file=sys.stderr, flush=True)
    return result


def reload_rates(args) -> dict:
    """The transformer loaded from the page cache, bf16 file and float8 file in turns."""
    import torch

    from ondeck.loading import ComponentLoader, ModelFolder
    from ondeck.loading.single_file import SingleFileFolder

    files = json.loads(args.files)
    base = ModelFolder.open(args.folder)
    arms = {name: SingleFileFolder(base, {"transformer": files[name]}) for name in ("bf16", "fp8")}
    loaders = {
        name: ComponentLoader(
            folder, "transformer", device=args.device, dtype=torch.bfloat16, progress=False
        )
        for name, folder in arms.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    file_bytes = {name: Path(files[name]).stat().st_size for name in loaders}
    for attempt in range(args.reload_attempts + 1):
        for name, loader in loaders.items():
            started = time.perf_counter()
            module = loader()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            if attempt:  # the first load of each warms the page cache and the allocator
                seconds[name].append(elapsed)
            del module
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return {
        "mode": "reload",
        "arms": {
            name: {
                "file_bytes": file_bytes[name],
                "median_seconds": statistics.median(values),
                "gb_per_second": file_bytes[name] / statistics.median(values) / 1e9,
                "bf16_bytes_per_second": file_bytes["bf16"] / statistics.median(values) / 1e9,
            }
            for name, values in seconds.items()
        },
    }


# -- the parent: every mode, then the table ------------------------------------------------


def later(row: dict) -> float | None:
    runs = row.get("runs") or []
    if not runs:
        return None
    return statistics.median([r["seconds"] for r in runs[1:]] or [runs[0]["seconds"]])


def ratio(rows: dict, mode: str, against: str) -> float | None:
    a, b = later(rows.get(mode, {})), later(rows.get(against, {}))
    return a / b if a and b else None


def summarise(rows: dict) -> dict:
    reload = rows.get("reload", {}).get("arms", {})
    fp8_rate = reload.get("fp8", {}).get("bf16_bytes_per_second")
    bf16_rate = reload.get("bf16", {}).get("gb_per_second")
    compile_row, plain = rows.get("compile-release", {}), rows.get("folder-release", {})
    recompile = None
    if compile_row.get("runs") and plain.get("runs"):
        recompile = later(compile_row) - later(plain)
    return {
        "file_vs_folder": {
            card: ratio(rows, f"file-{card}", f"folder-{card}") for card in ("release", "24", "8")
        },
        "fp8_reload_vs_bf16": fp8_rate / bf16_rate if fp8_rate and bf16_rate else None,
        "fp8file_8_vs_eager": ratio(rows, "fp8file-8", "eager"),
        "gguf_vs_eager": {m: ratio(rows, m, "eager") for m in ("gguf-full", "gguf-16", "gguf-8")},
        "gguf_vs_diffusers_gguf": {
            m: ratio(rows, m, "gguf-diffusers") for m in ("gguf-full", "gguf-16", "gguf-8")
        },
        "lora_vs_without": ratio(rows, "lora-release", "folder-release"),
        "recompile_seconds_per_reload": recompile,
        "compile_first_run_seconds": (compile_row.get("runs") or [{}])[0].get("seconds"),
    }


def frame_differences(rows: dict) -> dict:
    """Run 1's frames of each mode against eager's (the bf16 folder): max and mean
    absolute difference, pixels in [0, 1]. The same prompt and seed for every mode."""
    import numpy as np

    reference = rows.get("eager", {}).get("frames_file")
    if not reference:
        return {}
    expected = np.load(reference)
    differences = {}
    for mode, row in rows.items():
        if mode == "eager" or not row.get("frames_file"):
            continue
        difference = np.abs(np.load(row["frames_file"]) - expected)
        differences[mode] = {"max": float(difference.max()), "mean": float(difference.mean())}
    return differences


def print_table(rows: dict, summary: dict) -> None:
    print()
    print(f"{'mode':<17} {'runs 2+ s':>9} {'x eager':>8} {'peak GiB':>9}  transformer from / note")
    for mode, row in rows.items():
        if mode == "reload":
            continue
        seconds = later(row)
        peaks = [r.get("peak_allocated_bytes", 0) for r in row.get("runs", [])]
        versus = ratio(rows, mode, "eager")
        source = (row.get("runs") or [{}])[-1].get("transformer_source") or ""
        note = row.get("error") or source
        print(
            f"{mode:<17} {seconds if seconds is not None else float('nan'):>9.2f} "
            f"{versus if versus is not None else float('nan'):>8.3f} "
            f"{max(peaks, default=0) / GiB:>9.2f}  {note}"
        )
    for name, arm in rows.get("reload", {}).get("arms", {}).items():
        print(
            f"reload {name:<10} {arm['median_seconds']:>9.2f} s/load, "
            f"{arm['gb_per_second']:.2f} GB/s of file, {arm['bf16_bytes_per_second']:.2f} GB/s "
            "as bf16 bytes"
        )

    def shown(value):
        if isinstance(value, dict):
            return ", ".join(f"{k} {shown(v)}" for k, v in value.items())
        return "n/a" if value is None else f"{value:.3f}"

    print()
    print("target                                   measured")
    print(f"single file / folder (<= 1.02)          {shown(summary['file_vs_folder'])}")
    print(f"fp8 reload rate / bf16 (>= 1.8)         {shown(summary['fp8_reload_vs_bf16'])}")
    print(f"fp8 file at 8 GiB / eager (<= 1.06)     {shown(summary['fp8file_8_vs_eager'])}")
    print(f"GGUF Q8_0 / eager                       {shown(summary['gguf_vs_eager'])}")
    print(f"GGUF Q8_0 / diffusers' GGUF             {shown(summary['gguf_vs_diffusers_gguf'])}")
    print(f"one LoRA under release / without (1.03) {shown(summary['lora_vs_without'])}")
    print(
        f"recompile seconds per reload            {shown(summary['recompile_seconds_per_reload'])}"
    )
    print()
    print("frames of run 1 against eager's (bf16 folder): max / mean absolute difference")
    for mode, difference in summary.get("frames_vs_eager", {}).items():
        print(f"  {mode:<17} {difference['max']:.3e} / {difference['mean']:.3e}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/ondeck-bench/wan14b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reload-attempts", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny folder: smoke-test the modes")
    parser.add_argument(
        "--prepare", action="store_true", help="build the folder and the modes' files, then stop"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    parser.add_argument("--frames-dir", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        emit(reload_rates(args) if args.child == "reload" else run_mode(args))
        return
    modes = parse_modes(parser, args.modes, MODES)
    if args.tiny:
        folder = tiny_folder(out_dir() / "weights-tiny")
    else:
        from common import ready_wan14b_folder

        folder, _ = ready_wan14b_folder(Path(args.folder))
    written = write_files(folder, folder.parent / "files", files_needed(modes))
    files = {key: str(path) for key, path in written.items()}
    if args.prepare:
        print("folder and files ready: " + ", ".join(p for p in files.values() if Path(p).exists()))
        return
    frames_dir = Path(tempfile.mkdtemp(prefix="ondeck-weights-frames-"))
    rows = {}
    for mode in modes:
        child = [
            __file__,
            "--child", mode,
            "--folder", str(folder),
            "--files", json.dumps(files),
            "--runs", str(args.runs),
            "--reload-attempts", str(args.reload_attempts),
            "--device", args.device,
            "--frames-dir", str(frames_dir),
        ] + (["--tiny"] if args.tiny else [])  # fmt: skip
        rows[mode] = run_child(child, timeout=MODES[mode][1] * 60 * (1 if not args.tiny else 2))
        print(f"{mode}: {later(rows[mode]) or rows[mode].get('error')}", flush=True)
    summary = summarise(rows)
    summary["frames_vs_eager"] = frame_differences(rows)
    shutil.rmtree(frames_dir, ignore_errors=True)
    path = write_document("weights", {"rows": rows, "summary": summary, "files": files})
    print(f"wrote {path}")
    print_table(rows, summary)


if __name__ == "__main__":
    main()
