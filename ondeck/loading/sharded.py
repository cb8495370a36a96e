"""Load one rank's share of a component: FSDP2 over a device mesh, reading only its bytes.

The module is built on the meta device and sharded with ``fully_shard`` (each block,
then the root) before any memory is allocated. FSDP2 splits every parameter along dim
0 the way ``torch.chunk`` does, so this rank's shard is a run of whole rows: one
contiguous byte range of the safetensors file, which the reader streams straight into
the local shard. No rank ever holds, or reads, a full copy of a sharded parameter.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import LoadError
from ..lazy import ComponentSpec
from . import reads
from .components import ComponentLoader
from .host_cache import component_key
from .model_folder import ModelFolder
from .options import LoadOptions
from .pipelined import fill_groups
from .safetensors_format import TensorInfo
from .skeleton import (
    Skeleton,
    get_tensor,
    is_model_container,
    match_tensors,
    module_paths,
    set_tensor,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ShardedComponentLoader",
    "check_shard",
    "shardable_models",
    "shard_cache_key",
    "shard_rows",
    "shard_units",
    "rows_of",
]

# Methods other than ``forward`` that callers run a sharded component through.
ENTRY_METHODS = ("encode", "decode")


def shardable_models(folder: ModelFolder, skip: Collection[str] = ()) -> list[str]:
    """The folder's models ondeck can read by rows, from ``model_index.json`` alone: its
    ``nn.Module`` components, less ``skip`` and models that only hold others."""
    models = []
    for name in folder.component_names:
        if name in skip:
            continue
        try:
            cls = folder.component_class(name)
        except LoadError:
            continue
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            if not is_model_container(cls):
                models.append(name)
    return models


def check_shard(
    folder: ModelFolder, shard: str | Sequence[str], models: Sequence[str]
) -> tuple[str, ...]:
    """``shard`` as a tuple of distinct names, each refused before anything starts unless
    it is one of ``models`` (the pipeline's models ondeck loads from the folder's
    safetensors files) and stored unquantized."""
    from .quantized import quantization_method

    names = tuple(dict.fromkeys((shard,) if isinstance(shard, str) else shard))
    unknown = sorted(set(names) - set(models))
    if unknown:
        raise ValueError(f"cannot shard {unknown}; the models are {', '.join(models)}")
    for name in names:
        method = quantization_method(folder, name)
        if method is not None:
            raise LoadError(
                f"component '{name}': it is already quantized ({method or 'unnamed'}), "
                "and FSDP2 sharding does not apply to it; leave it out of shard",
                component=name,
            )
    return names


def shard_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first row, row count)`` of ``rank``'s shard of a dim of ``rows``, as FSDP2 splits it.

    Shards are ``ceil(rows / world_size)`` rows; the last ranks may get fewer, or none.
    """
    per_rank = math.ceil(rows / world_size) if rows else 0
    first = min(rank * per_rank, rows)
    return first, min(per_rank, rows - first)


