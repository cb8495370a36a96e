"""Load one component of a model folder straight into its final place and dtype."""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..errors import LoadError
from ..lazy import ComponentSpec, free_module_storages, free_storage
from . import fp8, reads, upcast
from .blocks import find_blocks
from .folder_loader import FolderLoader, open_folder
from .host_cache import HostCache, component_key
from .model_folder import ModelFolder
from .options import LoadOptions
from .page_cache import describe_source
from .pipelined import MIN_PIPELINED_BYTES, Filling, fill_groups, start_filling
from .quantized import QuantizedComponentLoader, quantization_method
from .safetensors_format import TensorInfo
from .single_file import SingleFileFolder, pieces_of
from .skeleton import Skeleton, get_tensor, match_tensors, module_paths, set_tensor

__all__ = ["ComponentLoader", "component_loader", "load_auxiliary", "load_component"]


class ComponentLoader(FolderLoader):
    """A zero-argument loader for one model component, usable as a ``LazyModule`` loader.

    Each call builds the module on the meta device, allocates every tensor directly on
    ``device`` in its final dtype, and streams the weights in. Any failure, interrupts
    included, frees what the load took before it propagates.

    ``begin()`` loads pipelined (:mod:`.pipelined`): it returns as soon as the module can
    start computing, with a :class:`~.pipelined.Filling` that brings the blocks in behind
    the forward pass. Calling the loader waits for every weight. ``pipelined``: None
    pipelines components of :data:`~.pipelined.MIN_PIPELINED_BYTES` or more that have
    repeated blocks, True any that has blocks, False none.

    ``placement`` (optional) may put some tensors elsewhere than ``device``: its
    ``destination(slot)`` returns ``(tensor, already_filled)``, or None for the usual
    place; ``finish(module)`` runs after a successful load, ``abort()`` after a failed
    one, ``unload(module)`` on release; ``file_source(slot, jobs_for)``, where it has one,
    learns how each placed tensor is read (``jobs_for(destination)``: the reads that fill
    a destination of its shape and dtype, casts included), for tensors it reads from the
    files itself. Block streaming keeps streamed blocks in host memory this way, or reads
    them from the files each pass (``ondeck.streaming``). A pipelined load with a
    placement first asks its ``fill_later()``, where it has one and no other placement's
    host-cache entry holds the tensors: the placement then fills its own tensors after
    ``finish`` (block streaming, behind the first pass). Otherwise it reads the
    placement's tensors first; either way it fills the device-resident blocks behind the
    compute.

    ``storage_dtype`` (e.g. ``"fp8"``): keep the layers diffusers' layerwise casting
    would cast in that dtype, cast chunk by chunk as they are read, and upcast each to
    ``dtype`` for its forward (``ondeck.loading.fp8``). A checkpoint saved in float8
    stays so by default.
    """

    places_blocks = True

    def __init__(
        self,
        folder: ModelFolder | str | os.PathLike,
        name: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        host_cache: HostCache | None = None,
        progress: bool = True,
        threads: int | None = None,
        buffer_bytes: int | None = None,  # None: the readers' own default
        buffer_count: int | None = None,
        placement: Any = None,
        pipelined: bool | None = None,
        storage_dtype: torch.dtype | str | None = None,
    ):
        options = LoadOptions(
            device=device,
            dtype=dtype,
            host_cache=host_cache,
            progress=progress,
            pipelined=pipelined,
            storage_dtype=storage_dtype,
        )
        super().__init__(folder, name, options)
        self.dtype, self.storage_dtype = fp8.resolve(
            self.folder, name, dtype, storage_dtype, self.device
        )
        # Stored because the file holds float8, not by the caller's choice: the tensors
        # the file holds in float8 stay so, the others load in the compute dtype.
        self._as_saved = storage_dtype is None and self.storage_dtype is not None
        self._stored_template: Any = None
        self._upcast_bytes: tuple[Skeleton, int] | None = None
        self.threads = threads
        self.buffer_bytes = buffer_bytes
        self.buffer_count = buffer_count
        self.placement = placement
        self._spare: tuple[Skeleton, Skeleton] | None = None  # (its template, a fresh copy)

    def __repr__(self) -> str:
        stored = f", stored in {self.storage_dtype}" if self.storage_dtype is not None else ""
        return (
            f"ComponentLoader({str(self.folder.path)!r}, {self.name!r}, {self.device}, "
            f"{self.dtype}{stored})"
        )

    @property
    def spec(self) -> ComponentSpec:
        spec = self.folder.spec(self.name, self.dtype, self.device)
        if self.storage_dtype is None:
            return spec
        return spec.with_updates(nbytes=self.template.nbytes)

    @property
    def upcast_bytes(self) -> int:
        """The most bytes of compute-dtype copies one stored layer makes for its forward
        (0 when nothing is stored): the allocator needs room for them beside the
        activations (``ondeck.policy.UPCAST_RESERVE_COPIES``). Read from the skeleton."""
        if self.storage_dtype is None:
            return 0
        template = self.template
        known = self._upcast_bytes
        if known is None or known[0] is not template:
            _, _, layers, kept = self._stored_template
            largest = fp8.largest_upcast_bytes(template, layers, kept, self.dtype)
            known = self._upcast_bytes = (template, largest)
        return known[1]

    @property
    def template(self) -> Skeleton:
        """The skeleton loads copy: the folder's, with stored tensors in the storage dtype."""
        template = self.folder.template(self.name, self.dtype)
        if self.storage_dtype is None:
            return template
        if self._stored_template is None or self._stored_template[0] is not template:
            stored, layers = fp8.stored_tensors(
                template.module, template.library, self.storage_dtype, self.dtype
            )
            if self._as_saved:
                sources = match_tensors(template, self.folder.tensors(self.name), self.name)
                stored, layers = fp8.as_saved(template.module, stored, layers, sources)
            kept = fp8.kept_layers(template.module, self.dtype)
            self._stored_template = (template, template.with_stored(stored), layers, kept)
        return self._stored_template[1]

    def __call__(self) -> torch.nn.Module:
        module, filling = self.begin()
        if filling is not None:
            try:
                filling.wait()
            except BaseException:
                filling.cancel()
                self.unload(module)  # the placement takes back what it armed
                free_module_storages(module)
                raise
        return module

    def begin(self) -> tuple[torch.nn.Module, Filling | None]:
        """Load, returning once the module can start computing: the module, and the
        filling still bringing its blocks in (None when everything is in place)."""
        started = time.perf_counter()
        if self.storage_dtype is not None:
            upcast.prepare(self.device, self.storage_dtype, self.dtype)  # beside the load
        tensors = self.folder.tensors(self.name)
        template = self.template
        blocks = self._pipelined_blocks(template)
        if blocks is not None:
            return self._begin_pipelined(tensors, template, blocks, started)
        return self._load_whole(tensors, template, started), None

    def _pipelined_blocks(self, template: Skeleton) -> str | None:
        """The blocks a pipelined load brings in behind the compute, or None to load whole."""
        if self.pipelined is False:
            return None
        if self.pipelined is None and template.nbytes < MIN_PIPELINED_BYTES:
            return None
        return find_blocks(template.module)

    def _begin_pipelined(
        self, tensors: dict[str, TensorInfo], template: Skeleton, path: str, started: float
    ) -> tuple[torch.nn.Module, Filling]:
        allocated: list[torch.Tensor] = []
        filling: Filling | None = None
        placement = self.placement
        try:
            sources = match_tensors(template, tensors, self.name, self.folder.directory(self.name))
            key, raw, other = self._cached(tensors, placement)
            if other is None and hasattr(placement, "fill_later"):
                # Its host copies filled behind the compute, block by block, rather than
                # before it (copies from another placement's entry are made here still).
                placement.fill_later()
            on_device: list[int] = []  # the sources read into device tensors, as jobs
            allocating = time.perf_counter()
            jobs, values, placed = _allocate(
                sources,
                self.device,
                allocated,
                placement,
                compute_dtype=self.dtype,
                job_sources=on_device,
            )
            # The placement's own memory (streamed blocks' host copies): read before any
            # compute, once; later loads find it filled.
            reading = time.perf_counter()
            self.last_allocate_seconds = reading - allocating
            placed_bytes = self._fill_placed(placed, other).nbytes if placed else 0
            self.last_placed_read_seconds = time.perf_counter() - reading if placed else 0.0
            groups, group_of = fill_groups(
                [sources[i][0].names for i in on_device],
                [sources[i][1].nbytes for i in on_device],
                path,
            )
            filling = self._start_filling(jobs, groups, key, raw, started, template, other)
            self.last_load_bytes += placed_bytes
            jobs = None  # the filling holds each group until it is read
            skeleton = self._take_skeleton(template)
            _install(skeleton, sources, values, self.device, allocated)
            module = skeleton.module
            filling.attach(module, path, group_of)
            filling.wait_group(0)
            _finish(module, self.name)
            if placement is not None:
                placement.finish(module)
        except BaseException as error:
            self._give_back(error, allocated=allocated, filling=filling, placement=placement)
            module = skeleton = values = filling = None  # noqa: F841
            raise
        return module, filling

    def _start_filling(
        self,
        jobs: list[reads.ReadJob],
        groups: list[list[int]],
        key: Any,
        raw: Any,
        started: float,
        template: Skeleton,
        other: Any = None,
    ) -> Filling:
        """Start the filling of a pipelined load: ``groups`` of ``jobs`` (their indices),
        read behind the compute; ``key``, ``raw`` and ``other`` as ``_cached`` found them.
        Once the load has ended, the filling's thread builds the next load's skeleton."""
        fill, fill_all, finished, reads_back = self._group_filler(jobs, key, raw, started, other)
        filling = start_filling(
            self.name,
            [[jobs[i] for i in group] for group in groups],
            fill,
            finished,
            device=self.device,
            started=started,
            fill_all=fill_all,
            then=functools.partial(self._prepare_spare, template),
        )
        filling.reads_back = reads_back
        return filling

    @staticmethod
    def _give_back(
        error: BaseException,
        *,
        allocated: list[torch.Tensor] | None = None,
        module: torch.nn.Module | None = None,
        filling: Filling | None = None,
        placement: Any = None,
    ) -> None:
        """After a load that failed with ``error``: stop its filling, let the placement
        take back what it gave, free every tensor the load allocated (or the whole
        ``module``), and clear the frames of the error's traceback, which would otherwise
        keep that memory alive for as long as the caller keeps the error. The caller
        drops its own references to the half-built module."""
        if filling is not None:
            filling.cancel()
        if placement is not None:
            placement.abort()
        for tensor in allocated or ():
            free_storage(tensor)
        if allocated:
            allocated.clear()
        if module is not None:
            free_module_storages(module)
        traceback.clear_frames(error.__traceback__)

    def _take_skeleton(self, template: Skeleton) -> Skeleton:
        """A fresh skeleton to fill: the one the last pipelined load left ready, else one
        built now (while the first group is read). Copying a large model's skeleton takes
        a good part of a second, which a pipelined load would otherwise spend before its
        stage can start."""
        spare, self._spare = self._spare, None
        if spare is not None and spare[0] is template:
            return spare[1]
        return self._pipelined_skeleton(template)

    def _prepare_spare(self, template: Skeleton) -> None:
        """After a pipelined load: the next one's skeleton, built on the filling's thread
        once the load has ended (nobody waits for it)."""
        if self._spare is None:
            self._spare = (template, self._pipelined_skeleton(template))

    def _pipelined_skeleton(self, template: Skeleton) -> Skeleton:
        """A fresh skeleton for a pipelined load, its stored layers already hooked to
        compute in the compute dtype (the hooks hold no tensor, so a spare built ahead
        takes them off the load's path). The filling writes into the module's tensors
        after it starts computing: the hooks put upcast copies beside them, never cast
        in place."""
        skeleton = template.fresh()
        self._upcast_for_compute(skeleton.module, template)
        return skeleton

    def _group_filler(
        self,
        jobs: list[reads.ReadJob],
        key: Any,
        raw: Any,
        started: float,
        other: Any = None,
    ):
        """``fill(group)`` for a pipelined load (or ``fill_all``), ``finished(error)`` to
        record it, and whether ``finished`` reads the filled weights back (a storage dtype's
        bytes into the host cache). ``other`` (see ``_cached``): what its entry holds is
        copied from there. The caller must call ``finished`` (with the error) if the
        filling never starts."""
        total = sum(job.info.nbytes for job in jobs)
        self.last_load_bytes = total
        self.last_read_seconds = 0.0
        cache = self.host_cache
        kept = self._from_other(jobs, other) if raw is None else {}
        replacing = other[0] if other is not None else None
        held = raw if raw is not None else kept  # what the host cache serves
        reading = [job for job in jobs if job.info.name not in held]
        captured = stored = None
        if raw is not None or (kept and not reading):
            self.last_source, self.last_readers = "host cache", None
        else:
            paths = sorted({job.info.path for job in reading if job.info.nbytes})
            self.last_source = describe_source(paths) if paths else "disk"
            if held:
                self.last_source = f"host cache and {self.last_source}"
            # A component kept in a storage dtype is cached as stored, once it is read.
            stored = list(reading) if cache and self.storage_dtype is not None else None
            capturing = cache is not None and stored is None
            infos = [job.info for job in reading]
            captured = cache.reserve(key, infos, keeping=replacing) if capturing else None
            if captured is not None:
                for job in reading:
                    job.capture = captured[job.info.name]
        bar = reads.progress_bar(total, self.progress, self.name, self.last_source)
        first_read: list[float] = []

        def fill(group: list[reads.ReadJob]) -> None:
            if not first_read:
                first_read.append(time.perf_counter())
            stats = self._copy_and_read(group, held, bar=bar)
            if any(job.info.name not in held for job in group):
                self.last_readers = stats.readers
            self.last_read_seconds = time.perf_counter() - first_read[0]

        def fill_all(groups: list[list[reads.ReadJob]], reached) -> None:
            """Everything from the files: one read for all groups."""
            first_read.append(time.perf_counter())

            def in_place(index: int) -> None:
                self.last_read_seconds = time.perf_counter() - first_read[0]
                reached(index)

            stats = self._read_in_groups(groups, in_place, bar)
            self.last_readers = stats.readers
            self.last_read_seconds = time.perf_counter() - first_read[0]

        def finished(error: BaseException | None) -> None:
            if bar is not None:
                bar.close()
            if captured is not None:
                if error is None:
                    cache.commit(key, captured, replacing=replacing, kept=kept)
                else:
                    cache.discard(key)
            elif kept and not reading and error is None:
                cache.commit(key, {}, replacing=replacing, kept=kept)
            if stored is not None and error is None:
                fp8.keep_in_cache(cache, key, stored, replacing=replacing, kept=kept)
            self.last_load_seconds = time.perf_counter() - started

        return fill, (fill_all if not held else None), finished, stored is not None

    def _load_whole(
        self, tensors: dict[str, TensorInfo], template: Skeleton, started: float
    ) -> torch.nn.Module:
        allocated: list[torch.Tensor] = []
        built: dict[str, torch.nn.Module] = {}
        placement = self.placement

        def build() -> None:
            # Copying the skeleton is CPU work: it overlaps the reads or the copies.
            skeleton = template.fresh()
            _install(skeleton, sources, values, self.device, allocated)
            built["module"] = skeleton.module

        try:
            sources = match_tensors(template, tensors, self.name, self.folder.directory(self.name))
            key, raw, other = self._cached(tensors, placement)
            self.last_allocate_seconds = 0.0  # not timed beside the host cache's copies
            if raw is not None:
                # Each destination's copy is issued as soon as it is allocated.
                copy = reads.HostCopy(
                    sum(t.numel() for t in raw.values()),
                    progress=self.progress,
                    component=self.name,
                )
                try:
                    jobs, values, placed = _allocate(
                        sources,
                        self.device,
                        allocated,
                        placement,
                        on_job=lambda job: copy.add(
                            self._cached_info(job), raw[job.info.name], job.destination
                        ),
                        compute_dtype=self.dtype,
                    )
                except BaseException:
                    copy.close()
                    raise
                self._record(copy.finish(while_copying=build))
            else:
                allocating = time.perf_counter()
                jobs, values, placed = _allocate(
                    sources, self.device, allocated, placement, compute_dtype=self.dtype
                )
                self.last_allocate_seconds = time.perf_counter() - allocating
                self._read_files(jobs, key, while_reading=build, other=other)
            self.last_placed_read_seconds = 0.0
            if placed:
                # The placement's own memory: read once, never captured in the host cache.
                reading = time.perf_counter()
                stats = self._fill_placed(placed, other)
                self.last_load_bytes += stats.nbytes
                self.last_placed_read_seconds = time.perf_counter() - reading
            if "module" not in built:
                build()
            module = built.pop("module")
            _finish(module, self.name)
            self._upcast_for_compute(module, template)
            if placement is not None:
                placement.finish(module)
        except BaseException as error:
            self._give_back(error, allocated=allocated, placement=placement)
            built.clear()
            module = jobs = values = None  # noqa: F841
            raise
        self.last_load_seconds = time.perf_counter() - started
        return module

    def _upcast_for_compute(self, module: torch.nn.Module, template: Skeleton) -> None:
        """Hook the layers kept in the storage dtype to compute in ``dtype``, and the
        weights of an fp8_scaled file to compute scaled."""
        scales = (
            self.folder.weight_scales(self.name)
            if isinstance(self.folder, SingleFileFolder) and self.folder.has_scales(self.name)
            else {}
        )
        scales = {**scales, **fp8.tied_names(module, scales)}  # a tied tensor's other names
        scaled = {name.rpartition(".")[0] for name in scales}
        if self.storage_dtype is not None:
            _, _, layers, kept = self._stored_template
            fp8.upcast_for_compute(
                module,
                template.library,
                self.storage_dtype,
                self.dtype,
                [layer for layer in layers if layer not in scaled],
                kept=kept,
            )
        if scales:
            fp8.apply_weight_scales(module, scales, self.storage_dtype, self.dtype, self.device)

    def unload(self, module: torch.nn.Module) -> None:
        """Called on release: the placement takes back what it attached to the module."""
        if self.placement is not None:
            self.placement.unload(module)

    def _cached(self, tensors: dict[str, TensorInfo], placement: Any):
        """The host cache key of this load (None without a cache), its entry if held, and
        else the entry of this component placed another way, if held (``(key, entry)``:
        the blocks that stream changed, or none do now; it holds most of what this load
        needs)."""
        cache = self.host_cache
        if cache is None:
            return None, None, None
        key = component_key(self.folder.path, self.name, tensors)
        if self.storage_dtype is not None:
            # A float8 file as saved keeps only its float8 tensors so; asked for, every
            # tensor that can be: other bytes for the same tensors.
            which = "as saved" if self._as_saved else "all"
            key = (*key, ("stored", str(self.storage_dtype), str(self.dtype), which))
        component_length = len(key)
        # A placed load reads fewer tensors here; every key of a component (and storage
        # dtype) ends in its placement, so that only those differ.
        key = (*key, placement.cache_tag if placement is not None else ("whole",))
        raw = cache.get(key)
        other = cache.other_placement(key, component_length) if raw is None else None
        return key, raw, other

    def _from_other(self, jobs: list[reads.ReadJob], other: Any) -> dict[str, torch.Tensor]:
        """The tensors of ``jobs`` that ``other`` (an entry of another placement) holds, as
        this load can use them: all or, for stored (fp8) bytes, kept only when whole."""
        kept = _held_by(jobs, other)
        if self.storage_dtype is not None and len(kept) < len(jobs):
            return {}  # stored bytes are kept after a whole read (fp8.keep_in_cache)
        return kept

    def _fill_placed(self, placed: list[reads.ReadJob], other: Any) -> reads.ReadStats:
        """Fill the placement's own memory (streamed blocks' host copies). A block that
        starts streaming after a re-plan was resident before: ``other``, this component's
        cache entry of the last placement, holds its bytes, and they are copied from
        there, not read again (in fp8, not cast again on the CPU)."""
        return self._copy_and_read(placed, _held_by(placed, other))

    def _cached_info(self, job: reads.ReadJob) -> TensorInfo:
        """How the host cache holds a tensor: as in the file, or as stored (fp8) when the
        component keeps a storage dtype."""
        if self.storage_dtype is None:
            return job.info
        return fp8.as_held(job.info, job.destination)

    def _read_files(
        self,
        jobs: list[reads.ReadJob],
        key: Any,
        while_reading: Callable[[], None],
        other: Any = None,
    ) -> None:
        """Read from the files, capturing the raw bytes into the host cache where it has
        room. ``other`` (see ``_cached``): what its entry holds is copied from there, and
        the new entry takes its place."""
        cache = self.host_cache
        replacing = other[0] if other is not None else None
        kept = self._from_other(jobs, other)
        reading = [job for job in jobs if job.info.name not in kept]
        # A component kept in a storage dtype is cached as stored (half of bf16's bytes),
        # copied back once read; otherwise the reads capture the file bytes.
        stored = cache is not None and self.storage_dtype is not None
        captured = None
        if cache is not None and reading and not stored:
            captured = cache.reserve(key, [job.info for job in reading], keeping=replacing)
        if captured is not None:
            for job in reading:
                job.capture = captured[job.info.name]
        try:
            stats = self._copy_and_read(jobs, kept, while_reading)
        except BaseException:
            if captured is not None:
                cache.discard(key)
            raise
        if stored:
            fp8.keep_in_cache(cache, key, reading, replacing=replacing, kept=kept)
        elif captured is not None or (kept and not reading):
            cache.commit(key, captured or {}, replacing=replacing, kept=kept)
        self._record(stats)

    def _copy_and_read(
        self,
        jobs: list[reads.ReadJob],
        held: dict[str, torch.Tensor],
        while_reading: Callable[[], None] | None = None,
        bar: Any = None,
    ) -> reads.ReadStats:
        """Copy the jobs whose tensors the host cache holds (``held``) into their
        destinations while the others are read from the files."""
        if not held:
            return self._read(jobs, while_reading, bar=bar)
        reading = [job for job in jobs if job.info.name not in held]
        if bar is None:
            total = sum(job.info.nbytes for job in jobs if job.info.name in held)
            copy = reads.HostCopy(total, progress=self.progress, component=self.name)
        else:
            copy = reads.HostCopy(0, component=self.name, bar=bar)
        try:
            for job in jobs:
                if job.info.name in held:
                    copy.add(self._cached_info(job), held[job.info.name], job.destination)
            read = self._read(reading, while_reading, bar=bar) if reading else None
            copied = copy.finish(while_copying=None if reading else while_reading)
        finally:
            copy.close()
        return _joined(copied, read)

    def _read(
        self,
        jobs: list[reads.ReadJob],
        while_reading: Callable[[], None] | None = None,
        bar: Any = None,
    ) -> reads.ReadStats:
        return reads.read_into(jobs, bar=bar, while_reading=while_reading, **self._read_options())

    def _read_in_groups(
        self, groups: list[list[reads.ReadJob]], reached: Callable[[int], None], bar: Any
    ) -> reads.ReadStats:
        return reads.read_in_groups(groups, reached, bar=bar, **self._read_options())

    def _read_options(self) -> dict[str, Any]:
        """This loader's settings for the reader, the same for every read it makes."""
        return dict(
            threads=self.threads,
            buffer_bytes=self.buffer_bytes,
            buffer_count=self.buffer_count,
            progress=self.progress,
            component=self.name,
        )

    def _record(self, stats: reads.ReadStats) -> None:
        self.last_load_bytes = stats.nbytes
        self.last_read_seconds = stats.seconds
        self.last_source = stats.source
        self.last_readers = stats.readers


