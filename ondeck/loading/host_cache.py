"""Components' raw file bytes kept in (pinned) host memory, so a reload is one copy per tensor.

The bytes are kept exactly as the file holds them, before any cast or transform, so
transforms re-applied after each load (LoRA, compile) see what a fresh load would.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..memory import (
    aligned,
    host_facts,
    is_unified,
    parse_bytes,
    pinned_host_bytes,
    positive_bytes,
)
from .chunks import ReadStats, progress_bar
from .safetensors_format import TensorInfo

__all__ = [
    "HostCache",
    "HostCopy",
    "component_key",
    "component_owner",
    "default_budget_bytes",
]

GiB = 2**30


def default_budget_bytes() -> int:
    """Half of what the OS says is available (or of what a cgroup's limit leaves, where
    that is less: ``memory.host_facts``), less 4 GiB of headroom; never negative."""
    facts = host_facts()
    room = facts.available_bytes
    if facts.cgroup_limit_bytes is not None and facts.cgroup_used_bytes is not None:
        room = min(room, facts.cgroup_limit_bytes - facts.cgroup_used_bytes)
    return max(0, room // 2 - 4 * GiB)


# Pinned arenas hold consecutive tensors of one block up to about this many bytes (a
# larger tensor has one of its own): when a component is placed another way (other blocks
# streamed), the arenas holding tensors the new placement still loads stay in the cache,
# and the others are freed whole.
ARENA_BYTES = 256 * 2**20


def _block_of(name: str) -> str:
    """The numbered module a tensor belongs to (``blocks.12`` of ``blocks.12.ffn.weight``),
    or "" for one outside any."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ""


def _arenas(infos: list[TensorInfo], pinned: bool) -> list[tuple[int, dict[int, int]]]:
    """Where each tensor's bytes go: ``(arena bytes, {tensor index: offset})``.

    Pinned: arenas of exactly their tensors' bytes (``memory.pinned_host_bytes``; torch's
    pinned allocator would round each up to a power of two, 16 GiB for a 10.1 GiB text
    encoder held in one). Pageable memory is not rounded: a buffer per tensor, exactly.
    """
    if not pinned:
        return [(info.nbytes, {index: 0}) for index, info in enumerate(infos)]
    arenas: list[tuple[int, dict[int, int]]] = []
    members: dict[int, int] = {}
    total = 0
    block = None
    for index, info in enumerate(infos):
        nbytes = aligned(info.nbytes)
        previous, block = block, _block_of(info.name)
        if members and (total + nbytes > ARENA_BYTES or block != previous):
            arenas.append((total, members))
            members, total = {}, 0
        members[index] = total
        total += nbytes
    if members:
        arenas.append((total, members))
    return arenas


