"""The device's libraries made ready while the first loads read.

A process's first matrix product, attention and convolution on a CUDA device each pay
once for what later calls find ready: the library behind it loaded and initialised
(cuBLAS, cuDNN), its kernels loaded into the context. A pipeline's first run pays that
inside its stages, after the loads it waited for. ``warm_device`` makes one small call of
each on a stream and thread of its own; ``start_warming`` runs it once per device, in
the background, when a pipeline is made, so it overlaps the first loads' reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["start_warming", "warm_device"]

_STARTED: set[Any] = set()
_LOCK = threading.Lock()


def warm_device(device: Any, dtypes: Iterable[Any] | None = None) -> None:
    """One small call of each kind of kernel a diffusion pipeline runs, in each of
    ``dtypes`` (bfloat16 and float32 by default), on a stream of its own: linear layers,
    attention at the usual head sizes, layer and group norms, 2D and 3D convolutions."""
    import torch
    import torch.nn.functional as F

    device = torch.device(device)
    dtypes = tuple(dtypes or (torch.bfloat16, torch.float32))
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream), torch.inference_mode():
        for dtype in dtypes:
            x = torch.randn(256, 512, device=device, dtype=dtype)
            w = torch.randn(512, 512, device=device, dtype=dtype)
            F.linear(x, w, w[0])
            F.layer_norm(x, (512,))
            if dtype in (torch.bfloat16, torch.float16):
                for head in (64, 128):
                    q = torch.randn(1, 4, 256, head, device=device, dtype=dtype)
                    F.scaled_dot_product_attention(q, q, q)
            image = torch.randn(1, 32, 32, 32, device=device, dtype=dtype)
            F.silu(F.group_norm(image, 8))
            F.conv2d(image, torch.randn(32, 32, 3, 3, device=device, dtype=dtype), padding=1)
            video = torch.randn(1, 32, 4, 16, 16, device=device, dtype=dtype)
            F.conv3d(video, torch.randn(32, 32, 3, 3, 3, device=device, dtype=dtype), padding=1)
    stream.synchronize()


def start_warming(device: Any, dtypes: Iterable[Any] | None = None) -> threading.Thread | None:
    """``warm_device`` on a daemon thread, the first time a CUDA device is asked for in
    this process; None where there is nothing to do. A failure is left for the stages
    themselves to meet."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _LOCK:
        if device in _STARTED:
            return None
        _STARTED.add(device)
    dtypes = tuple(dtypes) if dtypes is not None else None

    def warm() -> None:
        try:
            warm_device(device, dtypes)
        except Exception:
            pass

    thread = threading.Thread(target=warm, name="ondeck-warm-device", daemon=True)
    thread.start()
    return thread
