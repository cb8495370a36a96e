"""A component's repeated blocks: the unit that streaming moves and pipelined loading
waits for, found from the module's structure alone (a meta skeleton will do)."""

from __future__ import annotations

from typing import Any

__all__ = ["block_index", "find_blocks"]


def find_blocks(module: Any, path: str | None = None) -> str | None:
    """The ModuleList of repeated blocks: ``path`` if given, else the largest ModuleList
    (by parameter bytes) of two or more children that all share one class."""
    import torch

    if path:
        found = module.get_submodule(path)
        if not isinstance(found, torch.nn.ModuleList) or len(found) == 0:
            raise ValueError(f"'{path}' is not a non-empty ModuleList")
        return path
    best: tuple[int, str] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in child.parameters())
        if nbytes and (best is None or nbytes > best[0]):
            best = (nbytes, name)
    return best[1] if best else None


def block_index(names: list[str] | tuple[str, ...], path: str) -> int | None:
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
