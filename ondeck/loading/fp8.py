"""Weights stored in fp8 and computed in bfloat16: which tensors, the checks, the hooks.

A component loaded with a storage dtype keeps the tensors diffusers' layerwise casting
would cast (those of its Linear, Conv and Embedding layers outside the skip patterns; for
diffusers models also outside the modules the model keeps in float32) in that dtype from
the moment they are read: each chunk is cast as it arrives, so no wider copy of the
component ever exists. The layers are upcast for their forward by diffusers' own hook
(``diffusers.hooks.layerwise_casting``), so a diffusers model computes what diffusers'
``enable_layerwise_casting`` gives it, bit for bit. An Embedding looks its rows up in
the storage dtype and upcasts those alone: the same values, without an upcast copy of
the whole table.

A transformers model's ``_keep_in_fp32_modules`` (T5's ``wo``) are stored too unless the
compute dtype is float16 (transformers applies that rule for float16's range only; the
``_strict`` ones always stay): the module holding such a layer reads the layer's weight
dtype before calling it (T5 casts ``wo``'s input to it), so that module, not the layer,
is hooked, and the layer is upcast for the holder's whole forward.

A checkpoint already stored in float8 is kept so, with no upcast copy: its float8
dtype becomes the storage dtype unless the caller chose another.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import LoadError
from .options import StorageChoice
from .quantized import describe_method, package_installed, package_name, quantization_method
from .safetensors_format import TensorInfo
from .upcast import upcast

__all__ = [
    "FLOAT8_DTYPES",
    "check_quantization",
    "largest_upcast_bytes",
    "parse_storage_dtype",
    "resolve",
    "rounding_dtype",
    "storage_by_component",
    "stored_tensors",
    "tied_names",
    "upcast_for_compute",
]

FLOAT8_DTYPES: tuple[torch.dtype, ...] = tuple(
    dtype
    for dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if dtype is not None
)

# What a caller may write for a storage dtype; "fp8" is the e4m3 format fp8 checkpoints use.
_NAMES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}

_HOOK_NAME = "layerwise_casting"  # diffusers' name: its get_parameter_dtype looks for it
_HOLDER_HOOK_NAME = "ondeck_kept_layers_casting"
_ROWS_HOOK_NAME = "ondeck_embedding_rows"


def parse_storage_dtype(value: Any, component: str | None = None) -> torch.dtype | None:
    """A storage dtype from a torch dtype or a name ("fp8", "float8_e5m2"); None stays None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    where = f"component '{component}': " if component else ""
    if isinstance(value, str):
        name = _NAMES.get(value.strip().lower().removeprefix("torch."))
        dtype = getattr(torch, name, None) if name else None
        if dtype is not None:
            return dtype
        if name is not None:
            raise LoadError(
                f"{where}storage dtype {value!r}: torch {torch.__version__} has no {name}",
                component=component,
            )
    raise LoadError(
        f"{where}storage dtype {value!r} is not one ondeck stores weights in; use 'fp8' "
        "(float8_e4m3fn) or 'float8_e5m2'",
        component=component,
    )


def is_autoencoder(cls: type) -> bool:
    """A VAE: it stays in its own dtype when one storage dtype is given for a pipeline."""
    return ".autoencoders." in (cls.__module__ or "") or cls.__name__.startswith("Autoencoder")


def storage_by_component(
    storage_dtype: StorageChoice, classes: Mapping[str, type]
) -> dict[str, torch.dtype]:
    """The storage dtype of each model component named in ``classes``.

    ``storage_dtype`` is one dtype for the big components (every model but the VAEs,
    which decode in their own dtype), or a dict by component name; a name that is not a
    model component of the folder is refused.
    """
    if storage_dtype is None:
        return {}
    if isinstance(storage_dtype, Mapping):
        unknown = sorted(set(storage_dtype) - set(classes))
        if unknown:
            raise LoadError(
                f"storage_dtype names {', '.join(repr(n) for n in unknown)}, not a model "
                f"component here (they are {', '.join(classes) or 'none'})"
            )
        chosen = {name: parse_storage_dtype(value, name) for name, value in storage_dtype.items()}
        return {name: dtype for name, dtype in chosen.items() if dtype is not None}
    dtype = parse_storage_dtype(storage_dtype)
    return {name: dtype for name, cls in classes.items() if not is_autoencoder(cls)}


