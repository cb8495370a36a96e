"""Byte sizes (parsing, formatting) and device facts: what the device has, what is used."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int | float | None) -> int | None:
    """``"24GiB"`` -> 25769803776. Plain numbers are bytes; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"a size is a finite number of bytes; got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 24GiB, 500MB or 1e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def positive_bytes(value: str | int | float | None, what: str) -> int | None:
    """``parse_bytes(value)``, refusing a size of no bytes or fewer; ``what`` names the
    argument in the error ("a budget", "host_memory")."""
    size = parse_bytes(value)
    if size is not None and size <= 0:
        raise ValueError(f"{what} holds at least one byte; got {value!r}")
    return size


def freeze_what_lives(*, collect: bool = True) -> None:
    """For a command that owns its process, once its pipelines are built and before its
    runs: collect once (unless ``collect`` is false), then keep every object alive now out
    of later collections (``gc.freeze``). Otherwise a full pass of Python's garbage
    collector scans the imports and the pipelines' skeletons again during a run: 0.28-0.37
    s of a 2.6-3.2 s SD3.5-shaped run at 8 GiB, and two passes, 1.26 s, of a
    HunyuanVideo-shaped process's first run (BENCHMARKS.md); frozen, a pass scans only
    what the runs made. A process that ends after one run skips the collection, which
    would cost it the pass it saves. Never from the library: a caller's garbage would be
    kept for ever."""
    if collect:
        gc.collect()
    gc.freeze()


# Runs under way with the cyclic collector paused, and whether it ran before the first.
_pause_lock = threading.Lock()
_pauses = 0
_collecting_before = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for one run, then left as it was.

    A run that loads builds each component's module tree afresh (tens of thousands of
    containers for a large transformer) and, under ``release``, drops it before the run
    ends. Collected meanwhile, those trees are moved to the oldest generation, and
    every few runs that makes the collector scan the whole heap: 0.28-0.37 s of a 2.6 s
    SD3.5-shaped run. Paused, they stay young and go by their reference counts, and no
    scan comes. What a run leaves alive is collected as usual after it; ondeck frees the
    device memory of what it releases itself, and a ``gc.collect()`` still collects.
    Runs in several threads pause once; ``ONDECK_GC_PAUSE=0`` turns it off.
    """
    if os.environ.get("ONDECK_GC_PAUSE", "1") == "0":
        yield
        return
    paused = False
    try:
        # One call each way: an interrupt lands before or after the bookkeeping, never
        # inside it (signal handlers run as a Python function starts, not in between).
        paused = _pause()
        yield
    finally:
        if paused:
            _resume()


def _pause() -> bool:
    global _pauses, _collecting_before
    with _pause_lock:
        _pauses += 1
        if _pauses == 1:
            # Still set where the last resume was cut short: the collector was on then.
            _collecting_before = _collecting_before or gc.isenabled()
            gc.disable()
    return True


def _resume() -> None:
    global _pauses, _collecting_before
    with _pause_lock:
        _pauses -= 1
        if _pauses == 0 and _collecting_before:
            gc.enable()
            _collecting_before = False


def format_bytes(nbytes: int | float | None) -> str:
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class DeviceFacts:
    """What the runtime needs to know about the device weights will live on."""

    device: str
    unified: bool
    total_bytes: int
    available_bytes: int


def resolve_device(device: Any = None) -> Any:
    import torch

    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def usable_device(device: Any = None) -> Any:
    """``resolve_device(device)``; a ``ValueError`` for CUDA where torch has none, and for
    the meta device."""
    import torch

    device = resolve_device(device)
    if device.type == "meta":
        raise ValueError("device 'meta' holds no weights to compute with; use 'cuda' or 'cpu'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r} asked for, but CUDA is not available here (torch "
            f"{torch.__version__}); use device='cpu'"
        )
    mps = getattr(torch.backends, "mps", None)
    if device.type == "mps" and not (mps is not None and mps.is_available()):
        raise ValueError(
            f"device {str(device)!r} asked for, but Apple's Metal (mps) is not available "
            f"here (torch {torch.__version__}); use device='cpu'"
        )
    return device


def device_name(device: Any) -> str:
    """The device's model name for a CUDA device ("NVIDIA H100 80GB HBM3"), else its type:
    what measured activation profiles are kept apart by."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def host_available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


