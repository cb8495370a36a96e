"""Each streamed block's tensors packed into one buffer: their offsets, from a meta
skeleton, and the views of a buffer (a host copy, a device slot) that are those tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..loading.blocks import BlockLists
from .layout import BlockSizes, packed_offsets

__all__ = ["PackedTensor", "describe_blocks", "packed_view"]


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a block: where it sits in the block's packed buffer."""

    names: tuple[str, ...]  # full names in the component; several when tied
    offset: int
    nbytes: int
    dtype: Any
    shape: tuple[int, ...]
    is_parameter: bool
    requires_grad: bool
    wrap: Any = None  # makes a view into the module's tensor (a GGUF parameter); None: plain


def describe_blocks(
    skeleton: Any, lists: BlockLists | str
) -> tuple[BlockSizes, tuple[tuple[PackedTensor, ...], ...]]:
    """Bytes per block and each block's packed tensor layout, from a meta skeleton.

    ``lists``: the component's lists of blocks (a path names one), numbered jointly."""
    if isinstance(lists, str):
        lists = BlockLists((lists,), (len(skeleton.module.get_submodule(lists)),))
    count = lists.block_count
    members: list[list[Any]] = [[] for _ in range(count)]
    for slot in skeleton.slots:
        index = lists.index(slot.names)
        if index is not None:
            members[index].append(slot)
    tensors, block_bytes, packed = [], [], []
    for slots in members:
        offsets, end = packed_offsets([slot.nbytes for slot in slots])
        tensors.append(
            tuple(
                PackedTensor(
                    tuple(slot.names),
                    offset,
                    slot.nbytes,
                    slot.dtype,
                    tuple(slot.shape),
                    slot.is_parameter,
                    slot.requires_grad,
                    slot.wrap,
                )
                for slot, offset in zip(slots, offsets, strict=True)
            )
        )
        block_bytes.append(sum(slot.nbytes for slot in slots))
        packed.append(end)
    other = skeleton.nbytes - sum(block_bytes)
    list_counts = lists.counts if len(lists.counts) > 1 else ()
    sizes = BlockSizes(str(lists), tuple(block_bytes), tuple(packed), other, list_counts)
    return sizes, tuple(tensors)


def packed_view(buffer: Any, tensor: PackedTensor) -> Any:
    return (
        buffer[tensor.offset : tensor.offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
    )
