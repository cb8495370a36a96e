"""The pipeline's LoRA and textual inversion methods over deferred components.

diffusers carries a pipeline-level LoRA method out component by component: a diffusers
model through a method of its own, which the component's proxy records to do again at
every load; a transformers text encoder through helper functions that change the module
in place, which a reload would not know of. Here each deferred text encoder gets a
recorded call instead (the same pipeline-level method, diffusers' own, on a pipeline of
that encoder alone, done at every load), and diffusers' method does the rest with the
deferred encoders hidden. Which adapters a deferred component has is answered from the
calls recorded on it, so asking loads nothing. A textual inversion (new tokens, new
rows of a text encoder's embedding table, written in place) is kept as the rows it
added, written again at every load.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ...lazy import loaded_module
from ...loading.skeleton import library_of
from .component import PipelineComponent, fresh_copy
from .fused_lora import mark_recorded
from .runtime import DiffusersRuntime

__all__ = ["deferred_hidden", "lora_methods", "runtime_of"]

# Pipeline-level methods whose text-encoder part diffusers does in place.
_ENCODER_METHODS = (
    "set_adapters",
    "disable_lora",
    "enable_lora",
    "delete_adapters",
    "unload_lora_weights",
    "fuse_lora",
    "set_lora_device",
)


def runtime_of(pipe: Any) -> DiffusersRuntime | None:
    return pipe.__dict__.get("ondeck")


@contextlib.contextmanager
def deferred_hidden(
    runtime: DiffusersRuntime, names: Iterable[str] | None = None
) -> Iterator[None]:
    """The runtime's deferred components (or those of ``names``) read as None to
    diffusers code that would load them."""
    attributes = runtime.pipe.__dict__
    hidden = (*runtime.deferred, *runtime.containers) if names is None else tuple(names)
    saved = {name: attributes[name] for name in hidden if name in attributes}
    for name in saved:
        attributes[name] = None
    try:
        yield
    finally:
        attributes.update(saved)


def lora_methods(cls: type) -> dict[str, Any]:
    """The LoRA methods of ondeck's subclass of the pipeline class ``cls``: those of its
    own that ``cls`` has."""
    namespace: dict[str, Any] = {}
    base_unfuse = getattr(cls, "unfuse_lora", None)
    if base_unfuse is not None:
        namespace["unfuse_lora"] = _unfuse_lora_method(base_unfuse)
    base_list = getattr(cls, "get_list_adapters", None)
    if base_list is not None:
        namespace["get_list_adapters"] = _list_adapters_method(base_list)
    for method in _ENCODER_METHODS:
        base = getattr(cls, method, None)
        if base is not None:
            namespace[method] = _encoder_method(method, base)
    for method in ("load_textual_inversion", "unload_textual_inversion"):
        base = getattr(cls, method, None)
        if base is not None:
            namespace[method] = _textual_inversion_method(base)
    for attribute in _SHAPE_PROBES:
        static = inspect.getattr_static(cls, attribute, None)
        if isinstance(static, classmethod):
            namespace[attribute] = classmethod(_probe_on_skeleton(static.__func__))
    for attribute in dir(cls):
        if attribute.startswith("load_lora_into_"):
            static = inspect.getattr_static(cls, attribute)
            if isinstance(static, classmethod):
                namespace[attribute] = classmethod(_lora_into_component(static.__func__))
    return namespace


def _deferred_encoders(pipe: Any, runtime: DiffusersRuntime) -> dict[str, PipelineComponent]:
    """The deferred transformers models among the pipeline's LoRA-loadable components."""
    found = {}
    for name in getattr(pipe, "_lora_loadable_modules", ()):
        proxy = runtime.deferred.get(name)
        # __class__: a proxy answers its declared class.
        if isinstance(proxy, PipelineComponent) and library_of(proxy.__class__) == "transformers":
            found[name] = proxy
    return found


