"""A component's module built without weights, and the dtype and shape each tensor will get.

The same skeleton answers ``spec.nbytes`` before a load and guides the load itself, so
the prediction and the loaded module cannot disagree.
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..errors import LoadError

__all__ = ["Skeleton", "Slot", "build_skeleton", "library_of"]

# Building a module under a dtype changes torch's process-wide default dtype for a moment;
# two builds at once (a prefetch thread and the main thread) must not interleave.
_BUILD_LOCK = threading.Lock()


@dataclass
class Slot:
    """One tensor the file must fill; several names when weights are tied."""

    names: list[str]
    is_parameter: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


@dataclass
class Skeleton:
    """The module on the meta device, the slots to fill, and the buffers the file lacks."""

    module: torch.nn.Module
    slots: list[Slot]
    extra_buffers: dict[int, list[str]] = field(default_factory=dict)
    ignored_unexpected: tuple[str, ...] = ()
    library: str = "torch"
    dtype: torch.dtype = torch.float32
    file_keys: frozenset[str] = frozenset()

    def fresh(self) -> Skeleton:
        """An independent copy to fill. Copying touches no process-wide state, unlike a
        build (which sets torch's default dtype and patches nn.Module for a moment), so a
        load in a background thread cannot disturb the thread running the model."""
        return _describe(copy.deepcopy(self.module), self.library, self.dtype, self.file_keys)

    @property
    def nbytes(self) -> int:
        extra = 0
        for names in self.extra_buffers.values():
            buffer = _get(self.module, names[0])
            extra += buffer.numel() * buffer.element_size()
        return sum(slot.nbytes for slot in self.slots) + extra


def library_of(cls: type) -> str:
    """'diffusers', 'transformers', or 'torch' for a module class."""
    for base in cls.__mro__:
        module = base.__module__ or ""
        if module.startswith("diffusers.") and base.__name__ == "ModelMixin":
            return "diffusers"
        if module.startswith("transformers.") and base.__name__ == "PreTrainedModel":
            return "transformers"
    return "torch"


def build_skeleton(
    cls: type,
    directory: str | os.PathLike,
    dtype: torch.dtype,
    *,
    file_keys: Iterable[str] = (),
    component: str | None = None,
) -> Skeleton:
    """Instantiate ``cls`` from the config in ``directory`` with no weight memory.

    Parameters and persistent buffers land on the meta device; non-persistent buffers are
    computed for real, since no file holds them.
    """
    from accelerate import init_empty_weights

    directory = os.fspath(directory)
    library = library_of(cls)
    try:
        with _BUILD_LOCK, init_empty_weights(include_buffers=False):
            if library == "diffusers":
                module = _build_diffusers(cls, directory, dtype)
            elif library == "transformers":
                module = _build_transformers(cls, directory, dtype)
            else:
                raise LoadError(
                    f"component '{component}': {cls.__name__} is neither a diffusers nor a "
                    "transformers model; ondeck cannot build it from a folder"
                )
    except LoadError:
        raise
    except Exception as error:
        raise LoadError(
            f"component '{component}' from {directory}: building {cls.__name__} from its "
            f"config failed with {type(error).__name__}: {error}",
            component=component,
            path=directory,
        ) from error
    return _describe(module, library, dtype, frozenset(file_keys))


def _build_diffusers(cls: type, directory: str, dtype: torch.dtype) -> torch.nn.Module:
    config = cls.load_config(directory)
    previous = torch.get_default_dtype()
    # from_pretrained builds under the requested default dtype too; buffers computed in
    # __init__ then match it exactly.
    settable = dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if settable:
        torch.set_default_dtype(dtype)
    try:
        module = cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    module.register_to_config(_name_or_path=directory)
    return module


def _build_transformers(cls: type, directory: str, dtype: torch.dtype) -> torch.nn.Module:
    config = cls.config_class.from_pretrained(directory)
    config.name_or_path = directory
    previous = torch.get_default_dtype()
    try:
        return cls._from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)


def _describe(
    module: torch.nn.Module, library: str, dtype: torch.dtype, file_keys: frozenset[str]
) -> Skeleton:
    groups: dict[int, Slot] = {}
    extra_buffers: dict[int, list[str]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attribute, tensor in submodule._parameters.items():
            if tensor is not None:
                _add(groups, id(tensor), f"{dot}{attribute}", tensor, is_parameter=True)
        for attribute, tensor in submodule._buffers.items():
            if tensor is None:
                continue
            if attribute in submodule._non_persistent_buffers_set:
                extra_buffers.setdefault(id(tensor), []).append(f"{dot}{attribute}")
            else:
                _add(groups, id(tensor), f"{dot}{attribute}", tensor, is_parameter=False)

    slots = _merge_tied(module, list(groups.values()))
    fp32_rule = _fp32_rule(module, library, dtype)
    for slot in slots:
        key = next((name for name in slot.names if name in file_keys), slot.names[0])
        slot.dtype = _target_dtype(slot.dtype, key, dtype, fp32_rule, library)
    ignored = tuple(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    return Skeleton(module, slots, extra_buffers, ignored, library, dtype, file_keys)


def _add(groups: dict[int, Slot], key: int, name: str, tensor, *, is_parameter: bool) -> None:
    if key in groups:
        groups[key].names.append(name)
        return
    groups[key] = Slot(
        [name],
        is_parameter,
        tuple(tensor.shape),
        tensor.dtype,
        bool(getattr(tensor, "requires_grad", False)) if is_parameter else False,
    )


def _merge_tied(module: torch.nn.Module, slots: list[Slot]) -> list[Slot]:
    """Join the slots transformers ties after loading, so they get one tensor, counted once."""
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    if not isinstance(tied, dict) or not tied:
        return slots
    by_name = {name: slot for slot in slots for name in slot.names}
    for target, source in tied.items():
        target_slot, source_slot = by_name.get(target), by_name.get(source)
        if target_slot is None or source_slot is None or target_slot is source_slot:
            continue
        if target_slot.shape != source_slot.shape:
            continue
        source_slot.names.extend(target_slot.names)
        for name in target_slot.names:
            by_name[name] = source_slot
        target_slot.names = []
    return [slot for slot in slots if slot.names]


def _fp32_rule(module: torch.nn.Module, library: str, dtype: torch.dtype):
    """The keep-in-fp32 test from_pretrained applies for this library and dtype."""
    if library == "diffusers":
        keep = type(module)._keep_in_fp32_modules or []
        keep = [keep] if isinstance(keep, str) else list(keep)
        if not keep:
            return None
        return lambda key: any(part in key.split(".") for part in keep)
    if library == "transformers" and hasattr(module, "_get_dtype_plan"):
        plan = module._get_dtype_plan(dtype)
        if not plan:
            return None
        # transformers matches these names as regex globs anywhere in the key.
        pattern = re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in plan))
        return lambda key: pattern.search(key) is not None
    return None


def _target_dtype(meta_dtype, key, dtype, fp32_rule, library) -> torch.dtype:
    if not meta_dtype.is_floating_point:
        return meta_dtype
    if fp32_rule is not None and fp32_rule(key):
        return torch.float32
    if library == "transformers":
        # transformers keeps a parameter's own dtype when it differs from the default
        # (built under the requested dtype, so only deliberate exceptions differ).
        return meta_dtype
    return dtype


def _get(module: torch.nn.Module, name: str):
    owner, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attribute)
