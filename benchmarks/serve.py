"""``ondeck serve`` against its targets: a Wan 14B-shaped video model and a ~31 GiB
Flux-shaped image model served together on one emulated card, with a mixed queue.

    python benchmarks/serve.py [--card 24] [--parts eager,first,switch,soak] [--wheels DIR]

Measures, each against the target it is named for:
- ``eager``: diffusers eager's one-shot time to first video (a fresh process: imports,
  load, one call), on the full card;
- ``first``: the first video request to a running server (started beforehand, nothing
  loaded), then the same request warm: wall time over the job's own run time;
- ``switch``: alternating video and image jobs, queued together, once with the queue's
  look-ahead and once without (``--no-lookahead``): each switch's exposed load time over
  the plan's predicted load time at the measured rate, and with over without;
- ``soak``: a mixed queue (``--jobs``, a tenth failing, a twentieth cancelled): crashes,
  server RSS growth, device bytes allocated beyond the resident weights after each
  batch, and whether each good job's output equals the same job run alone.

The folders hold random weights at the real shapes (built once, on the GPU, and kept in
``--folders``; about 75 GB: use a machine with that much disk). Where diffusers and the
server's packages are not installed, ``--wheels DIR`` installs them from local wheels
into ``--target`` (torch is never touched); or put a ``pip install --target`` folder on
PYTHONPATH. ``--tiny`` runs every part on the CPU with tiny models, to check the script.
Prints a short table last; writes serve.json to $OUT.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GiB = 2**30
MiB = 2**20

# Import name -> distribution, for what the server and the folders need beside torch.
NEEDED = {
    "diffusers": "diffusers",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
    "huggingface_hub": "huggingface_hub",
    "tokenizers": "tokenizers",
    "fastapi": "fastapi",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic_core",
    "annotated_types": "annotated_types",
    "typing_inspection": "typing_inspection",
    "python_multipart": "python_multipart",
    "httpx": "httpx",
    "httpcore": "httpcore",
    "h11": "h11",
    "anyio": "anyio",
    "sniffio": "sniffio",
    "idna": "idna",
    "certifi": "certifi",
    "click": "click",
    "imageio": "imageio",
    "imageio_ffmpeg": "imageio-ffmpeg",
    "matplotlib": "matplotlib",
    "psutil": "psutil",
    "tqdm": "tqdm",
    "regex": "regex",
    "yaml": "pyyaml",
    "PIL": "pillow",
}


def ensure_packages(wheels: str | None, target: Path) -> dict[str, str]:
    """Install what is missing from ``wheels`` into ``target`` (no index, no deps: torch
    and what is already there stay as they are); returns the environment for children."""
    env = dict(os.environ)
    paths = [str(ROOT)]
    if wheels:
        missing = [dist for name, dist in NEEDED.items() if importlib.util.find_spec(name) is None]
        if missing:
            target.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            command += ["--find-links", wheels, "--target", str(target), *missing]
            print("installing " + " ".join(missing), flush=True)
            subprocess.run(command, check=True)
        paths.append(str(target))
        sys.path[:0] = [str(target)]
    sys.path[:0] = [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("ONDECK_PROGRESS", "0")
    return env


# -- folders ------------------------------------------------------------------------


def _clip_tokenizer():
    """A CLIP BPE tokenizer over single letters, built in code: no download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for letter in "abcdefghijklmnopqrstuvwxyz":
            vocab[letter + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_flux_folder(path: Path) -> Path:
    """FLUX.1-dev's shapes (12B transformer, T5-XXL, CLIP-L, its VAE) in bf16 with random
    weights, about 31 GiB, written by diffusers' own ``save_pretrained``."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if (path / "model_index.json").exists():
        return path
    with torch.device("cuda"):
        transformer = FluxTransformer2DModel(guidance_embeds=True).to(torch.bfloat16)
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=32128,
                d_model=4096,
                d_kv=64,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                feed_forward_proj="gated-gelu",
                is_gated_act=True,
            )
        ).to(torch.bfloat16)
        clip = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=768,
                intermediate_size=3072,
                num_attention_heads=12,
                num_hidden_layers=12,
                projection_dim=768,
            )
        ).to(torch.bfloat16)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=16,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            shift_factor=0.1159,
            scaling_factor=0.3611,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).to(torch.bfloat16)
    with torch.no_grad():
        for module in (transformer, t5, clip, vae):
            for parameter in module.parameters():
                parameter.normal_(0, 0.02)
    FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=clip,
        tokenizer=_clip_tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=ByT5Tokenizer(),
        transformer=transformer,
    ).save_pretrained(path, max_shard_size="5GB")
    del transformer, t5, clip, vae
    torch.cuda.empty_cache()
    return path


def build_broken_folder(path: Path) -> Path:
    """A tiny Wan whose transformer weights are NaN: every job on it fails, at full speed."""
    from safetensors.torch import load_file, save_file

    from ondeck.embedded import build_wan_folder

    if (path / "model_index.json").exists():
        return path
    build_wan_folder(path, preset="tiny", seed=2)
    weights = path / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file({k: v.fill_(float("nan")) for k, v in load_file(weights).items()}, weights)
    return path


def build_folders(args: argparse.Namespace) -> dict[str, Path]:
    root = Path(args.folders)
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests" / "integrations"))
        import tiny_pipelines

        from ondeck.embedded import build_wan_folder

        video = root / "tiny-wan"
        if not (video / "model_index.json").exists():
            build_wan_folder(video, preset="tiny", vivid=True)
        image = root / "tiny-sd3"
        if not (image / "model_index.json").exists():
            tiny_pipelines.build_sd3(image)
    else:
        sys.path.insert(0, str(HERE))
        from common import build_wan14b_folder

        video = build_wan14b_folder(root / "wan14b-saved")
        image = build_flux_folder(root / "flux-shaped")
    return {"video": video, "image": image, "broken": build_broken_folder(root / "broken")}


def folder_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*/*.safetensors")) / GiB


# -- diffusers eager, one shot --------------------------------------------------------

EAGER = """
import sys, time, torch
from diffusers import DiffusionPipeline
folder, device, height, width, frames, steps = sys.argv[1:7]
pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device)
pipe.set_progress_bar_config(disable=True)
out = pipe("a fox", height=int(height), width=int(width), num_frames=int(frames), num_inference_steps=int(steps),
           generator=torch.Generator("cpu").manual_seed(0), output_type="np")