def _held_by(jobs: list[reads.ReadJob], other: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``jobs`` that ``other`` (``(key, entry)`` of the host cache, or
    None) holds, by name."""
    if other is None:
        return {}
    entry = other[1]
    return {job.info.name: entry[job.info.name] for job in jobs if job.info.name in entry}


def _joined(copied: reads.ReadStats, read: reads.ReadStats | None) -> reads.ReadStats:
    """One load's stats from its host-cache copies and its file reads."""
    if read is None:
        return copied
    return reads.ReadStats(
        copied.nbytes + read.nbytes,
        max(copied.seconds, read.seconds),
        f"host cache and {read.source}",
        read.readers,
    )


def _allocate(
    sources,
    device: torch.device,
    allocated: list,
    placement: Any = None,
    on_job=None,
    compute_dtype: torch.dtype | None = None,
    job_sources: list[int] | None = None,
) -> tuple[list, list, list]:
    """A real, empty tensor on the device, in its final dtype, for every slot.

    Where the placement gives a tensor instead, that one is used (and never freed here).
    Returns the reads into device tensors, the values to install, and the reads into
    placed tensors that do not hold their weights yet. ``on_job`` sees each read into a
    device tensor as soon as that tensor exists; ``job_sources`` gets the index in
    ``sources`` of each read into a device tensor, in order.
    """
    jobs: list[reads.ReadJob] = []
    values: list[torch.Tensor] = []
    placed: list[reads.ReadJob] = []
    for index, (slot, info) in enumerate(sources):
        given = placement.destination(slot) if placement is not None else None
        if given is None:
            tensor = torch.empty(slot.shape, dtype=slot.dtype, device=device)
            allocated.append(tensor)
        else:
            tensor, filled = given
        if slot.is_parameter:
            value = torch.nn.Parameter(tensor, requires_grad=slot.requires_grad)
            if given is None:
                allocated.append(value)
        else:
            value = tensor
        values.append(value)
        via = fp8.rounding_dtype(info.dtype, slot.dtype, compute_dtype or slot.dtype)
        if given is not None and hasattr(placement, "file_source"):
            placement.file_source(slot, functools.partial(_reads_into, info, via))
        for job in _reads_into(info, via, tensor):
            if given is None:
                jobs.append(job)
                if job_sources is not None:
                    job_sources.append(index)
                if on_job is not None:
                    on_job(job)
            elif not filled:
                placed.append(job)
    return jobs, values, placed


def _reads_into(
    info: TensorInfo, via: torch.dtype | None, destination: torch.Tensor
) -> list[reads.ReadJob]:
    """The reads that fill ``destination`` from ``info``: one, or, for a tensor a
    single-file conversion assembles, one per part into its place."""
    return [reads.ReadJob(part, into, via=via) for part, into in pieces_of(info, destination)]


def _install(skeleton: Skeleton, sources, values, device: torch.device, allocated: list) -> None:
    """Put the allocated tensors in the skeleton's module, and move the buffers the file lacks."""
    module = skeleton.module
    modules = module_paths(module)
    for (slot, _), value in zip(sources, values, strict=True):
        for name in slot.names:
            set_tensor(module, name, value, parameter=slot.is_parameter, modules=modules)
    for names in skeleton.extra_buffers.values():
        # Not in the file: computed by __init__ on the host; moved, compactly, like the rest.
        buffer = get_tensor(module, names[0])
        moved = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
        allocated.append(moved)
        moved.copy_(buffer)
        for name in names:
            set_tensor(module, name, moved, parameter=False, modules=modules)


def _finish(module: torch.nn.Module, component: str) -> None:
    if hasattr(module, "tie_weights") and hasattr(module, "all_tied_weights_keys"):
        module.tie_weights()
    for kind, named in (("parameter", module.named_parameters), ("buffer", module.named_buffers)):
        for name, tensor in named():
            if tensor.device.type == "meta":
                raise LoadError(
                    f"component '{component}': {kind} '{name}' was not filled from the files",
                    component=component,
                )
    module.eval()


def load_auxiliary(folder: ModelFolder | str | os.PathLike, name: str) -> Any:
    """Load a part without weights (tokenizer, scheduler, feature extractor) from its folder."""
    folder = open_folder(folder, name)
    cls = folder.component_class(name)
    directory = folder.directory(name)
    loader = getattr(cls, "from_pretrained", None)
    if loader is None:
        raise LoadError(
            f"component '{name}': {cls.__name__} has no from_pretrained to load it with",
            component=name,
        )
    options: dict[str, Any] = {"local_files_only": True}
    if cls.__module__.startswith("transformers"):
        # Never the code a folder ships (an auto_map): transformers would prompt or run it.
        options["trust_remote_code"] = False
    try:
        return loader(str(directory), **options)
    except Exception as error:
        raise LoadError(
            f"component '{name}' from {directory}: {cls.__name__}.from_pretrained failed with "
            f"{type(error).__name__}: {error}",
            component=name,
            path=str(directory),
        ) from error


def component_loader(
    folder: ModelFolder | str | os.PathLike,
    name: str,
    options: LoadOptions | None = None,
    **keywords: Any,
) -> ComponentLoader | QuantizedComponentLoader:
    """The loader for model component ``name``: a :class:`QuantizedComponentLoader` when
    its config carries a ``quantization_config``, else a :class:`ComponentLoader`.

    ``options`` and the ``keywords`` that name its fields (``device=``, ``dtype=``, ...)
    say how it loads; other keywords are :class:`ComponentLoader`'s own (``placement``,
    the reading options). A quantized component's loader refuses ``storage_dtype`` and
    ``placement``, and the reading options do not apply to it."""
    folder = open_folder(folder, name)
    options, own = LoadOptions.split(options, keywords)
    if quantization_method(folder, name) is None:
        return ComponentLoader(folder, name, **options.keywords(), **own)
    if own.get("placement") is not None:
        raise LoadError(
            f"component '{name}': it is already quantized, and its weights cannot be placed "
            "elsewhere (block streaming)",
            component=name,
        )
    return QuantizedComponentLoader(folder, name, **options.keywords())


def load_component(folder: ModelFolder | str | os.PathLike, name: str, **options: Any) -> Any:
    """Load any component: models through :func:`component_loader`, other parts as they
    are."""
    folder = open_folder(folder, name)
    if folder.is_model(name):
        return component_loader(folder, name, **options)()
    return load_auxiliary(folder, name)