# -- before anything loads ----------------------------------------------------------------


def check_quantization(folder: Any, name: str) -> None:
    """Refuse a quantized component: ComponentLoader reads float weights; a quantized one
    loads through its library (``component_loader`` picks that loader)."""
    method = quantization_method(folder, name)
    if method is None:
        return  # not quantized, or a config the load reports as unreadable itself
    path = folder.config_path(name)
    package = package_name(method)
    installed = ""
    if package is not None:
        found = package_installed(method)
        installed = f"; its package '{package}' is {'installed' if found else 'not installed'}"
    raise LoadError(
        f"component '{name}': {path} asks for {describe_method(method)} quantization "
        f"(quantization_config){installed}; ComponentLoader reads float weights (optionally "
        "stored in fp8), and quantized ones load through their library: "
        "ondeck.loading.component_loader, which the pipelines use, picks that",
        component=name,
        path=str(path),
    )


def resolve(
    folder: Any, name: str, dtype: Any, storage_dtype: Any, device: torch.device
) -> tuple[torch.dtype, torch.dtype | None]:
    """The compute dtype and storage dtype (None: stored as computed) of one component.

    Checks, before anything loads, that the component is not quantized in a way ondeck
    cannot apply and that the storage dtype works on ``device``.
    """
    check_quantization(folder, name)
    storage = parse_storage_dtype(storage_dtype, name)
    saved_as = _file_float8(folder, name)
    compute = folder.resolve_dtype(name, dtype)
    if dtype is None and compute in FLOAT8_DTYPES:
        compute = _compute_dtype_beside(folder, name)
    if compute in FLOAT8_DTYPES:
        raise LoadError(
            f"component '{name}': {compute} is a storage dtype, not one to compute in; pass "
            f"dtype=torch.bfloat16 and storage_dtype={str(compute).removeprefix('torch.')!r}",
            component=name,
        )
    if storage is None:
        storage = saved_as  # a float8 checkpoint stays float8, with no upcast copy
    if storage is None or storage == compute:
        return compute, None
    if storage not in FLOAT8_DTYPES:
        raise LoadError(
            f"component '{name}': storage dtype {storage} is not one ondeck stores weights "
            "in; use 'fp8' (float8_e4m3fn) or 'float8_e5m2'",
            component=name,
        )
    if not compute.is_floating_point or compute.itemsize <= storage.itemsize:
        raise LoadError(
            f"component '{name}': fp8 storage needs a wider compute dtype than {compute}",
            component=name,
        )
    if device.type == "mps":
        raise LoadError(
            f"component '{name}': {str(storage).removeprefix('torch.')} storage cannot work "
            "on mps (Apple's GPUs have no float8 dtype); store weights as they compute there",
            component=name,
        )
    return compute, storage


def _file_float8(folder: Any, name: str) -> torch.dtype | None:
    """The float8 dtype holding most of the component's float8 bytes, if it has any."""
    try:
        tensors = folder.tensors(name)
    except LoadError:
        return None  # the load reports the folder's problem where it always did
    sizes: dict[torch.dtype, int] = {}
    for info in tensors.values():
        if info.dtype in FLOAT8_DTYPES:
            sizes[info.dtype] = sizes.get(info.dtype, 0) + info.nbytes
    return max(sizes, key=sizes.get) if sizes else None


def _compute_dtype_beside(folder: Any, name: str) -> torch.dtype:
    """For a float8 checkpoint: the dtype of its other floating tensors, else bfloat16."""
    sizes: dict[torch.dtype, int] = {}
    for info in folder.tensors(name).values():
        if info.dtype.is_floating_point and info.dtype not in FLOAT8_DTYPES:
            sizes[info.dtype] = sizes.get(info.dtype, 0) + info.nbytes
    return max(sizes, key=sizes.get) if sizes else torch.bfloat16


# -- which tensors are stored -------------------------------------------------------------