# The host memory a plan leaves to everything else on the machine: this share of what
# the process may use, at least this many bytes.
HOST_RESERVE_FRACTION = 0.10
HOST_RESERVE_MIN_BYTES = 2**30
# A cgroup limit this large is no limit (cgroup v1 writes one for "unlimited").
_NO_LIMIT = 2**60


@dataclass(frozen=True)
class HostFacts:
    """What this process may hold in host memory: ``budget_bytes`` is its whole RSS at
    most (what it holds now, plus what the machine or its cgroup has left, less a
    reserve); ``source`` says where the figure came from."""

    available_bytes: int
    process_bytes: int
    cgroup_limit_bytes: int | None
    cgroup_used_bytes: int | None
    budget_bytes: int
    source: str


def cgroup_memory(
    root: str | os.PathLike = "/sys/fs/cgroup", self_cgroup: str | os.PathLike = "/proc/self/cgroup"
) -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup, v2 or v1: the tightest of
    its own and its ancestors' (a limit is often set on a parent: a Slurm job, a systemd
    slice, a Kubernetes pod), usage less the inactive file pages the kernel reclaims
    first (the page cache of weights just read). None where there is no limit, or
    nothing can be read."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(root)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, relative = parts
        if controllers == "":  # v2: one unified hierarchy
            base, v1 = root, False
        elif "memory" in controllers.split(","):
            base, v1 = root / "memory", True
        else:
            continue
        folder, tightest = base / relative.lstrip("/"), None
        while True:
            found = _cgroup_level(folder, v1)
            if found is not None and (
                tightest is None or found[0] - found[1] < tightest[0] - tightest[1]
            ):
                tightest = found
            if folder == base or base not in folder.parents:
                return tightest
            folder = folder.parent
    return None


def _cgroup_level(folder: Path, v1: bool) -> tuple[int, int] | None:
    """(limit, usage less inactive file pages) of one cgroup folder; None without a limit."""
    names = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if v1
        else ("memory.max", "memory.current")
    )
    try:
        limit_text = (folder / names[0]).read_text().strip()
        used = int((folder / names[1]).read_text().strip())
    except (OSError, ValueError):
        return None
    stat = {}
    try:
        for row in (folder / "memory.stat").read_text().splitlines():
            key, _, value = row.partition(" ")
            if value.strip().isdigit():
                stat[key] = int(value)
    except OSError:
        pass
    limit = int(limit_text) if limit_text.isdigit() else None
    if limit is None or limit >= _NO_LIMIT:  # v1 with hierarchy: the ancestors' limit
        limit = stat.get("hierarchical_memory_limit") if v1 else None
    if limit is None or limit >= _NO_LIMIT:
        return None
    reclaimable = stat.get("total_inactive_file" if v1 else "inactive_file", 0)
    return limit, max(0, used - reclaimable)


