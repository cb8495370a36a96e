"""What one rank's share of a split Wan VAE decode costs, on one GPU.

    python benchmarks/split_decode.py [--height 480] [--width 832] [--frames 33] [--ranks 2]

Times the Wan 2.1 VAE (random weights, float32 as the Wan stages run it) decoding a
whole frame against decoding the widest slab one rank of a split decode gets (its share
of the longer side plus the margins ``decoder_margin`` counts), median of three after a
warm-up. The slab's attention runs over the slab here, not the gathered frame: at latent
size it is a small part of the decode. What the split saves on two GPUs is the
difference, less the output's gather; ``benchmarks/context_parallel.py`` measures that.
Writes split_decode.json to $OUT (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    import torch
    from diffusers import AutoencoderKLWan

    from ondeck.pipelines.split_decode import decoder_margin, plan_slab

    device = torch.device(args.device)
    with torch.device(device):
        vae = AutoencoderKLWan().eval()
    latent_frames = (args.frames - 1) // 4 + 1
    height, width = args.height // 8, args.width // 8
    margin = decoder_margin(vae)
    slabs = [plan_slab(height, width, rank, args.ranks, margin) for rank in range(args.ranks)]
    widest = max(slab.stop - slab.start for slab in slabs)
    dim = slabs[0].dim
    latents = torch.randn((1, vae.config.z_dim, latent_frames, height, width), device=device)

    def timed(x: torch.Tensor) -> tuple[float, int]:
        seconds = []
        peak = 0
        for _ in range(4):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            with torch.no_grad():
                vae.decode(x, return_dict=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds[1:]), peak

    whole, whole_peak = timed(latents)
    slab, slab_peak = timed(latents.narrow(dim, 0, widest).contiguous())
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": [args.height, args.width, args.frames],
        "ranks": args.ranks,
        "margin_latent_pixels": margin,
        "slab_latent_pixels": widest,
        "frame_latent_pixels": width if dim == -1 else height,
        "whole_seconds": whole,
        "slab_seconds": slab,
        "whole_peak_bytes": whole_peak,
        "slab_peak_bytes": slab_peak,
    }
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "split_decode.json").write_text(json.dumps(result, indent=2))
    GiB = 2**30
    print(f"{'decode':<28} {'seconds':>8} {'peak GiB':>9}")
    print(f"{'whole frame':<28} {whole:>8.3f} {whole_peak / GiB:>9.2f}")
    label = f"one rank's slab ({widest} of {result['frame_latent_pixels']})"
    print(f"{label:<28} {slab:>8.3f} {slab_peak / GiB:>9.2f}")
    print(f"slab / whole: {slab / whole:.2f}")


if __name__ == "__main__":
    main()
