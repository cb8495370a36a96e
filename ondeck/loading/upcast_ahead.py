"""Stored (fp8) layers upcast one layer ahead, on a side stream.

A layer kept in a storage dtype computes from compute-dtype copies of its weights, made
just before its forward. Made on the compute stream, those copies are elementwise kernels
queued between the layer's matrix products, which wait for them: a 14B transformer
stored in float8 spends 0.18 s of an 8 GiB card's 10 s run this way.

``UpcastAhead`` learns the order one module's stored layers run in. From then on, as a
layer starts, the copies of the next layer of the same block are made on a side stream,
while this layer computes, and the next layer's forward only waits for them. The values
are the ones an upcast on the compute stream gives, bit for bit: the same elementwise
conversion of the same tensors.

Only within a block (``group_of``): a streamed block's tensors view a device slot that
holds its bytes only between the block's own hooks, so the first stored layer of each
block is upcast where it runs. The copies made ahead are used only by the next stored
layer to run, only if it is the layer they were made for and still holds the very
tensors they were made from; otherwise they are dropped. The compute stream waits for
the side stream right after the forward of the layer that started them, so nothing
queued later (a slot handed to another block, an unload, the memory of dropped copies
handed out again) can overtake the side stream. At most two layers' copies exist at
once, which the fp8 reserve counts (``ondeck.policy.UPCAST_RESERVE_COPIES``).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["UpcastAhead", "group_of", "stored_entries"]

# The first numbered step of a module path: "blocks.3.attn1.to_q" -> "blocks.3".
_BLOCK = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")

_SIDE_STREAMS: dict[torch.device, Any] = {}


def group_of(name: str) -> str | None:
    """The repeated block a layer belongs to: its path up to its first numbered step
    (``blocks.3`` of ``blocks.3.attn1.to_q``, ``encoder.block.5`` of a T5 layer); None
    for a layer in no numbered list."""
    match = _BLOCK.match(name)
    return match.group(1) if match else None


def stored_entries(layer: torch.nn.Module, storage: torch.dtype) -> list[tuple[dict, str, Any]]:
    """``(table, name, tensor)`` for each of the layer's own tensors in the storage dtype."""
    return [
        (table, name, tensor)
        for table in (layer._parameters, layer._buffers)
        for name, tensor in table.items()
        if tensor is not None and tensor.dtype == storage
    ]


@dataclass
class _Ahead:
    """Copies made ahead for one layer: from ``sources`` (as its tables held them), done
    once ``done`` has passed on the side stream (None: made at once, off CUDA)."""

    name: str
    device: torch.device
    sources: list[tuple[dict, str, Any]]
    copies: list[Any]
    done: Any

    def still_holds(self, layer: torch.nn.Module, storage: torch.dtype) -> bool:
        current = stored_entries(layer, storage)
        return len(current) == len(self.sources) and all(
            table is own_table and name == own_name and tensor is own_tensor
            for (table, name, tensor), (own_table, own_name, own_tensor) in zip(
                current, self.sources, strict=True
            )
        )


class UpcastAhead:
    """The stored layers of one module, hooked by the swapping casting hook: which layer
    follows which (learned as they run), and the copies made ahead for the next one."""

    def __init__(
        self, storage: torch.dtype, compute: torch.dtype, layers: Iterable[tuple[str, Any]]
    ):
        self.storage, self.compute = storage, compute
        # name -> the layer, weakly: the layers' hooks hold this, the module its layers.
        self.layers = {name: weakref.ref(layer) for name, layer in layers}
        self.groups = {name: group_of(name) for name in self.layers}
        self.following: dict[str, str] = {}
        self.previous: str | None = None
        self.ahead: _Ahead | None = None
        self.made_ahead = 0  # layers whose copies were made ahead and used
        self.dropped = 0  # copies made ahead and not used

    def layer(self, name: str) -> torch.nn.Module:
        layer = self.layers[name]()
        if layer is None:
            raise RuntimeError(f"stored layer '{name}' is gone")
        return layer

    def swap_in(self, name: str, layer: torch.nn.Module, stored: list) -> None:
        """Put compute-dtype copies of ``layer``'s stored tensors in their place (noting
        in ``stored`` what to put back), the ones made ahead if there are; then start
        the next layer's on the side stream."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.name == name and ahead.still_holds(layer, self.storage):
            if ahead.done is not None:  # waited for already (``join``): costs nothing
                torch.cuda.current_stream(ahead.device).wait_event(ahead.done)
            for (table, key, tensor), copy in zip(ahead.sources, ahead.copies, strict=True):
                stored.append((table, key, tensor))
                table[key] = copy
            self.made_ahead += 1
        else:
            if ahead is not None:
                self.dropped += 1
            for table, key, tensor in stored_entries(layer, self.storage):
                stored.append((table, key, tensor))
                table[key] = tensor.to(self.compute)
        self._learn(name)
        following = self.following.get(name)
        if following is not None:
            self.ahead = self._start(following)

    def join(self, failed: bool) -> None:
        """After the layer's forward is queued: the compute stream waits for the copies
        made ahead before anything queued later, so whatever happens next (the next
        layer, a freed slot, an unload) comes after the side stream read the sources
        and wrote the copies. ``failed``: the forward raised; the copies go."""
        ahead = self.ahead
        if ahead is None:
            return
        if ahead.done is not None:
            torch.cuda.current_stream(ahead.device).wait_event(ahead.done)
        if failed:
            self.ahead = None
            self.dropped += 1

    def _learn(self, name: str) -> None:
        previous, self.previous = self.previous, name
        group = self.groups.get(name)
        if previous is not None and group is not None and self.groups.get(previous) == group:
            self.following[previous] = name

    def _start(self, name: str) -> _Ahead | None:
        layer = self.layers[name]()
        if layer is None or torch.compiler.is_compiling():
            return None
        sources = stored_entries(layer, self.storage)
        devices = {tensor.device for _, _, tensor in sources}
        if len(devices) != 1:
            return None
        (device,) = devices
        if device.type != "cuda":  # nothing to overlap with: made at once (tests)
            copies = [tensor.to(self.compute) for _, _, tensor in sources]
            return _Ahead(name, device, sources, copies, None)
        if torch.cuda.is_current_stream_capturing():
            return None
        current = torch.cuda.current_stream(device)
        # Allocated on the compute stream, which frees them after their layer's forward;
        # the side stream writes them after what the compute stream queued so far.
        copies = [torch.empty_like(tensor, dtype=self.compute) for _, _, tensor in sources]
        side = _side_stream(device)
        side.wait_stream(current)
        done = torch.cuda.Event()
        with torch.cuda.stream(side), torch.no_grad():
            for copy, (_, _, tensor) in zip(copies, sources, strict=True):
                copy.copy_(tensor)
            done.record(side)
        return _Ahead(name, device, sources, copies, done)


def _side_stream(device: torch.device) -> Any:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        # Ahead of the compute stream's kernels when both wait for room on the device:
        # the next layer waits for these copies.
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return stream