assert out.frames is not None
print("EAGER_DONE", flush=True)
"""


def eager_one_shot(folder: Path, env: dict, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-c", EAGER, str(folder), args.device, *map(str, args.video_shape)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if "EAGER_DONE" not in done.stdout:
        raise RuntimeError(f"diffusers eager failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


# -- the server -------------------------------------------------------------------------

LAUNCH = """
import sys, torch
card = float(sys.argv[1])
if card and torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, card * 2**30 / total))
sys.argv = ["ondeck"] + sys.argv[2:]
from ondeck.cli import console
sys.exit(console())
"""


class Served:
    """``ondeck serve`` in its own process, on an emulated card of ``card`` GiB."""

    def __init__(self, folders: dict[str, Path], env: dict, args: argparse.Namespace, *extra: str):
        import httpx

        self.port = 18000 + os.getpid() % 1000
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-c", LAUNCH, str(0 if args.tiny else args.card), "serve"]
        command += ["--port", str(self.port), "--device", args.device, "--budget", args.budget]
        command += ["--outputs", str(Path(args.folders) / "serve-outputs"), "--steps", "2"]
        if args.host_cache:
            command += ["--host-cache", args.host_cache]
        for name, folder in folders.items():
            command += ["--model", f"{name}={folder}"]
        self.log = open(Path(args.folders) / "serve-server.log", "a")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [*command, *extra], env=env, stdout=self.log, stderr=self.log
        )
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(30, read=args.timeout))
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.process.returncode}); see {self.log.name}"
                )
            try:
                if self.http.get("/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        self.start_seconds = time.perf_counter() - started

    def status(self) -> dict:
        return self.http.get("/v1/ondeck/status").json()

    def video(self, shape, *, seed=0, model="video", wait=True) -> dict:
        height, width, frames, steps = shape
        body = {"model": model, "prompt": "a fox", "size": f"{width}x{height}", "frames": frames}
        body.update(steps=steps, seed=seed)
        job = self.http.post("/v1/videos", json=body).json()
        return self.finish(job["id"]) if wait else job

    def finish(self, job_id: str) -> dict:
        while True:
            video = self.http.get(f"/v1/videos/{job_id}").json()
            if "error" in video and "status" not in video:  # refused or gone
                return {"status": "gone", **video}
            if video["status"] in ("completed", "failed"):
                return video
            time.sleep(0.02)

    def cancel_at_first_step(self, job_id: str) -> None:
        while self.http.get(f"/v1/ondeck/jobs/{job_id}").json().get("step", 1) < 1:
            time.sleep(0.01)
        self.http.delete(f"/v1/videos/{job_id}")

    def content(self, job_id: str) -> bytes:
        return self.http.get(f"/v1/videos/{job_id}/content").content

    def image(self, shape, *, seed=0) -> dict:
        height, width, steps = shape
        body = {"model": "image", "prompt": "a fox", "size": f"{width}x{height}", "steps": steps}
        return self.http.post("/v1/images/generations", json={**body, "seed": seed}).json()

    def report(self, job_id: str) -> dict:
        return self.http.get(f"/v1/ondeck/jobs/{job_id}/report").json()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(120)
        self.http.close()
        self.log.close()
        return code


def run_loads(report: dict) -> tuple[int, float, float]:
    """(bytes loaded, seconds loading, seconds of loading exposed) in the report's run."""
    run = report["runs"]
    loads = [e for e in report["events"] if e["kind"] == "load" and e["run"] == run]
    exposed = sum(s["exposed_load_seconds"] for s in report["stages"] if s["run"] == run)
    return sum(e["nbytes"] for e in loads), sum(e["duration_seconds"] or 0 for e in loads), exposed


