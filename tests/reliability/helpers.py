"""Damage, fault injection and memory measurement shared by the reliability tests."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import json
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

# Rewriting and sharding checkpoints: the loading tests' helpers.
from loading.helpers import rewrite_weights, shard, weights_file  # noqa: F401

import ondeck
from ondeck.lazy import module_nbytes
from ondeck.loading import ComponentLoader, ModelFolder
from ondeck.loading import components as components_module
from ondeck.loading.skeleton import Skeleton
from ondeck.pipelines.wan import WanTextToVideo

MiB = 2**20
_COMPONENTS_FILE = components_module.__file__
# Small enough that a run takes a fraction of a second even on the default preset.
SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=2)
PROMPT = "a fox in the snow"
MODELS = ("text_encoder", "transformer", "vae")


def wan(folder: Path, policy: str = "release", **options: Any) -> WanTextToVideo:
    return WanTextToVideo.from_folder(
        folder, policy=policy, dtype=torch.float32, device="cpu", progress=False, **options
    )


def linked_folder_without(template: Path, folder: Path, component: str) -> Path:
    """``folder`` linking to every part of ``template`` but ``component``, whose folder
    is made empty: large templates are shared, the one part a test changes is its own."""
    folder.mkdir()
    for entry in template.iterdir():
        if entry.name != component:
            (folder / entry.name).symlink_to(entry)
    (folder / component).mkdir()
    return folder


def generate(pipe: WanTextToVideo, prompt: str = PROMPT, seed: int = 0):
    return pipe.generate(prompt, negative_prompt="blurry", seed=seed, **SHAPE)


# -- memory ------------------------------------------------------------------------------

_libc = None


def malloc_trim() -> None:
    """Ask glibc to hand freed heap pages back to the OS.

    Without it, RSS keeps memory glibc has freed but holds in its arenas (small and
    mid-sized blocks below the mmap threshold), and readings drift by megabytes.
    """
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def settled_rss() -> int:
    """Process resident set size after a full collection and a heap trim (bytes)."""
    gc.collect()
    malloc_trim()
    return psutil.Process().memory_info().rss


def called_from_the_loader(depth: int = 2) -> bool:
    """Whether the caller ``depth`` frames up is code in ``ondeck/loading/components.py``.

    Matched by file, not by function, so faults and watches survive refactors there.
    """
    return sys._getframe(depth).f_code.co_filename == _COMPONENTS_FILE


class Watcher:
    """Weak references to every module the loader fills and every weight tensor it makes.

    Modules: each fresh skeleton copy a load fills (the shared, all-meta templates a
    folder caches are not half-built modules and are not watched). Tensors: every
    ``torch.empty`` made by the component loader. After a failed load every one of them
    must be dead once ``gc.collect()`` ran, even while the caller still holds the error.
    """

    def __init__(self, monkeypatch) -> None:
        self.refs: list[tuple[str, weakref.ref]] = []
        watcher = self
        real_empty = torch.empty

        def empty(*args, **kwargs):
            tensor = real_empty(*args, **kwargs)
            if called_from_the_loader():
                watcher.refs.append(("weight tensor", weakref.ref(tensor)))
            return tensor

        monkeypatch.setattr(torch, "empty", empty)
        if hasattr(Skeleton, "fresh"):
            real_fresh = Skeleton.fresh

            def fresh(skeleton):
                copy = real_fresh(skeleton)
                watcher.refs.append(
                    (f"{type(copy.module).__name__} module", weakref.ref(copy.module))
                )
                return copy

            monkeypatch.setattr(Skeleton, "fresh", fresh)
        else:
            real_skeleton = ModelFolder.skeleton

            def skeleton(folder, name, dtype=None):
                built = real_skeleton(folder, name, dtype)
                watcher.refs.append((f"{name} module", weakref.ref(built.module)))
                return built

            monkeypatch.setattr(ModelFolder, "skeleton", skeleton)

    def alive(self) -> list[str]:
        """Modules still alive, and weight tensors still holding bytes of memory."""
        gc.collect()
        found = []
        for what, ref in self.refs:
            value = ref()
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() == 0:
                continue  # an empty husk: its memory is back
            found.append(what)
        return found

    def alive_objects(self) -> list[str]:
        """Every module or tensor object still alive, empty or not."""
        gc.collect()
        return [what for what, ref in self.refs if ref() is not None]

    def modules_watched(self) -> int:
        return sum(1 for what, _ in self.refs if what.endswith("module"))


class LoaderCalls:
    """Counts ComponentLoader calls per component name."""

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {}
        real_begin = ComponentLoader.begin  # every load starts here, whole or pipelined
        counts = self.calls

        def begin(loader):
            counts[loader.name] = counts.get(loader.name, 0) + 1
            return real_begin(loader)

        monkeypatch.setattr(ComponentLoader, "begin", begin)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def loaded_names(pipe: ondeck.Pipeline) -> set[str]:
    return {name for name, proxy in pipe.deferred.items() if ondeck.is_loaded(proxy)}


def assert_tracker_agrees(pipe: ondeck.Pipeline) -> None:
    """The tracker's resident map names exactly what is loaded, with its measured bytes."""
    assert set(pipe.tracker.resident) == loaded_names(pipe)
    for name in loaded_names(pipe):
        module = pipe.deferred[name].materialize()
        assert pipe.tracker.resident[name] == module_nbytes(module)


