"""One rank of the split-decode tests. Run under torchrun; writes what this rank saw.

torchrun --standalone --nproc-per-node 2 split_decode_worker.py WAN_FOLDER OUT_DIR

First the tiny VAE decodes wide latents split across the ranks, then the Wan pipeline
runs context-parallel at a frame wide enough to split: rank 0 asks for frames, rank 1
for latents only (as the command's ranks do), twice, the second time with the VAE
sharded too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from ondeck import distributed
from ondeck.pipelines.split_decode import decoder_margin, plan_slab, split_decode
from ondeck.pipelines.wan import WanTextToVideo

WIDE = dict(height=32, width=320, num_frames=5, num_inference_steps=2)


def main(folder: str, out: Path) -> None:
    distributed.init()
    rank = distributed.rank()
    seen: dict = {"rank": rank}

    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(Path(folder) / "vae", torch_dtype=torch.float32).eval()
    latents = torch.randn(
        (1, vae.config.z_dim, 2, 4, 40), generator=torch.Generator().manual_seed(1)
    )
    margin = decoder_margin(vae)
    slab = plan_slab(4, 40, rank, distributed.world_size(), margin)
    with torch.no_grad():
        video = split_decode(vae, latents, slab)
    np.save(out / f"vae-rank{rank}.npy", video.numpy())
    torch.save(latents, out / "latents.pt")
    seen["slab"] = [slab.dim, slab.start, slab.stop, slab.own_start, slab.own_count]
    seen["vae_forward_restored"] = all("forward" not in m.__dict__ for m in vae.modules())

    for label, shard in (("context", ()), ("context+vae shard", ("vae",))):
        pipe = WanTextToVideo.from_folder(
            folder,
            parallel="context",
            device="cpu",
            dtype=torch.float32,
            policy="release",
            shard=shard,
            progress=False,
        )
        frames = pipe.generate(
            "a fox",
            negative_prompt="blurry",
            seed=7,
            output_type="np" if rank == 0 else "latent",
            **WIDE,
        )
        decode = pipe.stages[-1]
        split = decode.last_split
        seen[label] = {
            "split": None if split is None else [split.start, split.stop],
            "vae_loads": pipe.components["vae"].load_count,
            "frames_shape": list(frames.shape),
        }
        if rank == 0:
            np.save(out / f"{label}-frames.npy", frames)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    distributed.end_process()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