def local_ranks() -> int:
    """The processes a launcher started on this host (``LOCAL_WORLD_SIZE``, torchrun's),
    which share its memory and cores; 1 without one."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_facts(
    *,
    available_bytes: int | None = None,
    process_bytes: int | None = None,
    cgroup: tuple[int, int] | None | bool = True,
) -> HostFacts:
    """This process's host budget. The arguments stand in for the machine's readings
    (tests): ``cgroup`` True reads it, None means none, a pair is (limit, usage)."""
    available = host_available_bytes() if available_bytes is None else int(available_bytes)
    process = process_rss_bytes() if process_bytes is None else int(process_bytes)
    limits = cgroup_memory() if cgroup is True else cgroup
    room, source = available, "available memory"
    limit = used = None
    if limits:
        limit, used = limits
        if limit - used < room:
            room, source = max(0, limit - used), "the cgroup's memory limit"
    whole = process + room
    reserve = max(HOST_RESERVE_MIN_BYTES, int(HOST_RESERVE_FRACTION * whole))
    budget = max(process, whole - reserve)
    return HostFacts(available, process, limit, used, budget, source)


def is_unified(device: Any = None) -> bool:
    """Whether the device's memory is the host's: the CPU itself, Apple silicon, an
    integrated GPU. A host copy of its weights would be the same memory twice."""
    import torch

    device = resolve_device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return bool(getattr(torch.cuda.get_device_properties(index), "is_integrated", False))
    return device.type in ("cpu", "mps")


def device_facts(device: Any = None) -> DeviceFacts:
    """Unified memory (integrated GPUs, Apple silicon, the CPU itself) and free bytes.

    On CUDA, free bytes honour ``torch.cuda.set_per_process_memory_fraction``, so an
    emulated smaller card is seen as that card.
    """
    import psutil
    import torch

    device = resolve_device(device)
    if is_unified(device):
        return DeviceFacts(str(device), True, psutil.virtual_memory().total, host_available_bytes())
    if device.type == "cuda":
        index = device.index or 0
        free, total = torch.cuda.mem_get_info(index)
        fraction = _memory_fraction(index)
        if fraction < 1.0:
            total = int(total * fraction)
            free = max(0, total - torch.cuda.memory_reserved(index))
        return DeviceFacts(str(device), False, int(total), int(free))
    return DeviceFacts(str(device), False, psutil.virtual_memory().total, host_available_bytes())


def _memory_fraction(index: int) -> float:
    import torch

    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        try:
            return float(getter(index))
        except Exception:
            return 1.0
    return float(os.environ.get("ONDECK_MEMORY_FRACTION", "1.0"))


def measured_device_bytes(device: Any) -> int:
    """Bytes allocated on the device right now; on the CPU, the process's resident set."""
    import torch

    device = resolve_device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return process_rss_bytes()


def allocator_counts(device: Any) -> tuple[int, int] | None:
    """The CUDA caching allocator's counts on ``device`` so far: the times it gave back its
    cache and retried an allocation, and of those the ones that still ran out of memory.
    None off CUDA, or where the counts cannot be read."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    try:
        stats = torch.cuda.memory_stats(device)
        return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0))
    except Exception:
        return None


def free_cached_memory() -> None:
    """Collect garbage and hand the device memory torch's allocator caches back, so the
    next allocation after running out of memory finds it."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def process_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return process_rss_bytes()


# cudaHostRegisterPortable: page-locked for every device's context, not only the current one.
_REGISTER_PORTABLE = 1
_PAGE = 4096


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()


