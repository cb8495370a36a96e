"""A component's module built without weights, and the dtype and shape each tensor will get.

The same skeleton answers ``spec.nbytes`` before a load and guides the load itself, so
the prediction and the loaded module cannot disagree.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import functools
import gc
import inspect
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import LoadError
from .key_mapping import library_names
from .safetensors_format import TensorInfo, format_bytes

__all__ = [
    "get_tensor",
    "set_tensor",
    "Skeleton",
    "SkeletonBuildError",
    "Slot",
    "build_skeleton",
    "copy_module",
    "is_model_container",
    "library_of",
    "match_tensors",
    "module_paths",
    "some_names",
]

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
    # Makes a view of the slot's bytes into the module's tensor where that is not a plain
    # parameter or buffer (a GGUF parameter, which carries its quantization type).
    wrap: Any = None

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
    # Tensors kept in a storage dtype (fp8) instead of their compute dtype, by name
    # (``ondeck.loading.fp8``).
    stored: Mapping[str, torch.dtype] = field(default_factory=dict)

    def fresh(self) -> Skeleton:
        """An independent copy to fill. Copying sets no process-wide state a thread running
        the model reads, unlike a build (which sets torch's default dtype and patches
        nn.Module for a moment), so a load in a background thread cannot disturb it."""
        return _describe(
            copy_module(self.module), self.library, self.dtype, self.file_keys, self.stored
        )

    def with_stored(self, stored: Mapping[str, torch.dtype]) -> Skeleton:
        """This skeleton with the ``stored`` tensors in their storage dtype. It shares the
        module: read it, never fill it (``.fresh()`` to fill)."""
        slots = [replace(slot, names=list(slot.names)) for slot in self.slots]
        _apply_stored(slots, stored)
        return replace(self, slots=slots, stored=dict(stored))

    @property
    def nbytes(self) -> int:
        extra = 0
        for names in self.extra_buffers.values():
            buffer = get_tensor(self.module, names[0])
            extra += buffer.numel() * buffer.element_size()
        return sum(slot.nbytes for slot in self.slots) + extra


# -- copying a skeleton ---------------------------------------------------------------------

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# Also guards the collector's state while it is paused; reentrant, so a value's own
# __deepcopy__ may copy a module in turn.
_COPYING = threading.RLock()


def copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(module)``, several times faster for a large model's skeleton.

    A module tree is copied directly: each module's state as ``nn.Module`` hands it to
    deepcopy, with fresh tables of parameters, buffers and submodules, fresh empty hook
    tables, and immutable values shared, as deepcopy shares them. Anything else (configs,
    attention processors, non-empty hook tables, tensors) goes through ``copy.deepcopy``
    with the same memo, so a module or value reached twice is copied once, as deepcopy
    copies it. A class with its own copy or pickle methods is copied by deepcopy. The
    cyclic garbage collector is paused meanwhile (and then left as it was): the copy makes
    thousands of containers and no garbage, and a full collection triggered halfway would
    cost more than the copy.
    """
    with _COPYING:
        collecting = gc.isenabled()
        try:
            gc.disable()
            return _copy_module(module, {})
        finally:
            if collecting:
                gc.enable()


