"""A minute on the GPU before the long runs: every policy on a tiny Wan folder, on CUDA.

    python benchmarks/gpu_smoke.py

Checks frames against diffusers.WanPipeline (when diffusers is importable), prefetch,
the host cache and the budget policy's eviction, and prints what it found.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ondeck.embedded import build_wan_folder  # noqa: E402
from ondeck.loading import HostCache  # noqa: E402
from ondeck.pipelines.wan import WanTextToVideo  # noqa: E402

SHAPE = dict(height=64, width=64, num_frames=9, num_inference_steps=3)


def main() -> int:
    folder = build_wan_folder(Path(tempfile.mkdtemp()) / "wan", preset="default")
    from diffusers import WanPipeline

    reference = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32).to("cuda")
    expected = reference("a fox", generator=torch.Generator("cpu").manual_seed(0), **SHAPE).frames
    del reference
    torch.cuda.empty_cache()
    failures = 0
    for policy, options in [
        ("eager", {}),
        ("release", {}),
        ("budget", {"budget": "2GiB"}),
        ("budget", {"budget": "2GiB", "host_cache": HostCache(2 << 30)}),
        ("budget", {"budget": "200MiB"}),
        ("auto", {}),
    ]:
        pipe = WanTextToVideo.from_folder(
            folder, device="cuda", dtype=torch.float32, policy=policy, progress=False, **options
        )
        started = time.perf_counter()
        for _ in range(2):
            frames = pipe.generate("a fox", seed=0, **SHAPE)
        seconds = time.perf_counter() - started
        difference = float(np.abs(frames - expected).max())
        predicted = pipe.plan().peak_bytes
        measured = pipe.tracker.peak_resident_bytes
        ok = difference < 2e-3 and predicted == measured
        failures += not ok
        print(
            f"{policy:<8} {str({k: str(v) for k, v in options.items()}):<60} max|diff| {difference:.2e} "
            f"peak pred/meas {predicted}/{measured} exposed {pipe.tracker.exposed_load_seconds():.3f}s "
            f"{seconds:.2f}s {'ok' if ok else 'FAIL'}",
            flush=True,
        )
        pipe.release_all()
        del pipe
        torch.cuda.empty_cache()
    print(f"smoke: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