def stored_tensors(
    module: torch.nn.Module, library: str, storage: torch.dtype, compute: torch.dtype
) -> tuple[dict[str, torch.dtype], tuple[str, ...]]:
    """The tensors diffusers' layerwise casting stores in ``storage``, by name, and the
    layers it hooks; found by running diffusers' own choice on a copy of the (meta) module."""
    probe = copy.deepcopy(module)
    _apply_casting(probe, library, storage, compute)
    stored = {}
    for table in (probe.named_parameters, probe.named_buffers):
        for name, tensor in table(remove_duplicate=False):
            if tensor.dtype == storage:
                stored[name] = storage
    layers = tuple(
        name for name, layer in probe.named_modules() if _casting_hook(layer) is not None
    )
    return stored, layers


def _apply_casting(
    module: torch.nn.Module, library: str, storage: torch.dtype, compute: torch.dtype
) -> None:
    """diffusers' layerwise casting, chosen as diffusers chooses it for its own models;
    for other models, also the layers they keep in float32 (``_hook_kept_layers``)."""
    if library == "diffusers" and hasattr(module, "enable_layerwise_casting"):
        module.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
        return
    from diffusers.hooks.layerwise_casting import (
        DEFAULT_SKIP_MODULES_PATTERN,
        apply_layerwise_casting,
    )

    apply_layerwise_casting(
        module,
        storage,
        compute,
        skip_modules_pattern=_skip_patterns(module, DEFAULT_SKIP_MODULES_PATTERN),
    )
    _hook_kept_layers(module, storage, compute, stores=True)


def _skip_patterns(module: torch.nn.Module, defaults: Iterable[str]) -> tuple[str, ...]:
    """diffusers' defaults plus the modules the model keeps in float32, as diffusers' own
    ``enable_layerwise_casting`` adds them: those layers are not hooked themselves
    (``_hook_kept_layers`` hooks the modules holding them)."""
    patterns = list(defaults)
    patterns.extend(_kept_patterns(module))
    return tuple(dict.fromkeys(patterns))


def _kept_patterns(module: torch.nn.Module, *, strict_only: bool = False) -> list[str]:
    patterns: list[str] = []
    attributes = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
    for attribute in attributes[1:] if strict_only else attributes:
        kept = getattr(module, attribute, None) or ()
        patterns.extend([kept] if isinstance(kept, str) else kept)
    return patterns


def _cast_layers(
    module: torch.nn.Module, skip: tuple[str, ...], prefix: str = ""
) -> Iterable[tuple[str, torch.nn.Module]]:
    """The layers diffusers' ``apply_layerwise_casting`` hooks with these skip patterns,
    found by the same walk (a match on a module's name skips everything under it)."""
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    if any(re.search(pattern, prefix) for pattern in skip):
        return
    if isinstance(module, _GO_LC_SUPPORTED_PYTORCH_LAYERS):
        yield prefix, module
        return
    for name, child in module.named_children():
        yield from _cast_layers(child, skip, f"{prefix}.{name}" if prefix else name)


def kept_layers(module: torch.nn.Module, compute: torch.dtype) -> dict[str, tuple[str, ...]]:
    """``{holder: (its child layers stored though the model keeps them in float32)}``.

    The layers diffusers' defaults would cast but the model's ``_keep_in_fp32_modules``
    name. transformers applies that rule to float16 only (its range, not storage): with
    float16 compute, and for ``_keep_in_fp32_modules_strict``, they stay unstored."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    if compute == torch.float16 or not _kept_patterns(module):
        return {}
    always = (*DEFAULT_SKIP_MODULES_PATTERN, *_kept_patterns(module, strict_only=True))
    hooked = {name for name, _ in _cast_layers(module, _skip_patterns(module, always))}
    holders: dict[str, list[str]] = {}
    for name, _ in _cast_layers(module, always):
        if name in hooked or not name:
            continue
        holder, _, child = name.rpartition(".")
        holders.setdefault(holder, []).append(child)
    return {holder: tuple(children) for holder, children in holders.items()}


def _hook_kept_layers(
    module: torch.nn.Module,
    storage: torch.dtype,
    compute: torch.dtype,
    *,
    stores: bool,
    kept: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Hook the holders of ``kept_layers`` (``stores``: see ``KeptLayersCastingHook``):
    T5's ``DenseReluDense`` casts its hidden states to ``self.wo.weight.dtype`` before
    calling ``wo``, so ``wo`` must show the compute dtype for the holder's whole forward,
    not only its own."""
    from diffusers.hooks import HookRegistry

    if kept is None:
        kept = kept_layers(module, compute)
    for holder, children in kept.items():
        target = module.get_submodule(holder) if holder else module
        registry = HookRegistry.check_if_exists_or_initialize(target)
        hook = _holder_hook_class()(storage, compute, children, stores=stores)
        registry.register_hook(hook, _HOLDER_HOOK_NAME)


