"""Run under torchrun (two CPU processes): rank 0 arrives at ``shutdown`` late; rank 1
records whether rank 0 had arrived by the time its own ``shutdown`` returned."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ondeck import distributed


def main(out: Path) -> None:
    distributed.init()
    arrived = out / "rank0-arrived"
    rank = distributed.rank()
    total = torch.ones(2)
    torch.distributed.all_reduce(total)  # work on the group's threads, as a run leaves
    if rank == 0:
        time.sleep(0.5)  # only makes the order visible: rank 1 is at shutdown by now
        arrived.write_text("")
    distributed.shutdown()
    if rank == 1:
        (out / "rank1-saw").write_text("yes" if arrived.exists() else "no")
    distributed.end_process()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
