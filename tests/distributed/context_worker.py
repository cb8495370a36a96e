"""One rank of the context-parallel tests. Run under torchrun; writes what this rank saw.

torchrun --standalone --nproc-per-node 2 context_worker.py WAN_FOLDER SIX_BLOCK_FOLDER OUT_DIR

Each run generates twice with the same inputs: under ``release`` the transformer is
freed after the first and built again for the second, so the second shows whether
diffusers' hooks came back with the reload. SIX_BLOCK_FOLDER (a transformer larger than
the other components) runs under ``budget`` with some blocks streamed.
"""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import numpy as np
import torch

from ondeck import distributed
from ondeck.loading import ModelFolder
from ondeck.pipelines.wan import WanTextToVideo
from ondeck.policy import BudgetPolicy
from ondeck.streaming import StreamOptions, describe_blocks, find_blocks

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)
RUNS = {
    "float32": dict(dtype=torch.float32, policy="release"),
    "float32+shard": dict(dtype=torch.float32, policy="release", shard=("transformer",)),
    "float32+budget": dict(dtype=torch.float32, policy="budget", budget="1GiB"),
    "bfloat16": dict(dtype=torch.bfloat16, policy="release"),
}


def sequence_spy(seen: list[int]):
    """A transform recording the sequence length each call's first block returns."""

    def spy(module):
        module.blocks[0].register_forward_hook(lambda block, args, out: seen.append(out.shape[1]))
        return module

    return spy


def streaming_policy(folder: str) -> BudgetPolicy:
    """A budget that keeps two of the six blocks resident and streams the others, the
    CPU standing in for a discrete device (as in tests/streaming)."""
    template = ModelFolder.open(folder).template("transformer", torch.float32)
    sizes, _ = describe_blocks(template, find_blocks(template.module))
    budget = sizes.other_bytes + 2 * max(sizes.block_bytes) + 2 * max(sizes.packed_bytes)
    options = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
    return BudgetPolicy(budget, streaming=options)


def main(folder: str, six_block_folder: str, out: Path) -> None:
    distributed.init()
    rank = distributed.rank()
    seen: dict = {"rank": rank, "runs": {}}
    for label, options in RUNS.items():
        pipe = WanTextToVideo.from_folder(
            folder, parallel="context", device="cpu", progress=False, **options
        )
        tokens: list[int] = []
        pipe.components["transformer"].add_transform(sequence_spy(tokens))
        first = pipe.generate("a fox", negative_prompt="blurry", seed=7, **SHAPE)
        tokens_first = len(tokens)
        second = pipe.generate("a fox", negative_prompt="blurry", seed=7, **SHAPE)
        np.save(out / f"{label}-first-rank{rank}.npy", first)
        np.save(out / f"{label}-second-rank{rank}.npy", second)
        seen["runs"][label] = {
            "tokens_first": tokens[:tokens_first],
            "tokens_second": tokens[tokens_first:],
            "load_count": pipe.components["transformer"].load_count,
            "report": distributed.merged_report(pipe, pipe.report()),
        }

    # The last pipeline (release): hooks live on the loaded module and go with it.
    proxy = pipe.components["transformer"]
    module = proxy.materialize()
    seen["parallel_config_once_loaded"] = module._parallel_config is pipe.parallel.config
    seen["hooked_once_loaded"] = hasattr(module, "_diffusers_hook")
    alive = weakref.ref(module)
    del module
    proxy.release()
    gc.collect()
    seen["module_alive_after_release"] = alive() is not None

    pipe = WanTextToVideo.from_folder(
        six_block_folder,
        parallel="context",
        policy=streaming_policy(six_block_folder),
        dtype=torch.float32,
        device="cpu",
        progress=False,
        vae_tiling=False,  # whole frames, as the one-process reference decodes them
    )
    tokens = []
    pipe.components["transformer"].add_transform(sequence_spy(tokens))
    for prompt in ("a fox", "a heron"):
        frames = pipe.generate(prompt, negative_prompt="blurry", seed=7, **SHAPE)
        np.save(out / f"streamed-{prompt[2:]}-rank{rank}.npy", frames)
    seen["streamed"] = {"tokens": tokens, "stats": pipe.policy.streaming.stats()["transformer"]}

    import ondeck.diffusers

    pipe = ondeck.diffusers.from_pretrained(
        folder,
        torch_dtype=torch.float32,
        device="cpu",
        policy="release",
        parallel="context",
        progress=False,
    )
    tokens = []
    pipe.ondeck.add_transform("transformer", sequence_spy(tokens))
    frames = pipe(
        prompt="a fox",
        negative_prompt="blurry",
        generator=torch.Generator().manual_seed(3),
        output_type="np",
        **SHAPE,
    ).frames
    np.save(out / f"diffusers-rank{rank}.npy", frames)
    seen["diffusers_tokens"] = tokens
    # 16x16, 1 frame: a latent grid of one 2x2 patch, which two ranks cannot split.
    try:
        pipe(prompt="a fox", height=16, width=16, num_frames=1, num_inference_steps=1)
    except Exception as error:
        seen["diffusers_indivisible"] = f"{type(error).__name__}: {error}"
    (out / f"rank{rank}.json").write_text(json.dumps(seen, default=str))
    distributed.end_process()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
