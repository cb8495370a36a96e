"""One rank of the exit soak (torchrun, two CPU processes): DTensor's collectives, a
gathered report, then the end the first argument names ("end_process" or "return")."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ondeck import distributed


def main(end: str) -> None:
    distributed.init()
    mesh = distributed.device_mesh("cpu")
    for _ in range(20):  # as a context-parallel run gathers each call's output
        DTensor.from_local(torch.ones(64, 64), mesh, [Shard(0)]).full_tensor()
    gathered = [None] * distributed.world_size() if distributed.is_main() else None
    dist.gather_object({"rank": distributed.rank()}, gathered, dst=0)  # as the report is
    if end == "end_process":
        distributed.end_process()
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
