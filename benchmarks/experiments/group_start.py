"""How soon a pipelined load hands its module over, and how long its fill takes.

    python benchmarks/group_start.py [--folder DIR] [--attempts 4]

A folder holding only a Wan 2.1 14B-shaped transformer (bf16, written by diffusers'
``save_pretrained``), in the page cache. Three arms load it pipelined from the files,
taking turns in an order that turns each attempt, after one warm-up load each:

    one read, chunks made as reached   the reader as it is
    one read, chunks made up front     every chunk of the component planned before the
                                       first read (the reader before its lazy plan)
    a read per group                   each group of blocks read on its own (before
                                       one read for all groups)

Per arm, medians: the seconds until ``begin()`` returns (the parts outside the blocks
in place: compute could start), the whole fill, and the read's GB/s. Writes
group_start.json to $OUT and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import _randomise, warm_page_cache, write_document  # noqa: E402

ARMS = ("one read, chunks made as reached", "one read, chunks made up front", "a read per group")


def transformer_folder(path: Path, tiny: bool) -> Path:
    """A pipeline folder with the transformer alone."""
    import torch
    from diffusers import WanTransformer3DModel

    if (path / "model_index.json").exists():
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = dict(num_layers=2, num_attention_heads=2, attention_head_dim=8) if tiny else {}
    with torch.device(device):
        transformer = WanTransformer3DModel(**options).to(torch.bfloat16)
    _randomise(transformer)
    transformer.save_pretrained(path / "transformer", max_shard_size="5GB")
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}
    (path / "model_index.json").write_text(json.dumps(index))
    del transformer
    return path


def per_group(groups, reached, **options):
    """The reader before one read for all groups: a read per group."""
    from ondeck.loading import reads

    started = time.perf_counter()
    total = 0
    for index, group in enumerate(groups):
        total += reads.read_into(group, **options).nbytes
        reached(index)
    return reads.ReadStats(total, time.perf_counter() - started, "page cache", "processes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default="/tmp/wan14b-transformer")
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a tiny transformer (a CPU check)")
    args = parser.parse_args()
    import torch

    from ondeck.loading import ComponentLoader, ModelFolder, chunks, reads

    started = time.perf_counter()
    path = transformer_folder(Path(args.folder), args.tiny)
    files = sorted(str(p) for p in path.glob("transformer/*.safetensors"))
    warm_page_cache(files)
    print(f"(folder ready after {time.perf_counter() - started:.0f}s)", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = ModelFolder.open(path)
    lazy_iter, lazy_groups = chunks.ChunkPlan.__iter__, reads.read_in_groups

    def up_front(plan):
        plan[0]  # makes every chunk
        yield from plan._made

    loaders = {
        arm: ComponentLoader(folder, "transformer", device=device, pipelined=True, progress=False)
        for arm in ARMS
    }
    figures = {arm: {"begin": [], "fill": [], "read": []} for arm in ARMS}
    nbytes = sum(os.path.getsize(f) for f in files)
    for attempt in range(1 + args.attempts):
        for turn in range(len(ARMS)):
            arm = ARMS[(attempt + turn) % len(ARMS)]
            if arm == "one read, chunks made up front":
                chunks.ChunkPlan.__iter__ = up_front
            if arm == "a read per group":
                reads.read_in_groups = per_group
            try:
                if device == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                module, filling = loaders[arm].begin()
                handed = time.perf_counter() - began
                if filling is not None:
                    filling.wait()
                filled = time.perf_counter() - began
            finally:
                chunks.ChunkPlan.__iter__, reads.read_in_groups = lazy_iter, lazy_groups
            if attempt:
                figures[arm]["begin"].append(handed)
                figures[arm]["fill"].append(filled)
                figures[arm]["read"].append(loaders[arm].last_read_seconds)
            del module, filling
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    rows = {}
    for arm in ARMS:
        row = {key: statistics.median(values) for key, values in figures[arm].items()}
        row["read_gb_per_second"] = nbytes / row["read"] / 1e9
        row["samples"] = figures[arm]
        rows[arm] = row
    write_document("group_start", {"rows": rows, "file_bytes": nbytes})
    print(f"\n{'arm':<34} {'begin s':>8} {'fill s':>7} {'read GB/s':>9}   (medians)")
    for arm, row in rows.items():
        print(f"{arm:<34} {row['begin']:8.3f} {row['fill']:7.3f} {row['read_gb_per_second']:9.1f}")


if __name__ == "__main__":
    main()