def assert_nothing_resident(pipe: ondeck.Pipeline) -> None:
    assert loaded_names(pipe) == set()
    assert pipe.tracker.resident == {}


# -- damage ------------------------------------------------------------------------------


def read_raw_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_raw_header(path: Path, document: dict, data: bytes) -> None:
    text = json.dumps(document).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(component_dir: Path, edit: Callable[[dict], None]) -> Path:
    """Let ``edit`` change a component's parsed header in place; the data stays as it was."""
    path = weights_file(component_dir)
    document, data = read_raw_header(path)
    edit(document)
    write_raw_header(path, document, data)
    return path


def tensor_entries(document: dict) -> list[tuple[str, dict]]:
    """A header's tensor entries in file order."""
    entries = [(k, v) for k, v in document.items() if k != "__metadata__"]
    return sorted(entries, key=lambda item: item[1]["data_offsets"][0])


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


# -- faults ------------------------------------------------------------------------------


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class ReadFault:
    """Makes ``os.preadv`` act out ``action`` when the reader reaches one chosen tensor.

    ``action`` is called with no argument in the reading thread; it may raise (an I/O
    error) or do something else (send a signal) and return, the read then proceeding.
    """

    def __init__(self, monkeypatch, path: str, start: int, end: int, action: Callable) -> None:
        self.fired = 0
        real_preadv = os.preadv
        fault = self

        def preadv(fd, buffers, offset, *args):
            if start <= offset < end and fd_path(fd) == path and not fault.fired:
                fault.fired += 1
                action()
            return real_preadv(fd, buffers, offset, *args)

        monkeypatch.setattr(os, "preadv", preadv)


def io_error() -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


class AllocationFault:
    """Makes the ``at``-th ``torch.empty`` of ``component``'s load raise ``error``.

    Only the component loader's own allocations count (matched by file), so everything
    else that allocates (the model's forward, the reader's buffers) runs as usual.
    """

    def __init__(
        self, monkeypatch, at: int, error: BaseException, *, component: str | None = None
    ) -> None:
        self.calls = 0
        self.fired = 0
        real_empty = torch.empty
        real_begin = ComponentLoader.begin  # every load starts here, whole or pipelined
        fault = self
        # Which component is loading, per thread. Never read frame locals to find out:
        # that snapshots them into a dict which outlives the frame's own clean-up.
        current = threading.local()

        def begin(loader):
            current.name = loader.name
            try:
                return real_begin(loader)
            finally:
                current.name = None

        def empty(*args, **kwargs):
            loading = getattr(current, "name", None)
            if called_from_the_loader() and component in (None, loading):
                fault.calls += 1
                if fault.calls == at and not fault.fired:
                    fault.fired += 1
                    raise error
            return real_empty(*args, **kwargs)

        monkeypatch.setattr(ComponentLoader, "begin", begin)
        monkeypatch.setattr(torch, "empty", empty)