def _list_adapters_method(base: Callable[..., Any]) -> Callable[..., Any]:
    """``get_list_adapters``: a deferred component's adapters from the calls recorded on
    it (or from its module, when loaded), without loading it; diffusers' own answer for
    the others."""

    @functools.wraps(base)
    def get_list_adapters(self: Any) -> dict[str, list[str]]:
        runtime = runtime_of(self)
        if runtime is None:
            return base(self)
        with deferred_hidden(runtime):
            listed = base(self)
        for name in getattr(self, "_lora_loadable_modules", ()):
            proxy = runtime.deferred.get(name)
            if not isinstance(proxy, PipelineComponent):
                continue
            adapters = proxy.known_adapters()
            if adapters is None:  # an adapter diffusers names as it loads: ask the module
                adapters = list(getattr(proxy, "peft_config", {}) or {})
            if adapters:
                listed[name] = adapters
        order = list(getattr(self, "_lora_loadable_modules", ()))
        return dict(sorted(listed.items(), key=lambda item: order.index(item[0])))

    return get_list_adapters


def _encoder_method(method: str, base: Callable[..., Any]) -> Callable[..., Any]:
    """A pipeline-level LoRA method: diffusers' with the deferred text encoders hidden,
    then recorded on each of them (``_one_encoder``)."""
    signature = inspect.signature(base)

    @functools.wraps(base)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        encoders = _deferred_encoders(self, runtime) if runtime is not None else {}
        if not encoders:
            return base(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        with deferred_hidden(runtime, encoders):
            result = base(self, *args, **kwargs)
        for name, proxy in encoders.items():
            arguments = _encoder_arguments(method, name, bound.arguments)
            if arguments is not None:
                transform = _one_encoder(method, name, proxy, arguments)
                tried = _counting_try(proxy, transform) if method == "fuse_lora" else None
                proxy.add_checked_transform(transform)
                if method == "fuse_lora":  # counted as diffusers counts it: what merged
                    merged = tried[1] if tried is not None else loaded_module(proxy)
                    self._merged_adapters = self._merged_adapters | _merged_in(merged)
            if method == "delete_adapters":
                proxy.forget_adapters(bound.arguments["adapter_names"])
            elif method == "unload_lora_weights":
                proxy.forget_adapters(None)
        return result

    return call


def _encoder_arguments(method: str, name: str, given: dict[str, Any]) -> dict | None:
    """The arguments of ``method`` on a pipeline of encoder ``name`` alone; None where
    the call leaves it alone."""
    if method == "fuse_lora":
        if name not in (given.get("components") or ()):
            return None
        return {
            "components": [name],
            "lora_scale": given.get("lora_scale", 1.0),
            "safe_fusing": given.get("safe_fusing", False),
            "adapter_names": given.get("adapter_names"),
        }
    keep = {
        "set_adapters": ("adapter_names", "adapter_weights"),
        "delete_adapters": ("adapter_names",),
        "set_lora_device": ("adapter_names", "device"),
    }.get(method, ())
    return {key: given[key] for key in keep}


def _one_encoder(
    method: str, name: str, proxy: PipelineComponent, arguments: dict[str, Any]
) -> Callable[[Any], Any]:
    """A transform doing diffusers' pipeline-level ``method`` on a pipeline that holds
    only the encoder ``name``: what it does to that encoder, at every load."""

    def apply(module: Any) -> Any:
        from diffusers.loaders.lora_base import LoraBaseMixin

        if method == "fuse_lora":
            proxy.refuse_fusing_streamed(method)
        given = fresh_copy(arguments)
        if method == "set_adapters":
            given = _its_own_adapters(module, given)
            if given is None:
                return module
        part = LoraBaseMixin()
        part._lora_loadable_modules = [name]
        part._merged_adapters = set()
        setattr(part, name, module)
        getattr(part, method)(**given)
        return module

    apply.__qualname__ = f"pipeline {method} on {name} (recorded)"
    apply.on_skeleton = True
    return apply


def _counting_try(proxy: PipelineComponent, transform: Callable[[Any], Any]) -> Any:
    """A fuse tried on the encoder's skeleton, to count what it merges; nothing where a
    weightless copy cannot take it (a safe fuse reads values): the load checks it."""
    try:
        return proxy.try_on_skeleton(transform)
    except Exception:
        return None


def _merged_in(module: Any) -> set[str]:
    """The adapters merged into ``module``'s LoRA layers (none for None)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if module is None:
        return set()
    return {
        adapter
        for layer in module.modules()
        if isinstance(layer, BaseTunerLayer)
        for adapter in layer.merged_adapters
    }


def _its_own_adapters(module: Any, given: dict[str, Any]) -> dict[str, Any] | None:
    """``set_adapters``' names and weights for the adapters this encoder has: diffusers
    checks them against the whole pipeline's, and an adapter without layers here changes
    nothing here. None when it has none of them."""
    names = given["adapter_names"]
    names = [names] if isinstance(names, str) else list(names)
    weights = given["adapter_weights"]
    weights = weights if isinstance(weights, list) else [weights] * len(names)
    present = getattr(module, "peft_config", None) or {}
    pairs = [(n, w) for n, w in zip(names, weights, strict=True) if n in present]
    if not pairs:
        return None
    return {"adapter_names": [n for n, _ in pairs], "adapter_weights": [w for _, w in pairs]}


def _unfuse_lora_method(base_unfuse: Callable[..., Any]) -> Callable[..., Any]:
    """The pipeline's ``unfuse_lora``: diffusers unmerges each layer of the components in
    place, which a reload would not know of, so each deferred one records it, to do at
    every load."""

    @functools.wraps(base_unfuse)
    def unfuse_lora(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        if runtime is None:
            return base_unfuse(self, *args, **kwargs)
        bound = inspect.signature(base_unfuse).bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name in bound.arguments.get("components") or ():
            component = self.__dict__.get(name)
            if isinstance(component, PipelineComponent):
                _unfuse_component(component)
        with deferred_hidden(runtime):
            return base_unfuse(self, *args, **kwargs)

    return unfuse_lora


def _unfuse_component(component: PipelineComponent) -> None:
    """``unfuse_lora`` on a deferred component, recorded: a diffusers model's own
    method, or for a transformers model each LoRA layer unmerged, as diffusers does."""
    if hasattr(component.__class__, "unfuse_lora"):  # __class__: the declared class
        component.unfuse_lora()
        return

    def unmerge(module: Any) -> Any:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for layer in module.modules():
            if isinstance(layer, BaseTunerLayer):
                layer.unmerge()
        return module

    component.add_transform(unmerge)


# A LoRA's tensors as recorded calls own them, by the tensor diffusers handed out: the
# calls one load_lora_weights makes for each component (an SD pipeline's UNet and each
# text encoder get the whole state dict) share one copy. An entry goes with its source.
_owned_copies: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_owned_lock = threading.Lock()


def _owned(value: Any) -> Any:
    """``value`` with each tensor replaced by a copy of its own (one per source tensor
    while that tensor lives), containers rebuilt; anything else as it is."""
    return fresh_copy(value, _owned_tensor)


def _owned_tensor(tensor: torch.Tensor) -> torch.Tensor:
    key = id(tensor)
    with _owned_lock:
        known = _owned_copies.get(key)
        if known is not None and known[0]() is tensor:
            return known[1]
        copy = tensor.detach().clone()
        source = weakref.ref(tensor, lambda _, key=key: _owned_copies.pop(key, None))
        _owned_copies[key] = (source, copy)
        return copy


# Where diffusers logs what it met loading a LoRA (keys of it no layer took, say).
_LORA_LOGGERS = (
    "diffusers.utils.peft_utils",
    "diffusers.loaders.peft",
    "diffusers.loaders.lora_base",
    "diffusers.loaders.lora_pipeline",
)


class _OtherThreads(logging.Filter):
    """Passes the records of every thread but the one that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def _logged_once(applications: list[int]) -> Iterator[None]:
    """diffusers' log lines of a LoRA's loading at its first application only (when it
    is loaded, as a plain pipeline says them), not again at every reload."""
    applications[0] += 1
    if applications[0] == 1:
        yield
        return
    quiet = _OtherThreads()
    loggers = [logging.getLogger(name) for name in _LORA_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _lora_into_component(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``load_lora_into_<component>``: aimed at a deferred component, the loading
    becomes a transform of that component (applied at every load, loading nothing now)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def load_lora_into(cls: type, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        targets = [
            (key, value)
            for key, value in bound.arguments.items()
            if issubclass(type(value), PipelineComponent)
        ]
        if not targets:
            return function(cls, *args, **kwargs)
        key, proxy = targets[0]
        # The LoRA's tensors as they are now, in memory of their own: safetensors hands
        # out views of the file, which a trainer may write again before the next load.
        arguments = {
            name: value if name == key else _owned(value) for name, value in bound.arguments.items()
        }
        if "_pipeline" in signature.parameters:
            arguments["_pipeline"] = None  # its offload probes would load every component

        applications = [0]

        def apply(module: Any) -> Any:
            fresh = {name: fresh_copy(value) for name, value in arguments.items()}
            fresh[key] = module
            call = inspect.BoundArguments(signature, fresh)
            with _logged_once(applications):
                function(*call.args, **call.kwargs)
            return module

        apply.__qualname__ = f"{function.__name__} (recorded)"
        mark_recorded(apply, function.__name__, (), arguments)
        apply.on_skeleton = True
        # A LoRA of other shapes, or a name in use, fails now, not at a later load.
        proxy.load_adapter_checked(apply, arguments.get("adapter_name"))
        return None

    return load_lora_into


# What Flux's load_lora_weights reads of the transformer before it loads the LoRA into
# it: its modules' shapes, to widen a layer a Control LoRA is larger than.
_SHAPE_PROBES = ("_maybe_expand_transformer_param_shape_or_error_", "_maybe_expand_lora_state_dict")


def _probe_on_skeleton(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap one of ``_SHAPE_PROBES``: aimed at an unloaded transformer, it reads the
    transformer's skeleton (with the adapters recorded so far) instead of loading it. A
    LoRA that would widen a layer, which changes the module itself, loads it as before."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def probe(cls: type, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        proxy = bound.arguments.get("transformer")
        if not issubclass(type(proxy), PipelineComponent) or loaded_module(proxy) is not None:
            return function(cls, *args, **kwargs)
        tried = proxy.try_on_skeleton(lambda module: None)
        if tried is None:
            return function(cls, *args, **kwargs)
        arguments = dict(bound.arguments, transformer=tried[1])
        given = arguments.get("lora_state_dict")
        if isinstance(given, dict):
            arguments["lora_state_dict"] = dict(given)  # widened entries would be on meta
        call = inspect.BoundArguments(signature, arguments)
        answer = function(*call.args, **call.kwargs)
        if answer is True or (isinstance(answer, dict) and _changed(answer, given)):
            return function(cls, *args, **kwargs)  # a layer to widen: on the real module
        return given if isinstance(answer, dict) else answer

    return probe


def _changed(answer: dict, given: dict) -> bool:
    """Whether a probe gave back other entries than it was given (tensors compared by
    identity: a widened one is new)."""
    return answer.keys() != given.keys() or any(answer[k] is not v for k, v in given.items())


def _textual_inversion_method(base: Callable[..., Any]) -> Callable[..., Any]:
    """``load_textual_inversion`` / ``unload_textual_inversion``: diffusers' own (which
    loads the text encoder it changes), then the embedding table it left is kept as its
    size and the rows from the first new token's on, written again at every load of a
    deferred encoder (``_AddedRows``)."""
    signature = inspect.signature(base)

    @functools.wraps(base)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        bound = signature.bind(self, *args, **kwargs)
        encoder = bound.arguments.get("text_encoder") or self.__dict__.get("text_encoder")
        tokenizer = bound.arguments.get("tokenizer") or self.__dict__.get("tokenizer")
        if runtime is None or not isinstance(encoder, PipelineComponent) or tokenizer is None:
            return base(self, *args, **kwargs)
        rows = encoder.added_rows(lambda: _AddedRows(len(tokenizer)))
        rows.first = min(rows.first, len(tokenizer))  # new tokens' ids start here
        result = base(self, *args, **kwargs)
        if rows.take(encoder.get_input_embeddings().weight):
            encoder.add_transform(rows.apply)
        return result

    return call


class _AddedRows:
    """A text encoder's embedding table as textual inversions left it: its size, and
    its rows from ``first`` (the first new token's id) on, to make again at every load."""

    def __init__(self, first: int):
        self.first = first
        self.size = 0
        self.rows: torch.Tensor | None = None
        self.recorded = False

    def take(self, weight: torch.Tensor) -> bool:
        """Keep the table's size and its rows from ``first`` on, in host memory; whether
        the transform that makes them is still to be added."""
        self.size = weight.shape[0]
        self.rows = weight.detach()[self.first :].to("cpu", copy=True)
        fresh, self.recorded = not self.recorded, True
        return fresh

    def apply(self, module: Any) -> Any:
        if module.get_input_embeddings().weight.shape[0] != self.size:
            module.resize_token_embeddings(self.size, mean_resizing=False)  # written below
        weight = module.get_input_embeddings().weight
        with torch.no_grad():
            weight[self.first :] = self.rows.to(weight.device, weight.dtype)
        return module
