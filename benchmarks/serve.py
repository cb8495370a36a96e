"""``ondeck serve`` against its targets, in one command on one H200 within 9 minutes:
a Wan 2.1 14B-shaped video model (37.7 GiB) and a FLUX.1-shaped image model (31.4 GiB)
served together on an emulated 24 GiB card, with three tiny models beside them for the
soak.

    PYTHONUNBUFFERED=1 python3 benchmarks/serve.py            # on the GPU (510 s deadline)
    python benchmarks/serve.py --tiny --jobs 40               # tiny models on the CPU

Needs, beside torch, transformers, accelerate and safetensors, diffusers and the
packages of ``ondeck[serve]`` (``WHEELS`` below); it checks them first and names the
wheels that are missing. Where a machine has no package index, install those wheels
into a folder on PYTHONPATH in the same command:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site WHEELS/*.whl \
      && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/serve.py

It builds its folders with random weights at the real shapes (diffusers' own
``save_pretrained``; the pixels are noise) where there is room: the folder given, else
/dev/shm, else a tmpfs it mounts (as root). Then, each part within ``--deadline``:

- ``eager``: diffusers eager's one-shot time to first video (a fresh process: imports,
  ``WanPipeline.from_pretrained`` with a float32 VAE, ``.to("cuda")``, one call);
- a server with ``--no-lookahead``: the video and image model cold, then a queue of
  video, image, video, image (four switches);
- the server as it starts by default: the first video request (nothing loaded yet),
  the same request warm, the image model cold and warm, the same queue of four
  switches, then the soak: ``--jobs`` mixed jobs on the tiny models (a tenth failing,
  a twentieth cancelled at a running step) in batches, until the deadline. The tiny
  models share the process, the budget and the device with the big ones; 200 jobs of
  the big models (5 to 15 s each) would not fit the 9 minutes.

Targets, each row of the table printed last (and serve.json written to $OUT):

- a warm request's wall time (request to MP4 in hand) at most 1.05x the run itself:
  the pipeline's call and the writing of its MP4, as a local run does both;
- the first request to a model at most 0.5x diffusers eager's one-shot time;
- each switch costs at most 1.1x the plan's predicted load time, with the look-ahead
  and without. A switch's cost is its job's time on the device thread (making room,
  the run, the wait for what loaded ahead beside it) less the same model's warm job's:
  the time the switch adds, loads hidden behind compute not counted. The predicted
  load time is the plan's bytes for that switch at the model's load rate in the same
  server (what its jobs run alone, cold and warm, loaded over their load seconds).
  The loads' own seconds (a pipelined load's run until every weight is in place,
  beside the compute) are printed too, and each load of each switch is in serve.json.
  Each switch's job has a prompt of its own, as a server's requests do: the plan
  counts the text encoders;
- with the queue's look-ahead, a switch costs at most 0.5x what it costs without;
- the soak: no crash, exit 0 on SIGTERM, each job's one right answer, server RSS growth
  at most 50 MiB, device bytes allocated beyond the served weights back at their
  baseline after each job (within 1 MiB of allocator rounding), and each good job's
  output byte for byte the same job's run alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GiB = 2**30
MiB = 2**20

# Import name -> the wheel to carry where the GPU image lacks it (versions tested here).
# imageio-ffmpeg 0.6.0, not a later one: its wheel (29 MB, ffmpeg 7.0.2) fits beside the
# others in a 64 MiB transfer; 0.8.1's is 68 MB.
WHEELS = {
    "diffusers": "diffusers==0.42.1",
    "fastapi": "fastapi==0.165.0",
    "starlette": "starlette==1.10.0",
    "uvicorn": "uvicorn==0.55.0",
    "pydantic": "pydantic==2.14.4",
    "pydantic_core": "pydantic_core==2.50.5",
    "annotated_types": "annotated-types==0.8.0",
    "typing_inspection": "typing-inspection==0.4.5",
    "opentelemetry": "opentelemetry-api==1.45.2",
    "python_multipart": "python-multipart==0.0.34",
    "imageio_ffmpeg": "imageio-ffmpeg==0.6.0",
    # Already on the GPU image; named in case a machine lacks them.
    "httpx": "httpx==0.29.0",
    "anyio": "anyio==4.16.0",
    "h11": "h11==0.16.0",
    "click": "click==8.5.1",
    "annotated_doc": "annotated-doc==0.0.7",
    "imageio": "imageio==2.38.2",
    "psutil": "psutil==7.2.2",
}
# pydantic 2.14 needs typing_extensions 4.16: older ones lack names it imports.
TYPING_EXTENSIONS = (4, 16)


def check_packages() -> None:
    """Stop before any work, naming the wheels to install, when something is missing."""
    missing = [wheel for name, wheel in WHEELS.items() if importlib.util.find_spec(name) is None]
    try:
        from importlib.metadata import version

        import typing_extensions  # noqa: F401

        found = tuple(int(part) for part in version("typing_extensions").split(".")[:2])
        if found < TYPING_EXTENSIONS:
            missing.append("typing_extensions==4.16.0")
    except Exception:
        missing.append("typing_extensions==4.16.0")
    if missing:
        print("missing packages; install these wheels (no deps) onto PYTHONPATH first:")
        print("  " + " ".join(missing))
        sys.exit(2)


# -- folders ----------------------------------------------------------------------------

BIG_FOLDERS_BYTES = int(69.2 * GiB)  # Wan 14B-shaped 37.66 GiB + FLUX-shaped 31.42 GiB


def folders_root(args: argparse.Namespace) -> Path:
    """Where the folders go: the one given if built there already or it has room, else
    /dev/shm, else a tmpfs mounted for them (the 64 GiB disk of a one-GPU machine does
    not hold both models)."""
    wanted = Path(args.folders)
    need = 64 * MiB if args.tiny else BIG_FOLDERS_BYTES + 2 * GiB
    if (wanted / "wan14b" / "model_index.json").exists() or args.tiny:
        wanted.mkdir(parents=True, exist_ok=True)
        return wanted
    candidates = [wanted, Path("/dev/shm") / "ondeck-serve-bench"]
    for candidate in candidates:
        existing = next(p for p in [candidate, *candidate.parents] if p.exists())
        free = shutil.disk_usage(existing).free
        if free >= need:
            candidate.mkdir(parents=True, exist_ok=True)
            print(f"folders in {candidate} ({free / GiB:.0f} GiB free)", flush=True)
            return candidate
    mount = Path("/tmp/ondeck-serve-tmpfs")
    mount.mkdir(parents=True, exist_ok=True)
    size_gib = int(need / GiB) + 4
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_gib}g", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
        )
        why = done.stderr.strip() if done.returncode else ""
    except OSError as error:
        why = str(error)
    if why:
        sys.exit(
            f"no room for {need / GiB:.0f} GiB of folders in {wanted} or /dev/shm, and "
            f"mounting a tmpfs failed: {why}; give --folders a place with room"
        )
    print(f"folders in a {size_gib} GiB tmpfs at {mount}", flush=True)
    return mount


def _clip_tokenizer():
    """A CLIP BPE tokenizer over single letters, built in code: no download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for letter in "abcdefghijklmnopqrstuvwxyz":
            vocab[letter + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


# FLUX.1-dev's shapes, and a tiny stand-in of the same classes for --tiny.
FLUX_SHAPES = {
    "full": {
        "transformer": {"guidance_embeds": True},
        "t5": {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240,
               "num_layers": 24, "num_heads": 64},
        "clip": {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                 "num_hidden_layers": 12, "projection_dim": 768},
        "vae": {"latent_channels": 16, "block_out_channels": (128, 256, 512, 512),
                "layers_per_block": 2},
    },
    "tiny": {
        "transformer": {"guidance_embeds": True, "patch_size": 1, "in_channels": 16,
                        "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                        "num_attention_heads": 2, "joint_attention_dim": 32,
                        "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8]},
        "t5": {"vocab_size": 512, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2,
               "num_heads": 4},
        "clip": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4,
                 "num_hidden_layers": 2, "projection_dim": 32},
        "vae": {"latent_channels": 4, "block_out_channels": (8, 8), "layers_per_block": 1,
                "norm_num_groups": 4},
    },
}  # fmt: skip


def build_flux_folder(path: Path, *, tiny: bool = False) -> Path:
    """FLUX.1-dev's shapes (12B transformer, T5-XXL, CLIP-L, its VAE) in bf16 with random
    weights, 31.4 GiB, written by diffusers' own ``save_pretrained`` (on the GPU); with
    ``tiny``, the same classes at a few MiB in float32 (on the CPU)."""
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
    shape = FLUX_SHAPES["tiny" if tiny else "full"]
    default = torch.get_default_dtype()
    # Made in bf16 at once: a float32 12B transformer would take 48 GB of the card first.
    torch.set_default_dtype(torch.float32 if tiny else torch.bfloat16)
    try:
        with torch.device("cpu" if tiny else "cuda"):
            torch.manual_seed(0)
            transformer = FluxTransformer2DModel(**shape["transformer"])
            t5 = T5EncoderModel(
                T5Config(**shape["t5"], feed_forward_proj="gated-gelu", is_gated_act=True)
            )
            clip = CLIPTextModel(CLIPTextConfig(**shape["clip"]))
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * len(shape["vae"]["block_out_channels"]),
                up_block_types=("UpDecoderBlock2D",) * len(shape["vae"]["block_out_channels"]),
                shift_factor=0.1159,
                scaling_factor=0.3611,
                use_quant_conv=False,
                use_post_quant_conv=False,
                **shape["vae"],
            )
    finally:
        torch.set_default_dtype(default)
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
    if not tiny:
        torch.cuda.empty_cache()
    return path