# -- the parts ----------------------------------------------------------------------------


def part_first(server: Served, args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    first = server.video(args.video_shape)
    server.content(first["id"])
    first_wall = time.perf_counter() - started
    started = time.perf_counter()
    warm = server.video(args.video_shape)
    server.content(warm["id"])
    warm_wall = time.perf_counter() - started
    run = server.report(warm["id"])["run_seconds"][0]
    return {
        "server_start_seconds": server.start_seconds,
        "first_request_seconds": first_wall,
        "warm_request_seconds": warm_wall,
        "warm_run_seconds": run,
        "warm_overhead_ratio": warm_wall / run,
    }


def part_switch(server: Served, args: argparse.Namespace, pairs: int) -> dict:
    """Video and image jobs queued together, alternating; each switch's loads."""
    import threading

    plan = server.status()["plan"]
    predicted_bytes = {(s["from"], s["to"]): s["bytes"] for s in plan["switch_bytes"]}
    ids: list[tuple[str, str]] = []
    lock = threading.Lock()
    threads = []
    for index in range(2 * pairs):
        if index % 2 == 0:
            job = server.video(args.video_shape, seed=index, wait=False)
            with lock:
                ids.append(("video", job["id"]))
        else:
            # The image call waits for its job: in a thread, so the queue fills.
            def one(slot: int = len(ids), seed: int = index) -> None:
                result = server.image(args.image_shape, seed=seed)
                ids[slot] = ("image", result.get("ondeck_job", "failed"))

            with lock:
                ids.append(("image", ""))
            thread = threading.Thread(target=one)
            thread.start()
            threads.append(thread)
            time.sleep(0.3)  # keep the submission order the queue order
    for thread in threads:
        thread.join()
    for kind, job_id in ids:
        if kind == "video":
            server.finish(job_id)
    rows = []
    for position, (kind, job_id) in enumerate(ids):
        if position == 0:
            continue
        report = server.report(job_id)
        nbytes, load_seconds, exposed = run_loads(report)
        rate = nbytes / load_seconds if load_seconds else None
        before = "image" if kind == "video" else "video"
        predicted = predicted_bytes.get((before, kind))
        predicted_seconds = predicted / rate if rate and predicted else None
        rows.append(
            {
                "to": kind,
                "bytes_loaded": nbytes,
                "load_seconds": load_seconds,
                "exposed_load_seconds": exposed,
                "measured_rate": rate,
                "predicted_bytes": predicted,
                "predicted_seconds": predicted_seconds,
                "ratio": exposed / predicted_seconds if predicted_seconds else None,
                "run_seconds": report["run_seconds"][0],
            }
        )
    return {
        "switches": rows,
        "mean_exposed_seconds": _mean([r["exposed_load_seconds"] for r in rows]),
    }


def part_soak(server: Served, args: argparse.Namespace) -> dict:
    """A mixed queue in batches; outputs compared with the same jobs run alone first."""
    import random
    import threading

    chooser = random.Random(0)
    seeds = (0, 1, 2)
    alone = {}
    for seed in seeds:
        alone[("video", seed)] = server.content(server.video(args.soak_video, seed=seed)["id"])
        alone[("image", seed)] = base64.b64decode(
            server.image(args.soak_image, seed=seed)["data"][0]["b64_json"]
        )
    idle = server.status()
    baseline = _beyond_weights(idle)
    rss_start = idle["process_rss_bytes"]
    kinds = ["fail"] * (args.jobs // 10) + ["cancel"] * (args.jobs // 20)
    kinds += [chooser.choice(["video", "image"]) for _ in range(args.jobs - len(kinds))]
    chooser.shuffle(kinds)
    counts = {"done": 0, "failed_as_meant": 0, "cancelled": 0, "wrong": 0, "different_output": 0}
    drift = []
    started = time.perf_counter()
    ran = 0
    for first in range(0, len(kinds), args.batch):
        if time.perf_counter() - started > args.soak_seconds:
            break
        batch = kinds[first : first + args.batch]
        pending = []
        cancellers: list[threading.Thread] = []
        for kind in batch:
            seed = chooser.choice(seeds)
            if kind == "image":
                result = server.image(args.soak_image, seed=seed)
                good = (
                    "data" in result
                    and base64.b64decode(result["data"][0]["b64_json"]) == alone[("image", seed)]
                )
                counts["done" if "data" in result else "wrong"] += 1
                counts["different_output"] += "data" in result and not good
                continue
            model = "broken" if kind == "fail" else "video"
            shape = (32, 32, 5, 2) if kind == "fail" else args.soak_video
            if kind == "cancel":
                shape = (*args.soak_video[:3], 50)
            job = server.video(shape, seed=seed, model=model, wait=False)
            pending.append((kind, seed, job["id"]))
            if kind == "cancel":
                canceller = threading.Thread(target=server.cancel_at_first_step, args=(job["id"],))
                canceller.start()
                cancellers.append(canceller)
        for kind, seed, job_id in pending:
            video = server.finish(job_id)
            if kind == "fail":
                counts["failed_as_meant" if video["status"] == "failed" else "wrong"] += 1
            elif kind == "cancel":
                cancelled = (video.get("error") or {}).get("code") == "cancelled"
                counts["cancelled" if cancelled else "wrong"] += 1
                if not cancelled:
                    print(f"cancel of {job_id} answered {video}", flush=True)
            elif video["status"] == "completed":
                counts["done"] += 1
                counts["different_output"] += server.content(job_id) != alone[("video", seed)]
            else:
                counts["wrong"] += 1
        for canceller in cancellers:
            canceller.join()
        ran += len(batch)
        state = server.status()
        drift.append(_beyond_weights(state) - baseline if baseline is not None else None)
    state = server.status()
    known = [d for d in drift if d is not None]
    return {
        "jobs_run": ran,
        "seconds": time.perf_counter() - started,
        **counts,
        "crashed": server.process.poll() is not None,
        "rss_growth_bytes": state["process_rss_bytes"] - rss_start,
        "device_beyond_weights_drift_max_bytes": max(known, default=None),
        "device_beyond_weights_drift_bytes": drift,
    }


def _beyond_weights(status: dict) -> int | None:
    """Device bytes allocated beyond the resident weights (None off CUDA)."""
    allocated = status.get("device_allocated_bytes")
    return None if allocated is None else allocated - status["resident_bytes"]


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--folders", default=os.environ.get("SERVE_FOLDERS", "/tmp/ondeck-serve-bench")
    )
    parser.add_argument("--card", type=float, default=24, help="emulated card, GiB")
    parser.add_argument("--budget", help="the server's budget (default: the card's free memory)")
    parser.add_argument("--host-cache", help="the server's --host-cache, e.g. 48GiB")
    parser.add_argument("--parts", default="eager,first,switch,soak")
    parser.add_argument("--pairs", type=int, default=3, help="video/image pairs in the switch part")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--soak-seconds", type=float, default=420, help="stop submitting after this"
    )
    parser.add_argument(
        "--video-shape", type=_shape, default=(480, 832, 33, 4), help="H,W,frames,steps"
    )
    parser.add_argument("--image-shape", type=_shape, default=(1024, 1024, 4), help="H,W,steps")
    parser.add_argument("--soak-video", type=_shape, default=(240, 416, 9, 2))
    parser.add_argument("--soak-image", type=_shape, default=(512, 512, 2))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--wheels", help="a folder of wheels for what is not installed")
    parser.add_argument("--target", default="/tmp/ondeck-serve-deps")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models on the CPU: checks the script"
    )
    args = parser.parse_args()
    if args.tiny:
        args.video_shape, args.image_shape = (32, 32, 5, 2), (32, 32, 2)
        args.soak_video, args.soak_image = (32, 32, 5, 2), (32, 32, 2)
        args.budget = args.budget or "1800KiB"
    args.device = "cpu" if args.tiny else "cuda"
    args.budget = args.budget or f"{int(args.card * 0.92 * 1024)}MiB"
    env = ensure_packages(args.wheels, Path(args.target))
    parts = set(args.parts.split(","))
    started = time.perf_counter()
    folders = build_folders(args)
    result: dict = {
        "card_gib": args.card,
        "budget": args.budget,
        "folders_gib": {name: folder_gib(path) for name, path in folders.items()},
        "video_shape": args.video_shape,
        "image_shape": args.image_shape,
    }
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        (out / "serve.json").write_text(json.dumps(result, indent=2, default=str))

    if "eager" in parts:
        result["eager_one_shot_seconds"] = eager_one_shot(folders["video"], env, args)
        print(f"diffusers eager one shot: {result['eager_one_shot_seconds']:.1f}s", flush=True)
        write()
    if "switch" in parts:
        server = Served(folders, env, args, "--no-lookahead")
        result["switch_without_lookahead"] = part_switch(server, args, args.pairs)
        result["exit_without_lookahead"] = server.stop()
        write()
    if parts & {"first", "switch", "soak"}:
        server = Served(folders, env, args)
        if "first" in parts:
            result["first"] = part_first(server, args)
            write()
        if "switch" in parts:
            result["switch"] = part_switch(server, args, args.pairs)
            write()
        if "soak" in parts:
            result["soak"] = part_soak(server, args)
            write()
        result["exit_code"] = server.stop()
    result["seconds"] = time.perf_counter() - started
    write()
    print_table(result)
    print(f"\nresults in {out / 'serve.json'}")