def register_host_memory(pointer: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``pointer`` for every CUDA device
    (``cudaHostRegister``); CUDA's status, 0 on success."""
    return int(_cudart().cudaHostRegister(pointer, nbytes, _REGISTER_PORTABLE))


def pinned_host_bytes(nbytes: int) -> Any:
    """A uint8 host tensor of exactly ``nbytes`` (to the page), page-locked for copies to
    CUDA devices.

    torch's pinned allocator rounds every request up to a power of two: a 10.1 GiB
    component held in one buffer takes 16 GiB of host memory. This allocates the bytes
    asked for and registers them with CUDA instead; they are unregistered, then freed,
    once no tensor views them any more. Where registering fails, torch's allocator is
    used after all. In two steps (``fresh_host_bytes``, then ``page_locked``), a caller
    making many regions touches the next one's pages while this one is registered.
    """
    return page_locked(fresh_host_bytes(nbytes))


@dataclass(frozen=True)
class FreshHostBytes:
    """Host memory made and its pages touched, not yet page-locked (``page_locked``)."""

    owner: Any  # the numpy array that owns the memory
    start: int  # the page-aligned offset of the bytes in ``owner``
    nbytes: int
    size: int  # ``nbytes`` rounded up to whole pages


def fresh_host_bytes(nbytes: int) -> FreshHostBytes:
    """``nbytes`` of page-aligned host memory, its pages touched (``_touch_pages``)."""
    import numpy as np

    nbytes = int(nbytes)
    size = -(-max(nbytes, 1) // _PAGE) * _PAGE
    owner = np.empty(size + _PAGE, dtype=np.uint8)  # freed when its last view goes
    start = -owner.ctypes.data % _PAGE  # page-aligned, as registering wants
    try:
        _touch_pages(owner.ctypes.data + start, size)
    except Exception:  # no threads to start: registering faults the pages in itself
        pass
    return FreshHostBytes(owner, start, nbytes, size)


def page_locked(fresh: FreshHostBytes) -> Any:
    """``fresh`` registered with CUDA, as a uint8 tensor; torch's pinned allocator where
    registering fails."""
    import weakref

    import torch

    owner, pointer = fresh.owner, fresh.owner.ctypes.data + fresh.start
    try:
        status = register_host_memory(pointer, fresh.size)
    except Exception:
        status = -1
    if status != 0:
        consume_cuda_error()
        return torch.empty(fresh.nbytes, dtype=torch.uint8, pin_memory=True)
    # Runs as the owner is collected, before numpy frees its memory.
    weakref.finalize(owner, _unregister, pointer)
    return torch.from_numpy(owner[fresh.start : fresh.start + fresh.nbytes])


# Regions at least this large have their pages touched by several threads before they
# are registered (see _touch_pages).
_TOUCH_THREADS_FROM = 64 * 2**20


def _touch_pages(pointer: int, nbytes: int) -> None:
    """Make the kernel back fresh memory with pages, on several threads at once.

    Registering fresh memory faults in every page itself, one page at a time on one
    thread (about 4.5 GB/s on a 16-core host); zeroing the range first on 8 threads and
    then registering pages that are already there runs at about 15 GB/s. A first run
    that page-locks the host copies of 27 GiB of streamed blocks waits for this."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    threads = min(8, os.cpu_count() or 1)
    if nbytes < _TOUCH_THREADS_FROM or threads < 2:
        return  # registering touches them
    step = -(-nbytes // threads // _PAGE) * _PAGE
    with ThreadPoolExecutor(threads, thread_name_prefix="ondeck-touch") as pool:
        # ctypes' memset lets go of the GIL while it runs.
        done = pool.map(
            lambda offset: ctypes.memset(pointer + offset, 0, min(step, nbytes - offset)),
            range(0, nbytes, step),
        )
        list(done)


def _unregister(pointer: int) -> None:
    try:
        if int(_cudart().cudaHostUnregister(pointer)) != 0:
            consume_cuda_error()
    except Exception:  # at interpreter exit CUDA may be gone; the memory goes with it
        pass


def consume_cuda_error() -> None:
    """Clear the error a failed CUDA runtime call left on this thread.

    The runtime keeps the last error per thread until it is read, and torch reads it at
    its next kernel launch: a refused ``cudaHostRegister`` would otherwise surface as the
    failure of some later, unrelated kernel. A one-element launch reads (and clears) it.
    """
    import torch

    try:
        if torch.cuda.is_current_stream_capturing():
            return  # nothing may be launched into a graph being captured
        torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # the launch reported it: read, and so cleared
        pass


# Tensors packed into one buffer start at multiples of this: enough for every dtype and
# for the copy engines.
ALIGNMENT_BYTES = 256


def aligned(nbytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def packed_offsets(sizes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Offsets of tensors of ``sizes`` bytes laid out back to back at aligned offsets."""
    offsets, end = [], 0
    for nbytes in sizes:
        offsets.append(end)
        end += aligned(nbytes)
    return tuple(offsets), end
