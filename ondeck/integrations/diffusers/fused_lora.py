"""A fused LoRA re-applied from its low-rank factors at each load.

A component's recorded calls "load these adapters, (set their weights), fuse" run for
real, through diffusers and peft, the first time they are replayed. What that replay
added to each layer's weight is then kept as the layer's LoRA factors and scaling, and
every later load of the component adds those deltas to its fresh weights with peft's own
delta computation, without building peft's layers again (the injection is most of the
replay's time). The module that comes out holds plain ``nn.Linear`` layers whose weights
are bit for bit the fused ones; a merged peft layer's forward only calls its base layer,
so the outputs are the same too.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ...loading.blocks import block_index

__all__ = [
    "ADAPTER_METHODS",
    "FusedLora",
    "FusedLoraRecipe",
    "adapter_bytes",
    "asked_by_lora_scaling",
    "budget_overrun",
    "capture_fused_lora",
    "fused_span",
    "is_adapter_call",
    "mark_recorded",
    "recorded_method",
    "snapshot_tensors",
]

# Calls that load adapters into a diffusers model: its own, and the pipeline class's
# ``load_lora_into_<component>`` (which calls it).
_LOADS = frozenset({"load_lora_adapter"})
_LOAD_PREFIX = "load_lora_into_"
# Calls that read or change a model's adapters (diffusers' PeftAdapterMixin; transformers'
# load_adapter, which diffusers calls to put a LoRA on a text encoder). A recipe covers
# loads, set_adapters, one fuse_lora and an unload_lora right after it.
ADAPTER_METHODS = frozenset(
    {
        "load_lora_adapter",
        "load_adapter",
        "add_adapter",
        "set_adapter",
        "set_adapters",
        "enable_adapters",
        "disable_adapters",
        "delete_adapters",
        "fuse_lora",
        "unfuse_lora",
        "unload_lora",
        "enable_lora",
        "disable_lora",
        "enable_lora_hotswap",
    }
)


def mark_recorded(fn: Callable[..., Any], method: str, args: tuple, kwargs: dict) -> None:
    """Note on a transform which call on the component it replays."""
    fn.recorded_call = (method, args, kwargs)


def recorded_method(fn: Callable[..., Any]) -> str | None:
    """The method a transform replays (see :func:`mark_recorded`), None for any other."""
    call = getattr(fn, "recorded_call", None)
    return call[0] if call is not None else None


def _is_adapter_method(method: str) -> bool:
    return method in ADAPTER_METHODS or method.startswith(_LOAD_PREFIX)


def _is_load(method: str | None) -> bool:
    return method is not None and (method in _LOADS or method.startswith(_LOAD_PREFIX))


def is_adapter_call(fn: Callable[..., Any]) -> bool:
    """Whether a transform may read or change the component's adapters: a recorded
    adapter call, or any transform ondeck does not know (it could inspect peft's
    layers). Recorded calls of other kinds and hooks-only transforms cannot."""
    method = recorded_method(fn)
    if method is None:
        return getattr(fn, "reads_weights", True)
    return _is_adapter_method(method)


def _safe_fusing(fn: Callable[..., Any]) -> bool | None:
    """Whether a recorded ``fuse_lora`` asked for a safe merge; None when its arguments
    do not bind to diffusers' signature."""
    from diffusers.loaders.peft import PeftAdapterMixin

    _, args, kwargs = fn.recorded_call
    try:
        bound = inspect.signature(PeftAdapterMixin.fuse_lora).bind(None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bool(bound.arguments["safe_fusing"])


def fused_span(transforms: Sequence[Callable[..., Any]]) -> tuple[int, int] | None:
    """``(start, stop)`` of the transforms a recipe can stand in for: adapter loads and
    ``set_adapters`` calls, started by a load and ended by the one ``fuse_lora`` (not a
    safe one), or by an ``unload_lora`` right after it (diffusers' "fuse, then unload":
    the fused weights stay, peft's layers go). None when the adapter calls are anything
    else: another fuse, an unfuse, a deletion, an adapter call outside the span, or a
    transform after it that might read the adapters."""
    methods = [recorded_method(fn) for fn in transforms]
    fuses = [index for index, method in enumerate(methods) if method == "fuse_lora"]
    if len(fuses) != 1:
        return None
    fuse = fuses[0]
    stop = fuse + 1
    if stop < len(methods) and methods[stop] == "unload_lora":
        stop += 1
    start = fuse
    while start > 0 and (methods[start - 1] == "set_adapters" or _is_load(methods[start - 1])):
        start -= 1
    if not _is_load(methods[start]):
        return None
    for index, fn in enumerate(transforms):
        if start <= index < stop:
            continue
        method = methods[index]
        if (method is not None and _is_adapter_method(method)) or (
            index >= stop and is_adapter_call(fn)
        ):
            return None
    if _safe_fusing(transforms[fuse]) is not False:
        return None
    return start, stop


@dataclass(frozen=True)
class _Adapter:
    name: str
    down: torch.Tensor  # lora_A's weight: rank x in_features
    up: torch.Tensor  # lora_B's weight: out_features x rank
    scaling: float


@dataclass(frozen=True)
class _Layer:
    path: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    fan_in_fan_out: bool
    adapters: tuple[_Adapter, ...]


def _delta_weight(layer: _Layer, adapter: _Adapter, device: torch.device) -> torch.Tensor:
    """The delta peft's merge adds for ``adapter``: peft's own ``get_delta_weight``,
    called on a stand-in holding only what it reads (the factors on the weight's device,
    the scaling, the layout), so the same operations run in the same dtypes."""
    from peft.tuners.lora.layer import Linear

    # Pinned factors (for a device's weights) cross without holding up the host.
    down = adapter.down.to(device, non_blocking=True)
    up = adapter.up.to(device, non_blocking=True)
    stand_in = SimpleNamespace(
        lora_A={adapter.name: SimpleNamespace(weight=down)},
        lora_B={adapter.name: SimpleNamespace(weight=up)},
        scaling={adapter.name: adapter.scaling},
        fan_in_fan_out=layer.fan_in_fan_out,
    )
    with torch.no_grad():
        return Linear.get_delta_weight(stand_in, adapter.name)


class FusedLoraRecipe:
    """What a fused LoRA added to each layer of a component, kept as the LoRA's factors.

    Small: per adapted layer and adapter, rank x (in_features + out_features) numbers in
    the LoRA's dtype, on the host (the LoRA file's size, about; a rank-32 LoRA on a 14B
    Wan transformer's 320 attention projections is about 200 MB in bfloat16, against
    28 GB of weights), never a full-size delta.
    """

    def __init__(self, layers: Sequence[_Layer]):
        self.layers = tuple(layers)

    @property
    def nbytes(self) -> int:
        return sum(
            tensor.nbytes
            for layer in self.layers
            for adapter in layer.adapters
            for tensor in (adapter.down, adapter.up)
        )

    def fits(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` has each layer, a plain ``nn.Linear`` of the same shape,
        dtype and device as when the recipe was taken."""
        for layer in self.layers:
            try:
                target = module.get_submodule(layer.path)
            except AttributeError:
                return False
            if type(target) is not torch.nn.Linear:
                return False
            weight = target.weight
            if (weight.shape, weight.dtype, weight.device) != (
                layer.shape,
                layer.dtype,
                layer.device,
            ):
                return False
        return True

    def apply(self, module: torch.nn.Module, filling: Any = None) -> None:
        """Add each layer's deltas to its weight, in peft's merge order, one layer's delta
        in memory at a time. With the ``filling`` of a pipelined load still bringing the
        module's blocks in, a block's layers get theirs once its weights are in place
        (``Filling.when_in_place``), so the compute need not wait for the whole module."""
        path = getattr(filling, "blocks_path", None)
        if filling is not None and path is None:
            filling.wait()  # no blocks to wait for one by one
        by_block: dict[int | None, list[_Layer]] = {}
        for layer in self.layers:
            block = block_index([layer.path], path) if path is not None else None
            by_block.setdefault(block, []).append(layer)
        for block, layers in by_block.items():
            if block is None:
                _add_deltas(module, layers)
            else:
                filling.when_in_place(block, functools.partial(_add_deltas, module, layers))


def _add_deltas(module: torch.nn.Module, layers: Sequence[_Layer]) -> None:
    """Add ``layers``' deltas; in the factors' dtypes whatever autocast the forward that
    triggers it (a block's pre-hook) runs under, as a merge outside it computes them."""
    for layer in layers:
        weight = module.get_submodule(layer.path).weight
        with torch.autocast(weight.device.type, enabled=False):
            for adapter in layer.adapters:
                delta = _delta_weight(layer, adapter, weight.device)
                weight.data += delta  # as peft's merge adds it
                del delta


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def snapshot_tensors(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each parameter and buffer with its version, to tell afterwards what changed."""
    return {name: (tensor, tensor._version) for name, tensor in _tensors(module).items()}


def _base_names(module: torch.nn.Module, adapted: set[str]) -> dict[str, torch.Tensor]:
    """The module's tensors under the names they had before peft wrapped the ``adapted``
    layers (``x.base_layer.weight`` is ``x.weight``; the adapters' own are left out)."""
    tensors = {}
    for name, tensor in _tensors(module).items():
        path, _, rest = name.rpartition(".")
        owner = path
        while owner and owner not in adapted:
            owner = owner.rpartition(".")[0]
        if owner:
            inner = name[len(owner) + 1 :]
            if not inner.startswith("base_layer."):
                continue
            name = f"{owner}.{inner.removeprefix('base_layer.')}"
        tensors[name] = tensor
    return tensors


def _adapted_layer(path: str, layer: Any) -> _Layer | None:
    """A merged peft LoRA layer as factors, or None unless it is plain LoRA on an
    ``nn.Linear`` with every adapter merged (no DoRA or other variant, no LoRA bias)."""
    from peft.tuners.lora.layer import Linear

    base = layer.get_base_layer() if isinstance(layer, Linear) else None
    if type(layer) is not Linear or type(base) is not torch.nn.Linear:
        return None
    merged = list(layer.merged_adapters)
    if (
        layer.disable_adapters
        or layer.lora_variant
        or set(merged) != set(layer.lora_A.keys())
        or len(set(merged)) != len(merged)
        or any(layer.lora_bias.get(name) for name in merged)
        or layer.lora_embedding_A
    ):
        return None
    weight = base.weight

    def kept(factor: torch.Tensor) -> torch.Tensor:
        host = factor.detach().to("cpu", copy=True)
        return host.pin_memory() if weight.device.type == "cuda" else host

    adapters = tuple(
        _Adapter(
            name,
            kept(layer.lora_A[name].weight),
            kept(layer.lora_B[name].weight),
            layer.scaling[name],
        )
        for name in merged
    )
    return _Layer(path, weight.shape, weight.dtype, weight.device, layer.fan_in_fan_out, adapters)


def capture_fused_lora(
    module: torch.nn.Module, before: dict[str, tuple[torch.Tensor, int]]
) -> FusedLoraRecipe | None:
    """The recipe of what a full replay of a fused LoRA did to ``module``, or None when
    the replay did anything a recipe cannot repeat: a layer that is not plain merged
    LoRA on ``nn.Linear``, or any other tensor replaced or changed (``before``: its
    :func:`snapshot_tensors` taken before the replay)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = []
    for path, layer in module.named_modules():
        if isinstance(layer, BaseTunerLayer):
            adapted = _adapted_layer(path, layer)
            if adapted is None:
                return None
            layers.append(adapted)
    if not layers:
        return None
    merged = {f"{layer.path}.weight" for layer in layers}
    after = _base_names(module, {layer.path for layer in layers})
    if after.keys() != before.keys():
        return None
    for name, (tensor, version) in before.items():
        if after[name] is not tensor or (name not in merged and tensor._version != version):
            return None
    first, peft_layer = layers[0], module.get_submodule(layers[0].path)
    try:
        # The stand-in must compute what the layer itself computes, with this peft.
        same = torch.equal(
            _delta_weight(first, first.adapters[0], first.device),
            peft_layer.get_delta_weight(first.adapters[0].name).detach(),
        )
    except Exception:
        return None
    return FusedLoraRecipe(layers) if same else None


class _Step:
    """The transform a load runs in place of a fused span: the recipe when one fits the
    fresh module, else the span's own calls (and a recipe taken from what they did)."""

    reads_weights = True

    def __init__(self, owner: FusedLora, span: Sequence[Callable[[Any], Any]]):
        self.owner = owner
        self.span = tuple(span)

    def __call__(self, module: Any) -> Any:
        return self.while_filling(module, None)

    def while_filling(self, module: Any, filling: Any) -> Any:
        """The step on a module whose pipelined load (``filling``) may still be bringing
        its blocks in: from the recipe, each block's deltas go in as its weights land; a
        full replay waits for every weight first."""
        owner = self.owner
        recipe = owner.recipe
        if recipe is not None and not owner.full_next and recipe.fits(module):
            recipe.apply(module, filling)
            # Without peft's layers, as the full replay leaves it when the span unloads
            # them: only a module the span would have given adapters needs replaying.
            unloads = recorded_method(self.span[-1]) == "unload_lora"
            owner.built = None if unloads else weakref.ref(module)
            return module
        if filling is not None:
            filling.wait()
        owner.full_next = False
        owner.built = None
        before = snapshot_tensors(module)
        fuse = next(i for i, fn in enumerate(self.span) if recorded_method(fn) == "fuse_lora")
        for fn in self.span[: fuse + 1]:
            module = fn(module)
        owner.recipe = capture_fused_lora(module, before)
        for fn in self.span[fuse + 1 :]:  # unload_lora: peft's layers go, fused weights stay
            module = fn(module)
        return module

    def __repr__(self) -> str:
        return f"fused LoRA ({len(self.span)} recorded calls)"


class FusedLora:
    """One component's fused-LoRA recipe and the recorded calls it stands in for.

    The recipe is dropped as soon as the recorded calls stop being the ones it was taken
    from (``keep_only_for``) and when the pipeline closes (``forget``).
    """

    def __init__(self) -> None:
        self.recipe: FusedLoraRecipe | None = None
        self.span: tuple[weakref.ref, ...] = ()
        self.built: weakref.ref | None = None  # the loaded module the recipe made
        self.full_next = False

    def transforms_for_load(self, transforms: list[Callable[[Any], Any]]) -> list:
        """``transforms`` with a fused span replaced by one step (see :class:`_Step`)."""
        span = fused_span(transforms)
        if span is None:
            self.forget()
            return transforms
        start, stop = span
        if not self._is_span(transforms[start:stop]):
            self.forget()
            self.span = tuple(weakref.ref(fn) for fn in transforms[start:stop])
        return [*transforms[:start], _Step(self, transforms[start:stop]), *transforms[stop:]]

    def keep_only_for(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        """Drop the recipe unless ``transforms`` still hold the span it was taken from."""
        span = fused_span(transforms)
        if span is None or not self._is_span(transforms[span[0] : span[1]]):
            self.forget()

    def _is_span(self, fns: Sequence[Callable[[Any], Any]]) -> bool:
        return len(fns) == len(self.span) and all(
            ref() is fn for ref, fn in zip(self.span, fns, strict=True)
        )

    def built_fast(self, module: Any) -> bool:
        """Whether ``module`` was made by the recipe (it holds no peft layers)."""
        return module is not None and self.built is not None and self.built() is module

    def forget(self) -> None:
        self.recipe = None
        self.span = ()
        self.built = None
        self.full_next = False


def adapter_bytes(module: Any) -> int:
    """The bytes of the adapters' layers ``module`` holds."""
    return sum(
        tensor.numel() * tensor.element_size()
        for name, tensor in module.named_parameters()
        if ".lora_" in name
    )


def budget_overrun(runtime: Any, added: int | None) -> bool:
    """Whether ``added`` more resident bytes take ``runtime``'s pipeline over its policy's
    budget, outside a call (None: whether a budget binds it there at all)."""
    budget = getattr(runtime.policy, "budget_bytes", None) if runtime is not None else None
    if budget is None or runtime.running:
        return False
    return added is None or runtime.tracker.resident_bytes + max(0, added) > budget


@functools.cache
def _lora_scalings() -> dict:
    """The code of diffusers' ``scale_lora_layers`` and ``unscale_lora_layers``, which a
    pipeline calls on its text encoders around encoding a prompt at a LoRA scale."""
    try:
        from diffusers.utils import peft_utils
    except ImportError:
        return {}
    return {
        peft_utils.scale_lora_layers.__code__: "scale",
        peft_utils.unscale_lora_layers.__code__: "unscale",
    }


def asked_by_lora_scaling() -> tuple[str, Any] | None:
    """("scale" or "unscale", its weight) when one of ``_lora_scalings`` reads the
    attribute; None otherwise."""
    caller = sys._getframe(2)  # this function, the component's __getattr__, the asker
    kind = _lora_scalings().get(caller.f_code)
    return None if kind is None else (kind, caller.f_locals.get("weight"))
