"""A component's repeated blocks: the unit that streaming moves and pipelined loading
waits for, found from the module's structure alone (a meta skeleton will do)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BlockLists", "block_index", "find_block_lists", "find_blocks"]

# A list of repeated blocks holding less than this share of the component's parameter
# bytes is not worth streaming (a text-token refiner beside the main blocks): hooking it
# costs more than its bytes would save, and it stays resident with the other parts.
MIN_LIST_SHARE = 0.05


@dataclass(frozen=True)
class BlockLists:
    """One or more ModuleLists of repeated blocks, numbered as one sequence in the order
    a forward pass runs them (a double-stream list, then a single-stream one)."""

    paths: tuple[str, ...]
    counts: tuple[int, ...]

    def __str__(self) -> str:
        return "+".join(self.paths)

    @property
    def block_count(self) -> int:
        return sum(self.counts)

    @property
    def starts(self) -> tuple[int, ...]:
        starts, total = [], 0
        for count in self.counts:
            starts.append(total)
            total += count
        return tuple(starts)

    def index(self, names: Sequence[str]) -> int | None:
        """The block, in the joint numbering, that every one of ``names`` belongs to."""
        for path, start in zip(self.paths, self.starts, strict=True):
            local = block_index(names, path)
            if local is not None:
                return start + local
        return None

    def groups(self) -> list[range]:
        """Each list's blocks in the joint numbering."""
        return [
            range(start, start + count)
            for start, count in zip(self.starts, self.counts, strict=True)
        ]

    def modules(self, module: Any) -> list[Any]:
        """Every block of ``module``, in the joint numbering."""
        return [block for path in self.paths for block in module.get_submodule(path)]


def _repeated_lists(module: Any) -> list[tuple[str, int, int]]:
    """(path, children, parameter bytes) of every ModuleList of two or more children that
    share one class, outermost only (a list inside a block is part of the block)."""
    import torch

    found: list[tuple[str, int, int]] = []
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        if any(name.startswith(f"{outer}.") for outer, _, _ in found):
            continue
        nbytes = sum(p.numel() * p.element_size() for p in child.parameters())
        if nbytes:
            found.append((name, len(child), nbytes))
    return found


def find_blocks(module: Any, path: str | None = None) -> str | None:
    """The ModuleList of repeated blocks: ``path`` if given, else the largest ModuleList
    (by parameter bytes) of two or more children that all share one class."""
    import torch

    if path:
        found = module.get_submodule(path)
        if not isinstance(found, torch.nn.ModuleList) or len(found) == 0:
            raise ValueError(f"'{path}' is not a non-empty ModuleList")
        return path
    lists = _repeated_lists(module)
    return max(lists, key=lambda item: item[2])[0] if lists else None


def find_block_lists(module: Any, path: str | None = None) -> BlockLists | None:
    """Every list of repeated blocks worth streaming, in definition order (the order
    most models run them; the streamer learns the real one in the first pass, for
    lists that interleave, such as a UNet's resnets and attentions); ``path`` names a
    single one."""
    if path:
        found = find_blocks(module, path)
        return BlockLists((found,), (len(module.get_submodule(found)),))
    lists = _repeated_lists(module)
    if not lists:
        return None
    total = sum(p.numel() * p.element_size() for p in module.parameters()) or 1
    kept = [(name, count) for name, count, nbytes in lists if nbytes >= MIN_LIST_SHARE * total]
    if not kept:
        name, count, _ = max(lists, key=lambda item: item[2])
        kept = [(name, count)]
    return BlockLists(tuple(name for name, _ in kept), tuple(count for _, count in kept))


def block_index(names: list[str] | tuple[str, ...] | Sequence[str], path: str) -> int | None:
    """The block under ``path`` that every one of ``names`` belongs to, else None (a
    tensor outside the blocks, or tied across two of them)."""
    prefix = f"{path}."
    index = None
    for name in names:
        if not name.startswith(prefix):
            return None
        head = name[len(prefix) :].split(".", 1)[0]
        if not head.isdigit() or (index is not None and int(head) != index):
            return None
        index = int(head)
    return index