def _held_bytes(buffers: dict[str, torch.Tensor]) -> int:
    """The bytes of the buffers (arenas) that ``buffers``' tensors view, each once."""
    storages = {}
    for tensor in buffers.values():
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class HostCache:
    """Least-recently-used store of raw component bytes in host memory, within a budget.

    A key is usually ``(folder path, component, file signature)``. Entries are filled
    while a first load streams (the cache buffer is the staging buffer), then serve later
    loads of the same component.
    """

    def __init__(
        self,
        budget_bytes: int | str | None = None,
        *,
        pin: bool | None = None,
        elastic: bool = False,
    ):
        # The most it may hold: given, else ``default_budget_bytes``.
        given = positive_bytes(budget_bytes, "a host cache")
        self.cap_bytes = default_budget_bytes() if given is None else given
        # Elastic: the pipelines using it set its budget to the host room their plans
        # leave (``fit``; nothing until one does): it gives way to the streamed blocks'
        # pinned copies, takes nothing of a component no run will load again, and takes
        # no room from an entry it holds to make room for another.
        self.elastic = bool(elastic)
        self.budget_bytes = 0 if self.elastic else self.cap_bytes
        self._refused: frozenset[tuple[str, str]] = frozenset()
        # Pinned (the default where CUDA is): a reload is one DMA per tensor. The budget
        # counts the bytes really held, each tensor's alignment included.
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._entries: OrderedDict[Hashable, dict[str, torch.Tensor]] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        self._pending: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_setting(cls, setting: int | str | None) -> HostCache | None:
        """The cache a ``--host-cache`` setting asks for: ``"auto"`` an elastic one, a
        size a fixed one of that budget, None or 0 none."""
        if setting == "auto":
            return cls(elastic=True)
        size = parse_bytes(setting)
        return cls(size) if size else None

    def __repr__(self) -> str:
        return (
            f"HostCache({len(self._entries)} entries, {self.resident_bytes / GiB:.2f} of "
            f"{self.budget_bytes / GiB:.2f} GiB{', elastic' if self.elastic else ''}, "
            f"{self.hits} hits, {self.misses} misses)"
        )

    def fit(
        self,
        room_bytes: int,
        refused: Iterable[tuple[str, str]] = (),
        *,
        adding: bool = True,
    ) -> int:
        """An elastic cache's budget becomes ``room_bytes`` (at most ``cap_bytes``; with
        ``adding`` False no more than it holds and is filling now), the least recently
        used entries going until it holds no more. ``refused``: ``(folder, component)``
        of components it takes no new entry of (what it holds of them stays, to serve
        their next load). Returns the bytes freed; a fixed cache is left as it is."""
        if not self.elastic:
            return 0
        freed = 0
        with self._lock:
            budget = min(self.cap_bytes, int(room_bytes))
            if not adding:
                budget = min(budget, self._used())
            self.budget_bytes = max(0, budget)
            self._refused = frozenset(refused)
            while self._entries and self._used() > self.budget_bytes:
                key, _ = self._entries.popitem(last=False)
                freed += self._sizes.pop(key, 0)
        return freed

    def _is_refused(self, key: Hashable, owner: tuple[str, str] | None) -> bool:
        if owner is None and isinstance(key, tuple):
            owner = tuple(key[:2])
        return owner in self._refused

    @staticmethod
    def enabled_for(device: torch.device | str) -> bool:
        """False where a host copy would be the same memory twice: CPU and unified memory."""
        device = torch.device(device)
        return not is_unified(device)

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @property
    def held_bytes(self) -> int:
        """Its entries and the buffers reserved for loads in progress."""
        with self._lock:
            return self._used()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: Hashable) -> dict[str, torch.Tensor] | None:
        """The raw tensors of ``key`` (flat uint8, by tensor name), counting a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def reserve(
        self,
        key: Hashable,
        infos: Iterable[TensorInfo],
        *,
        keeping: Hashable | None = None,
        owner: tuple[str, str] | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """Host buffers to capture ``infos`` into while they load; None if they cannot fit.

        Evicts least recently used entries to make room (an elastic cache evicts none, and
        takes nothing of a component ``fit`` refused: ``owner``, its ``(folder,
        component)``, where the key does not start with them), but ``keeping``: the entry the
        new one will replace, whose tensors it keeps (``commit``'s ``replacing``). It
        stays, and counts, until then. Call :meth:`commit` once the buffers are full, or
        :meth:`discard` if the load failed.
        """
        infos = list(infos)
        pin = self.pin
        arenas = _arenas(infos, pin)
        nbytes = sum(capacity for capacity, _ in arenas)
        with self._lock:
            if key in self._entries or key in self._pending or nbytes > self.budget_bytes:
                return None
            if self.elastic and self._is_refused(key, owner):
                return None
            # An elastic cache keeps what it holds: in a pipeline's cycle of loads, the
            # least recently used entry is the one the next load needs.
            evictable = 0
            if not self.elastic:
                evictable = sum(size for k, size in self._sizes.items() if k != keeping)
            if self._used() - evictable + nbytes > self.budget_bytes:
                return None  # even evicting every entry would not make room: none goes
            while self._used() + nbytes > self.budget_bytes:
                evicted = next((k for k in self._entries if k != keeping), None)
                if evicted is None:
                    break
                self._entries.pop(evicted)
                self._sizes.pop(evicted, None)
            if self._used() + nbytes > self.budget_bytes:
                return None
            self._pending[key] = nbytes
        try:
            buffers: dict[str, torch.Tensor] = {}
            for capacity, members in arenas:
                if pin:
                    arena = pinned_host_bytes(capacity)
                else:
                    arena = torch.empty(capacity, dtype=torch.uint8)
                for index, offset in members.items():
                    buffers[infos[index].name] = arena[offset : offset + infos[index].nbytes]
            return buffers
        except BaseException:
            self.discard(key)
            raise

    def commit(
        self,
        key: Hashable,
        buffers: dict[str, torch.Tensor],
        *,
        replacing: Hashable | None = None,
        kept: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``buffers`` (from :meth:`reserve`) are full: keep them as ``key``.

        ``replacing``: an entry this one supersedes (the same component placed another
        way, see :meth:`other_placement`); it goes. ``kept``: its tensors that ``key``
        holds too, served from its buffers rather than read again; the arenas they view
        stay held by ``key`` and count there, the others are freed.
        """
        with self._lock:
            nbytes = self._pending.pop(key, None)
            if nbytes is None and not kept:
                return
            if replacing is not None and replacing != key:
                self._entries.pop(replacing, None)
                self._sizes.pop(replacing, None)
            entry = {**(kept or {}), **buffers}
            self._entries[key] = entry
            self._sizes[key] = _held_bytes(entry) if kept else nbytes

    def other_placement(
        self, key: tuple, base_length: int
    ) -> tuple[Hashable, dict[str, torch.Tensor]] | None:
        """The most recently used entry, other than ``key``, whose key is as long and starts
        with the same ``base_length`` items: the same component placed another way (other
        blocks streamed). Its tensors can serve a load of ``key`` in part; it counts as
        used, so making room for ``key`` evicts it last."""
        base = key[:base_length]
        with self._lock:
            for other in reversed(self._entries):
                if (
                    other != key
                    and isinstance(other, tuple)
                    and len(other) == len(key)
                    and other[:base_length] == base
                ):
                    self._entries.move_to_end(other)
                    return other, self._entries[other]
        return None

    def discard(self, key: Hashable) -> None:
        """Forget a reservation or an entry."""
        with self._lock:
            self._pending.pop(key, None)
            self._entries.pop(key, None)
            self._sizes.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict[str, int]:
        """Entries, the bytes they hold (arenas rounded up included) and their tensors' bytes."""
        with self._lock:
            tensors = sum(t.numel() for entry in self._entries.values() for t in entry.values())
            return {
                "entries": len(self._entries),
                "held_bytes": sum(self._sizes.values()),
                "tensor_bytes": int(tensors),
                "hits": self.hits,
                "misses": self.misses,
            }

    def _used(self) -> int:
        return sum(self._sizes.values()) + sum(self._pending.values())


# Host-cache copies are issued in batches of about this many bytes: each batch's side
# stream first waits for work queued so far on the current stream, whose freed memory the
# batch's destinations may reuse.
HOST_COPY_BATCH_BYTES = 256 * 2**20


class HostCopy:
    """Copies of raw file bytes kept in host memory into their destinations, issued as
    the destinations are allocated, so allocating the next overlaps copying the last.

    ``add`` each ``(info, raw, destination)``, then ``finish`` (or ``close``, after a
    failure); ``total`` bytes is for the progress bar (or ``bar``, advanced and left open). On CUDA the copies run
    asynchronously on a side stream; ``finish`` runs ``while_copying`` once all are
    issued, then waits for them.
    """

    def __init__(
        self, total: int, *, progress: bool = True, component: str | None = None, bar: Any = None
    ):
        self._started = time.perf_counter()
        self._own_bar = bar is None
        self._bar = progress_bar(total, progress, component, "host cache") if bar is None else bar
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._batch: list[tuple[TensorInfo, torch.Tensor, torch.Tensor]] = []
        self._batch_bytes = 0
        self._copied = 0

    def add(self, info: TensorInfo, raw: torch.Tensor, destination: torch.Tensor) -> None:
        self._batch.append((info, raw, destination))
        self._batch_bytes += info.nbytes
        if self._batch_bytes >= HOST_COPY_BATCH_BYTES:
            self._issue()

    def _issue(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        for device in {dst.device for _, _, dst in batch if dst.device.type == "cuda"}:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        for info, raw, destination in batch:
            if info.nbytes:
                source = raw.view(info.dtype).reshape(info.shape)
                stream = self._streams.get(destination.device)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        destination.copy_(source, non_blocking=True)
                else:
                    destination.copy_(source)
            self._copied += info.nbytes
            if self._bar is not None:
                self._bar.update(info.nbytes)

    def finish(self, while_copying: Callable[[], None] | None = None) -> ReadStats:
        try:
            self._issue()
            if while_copying is not None:
                while_copying()
        finally:
            self.close()
        return ReadStats(self._copied, time.perf_counter() - self._started, "host cache")

    def close(self) -> None:
        """Wait for what was issued (also after a failure: nothing may copy into freed
        memory later)."""
        for stream in self._streams.values():
            stream.synchronize()
        if self._bar is not None and self._own_bar:
            self._bar.close()
        self._bar = None


def component_key(folder_path: Path, name: str, tensors: Mapping[str, Any]) -> tuple:
    """The start of a component's key in the cache: its folder, its name, and each of its
    files' identity (size, mtime, inode and device, and the hash of the header as it was
    read), so that a file rewritten or replaced by another (a fine-tune copied over it
    with its mtime kept) is never served from memory. ``tensors``: the component's
    tensors (``TensorInfo`` by name)."""
    identities = {info.path: info.identity for info in tensors.values()}
    signature = tuple(
        (*file_key(path), identity.header_sha256 if identity is not None else None)
        for path, identity in sorted(identities.items())
    )
    return (*component_owner(folder_path, name), signature)


def component_owner(folder_path: Path, name: str) -> tuple[str, str]:
    """The first two items of a component's keys: its folder, resolved, and its name."""
    return (str(Path(folder_path).resolve()), name)


def file_key(path: str | os.PathLike) -> tuple:
    """A file's identity as a key: its path, size, mtime, inode and device."""
    status = os.stat(path)
    return (str(path), status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev)
