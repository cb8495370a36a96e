"""One rank of the tests that shard a diffusers pipeline's models (not Wan's stages).

torchrun --standalone --nproc-per-node 2 diffusers_shard_worker.py FLUX_FOLDER OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integrations.tiny_pipelines import FAMILIES, run  # noqa: E402

import ondeck.diffusers  # noqa: E402
from ondeck import distributed  # noqa: E402

SHARD = ("transformer", "text_encoder_2")
CONTEXT_SHAPE = {"height": 16, "width": 16}


def token_counter(tokens: list[int]):
    """A transform recording the image tokens each call's first block is given."""

    def count(module):
        def hook(block, args, kwargs):
            tokens.append(kwargs["hidden_states"].shape[1])

        module.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
        return module

    return count


def main(folder: str, out: Path) -> None:
    pipe = ondeck.diffusers.from_pretrained(
        folder, torch_dtype=torch.float32, device="cpu", policy="release", shard=SHARD,
        progress=False,
    )  # fmt: skip
    rank = distributed.rank()
    loaded_as: dict[str, bool] = {}
    for name in SHARD:

        def seen(module, name=name):
            loaded_as[name] = isinstance(module, FSDPModule)
            return module

        getattr(pipe, name).add_transform(seen, reads_weights=False)
    images = run(pipe, FAMILIES["flux"], seed=3)
    np.save(out / f"images-rank{rank}.npy", np.asarray(images))
    report = distributed.merged_report(pipe.ondeck, pipe.ondeck.report())
    seen_here = {
        "rank": rank,
        "loaded_as_fsdp": loaded_as,
        "bytes_read": {name: loader.bytes_read for name, loader in pipe.ondeck.loaders.items()},
        "component_bytes": pipe.ondeck.component_bytes(),
        "report_sharded": report["sharded"] if report else None,
    }
    # The sequence split over the ranks too (Flux has a diffusers context-parallel plan),
    # the transformer still sharded.
    del pipe
    split = ondeck.diffusers.from_pretrained(
        folder, torch_dtype=torch.float32, device="cpu", policy="release",
        shard=["transformer"], parallel=2, progress=False,
    )  # fmt: skip
    tokens: list[int] = []
    split.transformer.add_transform(token_counter(tokens), reads_weights=False)
    images = run(split, FAMILIES["flux"], seed=3, **CONTEXT_SHAPE)
    np.save(out / f"context-images-rank{rank}.npy", np.asarray(images))
    seen_here["context_tokens"] = sorted(set(tokens))
    (out / f"rank{rank}.json").write_text(json.dumps(seen_here))
    distributed.end_process()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
