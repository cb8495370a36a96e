"""What a process's first matrix product, attention and convolution cost on the GPU, and
what ondeck's first-use warm-up (``ondeck.first_use``) leaves of it.

    python benchmarks/experiments/first_use.py [--repeats 3]

Each mode is a fresh process (after one throwaway process has put the libraries in the
page cache):

- ``cold``: the first and second call of each kind of operation on the main thread, at
  the shapes of a 14B video transformer and its VAE, with nothing before them.
- ``warmed``: the same after ``ondeck.first_use.warm_up`` ran on a thread of its own
  (small stand-ins), with its seconds per kind.
- ``copy-alone`` and ``copy-beside-warm-up``: 8 GiB of pinned host memory copied to the
  device in 256 MiB pieces on the main thread, alone and while the warm-up runs, as
  the first load does.

With ``--pipeline``, instead: SD3.5 Large-shaped (``families.py``'s folder, built where
missing) on an emulated 8 GiB card, two runs per process, with the warm-up off, whole,
and in parts (``ONDECK_WARM_UP``), the variants interleaved, beside diffusers eager's
first and second runs. Run 1 is what a one-shot ``ondeck generate`` sees.

Prints a table of medians; writes first_use.json to $OUT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit, warm_libraries, write_document  # noqa: E402
from families import ready_family_folder  # noqa: E402

MODES = ("cold", "warmed", "copy-alone", "copy-beside-warm-up")
VARIANTS = {
    "off": "0",
    "whole": "",
    "no attention": "matmul,convolution,pointwise",
}
FAMILIES = Path(__file__).resolve().parents[1] / "families.py"


def real_calls(torch, F) -> list[tuple[str, object]]:
    """Operations at the shapes a 14B video transformer and its VAE use."""
    dev = "cuda"
    bf16 = torch.bfloat16

    def matmul():
        x = torch.ones(4096, 5120, device=dev, dtype=bf16)
        w = torch.ones(5120, 5120, device=dev, dtype=bf16)
        F.linear(x, w)

    def attention():
        q = torch.ones(1, 40, 4096, 128, device=dev, dtype=bf16)
        F.scaled_dot_product_attention(q, q, q)

    def text_attention():
        q = torch.ones(2, 64, 512, 64, device=dev, dtype=bf16)
        mask = torch.ones(2, 1, 512, 512, device=dev, dtype=torch.bool)
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    def conv3d():
        x = torch.ones(1, 96, 4, 120, 208, device=dev)
        F.conv3d(x, torch.ones(96, 96, 3, 3, 3, device=dev), padding=1)

    def conv2d():
        x = torch.ones(1, 128, 256, 256, device=dev, dtype=bf16)
        F.conv2d(x, torch.ones(128, 128, 3, 3, device=dev, dtype=bf16), padding=1)

    def norms():
        x = torch.ones(1, 96, 4, 120, 208, device=dev)
        F.group_norm(x, 32)
        F.silu(x)
        y = torch.ones(4096, 5120, device=dev, dtype=bf16)
        F.layer_norm(y, (5120,))
        F.gelu(y, approximate="tanh")

    return [
        ("matmul", matmul),
        ("attention", attention),
        ("text attention", text_attention),
        ("conv3d fp32", conv3d),
        ("conv2d bf16", conv2d),
        ("norms", norms),
    ]


def timed_calls(torch, F) -> dict:
    out = {}
    for name, call in real_calls(torch, F):
        seconds = []
        for _ in range(2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            call()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        out[name] = {"first": seconds[0], "second": seconds[1]}
    return out


def copy_seconds(torch, gib: int = 8) -> float:
    piece = 256 << 20
    host = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(piece, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range((gib << 30) // piece):
        device.copy_(host, non_blocking=True)
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - started


def child(mode: str) -> None:
    started = time.perf_counter()
    import torch
    import torch.nn.functional as F

    imported = time.perf_counter() - started
    started = time.perf_counter()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    result: dict = {
        "mode": mode,
        "import_s": imported,
        "cuda_init_s": time.perf_counter() - started,
    }
    from ondeck.first_use import warm_up

    dtypes = (torch.bfloat16, torch.float32)
    if mode == "cold":
        result["calls"] = timed_calls(torch, F)
    elif mode == "warmed":
        import threading

        seconds: dict = {}
        thread = threading.Thread(
            target=lambda: seconds.update(warm_up(torch.device("cuda", 0), dtypes))
        )
        thread.start()
        thread.join()
        result["warm_up"] = seconds
        result["reserved_after_warm_up"] = torch.cuda.memory_reserved()
        result["allocated_after_warm_up"] = torch.cuda.memory_allocated()
        result["calls"] = timed_calls(torch, F)
    else:
        import threading

        copy_seconds(torch, 1)  # the copy path's own first use
        warm = None
        if mode == "copy-beside-warm-up":
            warm = threading.Thread(target=warm_up, args=(torch.device("cuda", 0), dtypes))
            warm.start()
        result["copy_s"] = copy_seconds(torch)
        if warm is not None:
            warm.join()
    emit(result)


def run_mode(mode: str, command: list[str] | None = None, env: dict | None = None) -> dict:
    command = command or [__file__, "--child", mode]
    process = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=600, env=env
    )
    for line in process.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"mode {mode} failed:\n{process.stdout}\n{process.stderr}")


def pipeline_part(repeats: int, folder: str | None) -> None:
    import os

    path = ready_family_folder("sd35", folder)
    common = ["--family", "sd35", "--folder", str(path), "--runs", "2", "--steps", "8"]
    eager = run_mode("eager", [str(FAMILIES), "--child", "diffusers-eager", *common])
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, value in VARIANTS.items():
            command = [str(FAMILIES), "--child", "ondeck-diffusers", *common, "--memory-gib", "8"]
            env = dict(os.environ, ONDECK_WARM_UP=value)
            rows[name].append(run_mode(name, command, env))
    write_document("first_use", {"repeats": repeats, "eager": eager, "variants": rows})
    med = statistics.median
    first, second = (eager["runs"][i]["seconds"] for i in (0, 1))
    print(f"eager: run 1 {first:.2f} s, run 2 {second:.2f} s")
    print(f"{'8 GiB, warm-up':<24} {'run 1 (s)':>24} {'median':>7} {'run 2':>6} {'retries':>8}")
    for name, results in rows.items():
        ones = [r["runs"][0]["seconds"] for r in results]
        twos = [r["runs"][1]["seconds"] for r in results]
        retries = [sum(stage[3] for stage in r["runs"][0]["stages"]) for r in results]
        listed = ", ".join(f"{x:.2f}" for x in ones)
        print(f"{name:<24} {listed:>24} {med(ones):>7.2f} {med(twos):>6.2f} {str(retries):>8}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--folder")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.pipeline:
        warm_libraries()
        pipeline_part(args.repeats, args.folder)
        return
    warm_libraries()
    results = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            results[mode].append(run_mode(mode))
    write_document("first_use", {"repeats": args.repeats, "results": results})
    med = statistics.median
    print(f"{'call':<16} {'cold first':>10} {'cold second':>11} {'after warm-up':>13}")
    for name in results["cold"][0]["calls"]:
        cold = med(r["calls"][name]["first"] for r in results["cold"])
        second = med(r["calls"][name]["second"] for r in results["cold"])
        warmed = med(r["calls"][name]["first"] for r in results["warmed"])
        print(f"{name:<16} {cold * 1e3:>9.1f}ms {second * 1e3:>10.1f}ms {warmed * 1e3:>12.1f}ms")
    total = {
        mode: med(sum(c["first"] for c in r["calls"].values()) for r in results[mode])
        for mode in ("cold", "warmed")
    }
    print(f"{'all first calls':<16} {total['cold']:>10.3f}s {'':>11} {total['warmed']:>12.3f}s")
    for name in results["warmed"][0]["warm_up"]:
        print(f"warm-up {name}: {med(r['warm_up'][name] for r in results['warmed']):.3f} s")
    reserved = med(r["reserved_after_warm_up"] for r in results["warmed"])
    allocated = med(r["allocated_after_warm_up"] for r in results["warmed"])
    print(
        f"after the warm-up: {reserved / 2**20:.1f} MiB reserved, {allocated / 2**20:.1f} allocated"
    )
    for mode in ("copy-alone", "copy-beside-warm-up"):
        print(f"{mode}: 8 GiB in {med(r['copy_s'] for r in results[mode]):.3f} s")


if __name__ == "__main__":
    main()
