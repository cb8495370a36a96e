"""Running one pipeline across several processes: the process group, the mesh, the report.

Each process (a rank) drives its own device and runs the same stages on the same
inputs; components named for sharding hold only this rank's share of their weights
(see ``loading/sharded.py``), and with context parallelism each computes its slice of
the transformer's sequence (see ``parallel.py``). Everything here is a thin layer over
``torch.distributed``: NCCL between CUDA devices, gloo between CPU processes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, NoReturn

from .errors import OndeckError
from .loading.folder_loader import FolderLoader
from .memory import process_peak_rss_bytes

__all__ = [
    "context_mesh",
    "device_mesh",
    "end_process",
    "gather_all",
    "init",
    "is_active",
    "is_main",
    "joined",
    "launched_with_torchrun",
    "main_first",
    "merged_report",
    "rank",
    "rank_summary",
    "shutdown",
    "world_size",
]

# NVLink SHARP (multicast) is off for everything ondeck starts: FSDP's all-gathers do not
# need it, and on shared multi-GPU hosts a program using it can take the GPUs out of
# service. Set before the process group exists, since NCCL reads it once; an explicit
# value in the environment wins.
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0"}

# "joined": init ran in this process (it made a process group, or found one).
_state: dict[str, Any] = {"owned": False, "joined": False, "meshes": {}}


def launched_with_torchrun() -> bool:
    """True in a process started by ``torchrun`` (or anything that sets the same variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def is_active() -> bool:
    """True once a process group exists in this process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_active() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if is_active() else 1


def is_main() -> bool:
    """The rank that prints, writes the video and writes the merged report."""
    return rank() == 0


def init(backend: str | None = None) -> None:
    """Join the process group ``torchrun`` describes; a no-op when one already exists.

    ``backend`` defaults to ``nccl`` when CUDA is present (each rank then uses the GPU
    ``LOCAL_RANK`` names) and ``gloo`` otherwise.
    """
    for key, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if is_active():
        _state["joined"] = True
        return
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise OndeckError("this torch build has no torch.distributed; sharding needs it")
    if not launched_with_torchrun():
        raise OndeckError(
            "sharding needs one process per device: launch with "
            "`torchrun --nproc-per-node N -m ondeck generate MODEL_DIR --shard transformer`, "
            "or initialise torch.distributed before building the pipeline"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    _state["owned"] = _state["joined"] = True


def shutdown(*, wait: bool = True) -> None:
    """Leave the process group, if :func:`init` created it.

    ``wait``: every rank first waits for the others to get here, so none tears down its
    side of a group the others still use. Pass False after a failure, when the other
    ranks may never arrive. To end the process too, use :func:`end_process`.
    """
    _state["meshes"].clear()
    owned, _state["owned"] = _state["owned"], False
    if not (owned and is_active()):
        return
    import torch.distributed as dist

    if wait:
        if dist.get_backend() == "nccl":  # its barrier otherwise guesses the device
            import torch

            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
    dist.destroy_process_group()


def joined() -> bool:
    """True once :func:`init` has run in this process (it may have left the group since)."""
    return _state["joined"]


def end_process(status: int = 0) -> NoReturn:
    """Leave the process group (:func:`shutdown`) and end this process with ``status``,
    skipping the interpreter's teardown. The last call of a ``torchrun`` worker.

    The exit handlers (``atexit``) run first, with Python whole, and the standard
    streams are flushed; only the teardown after them is left out. It is where gloo
    aborts: torch keeps a group its functional collectives used (context parallelism,
    DTensor) to the end, and the group's threads release each finished collective's
    tensors when they get to it. One that gets there after Python began to shut down
    cannot take the interpreter's lock and takes the process down with SIGABRT
    ("terminate called without an active exception"), so torchrun reports a failed
    run whose work was done.
    """
    import atexit
    import sys

    try:
        try:
            shutdown()
        except Exception as error:  # the others may be gone: say so, and fail
            print(f"ondeck: leaving the process group failed: {error}", file=sys.stderr)
            status = status or 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def device_mesh(device: Any) -> Any:
    """The one-dimensional mesh of every rank, for devices of ``device``'s type.

    Built once per device type, in the calling thread: creating a mesh is collective,
    while a load that shards over it (maybe on a prefetch thread) is not.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    if not is_active():
        init()
    device_type = torch.device(device).type
    mesh = _state["meshes"].get(device_type)
    if mesh is None:
        mesh = init_device_mesh(device_type, (world_size(),))
        _state["meshes"][device_type] = mesh
    return mesh


def context_mesh(device: Any, *, ring: int, ulysses: int) -> Any:
    """The two-dimensional ``("ring", "ulysses")`` mesh diffusers' context parallelism
    splits the sequence over; built once per shape, in the calling thread (collective)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    if not is_active():
        init()
    device_type = torch.device(device).type
    key = (device_type, "ring", ring, "ulysses", ulysses)
    mesh = _state["meshes"].get(key)
    if mesh is None:
        mesh = init_device_mesh(device_type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
        _state["meshes"][key] = mesh
    return mesh


def gather_all(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order, on every rank; ``[value]`` alone.

    Collective: every rank must call it, in the same order as the others.
    """
    if not is_active():
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block before the others (building a shared cache folder, say)."""
    if not is_active():
        yield
        return
    import torch.distributed as dist

    if not is_main():
        dist.barrier()
    try:
        yield
    finally:
        if is_main():
            dist.barrier()


def rank_summary(pipeline: Any) -> dict[str, Any]:
    """This rank's memory and disk figures: what the tracker saw and what the loaders read."""
    tracker = pipeline.tracker
    loaders = getattr(pipeline, "loaders", None) or {}
    bytes_read = {name: _bytes_read(loader) for name, loader in sorted(loaders.items())}
    # Each stage's largest activation peak (device bytes allocated beyond the weights);
    # None where it was not measured (on CPU).
    activations: dict[str, int | None] = {}
    for record in tracker.stages:
        known = activations.get(record.stage)
        if record.activation_bytes is not None:
            known = max(known or 0, record.activation_bytes)
        activations[record.stage] = known
    parallel = getattr(pipeline, "parallel", None)
    return {
        "rank": rank(),
        "device": str(pipeline.device),
        "context_parallel": parallel.summary() if parallel is not None else None,
        "component_bytes": pipeline.component_bytes(),
        "activation_bytes": activations,
        "peak_resident_bytes": tracker.peak_resident_bytes,
        # Device bytes allocated (torch.cuda.max_memory_allocated per stage); None on CPU.
        "peak_allocated_bytes": tracker.peak_measured_bytes or None,
        "process_peak_rss_bytes": process_peak_rss_bytes(),
        "bytes_loaded": tracker.bytes_loaded,
        # None where a loader does not count (a plain ComponentLoader).
        "bytes_read_from_files": bytes_read,
        "bytes_read_from_files_total": (
            None if not bytes_read or None in bytes_read.values() else sum(bytes_read.values())
        ),
    }


def _bytes_read(loader: Any) -> int | None:
    """What a loader has read from the files; None where it does not count."""
    return loader.bytes_read if isinstance(loader, FolderLoader) else None


def merged_report(pipeline: Any, report: dict[str, Any]) -> dict[str, Any] | None:
    """``report`` (rank 0's) with every rank's summary under ``ranks``; None off rank 0.

    Collective: every rank must call it, in the same order as the others.
    """
    summary = rank_summary(pipeline)
    if not is_active():
        return {
            "context_parallel": summary["context_parallel"],
            **report,
            "world_size": 1,
            "ranks": [summary],
        }
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * world_size() if is_main() else None
    dist.gather_object(summary, gathered, dst=0)
    if not is_main():
        return None
    return {
        "context_parallel": summary["context_parallel"],
        **report,
        "world_size": world_size(),
        "backend": str(dist.get_backend()),
        "sharded": sorted(
            name
            for name, loader in (getattr(pipeline, "loaders", None) or {}).items()
            if isinstance(loader, FolderLoader) and loader.mesh is not None
        ),
        "ranks": gathered,
    }
