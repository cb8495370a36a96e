"""Start the CUDA libraries behind a pipeline's set-up, not inside its first call.

A process's first matrix product, attention, normalization and convolution on a CUDA
device pay for starting the libraries behind them: cuBLAS and cuBLASLt handles, cuDNN's
handle and engine libraries, kernels loaded on first use. A pipeline would pay all of it
inside its first component's turn of its first call, which is all a one-shot command
ever runs. ``start(device, dtype)`` pays it in a daemon thread while the pipeline is
being built (reading configs and headers, building skeletons, tokenizers), with tensors
of a few kilobytes. torch keeps those handles in per-device pools: when the thread ends,
its handles go back to the pool, where the pipeline's thread takes them ready-made.

Nothing here changes a result: the pipeline computes with the same kernels whether or not
this ran first. It never raises; a device or dtype it cannot exercise is left alone.
Set ``ONDECK_WARMUP=0`` to turn it off (to measure what it saves).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = ["start", "wait"]

_started: dict[str, threading.Thread] = {}
_lock = threading.Lock()
# What stopped the last warm-up, if anything (the first call pays instead).
last_error: BaseException | None = None


def start(device: Any, dtype: Any = None) -> threading.Thread | None:
    """Start the libraries ``device``'s kernels need, in ``dtype`` (and float32) in the
    background, once per process and device; the thread, or None where there is nothing
    to do (not CUDA, done before, turned off)."""
    if os.environ.get("ONDECK_WARMUP", "1") == "0":
        return None
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    dtypes = [dtype] if isinstance(dtype, torch.dtype) else list(_dtypes_of(dtype))
    dtype = next((d for d in dtypes if d.is_floating_point and d.itemsize == 2), torch.float32)
    key = str(device if device.index is not None else torch.device("cuda", 0))
    with _lock:
        if key in _started:
            return None
        thread = threading.Thread(
            target=_exercise, args=(device, dtype), name="ondeck-warmup", daemon=True
        )
        _started[key] = thread
    thread.start()
    return thread


def wait(timeout: float | None = None) -> None:
    """Wait for every warm-up started so far (tests; a caller about to time a call)."""
    for thread in list(_started.values()):
        thread.join(timeout)


def _dtypes_of(dtype: Any) -> list[torch.dtype]:
    """The dtypes of a ``torch_dtype`` given per component (``{"default": ...}``)."""
    if isinstance(dtype, dict):
        return [value for value in dtype.values() if isinstance(value, torch.dtype)]
    return []


def _exercise(device: torch.device, dtype: torch.dtype) -> None:
    """On the device's current stream, where the pipeline computes: cuBLAS keeps a
    workspace per handle and stream, so the pipeline's first product finds this one's."""
    try:
        with torch.cuda.device(device), torch.no_grad():
            for each in dict.fromkeys((dtype, torch.float32)):
                _kernels(device, each)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
    except Exception as error:  # noqa: BLE001 - an optimization: the first call pays
        global last_error
        last_error = error


def _kernels(device: torch.device, dtype: torch.dtype) -> None:
    """One of each operation a diffusion pipeline's first call starts a library for."""
    functional = torch.nn.functional
    x = torch.ones(2, 8, 64, device=device, dtype=dtype)
    weight = torch.ones(64, 64, device=device, dtype=dtype)
    bias = torch.zeros(64, device=device, dtype=dtype)
    functional.linear(x, weight, bias)  # cuBLASLt
    functional.linear(x, weight)
    torch.bmm(x, x.transpose(1, 2))  # cuBLAS
    functional.layer_norm(x, (64,))
    functional.gelu(x, approximate="tanh")
    functional.silu(x)
    torch.softmax(x, dim=-1)
    q = torch.ones(1, 2, 8, 64, device=device, dtype=dtype)
    functional.scaled_dot_product_attention(q, q, q)
    mask = torch.ones(1, 1, 8, 8, device=device, dtype=torch.bool)
    functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    image = torch.ones(1, 8, 8, 8, device=device, dtype=dtype)
    functional.group_norm(image, 4)
    functional.conv2d(image, torch.ones(8, 8, 3, 3, device=device, dtype=dtype), padding=1)
    functional.interpolate(image, scale_factor=2.0, mode="nearest")
    video = torch.ones(1, 8, 3, 8, 8, device=device, dtype=dtype)
    functional.conv3d(video, torch.ones(8, 8, 3, 3, 3, device=device, dtype=dtype), padding=1)