def build_broken_folder(path: Path) -> Path:
    """A tiny Wan whose transformer weights are NaN: every job on it fails, at once."""
    from safetensors.torch import load_file, save_file

    from ondeck.embedded import build_wan_folder

    if (path / "model_index.json").exists():
        return path
    build_wan_folder(path, preset="tiny", seed=2)
    weights = path / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = {k: v.fill_(float("nan")) for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def build_folders(root: Path, tiny: bool) -> dict[str, Path]:
    """The served folders by name: the big pair (or tiny stand-ins with --tiny), and the
    soak's tiny video, image and broken models."""
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    import tiny_pipelines

    from ondeck.embedded import build_wan_folder

    small_video, small_image = root / "tiny-wan", root / "tiny-sd3"
    if not (small_video / "model_index.json").exists():
        build_wan_folder(small_video, preset="tiny", vivid=True)
    if not (small_image / "model_index.json").exists():
        tiny_pipelines.build_sd3(small_image)
    folders = {"soak-video": small_video, "soak-image": small_image}
    folders["soak-broken"] = build_broken_folder(root / "tiny-broken")
    if tiny:
        image = build_flux_folder(root / "tiny-flux", tiny=True)
        return {"video": small_video, "image": image, **folders}
    sys.path.insert(0, str(HERE))
    from common import build_wan14b_folder

    image = build_flux_folder(root / "flux-shaped")
    video = build_wan14b_folder(root / "wan14b")
    return {"video": video, "image": image, **folders}


def folder_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*/*.safetensors")) / GiB


# -- diffusers eager, one shot ------------------------------------------------------------

EAGER = """
import sys, torch
from diffusers import AutoencoderKLWan, WanPipeline
folder, device, height, width, frames, steps = sys.argv[1:7]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
vae = AutoencoderKLWan.from_pretrained(folder + "/vae", torch_dtype=torch.float32)
pipe = WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=dtype).to(device)
pipe.set_progress_bar_config(disable=True)
out = pipe("a fox", height=int(height), width=int(width), num_frames=int(frames),
           num_inference_steps=int(steps), generator=torch.Generator("cpu").manual_seed(0),
           output_type="np")
assert out.frames is not None
print("EAGER_DONE", flush=True)
"""


def eager_one_shot(folder: Path, env: dict, args: argparse.Namespace, timeout: float) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-c", EAGER, str(folder), args.device, *map(str, args.video)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``ondeck serve`` in its own process, on an emulated card of ``args.card`` GiB."""

    def __init__(self, label: str, folders: dict[str, Path], env: dict, args, *extra: str):
        import httpx

        self.label = label
        self.port = free_port()
        command = [sys.executable, "-c", LAUNCH, str(0 if args.tiny else args.card), "serve"]
        command += ["--port", str(self.port), "--device", args.device, "--budget", args.budget]
        command += ["--outputs", str(args.root / f"outputs-{label}")]
        if args.host_cache:
            command += ["--host-cache", args.host_cache]
        for name, folder in folders.items():
            command += ["--model", f"{name}={folder}"]
        self.log_path = args.root / f"server-{label}.log"
        self.log = open(self.log_path, "w")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [*command, *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}", timeout=httpx.Timeout(60, read=300)
        )
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                if self.http.get("/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.start_seconds = time.perf_counter() - started

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def status(self) -> dict:
        return self.http.get("/v1/ondeck/status").json()

    def submit(self, model: str, kind: str, shape, *, seed: int = 0, prompt: str = "a fox") -> str:
        """Queue a job and return its id at once (images through ondeck's queued route)."""
        body = {"model": model, "prompt": prompt, "seed": seed}
        if kind == "video":
            height, width, frames, steps = shape
            body.update(size=f"{width}x{height}", frames=frames, steps=steps)
            response = self.http.post("/v1/videos", json=body)
        else:
            height, width, steps = shape
            body.update(size=f"{width}x{height}", steps=steps)
            response = self.http.post("/v1/ondeck/images", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{model} refused: {response.text}")
        return response.json()["id"]

    def job(self, job_id: str) -> dict:
        return self.http.get(f"/v1/ondeck/jobs/{job_id}").json()

    def finish(self, job_id: str, deadline: float) -> dict:
        """The job once over and measured (its device time and memory after it)."""
        while time.perf_counter() < deadline:
            job = self.job(job_id)
            if job.get("status") in ("completed", "failed") and job.get("device_seconds"):
                return job
            time.sleep(0.02)
        raise TimeoutError(f"job {job_id} not over by the deadline")

    def output(self, kind: str, job_id: str) -> bytes:
        path = (
            f"/v1/videos/{job_id}/content" if kind == "video" else f"/v1/ondeck/jobs/{job_id}/image"
        )
        return self.http.get(path).content

    def report(self, job_id: str) -> dict:
        return self.http.get(f"/v1/ondeck/jobs/{job_id}/report").json()

    def run_alone(self, model: str, kind: str, shape, deadline: float, seed: int = 0) -> dict:
        """Submit, wait, fetch the output: the client's wall time and the job's figures."""
        started = time.perf_counter()
        job_id = self.submit(model, kind, shape, seed=seed)
        job = self.finish(job_id, deadline)
        content = self.output(kind, job_id) if job["status"] == "completed" else b""
        return {**job, "wall_seconds": time.perf_counter() - started, "content": content}

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.http.close()
        self.log.close()
        return code


def report_loads(report: dict) -> tuple[int, float, float, list]:
    """(bytes loaded, seconds loading, seconds exposed, each load as [component, bytes,
    seconds]) in the report's run. A pipelined load's seconds run to its ``fill`` (every
    weight in place), not to its first block."""
    run = report["runs"]
    loads: list[list] = []
    for event in report["events"]:
        if event["run"] != run:
            continue
        if event["kind"] == "load":
            loads.append([event["name"], event["nbytes"], event["duration_seconds"] or 0.0])
        elif event["kind"] == "fill":
            for load in reversed(loads):
                if load[0] == event["name"]:
                    load[2] = max(load[2], event["duration_seconds"] or 0.0)
                    break
    exposed = sum(s["exposed_load_seconds"] for s in report["stages"] if s["run"] == run)
    return sum(n for _, n, _ in loads), sum(s for _, _, s in loads), exposed, loads


# -- the parts ---------------------------------------------------------------------------


def part_models(server: Served, args, deadline: float, *, warm: bool) -> dict:
    """Each model cold (and warm, if asked), one at a time; then video, image, video,
    image queued together: four switches."""
    video, image = ("video", "video", args.video), ("image", "image", args.image)
    alone = [("video cold", video)] + ([("video warm", video)] if warm else [])
    alone += [("image cold", image)] + ([("image warm", image)] if warm else [])
    jobs: dict[str, dict] = {}
    for role, (model, kind, shape) in alone:
        job = server.run_alone(model, kind, shape, deadline)
        job.pop("content")
        jobs[role] = {**job, "loads": report_loads(server.report(job["id"]))}
        print(f"  {server.label}: {role} {job['wall_seconds']:.2f}s", flush=True)
    queued = [
        (f"switch {index + 1} to {model}", model, kind, shape)
        for index, (model, kind, shape) in enumerate([video, image, video, image])
    ]
    # Each switch with a prompt of its own, as a server's requests come: a prompt
    # already encoded would spare the text encoders the plan counts.
    ids = [
        (role, model, server.submit(model, kind, shape, prompt=f"a fox, {role}"))
        for role, model, kind, shape in queued
    ]
    for role, model, job_id in ids:
        job = server.finish(job_id, deadline)
        jobs[role] = {**job, "model": model, "loads": report_loads(server.report(job_id))}
        print(f"  {server.label}: {role} {job['device_seconds']:.2f}s on the device", flush=True)
    plan = server.status()["plan"]
    switch_bytes = {f"{s['from']}->{s['to']}": s["bytes"] for s in plan["switch_bytes"]}
    return {
        "jobs": jobs,
        "plan_switch_bytes": {k: v for k, v in switch_bytes.items() if "soak" not in k},
        "plan_models": {k: v for k, v in plan["models"].items() if not k.startswith("soak")},
    }


def load_rates(models: dict) -> dict[str, float]:
    """Each model's load rate in the server: bytes over seconds of what its jobs run
    alone (cold, then warm) loaded."""
    rates = {}
    for model in ("video", "image"):
        alone = [job for role, job in models["jobs"].items() if role.startswith(f"{model} ")]
        loaded = sum(job["loads"][0] for job in alone)
        seconds = sum(job["loads"][1] for job in alone)
        if seconds:
            rates[model] = loaded / seconds
    return rates


def switch_costs(models: dict, warm: dict[str, dict], rates: dict[str, float]) -> list[dict]:
    """Each queued switch: the loading its job did against the plan's switch bytes at
    the model's load rate in ``rates`` (its jobs run alone), and its time on the device
    thread beyond the same model's warm job (what the queue's look-ahead should cut)."""
    rows = []
    previous = "image"
    for role, job in models["jobs"].items():
        if not role.startswith("switch"):
            continue
        model = job["model"]
        loaded, load_seconds, exposed, each = job["loads"]
        predicted_bytes = models["plan_switch_bytes"].get(f"{previous}->{model}")
        rate = rates.get(model)
        predicted = predicted_bytes / rate if predicted_bytes and rate else None
        cost = job["device_seconds"] - warm[model]["device_seconds"]
        rows.append(
            {
                "switch": f"{previous}->{model}",
                "bytes_loaded": loaded,
                "load_seconds": load_seconds,
                "exposed_load_seconds": exposed,
                "predicted_bytes": predicted_bytes,
                "predicted_seconds": predicted,
                "loading_ratio": load_seconds / predicted if predicted else None,
                "device_seconds": job["device_seconds"],
                "cost_seconds": cost,
                "ratio": cost / predicted if predicted else None,
                "loads": each,
            }
        )
        previous = model
    return rows


def part_soak(server: Served, args, deadline: float) -> dict:
    """Mixed jobs on the tiny models in batches, until ``--jobs`` or the deadline; each
    good output compared with the same job run alone before."""
    video, image = (args.soak_video, "video"), (args.soak_image, "image")
    seeds = (0, 1, 2)
    cancel_shape = (*args.soak_video[:3], 200)

    def submit(kind: str, seed: int) -> str:
        if kind == "image":
            return server.submit("soak-image", "image", image[0], seed=seed)
        if kind == "failing":
            return server.submit("soak-broken", "video", video[0], seed=seed)
        shape = cancel_shape if kind == "cancelled" else video[0]
        return server.submit("soak-video", "video", shape, seed=seed)

    def cancel_when_running(job_id: str) -> None:
        while time.perf_counter() < deadline:
            job = server.job(job_id)
            if job["step"] >= 1 or job["status"] in ("completed", "failed"):
                break
            time.sleep(0.02)
        server.http.delete(f"/v1/videos/{job_id}")

    alone = {}
    for kind in ("video", "image"):
        for seed in seeds:
            job_id = submit(kind, seed)
            server.finish(job_id, deadline)
            alone[kind, seed] = server.output(kind, job_id)
    for kind in ("failing", "cancelled"):  # what a first failure caches is in the baseline
        job_id = submit(kind, 0)
        if kind == "cancelled":
            cancel_when_running(job_id)
        server.finish(job_id, deadline)
    baseline = server.status()
    beyond_at_start = _beyond_weights(baseline)
    chooser = random.Random(0)
    kinds = ["failing"] * (args.jobs // 10) + ["cancelled"] * (args.jobs // 20)
    kinds += [chooser.choice(["video", "image"]) for _ in range(args.jobs - len(kinds))]
    chooser.shuffle(kinds)
    counts = {"good": 0, "failed_as_meant": 0, "cancelled": 0, "wrong": 0, "unlike_alone": 0}
    wrong: list[dict] = []
    after_each: list[dict] = []
    started = time.perf_counter()
    ran = 0
    # A batch of 10 takes well under 10 s even on the CPU; none starts that late.
    for first in range(0, len(kinds), args.batch):
        if time.perf_counter() > deadline - 10:
            break
        batch = [(kind, chooser.choice(seeds)) for kind in kinds[first : first + args.batch]]
        submitted = [(kind, seed, submit(kind, seed)) for kind, seed in batch]
        for kind, _, job_id in submitted:
            if kind == "cancelled":
                cancel_when_running(job_id)
        for kind, seed, job_id in submitted:
            job = server.finish(job_id, deadline + 30)
            code = (job.get("error") or {}).get("code")
            if kind in ("video", "image") and job["status"] == "completed":
                counts["good"] += 1
                counts["unlike_alone"] += server.output(kind, job_id) != alone[kind, seed]
            elif kind == "failing" and code == "non_finite_output":
                counts["failed_as_meant"] += 1
            elif kind == "cancelled" and code == "cancelled":
                counts["cancelled"] += 1
            else:
                counts["wrong"] += 1
                wrong.append({"kind": kind, "job": job})
            after_each.append(job["memory_after"])
        ran += len(batch)
    end = server.status()
    rss = [after["process_rss_bytes"] for after in after_each]
    drift = [
        _beyond_weights(after) - beyond_at_start
        for after in after_each
        if beyond_at_start is not None and after["device_allocated_bytes"] is not None
    ]
    return {
        "jobs_asked": args.jobs,
        "jobs_run": ran,
        "seconds": time.perf_counter() - started,
        **counts,
        "wrong_examples": wrong[:5],
        "crashed": server.process.poll() is not None,
        "rss_baseline_bytes": baseline["process_rss_bytes"],
        "rss_growth_bytes": end["process_rss_bytes"] - baseline["process_rss_bytes"],
        "rss_growth_max_after_a_job_bytes": max(rss, default=0) - baseline["process_rss_bytes"],
        "device_beyond_weights_baseline_bytes": beyond_at_start,
        "device_beyond_weights_drift_max_bytes": max(drift, default=None),
        "resident_bytes_after_each_job": sorted({a["resident_bytes"] for a in after_each}),
    }


def _beyond_weights(measured: dict) -> int | None:
    """Device bytes allocated beyond the served weights (None off CUDA)."""
    allocated = measured.get("device_allocated_bytes")
    return None if allocated is None else allocated - measured["resident_bytes"]


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folders", default="/tmp/ondeck-serve-bench")
    parser.add_argument("--card", type=float, default=24, help="emulated card, GiB")
    parser.add_argument("--budget", help="the server's budget (default: 92%% of the card)")
    parser.add_argument("--host-cache", help="the server's --host-cache, e.g. 48GiB")
    parser.add_argument("--deadline", type=float, default=510, help="seconds for it all")
    parser.add_argument("--jobs", type=int, default=200, help="soak jobs")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--video", type=_shape, default=(480, 832, 33, 4), help="H,W,frames,steps")
    parser.add_argument("--image", type=_shape, default=(1024, 1024, 4), help="H,W,steps")
    parser.add_argument("--soak-video", type=_shape, default=(32, 32, 5, 2))
    parser.add_argument("--soak-image", type=_shape, default=(32, 32, 2))
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU")
    args = parser.parse_args()
    check_packages()
    if args.tiny:
        args.video, args.image = (32, 32, 5, 2), (32, 32, 2)
        args.budget = args.budget or "7MiB"  # the tiny FLUX (6.6 MiB) beside nothing else
    args.device = "cpu" if args.tiny else "cuda"
    args.budget = args.budget or f"{int(args.card * 0.92 * 1024)}MiB"
    deadline = started + args.deadline
    sys.path[:0] = [str(ROOT)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("ONDECK_PROGRESS", "0")
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)
    args.root = folders_root(args)
    result: dict = {"card_gib": args.card, "budget": args.budget, "video": args.video}
    result.update(image=args.image, folders_root=str(args.root), errors={})

    def write() -> None:
        result["seconds"] = time.perf_counter() - started
        (out / "serve.json").write_text(json.dumps(result, indent=2, default=str))

    building = time.perf_counter()
    folders = build_folders(args.root, args.tiny)
    result["build_seconds"] = time.perf_counter() - building
    result["folders_gib"] = {name: folder_gib(path) for name, path in folders.items()}
    print(f"folders built in {result['build_seconds']:.0f}s: {result['folders_gib']}", flush=True)
    big = {name: folders[name] for name in ("video", "image")}
    write()
    try:
        if not args.skip_eager:
            result["eager_one_shot_seconds"] = eager_one_shot(
                folders["video"], env, args, timeout=max(30, deadline - time.perf_counter())
            )
            print(f"diffusers eager one shot: {result['eager_one_shot_seconds']:.1f}s", flush=True)
    except Exception as error:
        result["errors"]["eager"] = str(error)[-2000:]
    write()
    for label, extra, served in (
        ("without-lookahead", ("--no-lookahead",), big),
        ("default", (), folders),
    ):
        server = None
        try:
            server = Served(label, served, env, args, *extra)
            print(f"{label} server up in {server.start_seconds:.1f}s", flush=True)
            result[label] = {"start_seconds": server.start_seconds}
            result[label]["models"] = part_models(server, args, deadline, warm=label == "default")
            write()
            if label == "default":
                result["soak"] = part_soak(server, args, deadline - 20)
        except Exception as error:
            result["errors"][label] = f"{type(error).__name__}: {error}"[-2000:]
            print(f"{label}: {result['errors'][label]}", flush=True)
        finally:
            if server is not None:
                result.setdefault(label, {})["exit_code"] = server.stop()
                shutil.copy(server.log_path, out / server.log_path.name)
        write()
    try:
        summarise(result)
    except (KeyError, TypeError, ZeroDivisionError) as error:  # a part did not finish
        result["errors"]["summary"] = f"{type(error).__name__}: {error}"
    write()
    print_table(result)
    print(f"\nresults in {out / 'serve.json'}")


def summarise(result: dict) -> None:
    """The targets' figures from the parts' measurements."""
    default = (result.get("default") or {}).get("models")
    without = (result.get("without-lookahead") or {}).get("models")
    figures: dict = {}
    if default:
        jobs = default["jobs"]
        warm = jobs["video warm"]
        made = warm["run_seconds"] + warm["write_seconds"]
        figures["first_request_seconds"] = jobs["video cold"]["wall_seconds"]
        figures["warm_request_seconds"] = warm["wall_seconds"]
        figures["warm_run_seconds"] = warm["run_seconds"]
        figures["warm_write_seconds"] = warm["write_seconds"]
        figures["warm_over_run_and_write"] = warm["wall_seconds"] / made
        figures["warm_over_run"] = warm["wall_seconds"] / warm["run_seconds"]
        if result.get("eager_one_shot_seconds"):
            figures["first_over_eager"] = (
                figures["first_request_seconds"] / result["eager_one_shot_seconds"]
            )
        warm_jobs = {m: jobs[f"{m} warm"] for m in ("video", "image")}
        figures["load_bytes_per_second"] = load_rates(default)
        figures["switches"] = switch_costs(default, warm_jobs, load_rates(default))
        if without:
            figures["switches_without_lookahead"] = switch_costs(
                without, warm_jobs, load_rates(without)
            )
    result["figures"] = figures


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def print_table(result: dict) -> None:
    from ondeck.memory import format_bytes

    figures = result.get("figures", {})
    rows = []

    def row(name, value, target, met):
        rows.append((name, value, target, "-" if met is None else ("yes" if met else "NO")))

    if "warm_over_run_and_write" in figures:
        ratio = figures["warm_over_run_and_write"]
        value = f"{ratio:.3f} ({figures['warm_request_seconds']:.2f}s / "
        value += f"{figures['warm_run_seconds']:.2f}+{figures['warm_write_seconds']:.2f}s)"
        row("warm request / its run + MP4", value, "<= 1.05", ratio <= 1.05)
        row("warm request / its run alone", f"{figures['warm_over_run']:.3f}", "-", None)
    if "first_over_eager" in figures:
        ratio = figures["first_over_eager"]
        value = f"{ratio:.2f} ({figures['first_request_seconds']:.1f}s / "
        value += f"{result['eager_one_shot_seconds']:.1f}s)"
        row("first request / eager one shot", value, "<= 0.5", ratio <= 0.5)
    with_, without = figures.get("switches"), figures.get("switches_without_lookahead")
    for label, switches in (("default", with_), ("no look-ahead", without)):
        ratios = [s["ratio"] for s in switches or [] if s["ratio"] is not None]
        if ratios:
            value = f"{max(ratios):.2f} (" + ", ".join(f"{r:.2f}" for r in ratios) + ")"
            met = max(ratios) <= 1.1
            row(f"switch's cost / plan's load time, {label}", value, "<= 1.1", met)
        loading = [s["loading_ratio"] for s in switches or [] if s["loading_ratio"] is not None]
        if loading:
            value = ", ".join(f"{r:.2f}" for r in loading)
            row(f"  its loads' seconds / plan's, {label}", value, "-", None)
    if without:
        loaded = ", ".join(
            f"{format_bytes(s['bytes_loaded'])}/{format_bytes(s['predicted_bytes'] or 0)}"
            for s in without
        )
        row("  loaded / planned, each switch", loaded, "-", None)
    if with_ and without:
        mean_with = _mean([s["cost_seconds"] for s in with_])
        mean_without = _mean([s["cost_seconds"] for s in without])
        if mean_with is not None and mean_without:
            ratio = mean_with / mean_without
            value = f"{ratio:.2f} ({mean_with:.2f}s / {mean_without:.2f}s a switch)"
            row("switch with / without look-ahead", value, "<= 0.5", ratio <= 0.5)
    soak = result.get("soak")
    if soak:
        jobs = f"{soak['jobs_run']} of {soak['jobs_asked']} in {soak['seconds']:.0f}s"
        row("soak jobs", jobs, str(soak["jobs_asked"]), soak["jobs_run"] >= soak["jobs_asked"])
        crashed = soak["crashed"] or (result.get("default") or {}).get("exit_code") != 0
        answers = f"{int(crashed)} / {soak['wrong']}"
        row("crashes / wrong answers", answers, "0 / 0", not crashed and not soak["wrong"])
        growth = max(soak["rss_growth_bytes"], soak["rss_growth_max_after_a_job_bytes"])
        row("server RSS growth", f"{growth / MiB:.1f} MiB", "<= 50 MiB", growth <= 50 * MiB)
        drift = soak["device_beyond_weights_drift_max_bytes"]
        value = "-" if drift is None else f"{drift / MiB:.3f} MiB"
        row("device beyond weights after a job", value, "0 (1 MiB)", drift is None or drift <= MiB)
        row("good outputs unlike alone", str(soak["unlike_alone"]), "0", not soak["unlike_alone"])
    for part, error in result.get("errors", {}).items():
        row(f"ERROR in {part}", error.splitlines()[0][:60], "-", False)
    print(f"\n{'measure':<50} {'value':<44} {'target':<10} met")
    for name, value, target, met in rows:
        print(f"{name:<50} {value:<44} {target:<10} {met}")


if __name__ == "__main__":
    main()
