"""One rank of the sharded-pipeline tests. Run under torchrun; writes what this rank saw.

torchrun --standalone --nproc-per-node 2 rank_worker.py WAN_FOLDER OUT_DIR
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

from ondeck import distributed
from ondeck.loading.host_cache import HostCache
from ondeck.loading.skeleton import Skeleton
from ondeck.pipelines.wan import WanTextToVideo

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)
RUNS = {
    "transformer": ("transformer",),
    "transformer+text_encoder": ("transformer", "text_encoder"),
    # Blocks' shards arrive behind the compute, however small the component.
    "pipelined": ("transformer", "text_encoder"),
}


def main(folder: str, out: Path) -> None:
    distributed.init()
    rank = distributed.rank()
    seen: dict = {"rank": rank, "world_size": distributed.world_size(), "runs": {}}
    for label, shard in RUNS.items():
        pipe = WanTextToVideo.from_folder(
            folder,
            shard=shard,
            policy="release",
            dtype=torch.float32,
            device="cpu",
            progress=False,
            pipelined=True if label == "pipelined" else None,
        )
        frames = pipe.generate("a fox", negative_prompt="blurry", seed=7, **SHAPE)
        np.save(out / f"{label}-rank{rank}.npy", frames)
        seen["runs"][label] = {
            "component_bytes": pipe.component_bytes(),
            "bytes_read": {name: loader.bytes_read for name, loader in pipe.loaders.items()},
            "report": distributed.merged_report(pipe, pipe.report()),
        }

    # The last pipeline's loads are pipelined: a load returns before its blocks are in.
    # Its fill's thread then copies the skeleton the next load shards, so the next load
    # copies none on the caller's thread.
    copies: list[str] = []
    fresh = Skeleton.fresh

    def watched(skeleton):
        copies.append(threading.current_thread().name)
        return fresh(skeleton)

    Skeleton.fresh = watched
    try:
        module, filling = pipe.loaders["transformer"].begin()
        seen["pipelined_filling"] = filling is not None
        if filling is not None:
            filling.wait()
            filling._thread.join()  # it builds the next skeleton after the fill has ended
        del module, filling
        seen["skeleton_copies_filling"] = list(copies)
        copies.clear()
        module, filling = pipe.loaders["transformer"].begin()
        seen["skeleton_copies_next_begin"] = list(copies)
        if filling is not None:
            filling.wait()
        del module, filling
    finally:
        Skeleton.fresh = fresh

    # With a host cache each rank keeps its own rows: the second run reads no file.
    # (The cache serves CPU loads here, which it refuses outside tests.)
    HostCache.enabled_for = staticmethod(lambda device: True)
    cached = WanTextToVideo.from_folder(
        folder,
        shard=("transformer", "text_encoder"),
        policy="release",
        dtype=torch.float32,
        device="cpu",
        progress=False,
        pipelined=True,
        host_cache=HostCache(budget_bytes=2**30, pin=False),
    )
    reads = []
    for prompt in ("a cat", "a fox"):  # not one prompt twice: its encoding would be reused
        frames = cached.generate(prompt, negative_prompt="blurry", seed=7, **SHAPE)
        reads.append({name: loader.bytes_read for name, loader in cached.loaders.items()})
    np.save(out / f"host-cache-rank{rank}.npy", frames)
    seen["host_cache"] = {
        "bytes_read": reads,
        "sources": {name: loader.last_source for name, loader in cached.loaders.items()},
    }
    del cached

    proxy = pipe.components["transformer"]
    seen["fsdp_while_unloaded"] = isinstance(proxy, FSDPModule)
    module = proxy.materialize()
    seen["fsdp_once_loaded"] = isinstance(proxy, FSDPModule)
    shards = [parameter.to_local() for parameter in module.parameters()]
    seen["shard_storage_bytes_loaded"] = sum(s.untyped_storage().nbytes() for s in shards)
    alive = weakref.ref(module)
    del module
    seen["released_bytes"] = proxy.release()
    # A fill's thread runs its last steps (the next load's skeleton) after the fill has
    # ended and the release has freed every byte; on a busy machine it may still be in
    # them here. What counts is that nothing else keeps the module.
    for thread in threading.enumerate():
        if thread.name.startswith("ondeck-fill-"):
            thread.join(timeout=60)
    gc.collect()
    seen["module_alive_after_release"] = alive() is not None
    if alive() is not None:
        seen["module_referrers"] = sorted({type(r).__name__ for r in gc.get_referrers(alive())})
    seen["shard_storage_bytes_released"] = sum(s.untyped_storage().nbytes() for s in shards)
    seen["fsdp_after_release"] = isinstance(proxy, FSDPModule)
    (out / f"rank{rank}.json").write_text(json.dumps(seen, default=str))
    distributed.end_process()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
