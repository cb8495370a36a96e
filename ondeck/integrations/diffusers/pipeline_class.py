"""The subclass of a diffusers pipeline class that routes calls, placement, the
execution device and LoRA loading through the runtime."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...errors import OndeckError
from ...lazy import is_lazy, loaded_module
from .component import PipelineComponent, fresh_copy
from .fused_lora import mark_recorded
from .runtime import DiffusersRuntime

_PIPELINE_CLASSES: dict[type, type] = {}
_PIPELINE_CLASSES_LOCK = threading.Lock()


def ondeck_pipeline_class(cls: type) -> type:
    """A subclass of the diffusers pipeline class ``cls`` that routes through ondeck.

    It keeps the name, module and behaviour of ``cls`` (``isinstance`` holds, the saved
    ``_class_name`` is unchanged); calls, placement, the execution device and LoRA
    loading go through the runtime in ``pipe.ondeck``.
    """
    with _PIPELINE_CLASSES_LOCK:
        found = _PIPELINE_CLASSES.get(cls)
        if found is None:
            found = _PIPELINE_CLASSES[cls] = _build_pipeline_class(cls)
        return found


def _runtime(pipe: Any) -> DiffusersRuntime | None:
    return pipe.__dict__.get("ondeck")


@contextlib.contextmanager
def _deferred_hidden(runtime: DiffusersRuntime) -> Iterator[None]:
    """The runtime's deferred components read as None to diffusers code that would load
    them."""
    attributes = runtime.pipe.__dict__
    hidden = (*runtime.deferred, *runtime.containers)
    saved = {name: attributes[name] for name in hidden if name in attributes}
    for name in saved:
        attributes[name] = None
    try:
        yield
    finally:
        attributes.update(saved)


def _build_pipeline_class(cls: type) -> type:
    from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

    base_call = cls.__call__
    base_to = cls.to
    base_setattr = cls.__setattr__

    @functools.wraps(base_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime(self)
        if runtime is None:
            return base_call(self, *args, **kwargs)
        return runtime.run(base_call, self, *args, **kwargs)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        base_setattr(self, name, value)
        runtime = _runtime(self)
        if runtime is not None and name in runtime.components:
            runtime.swap(name, value)
        if not is_lazy(value):
            return
        # diffusers records (library, class) from value.__module__, which for a proxy
        # names ondeck; the declared class knows the right pair.
        config = self.__dict__.get("_internal_dict")
        if config is not None and isinstance(config.get(name), (list, tuple)):
            self.register_to_config(**{name: _fetch_class_library_tuple(value.__class__)})

    @functools.wraps(base_to)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime(self)
        if runtime is None:
            return base_to(self, *args, **kwargs)
        device, dtype = _pipeline_placement(args, kwargs)
        runtime.place(device, dtype)
        with _deferred_hidden(runtime):
            base_to(self, *args, **kwargs)
        return self

    def _execution_device(self: Any) -> torch.device:
        return _pipeline_execution_device(self)

    def refuse_offload(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OndeckError(
            "this pipeline's components already load when a call first needs them and "
            "are freed by its ondeck policy; offload hooks would load every component "
            "now. Choose policy='release' or a budget in ondeck.diffusers.from_pretrained"
        )

    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__call__": __call__,
        "__setattr__": __setattr__,
        "to": to,
        "_execution_device": property(_execution_device),
        "enable_model_cpu_offload": refuse_offload,
        "enable_sequential_cpu_offload": refuse_offload,
        "enable_group_offload": refuse_offload,
    }
    base_unfuse = getattr(cls, "unfuse_lora", None)
    if base_unfuse is not None:
        namespace["unfuse_lora"] = _unfuse_lora_method(base_unfuse)
    for attribute in dir(cls):
        if attribute.startswith("load_lora_into_"):
            static = inspect.getattr_static(cls, attribute)
            if isinstance(static, classmethod):
                namespace[attribute] = classmethod(_lora_into_component(static.__func__))
    return type(cls.__name__, (cls,), namespace)


def _unfuse_lora_method(base_unfuse: Callable[..., Any]) -> Callable[..., Any]:
    """The pipeline's ``unfuse_lora``: diffusers unmerges each layer of the components in
    place, which a reload would not know of, so each deferred one records it, to do at
    every load."""

    @functools.wraps(base_unfuse)
    def unfuse_lora(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime(self)
        if runtime is None:
            return base_unfuse(self, *args, **kwargs)
        bound = inspect.signature(base_unfuse).bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name in bound.arguments.get("components") or ():
            component = self.__dict__.get(name)
            if isinstance(component, PipelineComponent):
                _unfuse_component(component)
        with _deferred_hidden(runtime):
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
        arguments = dict(bound.arguments)
        if "_pipeline" in signature.parameters:
            arguments["_pipeline"] = None  # its offload probes would load every component

        def apply(module: Any) -> Any:
            fresh = {name: fresh_copy(value) for name, value in arguments.items()}
            fresh[key] = module
            call = inspect.BoundArguments(signature, fresh)
            function(*call.args, **call.kwargs)
            return module

        apply.__qualname__ = f"{function.__name__} (recorded)"
        mark_recorded(apply, function.__name__, (), arguments)
        proxy.add_checked_transform(apply)
        if arguments.get("adapter_name"):
            proxy.record_adapter(arguments["adapter_name"])
        return None

    return load_lora_into


def _pipeline_placement(args: tuple, kwargs: dict) -> tuple[Any, torch.dtype | None]:
    """(device, dtype) from DiffusionPipeline.to's arguments."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    if len(args) == 1:
        if isinstance(args[0], torch.dtype):
            dtype = args[0]
        else:
            device = args[0]
    elif len(args) >= 2:
        device, dtype = args[0], args[1]
    return (torch.device(device) if device is not None else None), dtype


def _pipeline_execution_device(pipe: Any) -> torch.device:
    """diffusers' execution device, without loading or touching components.

    The same answer as ``DiffusionPipeline._execution_device``: hooks only live on
    loaded modules, which are inspected directly (walking them through the proxy would
    count as the call using them), and an unloaded component computes where its
    loader puts it.
    """
    try:
        from diffusers.hooks.group_offloading import _get_group_onload_device
    except ImportError:  # an older diffusers without group offloading
        _get_group_onload_device = None
    components = {
        name: _loaded_module(model)
        for name, model in pipe.components.items()
        if isinstance(model, torch.nn.Module)
    }
    if _get_group_onload_device is not None:
        for module in components.values():
            if module is None:
                continue
            try:
                return _get_group_onload_device(module)
            except ValueError:
                pass
    for name, module in components.items():
        if name in pipe._exclude_from_cpu_offload:
            continue
        if module is None or not hasattr(module, "_hf_hook"):
            return pipe.device
        for submodule in module.modules():
            hook = getattr(submodule, "_hf_hook", None)
            if getattr(hook, "execution_device", None) is not None:
                return torch.device(hook.execution_device)
    return pipe.device


def _loaded_module(component: Any) -> Any:
    """The module itself: behind a proxy when loaded, None when not loaded."""
    if is_lazy(component):
        return loaded_module(component)
    return component