def rounding_dtype(
    file_dtype: torch.dtype, stored_dtype: torch.dtype, compute: torch.dtype
) -> torch.dtype | None:
    """The dtype a file's tensor is rounded through on its way to storage: the compute
    dtype, when the file holds another floating dtype (a float32 file stored in fp8 holds
    the float8 of its bfloat16 model, as diffusers' casting of that model does)."""
    if stored_dtype not in FLOAT8_DTYPES or not file_dtype.is_floating_point:
        return None
    if file_dtype in (compute, stored_dtype) or file_dtype in FLOAT8_DTYPES:
        return None
    return compute


# -- the host cache -----------------------------------------------------------------------


def as_held(info: TensorInfo, destination: torch.Tensor) -> TensorInfo:
    """``info`` as the loaded module holds the tensor: in the destination's dtype."""
    if destination.dtype == info.dtype:
        return info
    nbytes = destination.numel() * destination.element_size()
    return dataclasses.replace(info, dtype=destination.dtype, end=info.start + nbytes)


def keep_in_cache(
    cache: Any, key: Any, jobs: list, *, replacing: Any = None, kept: dict | None = None
) -> None:
    """Copy freshly loaded tensors, as stored, into the host cache where it has room: a
    reload is then one copy of the stored bytes (fp8: half of bf16's). ``replacing`` and
    ``kept``: as ``HostCache.commit`` takes them."""
    if not jobs:
        if kept:
            cache.commit(key, {}, replacing=replacing, kept=kept)
        return
    infos = [as_held(job.info, job.destination) for job in jobs]
    buffers = cache.reserve(key, infos, keeping=replacing)
    if buffers is None:
        return
    devices = {job.destination.device for job in jobs if job.destination.device.type == "cuda"}
    # On a side stream: the copies must not queue behind (or hold up) the compute.
    streams = {device: torch.cuda.Stream(device) for device in devices}
    for device, stream in streams.items():
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        for job, info in zip(jobs, infos, strict=True):
            if not info.nbytes:
                continue
            held = buffers[info.name].view(info.dtype).view(job.destination.shape)
            stream = streams.get(job.destination.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                held.copy_(job.destination, non_blocking=stream is not None)
    except BaseException:
        for stream in streams.values():
            stream.synchronize()
        cache.discard(key)
        raise
    for stream in streams.values():
        stream.synchronize()
    cache.commit(key, buffers, replacing=replacing, kept=kept)


# -- after the load -----------------------------------------------------------------------


def upcast_for_compute(
    module: torch.nn.Module,
    library: str,
    storage: torch.dtype,
    compute: torch.dtype,
    layers: Iterable[str],
    *,
    kept: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Hook the stored layers so each computes in ``compute`` and stays in ``storage``:
    a variant of diffusers' layerwise casting hook that puts upcast copies beside the
    stored tensors for the forward (``ondeck.loading.upcast``) and puts the stored ones
    back after. Diffusers' own hook casts a layer's tensors in place and back down after
    its forward, twice the bytes through the device's memory; it would also leave a
    streamed block's tensors private copies of its device slots. Either way the layers
    compute on the same values.
    ``kept``: the module's ``kept_layers``, when the caller knows them already (a loader
    finds them once, on its skeleton: the walk costs a T5 load tens of milliseconds).
    """
    from diffusers.hooks import HookRegistry

    layers = tuple(layers)
    for name in layers:
        layer = module.get_submodule(name)
        registry = HookRegistry.check_if_exists_or_initialize(layer)
        registry.register_hook(_swapping_hook(storage, compute), _HOOK_NAME)
    if not (library == "diffusers" and hasattr(module, "enable_layerwise_casting")):
        _hook_kept_layers(module, storage, compute, stores=False, kept=kept)
    for name in layers:
        layer = module.get_submodule(name)
        _answer_adapter_dtype(layer, compute)
        if _gathers_rows(layer):
            registry = HookRegistry.check_if_exists_or_initialize(layer)
            registry.register_hook(_row_gathering_hook_class()(storage, compute), _ROWS_HOOK_NAME)
    if library == "transformers":
        _answer_compute_dtype(module)


def as_saved(
    module: torch.nn.Module,
    stored: Mapping[str, torch.dtype],
    layers: Iterable[str],
    sources: Iterable[tuple[Any, TensorInfo]],
) -> tuple[dict[str, torch.dtype], tuple[str, ...]]:
    """Of the tensors layerwise casting would store (and the layers it hooks), those the
    checkpoint itself holds in float8: a float8 file keeps its float8 tensors as they are
    and its wider ones as wide, rather than rounding them to float8 as well."""
    saved = {name for slot, info in sources if info.dtype in FLOAT8_DTYPES for name in slot.names}
    kept = {name: dtype for name, dtype in stored.items() if name in saved}
    hooked = tuple(
        layer
        for layer in layers
        if any(
            f"{layer}.{name}" in kept
            for name, _ in module.get_submodule(layer).named_parameters(recurse=False)
        )
    )
    return kept, hooked


def apply_weight_scales(
    module: torch.nn.Module,
    scales: Mapping[str, torch.Tensor],
    storage: torch.dtype | None,
    compute: torch.dtype,
    device: torch.device,
) -> None:
    """fp8_scaled weights: each scaled tensor computes as ``weight.to(compute) *
    scale.to(compute)``, the dequantization that format defines (a float8 weight, and a
    float32 scale beside it, one per weight), and stays as stored. The layer's casting hook,
    if it has one, is replaced by one that also scales; its other stored tensors are upcast
    as before. ``scales``: ``{tensor name: scale}``, a tensor held under several names
    under each (``tied_names``); their layers must have no casting hook yet."""
    from diffusers.hooks import HookRegistry

    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for name, scale in scales.items():
        layer, _, attribute = name.rpartition(".")
        by_layer.setdefault(layer, {})[attribute] = scale.to(device=device, dtype=compute)
    for name, layer_scales in by_layer.items():
        layer = module.get_submodule(name)
        _answer_adapter_dtype(layer, compute)
        registry = HookRegistry.check_if_exists_or_initialize(layer)
        hook = _scaling_hook_class()(storage or compute, compute, layer_scales)
        registry.register_hook(hook, _HOOK_NAME)


def tied_names(module: torch.nn.Module, scales: Mapping[str, Any]) -> dict[str, Any]:
    """Other names of the scaled tensors (a T5's ``shared.weight`` is its encoder's
    ``embed_tokens.weight`` too), each with its tensor's scale: a layer computing through
    one of them computes scaled as well."""
    if not scales:
        return {}  # no walk of the module's tensors at every load of an unscaled one
    by_tensor = {}
    for name, scale in scales.items():
        layer, _, attribute = name.rpartition(".")
        tensor = getattr(module.get_submodule(layer), attribute, None)
        if tensor is not None:
            by_tensor[id(tensor)] = scale
    tied = {}
    for prefix, layer in module.named_modules(remove_duplicate=False):
        for table in (layer._parameters, layer._buffers):
            for attribute, tensor in table.items():
                name = f"{prefix}.{attribute}" if prefix else attribute
                if tensor is not None and id(tensor) in by_tensor and name not in scales:
                    tied[name] = by_tensor[id(tensor)]
    return tied


def _answer_adapter_dtype(layer: torch.nn.Module, compute: torch.dtype) -> None:
    """PEFT makes a LoRA beside a layer in the dtype of its weight, unless the layer says
    its ``compute_dtype`` (as bitsandbytes' layers do): a stored layer says it, so a
    LoRA on it is made and computed in the compute dtype, not rounded to float8."""
    layer.compute_dtype = compute


@functools.cache
def _scaling_hook_class() -> type:
    base = _swapping_hook_class()

    class ScalingCastingHook(base):
        """The swapping hook, with the scaled tensors multiplied by their scales."""

        def __init__(self, storage, compute, scales: dict[str, torch.Tensor]):
            super().__init__(storage, compute, non_blocking=False)
            self.scales = scales

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            stored: list = []
            try:
                for name, scale in self.scales.items():
                    tensor = module._parameters.get(name)
                    table = module._parameters
                    if tensor is None:
                        tensor, table = module._buffers[name], module._buffers
                    stored.append((table, name, tensor))
                    table[name] = upcast(tensor, self.compute_dtype) * scale
                others = [
                    (table, name, tensor)
                    for table in (module._parameters, module._buffers)
                    for name, tensor in table.items()
                    if name not in self.scales
                    and tensor is not None
                    and tensor.dtype == self.storage_dtype
                    and self.storage_dtype != self.compute_dtype
                ]
                for table, name, tensor in others:
                    stored.append((table, name, tensor))
                    table[name] = upcast(tensor, self.compute_dtype)
                return self.fn_ref.original_forward(*args, **kwargs)
            finally:
                for table, name, tensor in reversed(stored):
                    table[name] = tensor

    return ScalingCastingHook


def largest_upcast_bytes(
    skeleton: Any,
    layers: Iterable[str],
    kept: Mapping[str, tuple[str, ...]],
    compute: torch.dtype,
) -> int:
    """The most bytes of compute-dtype copies one hook makes for a forward: a hooked
    layer's stored tensors, or a holder's stored children's (``kept``). An Embedding that
    gathers its rows makes no copy of its table. ``skeleton``: the stored template."""
    module, stored = skeleton.module, skeleton.stored

    def copies(names: Iterable[str]) -> int:
        numel = 0
        for name in names:
            layer = module.get_submodule(name)
            if _gathers_rows(layer):
                continue
            prefix = f"{name}." if name else ""
            for table in (layer.named_parameters, layer.named_buffers):
                for own, tensor in table(recurse=False):
                    if prefix + own in stored:
                        numel += tensor.numel()
        return numel

    groups = [[name] for name in layers]
    groups += [
        [f"{holder}.{child}" if holder else child for child in children]
        for holder, children in kept.items()
    ]
    return max((copies(group) for group in groups), default=0) * compute.itemsize


def _gathers_rows(layer: torch.nn.Module) -> bool:
    """An Embedding whose forward is torch's own lookup: its rows can be gathered before
    the upcast (a subclass's forward may do more with its table)."""
    return (
        isinstance(layer, torch.nn.Embedding) and type(layer).forward is torch.nn.Embedding.forward
    )


@functools.cache
def _row_gathering_hook_class() -> type:
    from diffusers.hooks import ModelHook

    class RowGatheringHook(ModelHook):
        """An Embedding kept in the storage dtype looks its rows up there and upcasts
        only those. A cast is elementwise, so the rows are the ones the casting hook
        under this one computes, bit for bit, without the upcast copy of the whole
        table it makes (a T5 encoder's: 2 GiB in bfloat16, twice per prompt).

        Registered over the casting hook, it calls through to it when the lookup is
        not a plain one (``max_norm`` rewrites the table) or the table is not stored."""

        _is_stateful = False

        def __init__(self, storage: torch.dtype, compute: torch.dtype):
            super().__init__()
            self.storage_dtype, self.compute_dtype = storage, compute

        def new_forward(self, module: torch.nn.Module, ids: torch.Tensor, *args: Any, **kwargs):
            table = module.weight
            if args or kwargs or module.max_norm is not None or table.dtype != self.storage_dtype:
                return self.fn_ref.original_forward(ids, *args, **kwargs)
            if ids.dtype not in (torch.int32, torch.int64):
                return self.fn_ref.original_forward(ids)  # torch's own error for bad ids
            # index_select on the bytes: every dtype has it, float8 not on every torch.
            rows = table.detach().view(torch.uint8).index_select(0, ids.reshape(-1))
            rows = rows.view(self.storage_dtype).to(self.compute_dtype)
            return rows.view(*ids.shape, table.shape[-1])

    return RowGatheringHook


def _casting_hook(module: torch.nn.Module) -> Any:
    registry = getattr(module, "_diffusers_hook", None)
    return registry.get_hook(_HOOK_NAME) if registry is not None else None


def _swapping_hook(storage: torch.dtype, compute: torch.dtype) -> Any:
    return _swapping_hook_class()(storage, compute, non_blocking=False)


@functools.cache
def _swapping_hook_class() -> type:
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    class SwappingCastingHook(LayerwiseCastingHook):
        """diffusers' layerwise casting hook, without casting the stored tensors in place:
        a forward sees upcast copies, the module keeps the stored tensors."""

        def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
            return module  # loaded in the storage dtype already

        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any):
            return args, kwargs

        def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
            return output

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            stored: list = []
            try:
                _swap_in([module], self.storage_dtype, self.compute_dtype, stored)
                return self.fn_ref.original_forward(*args, **kwargs)
            finally:
                for table, name, tensor in stored:
                    table[name] = tensor

    return SwappingCastingHook


def _swap_in(
    layers: Iterable[torch.nn.Module], storage: torch.dtype, compute: torch.dtype, stored: list
) -> None:
    """Put compute-dtype copies of the layers' stored tensors in their place, noting in
    ``stored`` what to put back (also when a copy fails halfway)."""
    for layer in layers:
        for table in (layer._parameters, layer._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.dtype == storage:
                    stored.append((table, name, tensor))
                    table[name] = upcast(tensor, compute)


@functools.cache
def _holder_hook_class() -> type:
    from diffusers.hooks import ModelHook

    class KeptLayersCastingHook(ModelHook):
        """Upcasts stored child layers for the holder's whole forward, as copies beside
        the stored tensors (see ``upcast_for_compute``). ``stores``: registering the hook
        casts the children to the storage dtype itself, as diffusers' own casting does
        (``stored_tensors`` runs that choice on a probe to find what is stored)."""

        _is_stateful = False

        def __init__(self, storage, compute, children: tuple[str, ...], *, stores: bool):
            super().__init__()
            self.storage_dtype, self.compute_dtype = storage, compute
            self.children, self.stores = children, stores

        def _layers(self, module: torch.nn.Module) -> list[torch.nn.Module]:
            return [module.get_submodule(child) for child in self.children]

        def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
            if self.stores:
                for layer in self._layers(module):
                    layer.to(dtype=self.storage_dtype)
            return module

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            layers = self._layers(module)
            stored: list = []
            try:
                _swap_in(layers, self.storage_dtype, self.compute_dtype, stored)
                return self.fn_ref.original_forward(*args, **kwargs)
            finally:
                for table, name, tensor in stored:
                    table[name] = tensor

    return KeptLayersCastingHook


_COMPUTE_DTYPE_CLASSES: dict[type, type] = {}


def _answer_compute_dtype(module: torch.nn.Module) -> None:
    """transformers' ``model.dtype`` is its first floating parameter's dtype, fp8 here;
    pipelines cast their embeddings to it. Answer the compute dtype instead, as diffusers'
    models do for their layerwise casting: the class is swapped for a subclass that
    differs in nothing else (same name and module)."""
    cls = type(module)
    if getattr(cls, "_ondeck_answers_compute_dtype", False):
        return
    subclass = _COMPUTE_DTYPE_CLASSES.get(cls)
    if subclass is None:

        def dtype(self: torch.nn.Module) -> torch.dtype:
            for layer in self.modules():
                hook = _casting_hook(layer)
                if hook is not None:
                    return hook.compute_dtype
            return super(subclass, self).dtype

        subclass = type(
            cls.__name__,
            (cls,),
            {
                "dtype": property(dtype),
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
                "_ondeck_answers_compute_dtype": True,
            },
        )
        _COMPUTE_DTYPE_CLASSES[cls] = subclass
    module.__class__ = subclass


def describe(storage: Mapping[str, torch.dtype]) -> str:
    """``transformer, text_encoder in float8_e4m3fn`` for messages and plans."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, dtype in storage.items():
        by_dtype.setdefault(dtype, []).append(name)
    return "; ".join(
        f"{', '.join(names)} in {str(dtype).removeprefix('torch.')}"
        for dtype, names in by_dtype.items()
    )
