"""What ondeck's outputs are compared with: plain diffusers, in two forms.

On the CPU, plain ``from_pretrained`` leaves weights as views into the memory-mapped
safetensors file, at the file's offsets (mostly not 64-byte aligned); ondeck copies
them into fresh, aligned tensors. Some CPUs' kernels round differently for the two
layouts, so plain diffusers and ondeck can differ in the last bits while computing the
same thing. Hence:

- ``in_fresh_tensors(pipe)``: plain diffusers with every weight copied into a fresh
  tensor, the same kind of memory ondeck uses. ondeck must match it bit for bit.
- ``assert_close_to_plain(ours, plain)``: unmodified plain diffusers, within
  ``PLAIN_TOLERANCE``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Not ondeck's arithmetic: the rounding of CPU kernels on unaligned (mmap'd) weights
# against aligned ones, about 1e-7 on AMD EPYC for outputs in [0, 1]. Two orders of
# magnitude of room, still far below any real difference (a wrong weight, a skipped step).
PLAIN_TOLERANCE = 1e-5


def in_fresh_tensors(target: Any) -> Any:
    """Copy every parameter and buffer of ``target`` (a module, or a pipeline's module
    components) into a fresh tensor, in place; returns ``target``.

    Tied weights stay tied: a parameter object shared by two modules is copied once.
    """
    modules = (
        [target]
        if isinstance(target, torch.nn.Module)
        else [c for c in target.components.values() if isinstance(c, torch.nn.Module)]
    )
    copied: set[int] = set()
    # id -> (old, fresh): holding the old buffer keeps its id from being reused meanwhile.
    fresh_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for module in modules:
            for owner in module.modules():
                for parameter in owner._parameters.values():
                    if parameter is not None and id(parameter) not in copied:
                        copied.add(id(parameter))
                        parameter.data = parameter.data.clone()
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        if id(buffer) not in fresh_buffers:
                            fresh_buffers[id(buffer)] = (buffer, buffer.clone())
                        owner._buffers[name] = fresh_buffers[id(buffer)][1]
    return target


def assert_close_to_plain(ours: Any, plain: Any, what: str = "") -> None:
    ours, plain = np.asarray(ours), np.asarray(plain)
    assert ours.shape == plain.shape, what
    difference = float(np.max(np.abs(ours - plain))) if ours.size else 0.0
    assert difference <= PLAIN_TOLERANCE, f"{what}: differs from plain diffusers by {difference}"
