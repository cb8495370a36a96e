"""A float8 tensor upcast to its compute dtype for one forward, at the device's rate.

Every value of ``float8_e4m3fn`` and ``float8_e5m2`` is exact in bfloat16 and float16,
so any correct conversion gives the same values; what differs is the rate. torch's own
``tensor.to(dtype)`` converts float8 at 0.94 TB/s of bytes read and written on an H100,
under a third of its memory's rate, and a layer's upcast sits in front of its product on
the compute stream. On CUDA, where Triton runs, :func:`upcast` converts with the device's
own float8 instructions in one pass over the bytes instead (2.7 TB/s there;
``benchmarks/experiments/upcast_overlap.py``). Anywhere else (the CPU, mps, no Triton, a
device below compute capability 8.9, a non-contiguous tensor, other dtypes) it is
``tensor.to(dtype)``.

The kernel is compiled (or loaded from Triton's cache) the first time it runs for a pair
of dtypes: a load of a stored component starts that on a thread of its own
(:func:`prepare`), and a first forward that comes while it is under way waits for it
rather than building a second. Where it cannot be built (Triton without the compiler it
needs, say), a warning says so once and torch converts from then on.
``ONDECK_TRITON_UPCAST=0`` turns the kernel off (torch's conversion everywhere).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable

import torch

# Below this many elements torch's conversion is as quick as a kernel launch through
# Triton's Python launcher.
_SMALLEST = 1 << 16
_BLOCK = 4096

_FLOAT8 = tuple(
    dtype
    for dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if dtype is not None
)
_WIDE = (torch.bfloat16, torch.float16, torch.float32)
# What the kernel converts: every pair but float8_e5m2 to bfloat16, where Triton 3.6's
# conversion on an H100 gave other values than torch's (tests/gpu/test_upcast.py).
_PAIRS = {
    (storage, compute)
    for storage in _FLOAT8
    for compute in _WIDE
    if (storage, compute) != (getattr(torch, "float8_e5m2", None), torch.bfloat16)
}

_lock = threading.Lock()
_build_lock = threading.Lock()
_prepared: set[tuple] = set()  # (device index, storage, compute) a preparation started for
_built: set[tuple] = set()  # (device index, storage, compute) the kernel has run for
_state = {"failed": False}  # the kernel could not be built


def upcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, the same values, through the Triton kernel where it applies.
    Under ``torch.compile`` it is ``tensor.to(dtype)``, which the compiler fuses itself."""
    if torch.compiler.is_compiling() or not _kernel_applies(tensor, dtype):
        return tensor.to(dtype)
    key = (tensor.device.index, tensor.dtype, dtype)
    if key in _built:
        out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        _launch(_kernel(), tensor, out)
        return out
    # The first launch builds the kernel; one waits for a build under way (a load's
    # preparation) rather than making its own.
    with _build_lock:
        kernel = None if _state["failed"] else _kernel()
        if kernel is None:
            return tensor.to(dtype)
        out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        try:
            _launch(kernel, tensor, out)
        except Exception as error:  # Triton's compiler or launcher, not the conversion
            _give_up(error)
            return tensor.to(dtype)
        _built.add(key)
    return out


def _launch(kernel: Callable, tensor: torch.Tensor, out: torch.Tensor) -> None:
    count = tensor.numel()
    with torch.cuda.device(tensor.device):
        kernel[(triton_blocks(count),)](tensor, out, count, BLOCK=_BLOCK)


def prepare(device: torch.device | str, storage: torch.dtype, compute: torch.dtype) -> None:
    """Build the kernel for a load that will compute ``storage`` tensors in ``compute``
    on ``device``, on a thread of its own, once per process and dtypes; nothing where
    the kernel would not apply."""
    device = torch.device(device)
    if device.type != "cuda" or (storage, compute) not in _PAIRS:
        return
    if not enabled() or _state["failed"] or not torch.cuda.is_available():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, storage, compute)
    with _lock:
        if key in _prepared:
            return
        _prepared.add(key)
    threading.Thread(
        target=_warm, args=(index, storage, compute), name="ondeck-upcast-build", daemon=True
    ).start()


def _warm(index: int, storage: torch.dtype, compute: torch.dtype) -> None:
    device = torch.device("cuda", index)
    if not _converts_float8(index):
        return
    try:
        sample = torch.zeros(_SMALLEST, dtype=torch.uint8, device=device).view(storage)
        upcast(sample, compute)
    except torch.OutOfMemoryError:
        pass  # no room for the sample now: the first forward builds the kernel instead


def _give_up(error: Exception) -> None:
    """Called under ``_build_lock``, by the first build that failed."""
    _state["failed"] = True
    warnings.warn(
        f"ondeck: the Triton kernel that upcasts float8 weights could not be built "
        f"({type(error).__name__}: {error}); torch's conversion is used instead, slower. "
        "ONDECK_TRITON_UPCAST=0 leaves Triton out.",
        RuntimeWarning,
        stacklevel=3,
    )


def triton_blocks(count: int) -> int:
    return -(-count // _BLOCK)


def _kernel_applies(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        tensor.is_cuda
        and (tensor.dtype, dtype) in _PAIRS
        and tensor.numel() >= _SMALLEST
        and tensor.is_contiguous()
        and enabled()
        and not _state["failed"]
        and _converts_float8(tensor.device.index)
    )


@functools.cache
def _converts_float8(index: int) -> bool:
    """Whether CUDA device ``index`` has float8 conversion (compute capability 8.9 on)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def enabled() -> bool:
    return os.environ.get("ONDECK_TRITON_UPCAST", "1") != "0"


@functools.cache
def _kernel() -> Callable | None:
    """The Triton kernel, or None where Triton is missing. (Devices below compute
    capability 8.9, with no float8 conversion, are left to torch before this.)"""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # One build for every count: an integer argument is otherwise specialized on
    # whether it divides by 16.
    @triton.jit(do_not_specialize=["count"])
    def widen(source, out, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        values = tl.load(source + offsets, mask=inside)
        tl.store(out + offsets, values.to(out.dtype.element_ty), mask=inside)

    return widen
