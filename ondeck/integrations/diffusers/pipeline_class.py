"""The subclass of a diffusers pipeline class that routes calls, placement, the
execution device and LoRA loading through the runtime."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import OndeckError
from ...lazy import is_lazy, is_loaded, loaded_module
from ...memory import usable_device
from .pipeline_lora import deferred_hidden, lora_methods, runtime_of

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


def _build_pipeline_class(cls: type) -> type:
    from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

    base_call = cls.__call__
    base_to = cls.to
    base_setattr = cls.__setattr__
    base_components = cls.components
    one_at_a_time = {
        name: _loading_one_at_a_time(getattr(cls, name))
        for name in ("save_pretrained", "get_active_adapters")
        if callable(getattr(cls, name, None))
    }

    @functools.wraps(base_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        if runtime is None:
            return base_call(self, *args, **kwargs)
        return runtime.run(base_call, self, *args, **kwargs)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        runtime = runtime_of(self)
        if runtime is not None:
            # A refused assignment changes nothing: checked before diffusers sets it.
            runtime.check_assignment(name, value)
        base_setattr(self, name, value)
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
        runtime = runtime_of(self)
        if runtime is None:
            return base_to(self, *args, **kwargs)
        device, dtype = _pipeline_placement(args, kwargs)
        runtime.place(None if device is None else usable_device(device), dtype)
        with deferred_hidden(runtime):
            base_to(self, *args, **kwargs)
        return self

    def _execution_device(self: Any) -> torch.device:
        return _pipeline_execution_device(self)

    @functools.wraps(base_components.fget)
    def components(self: Any) -> dict[str, Any]:
        if runtime_of(self) is not None and _asked_by_from_pipe():
            raise _from_pipe_refused(self)
        return base_components.fget(self)

    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__call__": __call__,
        "__setattr__": __setattr__,
        "to": to,
        "_execution_device": property(_execution_device),
        "components": property(components),
        "enable_model_cpu_offload": _refuse_offload,
        "enable_sequential_cpu_offload": _refuse_offload,
        "enable_group_offload": _refuse_offload,
    }
    namespace.update(lora_methods(cls))
    namespace.update(one_at_a_time)
    return type(cls.__name__, (cls,), namespace)


def _loading_one_at_a_time(base: Any) -> Any:
    """A pipeline method that reads each component in turn (``save_pretrained``,
    ``get_active_adapters``): outside a call, what it loads is released before the next
    component loads and when it returns, so it takes the largest component's memory, not
    the sum, and leaves loaded only what was loaded before. The loads ahead of the next
    call are waited for first: they are what was loaded before."""

    @functools.wraps(base)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        if runtime is None or runtime.current_stage_index is not None:
            return base(self, *args, **kwargs)
        runtime.cancel_prefetch_quietly()
        with _released_as_they_go(list(runtime.deferred.values())):
            return base(self, *args, **kwargs)

    return method


class _LoadsOneAtATime:
    """An observer of deferred components: each load this thread makes first releases
    what this thread loaded before it while observed (loads from other threads, a call's
    own, are left alone)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.loaded: list[Any] = []
        self._lock = threading.Lock()

    def before_load(self, proxy: Any) -> None:
        if threading.get_ident() == self.thread:
            self.release(but=proxy)

    def after_load(self, proxy: Any, nbytes: int, seconds: float) -> None:
        if threading.get_ident() == self.thread:
            with self._lock:
                self.loaded.append(proxy)

    def after_release(self, proxy: Any, nbytes: int) -> None:
        with self._lock:
            self.loaded = [other for other in self.loaded if other is not proxy]

    def release(self, but: Any = None) -> None:
        with self._lock:
            going = [proxy for proxy in self.loaded if proxy is not but]
        for proxy in going:
            if is_loaded(proxy):
                proxy.release()
        with self._lock:
            self.loaded = [proxy for proxy in self.loaded if proxy not in going]


@contextlib.contextmanager
def _released_as_they_go(proxies: list[Any]) -> Iterator[None]:
    observer = _LoadsOneAtATime()
    for proxy in proxies:
        proxy.add_observer(observer)
    try:
        yield
    finally:
        for proxy in proxies:
            proxy.remove_observer(observer)
        observer.release()


def _asked_by_from_pipe() -> bool:
    """Whether ``pipe.components`` is being read by one of diffusers' ``from_pipe``
    (``DiffusionPipeline``'s and the auto pipelines'), which builds a new pipeline over
    the components it returns."""
    caller = sys._getframe(2)  # this function, the property, the reader
    module = caller.f_globals.get("__name__", "")
    return caller.f_code.co_name == "from_pipe" and module.startswith("diffusers.")


def _refuse_offload(self: Any, *args: Any, **kwargs: Any) -> None:
    """diffusers' offload methods on a pipeline whose components ondeck loads."""
    policy = getattr(getattr(runtime_of(self), "policy", None), "name", None)
    now = f" (it runs under '{policy}')" if policy else ""
    release = "" if policy == "release" else "policy='release', or "
    raise OndeckError(
        "this pipeline's components already load when a call first needs them and "
        f"are freed by its ondeck policy{now}; offload hooks would load every "
        "component now. For less device memory, give ondeck.diffusers.from_pretrained "
        f"{release}a budget= that streams what does not fit"
    )


def _from_pipe_refused(pipe: Any) -> OndeckError:
    return OndeckError(
        f"from_pipe cannot take this ondeck {type(pipe).__name__}: its components load "
        "when its calls need them and its runtime (pipe.ondeck) frees them; a pipeline "
        "built over them would have no runtime, and what it loaded would stay loaded. "
        "Load the other pipeline with ondeck.diffusers.from_pretrained, from a folder "
        "whose model_index.json names its class (one host_cache=HostCache(...) given to "
        "both keeps one host copy of the files they share)"
    )


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
