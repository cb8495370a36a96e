"""What a process pays the first time it computes on a CUDA device, paid while weights load.

A process's first matrix product, attention and convolution on a CUDA device each load
libraries and kernels (cuBLAS and cuBLASLt, cuDNN's engines, the attention kernels), and
the first call of each kind waits for that. A pipeline's first run pays it inside its
stages, after each component's weights are in: a one-shot command only ever sees that
run. ``start_warm_up`` has a thread of its own call small stand-ins of those operations
once per process and device, while the first component loads, so the run finds the
libraries loaded. The stand-ins run on the device's default stream, as the pipelines'
own calls do, so the few MiB they take (and cuBLAS's workspace) go back to the
allocator's cache for that stream and serve the run; their results are thrown away and
nothing global changes. ``ONDECK_WARM_UP=0`` turns it off; a list of kinds
(``matmul,convolution``) warms only those.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

__all__ = ["STAND_INS", "chosen_stand_ins", "start_warm_up", "warm_up"]

_lock = threading.Lock()
_started: dict[torch.device, threading.Thread] = {}


def _matmul(device: torch.device, dtype: torch.dtype) -> None:
    a = torch.ones(128, 128, device=device, dtype=dtype)
    F.linear(a, a, a[0])
    torch.baddbmm(a[None], a[None], a[None])


def _attention(device: torch.device, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        return  # the pipelines attend in half precision
    for head_dim in (64, 128):
        q = torch.ones(1, 2, 64, head_dim, device=device, dtype=dtype)
        F.scaled_dot_product_attention(q, q, q)
        mask = torch.ones(1, 1, 64, 64, device=device, dtype=torch.bool)
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _convolution(device: torch.device, dtype: torch.dtype) -> None:
    image = torch.ones(1, 8, 16, 16, device=device, dtype=dtype)
    F.conv2d(image, torch.ones(8, 8, 3, 3, device=device, dtype=dtype), padding=1)
    video = torch.ones(1, 8, 4, 16, 16, device=device, dtype=dtype)
    F.conv3d(video, torch.ones(8, 8, 3, 3, 3, device=device, dtype=dtype), padding=1)


def _pointwise(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.ones(1, 8, 16, 16, device=device, dtype=dtype)
    F.group_norm(x, 4)
    F.layer_norm(x, (16,))
    F.silu(x)
    F.gelu(x, approximate="tanh")
    F.softmax(x, dim=-1)
    F.interpolate(x, scale_factor=2.0, mode="nearest")
    torch.randn(64, device=device, dtype=dtype)


STAND_INS: tuple[tuple[str, Callable[[torch.device, torch.dtype], None]], ...] = (
    ("matmul", _matmul),
    ("attention", _attention),
    ("convolution", _convolution),
    ("pointwise", _pointwise),
)


def chosen_stand_ins() -> tuple[str, ...]:
    """The kinds of stand-ins ``ONDECK_WARM_UP`` asks for: every kind when unset, none
    for ``0``, else the comma-separated names of ``STAND_INS``."""
    text = os.environ.get("ONDECK_WARM_UP", "").strip()
    known = tuple(name for name, _ in STAND_INS)
    if not text:
        return known
    if text == "0":
        return ()
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"ONDECK_WARM_UP={text!r}: unknown {', '.join(unknown)}; use 0 or some of "
            f"{', '.join(known)}"
        )
    return names


def warm_up(
    device: torch.device, dtypes: Iterable[torch.dtype], kinds: Iterable[str] | None = None
) -> dict[str, float]:
    """Call each stand-in (of ``kinds``, every kind by default) on ``device`` in each of
    ``dtypes`` (floating ones) and wait for them; returns the seconds each kind took."""
    device = torch.device(device)
    wanted = [dtype for dtype in dict.fromkeys(dtypes) if dtype.is_floating_point]
    kinds = None if kinds is None else set(kinds)
    seconds: dict[str, float] = {}
    with torch.cuda.device(device), torch.no_grad():
        for name, stand_in in STAND_INS:
            if kinds is not None and name not in kinds:
                continue
            started = time.perf_counter()
            for dtype in wanted:
                stand_in(device, dtype)
            torch.cuda.current_stream(device).synchronize()
            seconds[name] = time.perf_counter() - started
    return seconds


def start_warm_up(
    device: torch.device, dtypes: Iterable[torch.dtype], kinds: Iterable[str] | None = None
) -> threading.Thread | None:
    """Start ``warm_up`` on a daemon thread, once per process and CUDA device; returns the
    thread, or None where there is nothing to do (not CUDA, no kinds, or started before)."""
    device = torch.device(device)
    kinds = tuple(chosen_stand_ins() if kinds is None else kinds)
    if device.type != "cuda" or not kinds:
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtypes = tuple(dtypes) or (torch.bfloat16,)
    with _lock:
        if device in _started:
            return None
        thread = threading.Thread(
            target=_quietly, args=(device, dtypes, kinds), name="ondeck-first-use", daemon=True
        )
        _started[device] = thread
    thread.start()
    return thread


def _quietly(device: torch.device, dtypes: tuple[torch.dtype, ...], kinds: tuple[str, ...]) -> None:
    # A stand-in that fails costs nothing but the warm-up: the run's own call loads
    # the library then, and reports whatever is wrong with it.
    try:
        warm_up(device, dtypes, kinds)
    except Exception:  # noqa: BLE001
        pass