def print_table(result: dict) -> None:
    rows = []
    first, eager = result.get("first"), result.get("eager_one_shot_seconds")
    if first:
        rows.append(("warm request / its run", f"{first['warm_overhead_ratio']:.3f}", "<= 1.05"))
        if eager:
            ratio = first["first_request_seconds"] / eager
            rows.append(
                (
                    "first request / eager one shot",
                    f"{ratio:.2f} ({first['first_request_seconds']:.1f}s / {eager:.1f}s)",
                    "<= 0.5",
                )
            )
    switch, without = result.get("switch"), result.get("switch_without_lookahead")
    if switch:
        ratios = [r["ratio"] for r in switch["switches"] if r["ratio"] is not None]
        rows.append(
            ("switch exposed / predicted (max)", f"{max(ratios):.2f}" if ratios else "-", "<= 1.1")
        )
    if switch and without and without["mean_exposed_seconds"]:
        ratio = (switch["mean_exposed_seconds"] or 0) / without["mean_exposed_seconds"]
        rows.append(("switch with / without look-ahead", f"{ratio:.2f}", "<= 0.5"))
    soak = result.get("soak")
    if soak:
        rows.append(("soak jobs run", f"{soak['jobs_run']} in {soak['seconds']:.0f}s", "200"))
        rows.append(
            ("crashes / wrong answers", f"{int(soak['crashed'])} / {soak['wrong']}", "0 / 0")
        )
        rows.append(("server RSS growth", f"{soak['rss_growth_bytes'] / MiB:.1f} MiB", "<= 50 MiB"))
        drift = soak["device_beyond_weights_drift_max_bytes"]
        rows.append(
            (
                "device beyond weights, drift",
                "-" if drift is None else f"{drift / MiB:.1f} MiB",
                "0",
            )
        )
        rows.append(("good outputs unlike alone", str(soak["different_output"]), "0"))
    print(f"\n{'measure':<36} {'value':<32} target")
    for name, value, target in rows:
        print(f"{name:<36} {value:<32} {target}")


if __name__ == "__main__":
    main()