def rows_of(info: TensorInfo, first: int, count: int) -> TensorInfo:
    """The entry for rows ``[first, first + count)`` of a tensor: a narrower byte range."""
    row_nbytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
    start = info.start + first * row_nbytes
    return dataclasses.replace(
        info, shape=(count, *info.shape[1:]), start=start, end=start + count * row_nbytes
    )


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules that get their own ``fully_shard``: each gathers its weights alone.

    The model's ``_no_split_modules`` (transformer blocks, encoder layers) when it names
    any, else the items of its module lists; outermost matches only.
    """
    wanted = set(getattr(module, "_no_split_modules", None) or ())
    found: list[tuple[str, torch.nn.Module]] = []
    if wanted:
        for name, submodule in module.named_modules():
            if name and type(submodule).__name__ in wanted:
                found.append((name, submodule))
    if not found:
        for name, submodule in module.named_modules():
            if isinstance(submodule, torch.nn.ModuleList):
                found += [(f"{name}.{index}", item) for index, item in enumerate(submodule)]
    units: list[torch.nn.Module] = []
    kept: list[str] = []
    for name, submodule in found:
        if not any(name.startswith(f"{outer}.") for outer in kept):
            kept.append(name)
            units.append(submodule)
    return units


class ShardedComponentLoader(ComponentLoader):
    """Loads this rank's shard of a component, as an FSDP2 module over ``mesh``.

    ``mesh`` is a one-dimensional device mesh of every rank
    (:func:`ondeck.distributed.device_mesh`). Each load builds a fresh module, shards
    it, allocates only the local shards on ``device`` and reads only their byte ranges.
    With ``mesh=None`` the component loads whole, as :class:`ComponentLoader` loads it.
    Either way ``bytes_read`` counts the bytes this process has read from the files.
    ``options`` say how it loads, as for every loader (:class:`~.options.LoadOptions`).
    """

    def __init__(
        self,
        folder: ModelFolder | str | os.PathLike,
        name: str,
        options: LoadOptions | None = None,
        *,
        mesh: DeviceMesh | None = None,
    ):
        options = options or LoadOptions()
        if mesh is not None and options.storage_dtype is not None:
            # A shard is read as it is stored in the files; kept as fp8 it would need
            # its stored bytes cached per rank, which sharding does not do.
            options = options.replace(host_cache=None)
        super().__init__(folder, name, **options.keywords())
        self.mesh = mesh
        self.bytes_read = 0
        self._shard_nbytes: int | None = None
        if mesh is not None:
            if mesh.ndim != 1:
                raise ValueError(f"component '{name}': shard over a 1-D mesh, got {mesh.ndim}-D")
            if torch.device(mesh.device_type).type != self.device.type:
                raise ValueError(
                    f"component '{name}': the mesh is of {mesh.device_type} devices, the "
                    f"component loads onto {self.device}"
                )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.progress = self.progress and torch.distributed.get_rank() == 0

    def __repr__(self) -> str:
        shards = f", {self.mesh.size()} shards" if self.mesh is not None else ""
        return f"ShardedComponentLoader({str(self.folder.path)!r}, {self.name!r}, {self.device}{shards})"

    @property
    def spec(self) -> ComponentSpec:
        """As :class:`ComponentLoader`'s, with ``nbytes`` this rank's share of the weights."""
        whole = super().spec
        if self.mesh is None:
            return whole
        if self._shard_nbytes is None:
            template = self.folder.template(self.name, self.dtype)
            self._shard_nbytes = shard_nbytes(template, self.mesh.size())
        return whole.with_updates(nbytes=self._shard_nbytes)

    def begin(self) -> tuple[torch.nn.Module, Any]:
        """Without a mesh, as :class:`ComponentLoader`'s. With one, pipelined as well
        where the component is large enough: this rank's shards of the blocks arrive
        behind the compute, each block's forward waits for its own before FSDP2 gathers
        it from the ranks (every rank waits for its own share, so the gather finds all
        of them in place)."""
        if self.mesh is None:
            return super().begin()
        started = time.perf_counter()
        module = filling = None
        try:
            template = self.folder.template(self.name, self.dtype)
            module, sources, computed = self._build_sharded(template)
            jobs, names = self._shard_jobs(module, sources, computed)
            path = self._pipelined_blocks(template)
            key = raw = None
            if self.host_cache is not None:
                key = shard_cache_key(
                    self.folder, self.name, self.mesh.get_local_rank(), self.mesh.size()
                )
                raw = self.host_cache.get(key)
            self.last_load_bytes = 0
            if path is None or not _evenly_sharded(sources, self.mesh):
                if raw is not None:
                    self._record(self._copy_and_read(jobs, raw))
                else:
                    self._read_files(jobs, key, while_reading=None)
                self.last_load_seconds = time.perf_counter() - started
                module.eval()
                return module, None
            groups, group_of = fill_groups(names, [job.info.nbytes for job in jobs], path)
            filling = self._start_filling(jobs, groups, key, raw, started, template)
            jobs = None  # the filling holds each group until it is read
            filling.attach(module, path, group_of)
            filling.wait_group(0)
            module.eval()
        except BaseException as error:
            # Give this rank's shards back now; the traceback would keep them alive.
            self._give_back(error, module=module, filling=filling)
            module = jobs = filling = None
            raise
        return module, filling

    def _read(
        self,
        jobs: list[reads.ReadJob],
        while_reading: Any = None,
        bar: Any = None,
    ) -> reads.ReadStats:
        """Read from the files, counting the bytes in ``bytes_read`` (copies from the host
        cache do not pass here)."""
        stats = super()._read(jobs, while_reading, bar=bar)
        self.bytes_read += stats.nbytes
        return stats

    def _read_in_groups(self, groups, reached, bar) -> reads.ReadStats:
        stats = super()._read_in_groups(groups, reached, bar)
        self.bytes_read += stats.nbytes
        return stats

    def _build_sharded(self, template: Skeleton) -> tuple[torch.nn.Module, list, list]:
        """The module sharded over the mesh, its local shards allocated but not filled."""
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        tensors = self.folder.tensors(self.name)
        skeleton = self._take_skeleton(template)
        sources = match_tensors(skeleton, tensors, self.name, self.folder.directory(self.name))
        module = skeleton.module
        modules = module_paths(module)
        # Final dtypes before sharding: FSDP2 keeps each parameter's dtype as it finds it.
        # Frozen parameters: FSDP2 gathers a block of mixed dtypes (float32 norms beside
        # bf16 weights) only when none of them is trainable.
        for slot, _ in sources:
            value = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
            if slot.is_parameter:
                value = torch.nn.Parameter(value, requires_grad=False)
            for name in slot.names:
                set_tensor(module, name, value, parameter=slot.is_parameter, modules=modules)
        # Buffers the files lack were computed on the host by __init__; to_empty below
        # replaces every tensor, so keep them to copy back.
        computed = [
            (names, get_tensor(module, names[0])) for names in skeleton.extra_buffers.values()
        ]
        for unit in shard_units(module):
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=True)
        fully_shard(module, mesh=self.mesh, reshard_after_forward=True)
        # FSDP2 gathers the root's own weights around ``forward``; a VAE is called
        # through ``encode`` and ``decode``, which must do the same.
        for method in ENTRY_METHODS:
            if callable(getattr(module, method, None)):
                register_fsdp_forward_method(module, method)
        # Allocates each parameter's local shard only (FSDP2 pads uneven ones to equal
        # sizes), and every buffer whole.
        module.to_empty(device=self.device)
        return module, sources, computed

    def _shard_jobs(
        self, module: torch.nn.Module, sources: list, computed: list
    ) -> tuple[list[reads.ReadJob], list[tuple[str, ...]]]:
        """A read job for this rank's rows of every parameter and for every buffer, and
        the module names each job fills."""
        rank, world_size = self.mesh.get_local_rank(), self.mesh.size()
        jobs: list[reads.ReadJob] = []
        job_names: list[tuple[str, ...]] = []
        with torch.no_grad():
            for slot, info in sources:
                tensor = get_tensor(module, slot.names[0])
                if not slot.is_parameter:
                    # Buffers are not sharded; to_empty gave each name its own tensor.
                    for name in slot.names[1:]:
                        set_tensor(module, name, tensor, parameter=False)
                    jobs.append(reads.ReadJob(info, tensor))
                    job_names.append(tuple(slot.names))
                    continue
                local = tensor.to_local()
                first, count = shard_rows(slot.shape[0], rank, world_size)
                if tuple(local.shape) != (count, *slot.shape[1:]):
                    raise LoadError(
                        f"component '{self.name}': parameter '{slot.names[0]}' has a local "
                        f"shard of shape {list(local.shape)} on rank {rank}; ondeck reads "
                        f"dim-0 shards of {count} rows",
                        component=self.name,
                    )
                if count:
                    jobs.append(reads.ReadJob(rows_of(info, first, count), local))
                    job_names.append(tuple(slot.names))
            for buffer_names, host_value in computed:
                moved = get_tensor(module, buffer_names[0])
                moved.copy_(host_value)
                for name in buffer_names[1:]:
                    set_tensor(module, name, moved, parameter=False)
        return jobs, job_names


def shard_cache_key(folder: Any, name: str, rank: int, world_size: int) -> tuple:
    """The host cache key of one rank's rows of a component: an entry per rank and number
    of ranks. A whole or streamed load looks for its component placed another way among
    keys of its own length that share its items before the placement
    (``HostCache.other_placement``); this key, five items with the shard fourth, is
    never one of them (a plain load's key has four, a stored one's the storage fourth)."""
    base = component_key(folder.path, name, folder.tensors(name))
    return (*base, ("shard", rank, world_size), ("rows",))


def _evenly_sharded(sources: list, mesh: Any) -> bool:
    """Whether every parameter's local shard on this rank is as large as FSDP2's padded
    one, or empty. A shorter one FSDP2 copies into a padded buffer at the first forward,
    which a fill behind the compute might not have written yet."""
    rank, world_size = mesh.get_local_rank(), mesh.size()
    for slot, _ in sources:
        if slot.is_parameter and slot.shape:
            _, count = shard_rows(slot.shape[0], rank, world_size)
            _, padded = shard_rows(slot.shape[0], 0, world_size)  # rank 0's is never short
            if 0 < count < padded:
                return False
    return True


def shard_nbytes(skeleton: Skeleton, world_size: int) -> int:
    """Bytes one rank holds: padded dim-0 shards of the parameters, buffers whole."""
    total = skeleton.nbytes
    for slot in skeleton.slots:
        if slot.is_parameter and slot.shape:
            rows = math.ceil(slot.shape[0] / world_size)
            total += rows * (slot.nbytes // slot.shape[0] if slot.shape[0] else 0) - slot.nbytes
    return total