def _copy_module(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    found = memo.get(id(module))
    if found is not None:
        return found
    cls = type(module)
    if not _plainly_copied(cls) or "__deepcopy__" in module.__dict__:
        return copy.deepcopy(module, memo)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state: dict[str, Any] = {}
    for key, value in module.__getstate__().items():  # what deepcopy would copy
        kind = type(value)
        if key == "_modules":
            state[key] = kind(
                (name, None if child is None else _copy_module(child, memo))
                for name, child in value.items()
            )
        elif key in ("_parameters", "_buffers"):
            state[key] = kind(
                (name, None if tensor is None else _copy_tensor(tensor, memo))
                for name, tensor in value.items()
            )
        elif kind in _ATOMS:
            state[key] = value
        elif kind in (dict, OrderedDict, set) and not value:
            # Memoised like deepcopy's: an empty table reached twice is one in the copy.
            state[key] = memo.setdefault(id(value), kind())
        elif kind in (tuple, torch.Size) and all(type(item) in _ATOMS for item in value):
            state[key] = value
        else:
            state[key] = copy.deepcopy(value, memo)
    new.__setstate__(state)
    return new


def _copy_tensor(tensor: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    """deepcopy's copy of a module's tensor. A plain parameter on the meta device (a
    skeleton's weight, replaced when the module is installed) is made without a torch
    operation: an operation gives up the interpreter's lock, and a load on a thread of its
    own beside a running pipeline then waits to get it back, once per tensor."""
    if type(tensor) is torch.nn.Parameter and tensor.is_meta and not tensor.__dict__:
        found = memo.get(id(tensor))
        if found is None:
            found = memo[id(tensor)] = torch.nn.Parameter(tensor.data, tensor.requires_grad)
        return found
    return copy.deepcopy(tensor, memo)


_COPY_METHODS = (
    "__deepcopy__", "__reduce_ex__", "__reduce__", "__getstate__", "__setstate__",
    "__getnewargs__", "__getnewargs_ex__",
)  # fmt: skip


@functools.cache
def _plainly_copied(cls: type) -> bool:
    """Whether deepcopy would copy ``cls`` as nn.Module does: through the state
    ``nn.Module.__getstate__`` gives. Asked once per class (classes do not change their
    copy methods after they are used)."""
    if cls in copyreg.dispatch_table or copyreg._slotnames(cls):
        return False
    return all(
        getattr(cls, method, None) is getattr(torch.nn.Module, method, None)
        for method in _COPY_METHODS
    )


def library_of(cls: type) -> str:
    """'diffusers', 'transformers', or 'torch' for a module class."""
    for base in cls.__mro__:
        module = base.__module__ or ""
        if module.startswith("diffusers.") and base.__name__ == "ModelMixin":
            return "diffusers"
        if module.startswith("transformers.") and base.__name__ == "PreTrainedModel":
            return "transformers"
    return "torch"


def is_model_container(cls: Any) -> bool:
    """A diffusers model class that only holds models saved beside it
    (``MultiControlNetModel``: ``controlnet``, ``controlnet_1``, ...), built from a list of
    them, with no config."""
    return (
        isinstance(cls, type)
        and issubclass(cls, torch.nn.Module)
        and library_of(cls) == "diffusers"
        and not hasattr(cls, "load_config")
        and "controlnets" in inspect.signature(cls.__init__).parameters
    )


class SkeletonBuildError(LoadError):
    """The class could not be instantiated from its config without weights (the library
    may still load it its own way); any other LoadError from a build is the folder's fault."""


# How far a constructor may go past what the weight files hold before it is stopped: twice
# the files' tensors and elements (transformers makes both halves of a tied pair before it
# ties them), plus room for the tables tiny models compute for themselves.
_EXTRA_TENSORS = 64
_EXTRA_ELEMENTS = 2**24
# Tables a model computes in __init__ and no file holds (rope frequencies, position ids,
# masks) are a small fraction of any real model's weights; a config asking for more names
# a length no checkpoint was made for.
_COMPUTED_BYTES_FLOOR = 64 * 2**20
_COMPUTED_BYTES_SHARE = 16


def build_skeleton(
    cls: type,
    directory: str | os.PathLike,
    dtype: torch.dtype,
    *,
    tensors: Mapping[str, TensorInfo] | None = None,
    component: str | None = None,
    config_path: str | os.PathLike | None = None,
) -> Skeleton:
    """Instantiate ``cls`` from the config in ``directory`` with no weight memory.

    Parameters and persistent buffers land on the meta device; non-persistent buffers are
    computed for real, since no file holds them.

    With ``tensors`` (the weight files' headers) the config is checked against them before
    anything real is made: the module is first built entirely on the meta device, under a
    guard that stops the constructor once it has made clearly more tensors or elements
    than the files hold (a layer count of 10**9 would otherwise build forever); then every
    parameter and persistent buffer must match a file tensor by name and shape, and the
    tables the model computes for itself must stay small next to its weights. Only then is
    the module built again with those tables computed for real, where it has any. This
    is generic on purpose: it compares what the constructor makes, whatever config keys
    made it, so it holds for any diffusers or transformers class.
    """
    directory = os.fspath(directory)
    library = library_of(cls)
    if library not in ("diffusers", "transformers"):
        raise LoadError(
            f"component '{component}': {cls.__name__} is neither a diffusers nor a "
            "transformers model; ondeck cannot build it from a folder",
            component=component,
        )
    checked = tensors is not None
    tensors = dict(tensors or {})
    file_keys = frozenset(tensors)
    config = os.fspath(config_path) if config_path else os.path.join(directory, "config.json")
    guard = _SizeGuard(tensors, component, config) if checked else None
    # Checked, everything is first made on meta, buffers included: nothing real before
    # the check.
    on_meta = checked
    module = None
    if on_meta:
        module = _guarded_build(cls, directory, dtype, library, component, guard, on_meta=True)
    if module is None:
        on_meta = False
        module = _guarded_build(cls, directory, dtype, library, component, guard, on_meta=False)
    skeleton = _describe(module, library, dtype, file_keys)
    if not checked:
        return skeleton
    try:
        match_tensors(skeleton, tensors, component, directory, config_path=config)
        _check_computed_buffers(skeleton, tensors, component, config)
    except LoadError:
        module = skeleton = None  # the error's traceback must not keep the module alive
        raise
    if on_meta and (skeleton.extra_buffers or _has_meta_tables(module)):
        del module, skeleton
        module = _guarded_build(cls, directory, dtype, library, component, guard, on_meta=False)
        skeleton = _describe(module, library, dtype, file_keys)
    return skeleton


def _guarded_build(
    cls: type,
    directory: str,
    dtype: torch.dtype,
    library: str,
    component: str | None,
    guard: _SizeGuard | None,
    *,
    on_meta: bool,
) -> torch.nn.Module | None:
    """One build; on the meta device, None when the class cannot be built there."""
    from accelerate import init_empty_weights

    build = _build_diffusers if library == "diffusers" else _build_transformers
    # On meta, torch's default device makes every tensor there, buffers and temporaries
    # included (thread-local); accelerate's hook still moves a parameter made on the host
    # (from numpy, say). Without meta, buffers are computed on the host for real.
    everything_on_meta = torch.device("meta") if on_meta else contextlib.nullcontext()
    try:
        with (
            _BUILD_LOCK,
            everything_on_meta,
            init_empty_weights(include_buffers=False),
            guard or contextlib.nullcontext(),
        ):
            return build(cls, directory, dtype)
    except Exception as error:
        if guard is not None and guard.tripped is not None:
            # Whatever the library made of the interruption, the guard's reason is the one.
            # Without the library's frames, which hold the half-built module.
            raise guard.tripped.with_traceback(None) from None
        if isinstance(error, LoadError):
            raise
        if on_meta:
            # A constructor that reads the values of tensors it makes (``.item()``) cannot
            # run on meta; the guarded build with real buffers still bounds it.
            return None
        raise SkeletonBuildError(
            f"component '{component}' from {directory}: building {cls.__name__} from its "
            f"config failed with {type(error).__name__}: {error}",
            component=component,
            path=directory,
        ) from error


class _SizeGuard:
    """Counts the parameters and buffers a constructor registers, and stops it once they
    clearly exceed what the weight files hold.

    torch's module registration hooks are process-wide, so the count keeps to the thread
    that builds; another thread making modules meanwhile is neither counted nor stopped.
    """

    def __init__(self, tensors: Mapping[str, TensorInfo], component: str | None, config: str):
        self.file_tensors = len(tensors)
        self.file_elements = sum(info.numel for info in tensors.values())
        self.max_tensors = 2 * self.file_tensors + _EXTRA_TENSORS
        self.max_elements = 2 * self.file_elements + _EXTRA_ELEMENTS
        self.component = component
        self.config = config
        self.files = _files_of(tensors)
        self.tripped: LoadError | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> _SizeGuard:
        from torch.nn.modules import module as nn_module

        self.thread = threading.get_ident()
        self.tensors = 0
        self.elements = 0
        self.tripped = None
        self._handles = [
            nn_module.register_module_parameter_registration_hook(self._count),
            nn_module.register_module_buffer_registration_hook(self._count),
        ]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _count(self, module: torch.nn.Module, name: str, tensor: Any) -> None:
        if tensor is None or threading.get_ident() != self.thread:
            return None
        self.tensors += 1
        self.elements += tensor.numel()
        if self.tripped is None and (
            self.tensors > self.max_tensors or self.elements > self.max_elements
        ):
            if self.tensors > self.max_tensors:
                made = f"more than {self.max_tensors} tensors, the weights hold {self.file_tensors}"
            else:
                made = (
                    f"more than {_count_text(self.max_elements)} elements, the weights hold "
                    f"{_count_text(self.file_elements)}"
                )
            self.tripped = LoadError(
                f"component '{self.component}': {self.config} and {self.files} disagree: "
                f"the config makes {made} (the weights are another model's, or a layer "
                "count, a width or a length in the config is too large)",
                component=self.component,
                path=self.config,
            )
        if self.tripped is not None:
            raise self.tripped
        return None


def _has_meta_tables(module: torch.nn.Module) -> bool:
    """Whether a constructor kept tensors as plain attributes (QwenImage's rope tables):
    no file holds them and ``to()`` does not see them, so they must be computed for real."""
    for submodule in module.modules():
        for value in vars(submodule).values():
            values = value if isinstance(value, (list, tuple)) else (value,)
            if any(isinstance(item, torch.Tensor) and item.is_meta for item in values):
                return True
    return False


def _check_computed_buffers(
    skeleton: Skeleton, tensors: Mapping[str, TensorInfo], component: str | None, config: str
) -> None:
    """Refuse tables computed in __init__ (no file holds them) that dwarf the weights."""
    file_bytes = sum(info.nbytes for info in tensors.values())
    limit = _COMPUTED_BYTES_FLOOR + file_bytes // _COMPUTED_BYTES_SHARE
    sizes = {}
    for names in skeleton.extra_buffers.values():
        buffer = get_tensor(skeleton.module, names[0])
        sizes[names[0]] = buffer.numel() * buffer.element_size()
    computed = sum(sizes.values())
    if computed > limit:
        largest = sorted(sizes, key=sizes.get, reverse=True)
        raise LoadError(
            f"component '{component}': {config} asks for {format_bytes(computed)} of tables "
            f"the model computes for itself ({some_names(largest, 3)}), against "
            f"{format_bytes(file_bytes)} of weights in {_files_of(tensors)}; a length in the "
            "config (a maximum sequence length?) is implausible",
            component=component,
            path=config,
        )


def match_tensors(
    skeleton: Skeleton,
    tensors: Mapping[str, TensorInfo],
    component: str | None,
    directory: str | os.PathLike | None = None,
    *,
    config_path: str | os.PathLike | None = None,
) -> list[tuple[Slot, TensorInfo]]:
    """Pair every slot with its file tensor; refuse missing, unexpected and misshapen ones.

    Checkpoint keys are taken under the names the model's library loads them as."""
    tensors = library_names(skeleton.module, dict(tensors), component)
    disagree = f" ({config_path} and the weights disagree)" if config_path else ""
    prefix = getattr(skeleton.module, "base_model_prefix", "") or ""
    sources: list[tuple[Slot, TensorInfo]] = []
    used: set[str] = set()
    missing: list[str] = []
    for slot in skeleton.slots:
        key = _find_key(slot.names, tensors, prefix)
        if key is None:
            missing.append(slot.names[0])
            continue
        info = tensors[key]
        used.add(key)
        if tuple(info.shape) != tuple(slot.shape):
            raise LoadError(
                f"component '{component}' from {info.path}: tensor '{key}' has shape "
                f"{list(info.shape)}, the model expects {list(slot.shape)}{disagree}",
                component=component,
                path=info.path,
            )
        sources.append((slot, info))
    if missing:
        files = ", ".join(sorted({str(info.path) for info in tensors.values()}))
        if not files:
            raise LoadError(
                f"component '{component}' from {directory}: no safetensors weights there "
                f"(expected diffusion_pytorch_model.safetensors, model.safetensors or a "
                f"*.safetensors.index.json); the model needs {len(missing)} tensor(s)",
                component=component,
                path=os.fspath(directory) if directory is not None else None,
            )
        raise LoadError(
            f"component '{component}' from {files}: {len(missing)} tensor(s) the model needs "
            f"are missing: {some_names(missing)}{disagree}",
            component=component,
        )
    extra_names = {name for names in skeleton.extra_buffers.values() for name in names}
    tied = {name for slot, _ in sources for name in slot.names}  # a tied weight's other names
    unexpected = [
        key
        for key in tensors
        if key not in used
        and key not in extra_names
        and key not in tied
        and not any(re.search(pattern, key) for pattern in skeleton.ignored_unexpected)
    ]
    if unexpected:
        info = tensors[unexpected[0]]
        raise LoadError(
            f"component '{component}' from {info.path}: {len(unexpected)} tensor(s) the model "
            f"does not have: {some_names(unexpected)}{disagree}",
            component=component,
            path=info.path,
        )
    return sources


def _find_key(names: list[str], tensors: Mapping[str, TensorInfo], prefix: str) -> str | None:
    for name in names:
        if name in tensors:
            return name
    if prefix:
        # transformers checkpoints may be saved with or without the base model's prefix.
        for name in names:
            for candidate in (f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
                if candidate in tensors:
                    return candidate
    return None


def _files_of(tensors: Mapping[str, TensorInfo]) -> str:
    files = sorted({str(info.path) for info in tensors.values() if info.path})
    if not files:
        return "the weight files"
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more shard(s)"


def _count_text(count: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def some_names(names: list[str], limit: int = 5, *, quoted: bool = True) -> str:
    """The first ``limit`` of ``names`` and how many more, for an error message."""
    shown = ", ".join(f"'{name}'" if quoted else name for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


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
    module: torch.nn.Module,
    library: str,
    dtype: torch.dtype,
    file_keys: frozenset[str],
    stored: Mapping[str, torch.dtype] | None = None,
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
    _apply_stored(slots, stored or {})
    ignored = tuple(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    return Skeleton(
        module, slots, extra_buffers, ignored, library, dtype, file_keys, dict(stored or {})
    )


def _apply_stored(slots: list[Slot], stored: Mapping[str, torch.dtype]) -> None:
    for slot in slots:
        found = next((stored[name] for name in slot.names if name in stored), None)
        if found is not None:
            slot.dtype = found


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


def get_tensor(module: torch.nn.Module, name: str):
    """The parameter or buffer ``name`` (dotted) of ``module``."""
    owner, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attribute)


def set_tensor(
    module: torch.nn.Module,
    name: str,
    value: torch.Tensor,
    *,
    parameter: bool,
    modules: dict[str, torch.nn.Module] | None = None,
) -> None:
    """Put ``value`` at ``name`` (dotted) as a parameter or a buffer, replacing what is
    there. ``modules`` (``module_paths(module)``) finds the owner without walking from
    the root: a caller setting every tensor of a large model passes it."""
    owner_name, _, attribute = name.rpartition(".")
    if modules is not None:
        owner = modules[owner_name]
    else:
        owner = module.get_submodule(owner_name) if owner_name else module
    if parameter:
        owner._parameters[attribute] = value
    else:
        owner._buffers[attribute] = value


def module_paths(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every submodule by each dotted path it is reached by (a module shared by two
    parents under both), the root under ``""``."""
    return dict(module.named_modules(remove_duplicate=False))
