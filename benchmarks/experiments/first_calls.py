"""What a process's first call of each kind of kernel costs on the device, and how much of
it a warm-up on another thread, during loads, takes away.

    python benchmarks/experiments/first_calls.py [--repeats 3]

Each arm runs in a fresh process, after CUDA's context is made (every load makes it):

- ``cold``: the operations a diffusion pipeline's components run (linear layers in
  bfloat16 and float32, attention at head dims 64 and 128, layer and group norms, 2D and
  3D convolutions in float32 and bfloat16), each timed on its first call and its second,
  the device synchronised around each;
- ``warmed``: the same, after ``ondeck.warmup.warm_device`` ran on its own thread while
  the main thread slept (as a load waits for its reads).

The first call's excess over the second is what a first run pays beyond later runs for
that operation. Writes first_calls.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit, run_child, warm_libraries, write_document  # noqa: E402

ARMS = ("cold", "warmed")
SLEEP_S = 3.0


def operations():
    """(name, build) pairs; build() returns a callable making one call of the operation."""
    import torch
    import torch.nn.functional as F

    cuda = torch.device("cuda")

    def linear(tokens, width, out, dtype):
        x = torch.randn(tokens, width, device=cuda, dtype=dtype)
        w = torch.randn(out, width, device=cuda, dtype=dtype) * 0.02
        b = torch.randn(out, device=cuda, dtype=dtype)
        return lambda: F.linear(x, w, b)

    def attention(heads, tokens, dim):
        q, k, v = (
            torch.randn(1, heads, tokens, dim, device=cuda, dtype=torch.bfloat16) for _ in range(3)
        )
        return lambda: F.scaled_dot_product_attention(q, k, v)

    def conv(shape, channels, dtype):
        x = torch.randn(*shape, device=cuda, dtype=dtype)
        kernel = (3,) * (len(shape) - 2)
        w = torch.randn(channels, shape[1], *kernel, device=cuda, dtype=dtype) * 0.02
        op = F.conv2d if len(shape) == 4 else F.conv3d
        return lambda: op(x, w, padding=1)

    def layer_norm():
        x = torch.randn(8192, 4096, device=cuda, dtype=torch.bfloat16)
        return lambda: F.layer_norm(x, (4096,))

    def group_norm():
        x = torch.randn(1, 512, 128, 128, device=cuda)
        return lambda: F.silu(F.group_norm(x, 32))

    return [
        ("linear bf16 8192x4096->4096", lambda: linear(8192, 4096, 4096, torch.bfloat16)),
        ("linear bf16 8192x4096->16384", lambda: linear(8192, 4096, 16384, torch.bfloat16)),
        ("linear fp32 512x4096->4096", lambda: linear(512, 4096, 4096, torch.float32)),
        ("attention bf16 d64", lambda: attention(24, 4096, 64)),
        ("attention bf16 d128", lambda: attention(40, 8192, 128)),
        ("layer norm bf16", layer_norm),
        ("group norm + silu fp32", group_norm),
        ("conv2d fp32 512ch 128^2", lambda: conv((1, 512, 128, 128), 512, torch.float32)),
        ("conv3d bf16 384ch", lambda: conv((1, 384, 5, 60, 104), 384, torch.bfloat16)),
        ("conv3d fp32 384ch", lambda: conv((1, 384, 5, 60, 104), 384, torch.float32)),
    ]


def run_arm(arm: str) -> dict:
    import threading

    import torch

    torch.zeros(1, device="cuda")  # the context: every load makes it
    torch.cuda.synchronize()
    warm_seconds = None
    if arm == "warmed":
        from ondeck.warmup import warm_device

        done = {}

        def warm():
            started = time.perf_counter()
            warm_device(torch.device("cuda"))
            done["seconds"] = time.perf_counter() - started

        thread = threading.Thread(target=warm)
        thread.start()
        time.sleep(SLEEP_S)
        thread.join()
        warm_seconds = done.get("seconds")
    rows = {}
    for name, build in operations():
        call = build()
        torch.cuda.synchronize()
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            call()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        rows[name] = {"first": seconds[0], "second": seconds[1]}
    return {"arm": arm, "warm_seconds": warm_seconds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        emit(run_arm(args.child))
        return
    warm_libraries()  # the libraries' files in the page cache for every arm alike
    results = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            result = run_child([__file__, "--child", arm], timeout=300)
            results[arm].append(result)
            print(f"{arm}: {result.get('error') or 'done'}", file=sys.stderr, flush=True)
    table = {}
    for arm, runs in results.items():
        runs = [r for r in runs if "rows" in r]
        if not runs:
            continue
        for name in runs[0]["rows"]:
            excess = statistics.median(
                r["rows"][name]["first"] - r["rows"][name]["second"] for r in runs
            )
            table.setdefault(name, {})[arm] = excess
    path = write_document("first_calls", {"results": results, "excess_seconds": table})
    print(f"wrote {path}")
    print(f"\n{'operation':<32} {'cold excess s':>14} {'warmed excess s':>16}")
    for name, arms in table.items():
        print(
            f"{name:<32} {arms.get('cold', float('nan')):>14.4f} {arms.get('warmed', float('nan')):>16.4f}"
        )
    totals = {arm: sum(arms.get(arm, 0.0) for arms in table.values()) for arm in ARMS}
    print(f"{'all':<32} {totals['cold']:>14.4f} {totals['warmed']:>16.4f}")
    warms = [r.get("warm_seconds") for r in results["warmed"] if r.get("warm_seconds")]
    if warms:
        print(f"warm-up on its thread: median {statistics.median(warms):.3f} s")


if __name__ == "__main__":
    main()
