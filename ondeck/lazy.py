"""A proxy that stands in for one pipeline component until it is needed."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .errors import LoadError, OndeckError
from .loader import as_loader

__all__ = [
    "ComponentSpec",
    "LazyModule",
    "component_name",
    "free_module_storages",
    "free_storage",
    "is_lazy",
    "is_loaded",
    "loaded_module",
    "loader_of",
    "module_nbytes",
    "pinned",
    "wait_filled",
]


@dataclass(frozen=True)
class ComponentSpec:
    """What is known about a component without reading its weights."""

    cls: type | None = None
    config: Any = None
    dtype: Any = None
    device: Any = None
    nbytes: int | None = None

    def with_updates(self, **changes: Any) -> ComponentSpec:
        return replace(self, **changes)


# Methods whose calls change how the loaded component is placed or behaves. They are
# recorded and replayed after every reload, so a release costs latency, never state.
REPLAYED_METHODS = frozenset(
    {
        "to",
        "cuda",
        "cpu",
        "float",
        "half",
        "bfloat16",
        "double",
        "type",
        "eval",
        "train",
        "requires_grad_",
    }
)

_CASTS = {"float", "half", "bfloat16", "double", "type"}


def _aspects(method: str, args: tuple, kwargs: dict) -> frozenset[str]:
    """What a replayed call sets on the module: a later call that sets all of it makes
    this one redundant (``to("cpu")`` then ``to("cuda")``), one that sets only part of it
    does not (``to(float16)`` then ``to("cpu")`` keeps both, in order)."""
    if method == "to":
        import torch

        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except Exception:
            return frozenset({f"call {id(args)}"})
        aspects = {"device"} if device is not None else set()
        aspects |= {"dtype"} if dtype is not None else set()
        aspects |= {"memory_format"} if memory_format is not None else set()
        return frozenset(aspects)
    if method in ("cuda", "cpu"):
        return frozenset({"device"})
    if method in _CASTS:
        return frozenset({"dtype"})
    if method in ("eval", "train"):
        return frozenset({"mode"})
    if method == "requires_grad_":
        return frozenset({"requires_grad"})
    return frozenset({f"call {id(args)}"})


class ReplayLog:
    """Calls that changed a loaded component, in the order they were made, to apply again
    after every reload with their own arguments. A call is dropped only once later calls
    set everything it set, so the log stays as short as the state it describes."""

    def __init__(self) -> None:
        self._calls: list[tuple[str, tuple, dict, frozenset[str]]] = []
        self.revision = 0  # calls added so far

    def add(self, method: str, args: tuple, kwargs: dict) -> None:
        self.revision += 1
        aspects = _aspects(method, args, kwargs)
        if aspects:
            self._calls = [call for call in self._calls if not call[3] <= aspects]
        self._calls.append((method, tuple(args), dict(kwargs), aspects))

    def __iter__(self):
        return iter([(method, args, kwargs) for method, args, kwargs, _ in self._calls])

    def __len__(self) -> int:
        return len(self._calls)


# Attributes that integrations probe with hasattr() to detect hooks; an unloaded
# component has none of them, so answering must not load it.
_ABSENT_WHILE_UNLOADED = frozenset({"_hf_hook", "_diffusers_hook", "hf_device_map", "_ondeck_hook"})

INTERNAL_ATTRIBUTES = (
    "_ondeck_name",
    "_ondeck_loader",
    "_ondeck_spec",
    "_ondeck_module",
    "_ondeck_lock",
    "_ondeck_loading_thread",
    "_ondeck_transforms",
    "_ondeck_release_callbacks",
    "_ondeck_replay",
    "_ondeck_observers",
    "_ondeck_pins",
    "_ondeck_pins_changed",
    "_ondeck_load_count",
    "_ondeck_free_storage",
    "_ondeck_filling",
    "_ondeck_changes",
)


def is_lazy(obj: Any) -> bool:
    """True for a LazyModule proxy, loaded or not. Never loads anything."""
    return issubclass(type(obj), LazyModule)


def is_loaded(obj: Any) -> bool:
    """True when ``obj`` is not a proxy, or is a proxy whose component is resident."""
    if not is_lazy(obj):
        return True
    return object.__getattribute__(obj, "_ondeck_module") is not None


def is_loading(obj: Any) -> bool:
    """True while a proxy's loader runs (in any thread)."""
    if not is_lazy(obj):
        return False
    return object.__getattribute__(obj, "_ondeck_loading_thread") is not None


def module_nbytes(module: Any) -> int:
    """Bytes held by a module's parameters and buffers, counting shared storage once."""
    import torch

    if isinstance(module, torch.Tensor):
        return module.untyped_storage().nbytes()
    if not isinstance(module, torch.nn.Module):
        return 0
    storages: dict[tuple[str, int], int] = {}
    for tensor in _module_tensors(module):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _module_tensors(module: Any) -> list:
    import torch

    tensors = [*module.parameters(recurse=True), *module.buffers(recurse=True)]
    with torch.no_grad():
        # A sharded (DTensor) parameter has no storage of its own: its local shard has.
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def free_storage(tensor: Any) -> None:
    """Give a tensor's memory back now, whoever else still holds the tensor."""
    storage = tensor.untyped_storage()
    if storage.nbytes() and tensor.device.type != "meta" and storage.resizable():
        storage.resize_(0)


def free_module_storages(module: Any) -> None:
    """Give the memory of a module's tensors back now, even if a stray reference survives.

    Only for modules a loader built fresh: the storage would otherwise stay alive as
    long as any forgotten hook, closure or cache still points at the module.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        return
    for tensor in _module_tensors(module):
        free_storage(tensor)


# -- what loading, streaming and the integrations may ask of a proxy, without loading it --


def loader_of(proxy: LazyModule) -> Callable[[], Any]:
    """The proxy's loader."""
    return object.__getattribute__(proxy, "_ondeck_loader")


def loaded_module(proxy: LazyModule) -> Any:
    """The loaded component, or None; never loads."""
    return object.__getattribute__(proxy, "_ondeck_module")


def component_name(proxy: LazyModule) -> str:
    """The name the proxy was given (not the module's own ``name``)."""
    return object.__getattribute__(proxy, "_ondeck_name")


def wait_filled(proxy: LazyModule) -> None:
    """Wait for the rest of a pipelined load in progress; never loads. A fill that failed
    raises its error (and the component is released, as for any access)."""
    if is_lazy(proxy) and is_loaded(proxy):
        object.__getattribute__(proxy, "_complete_filling")()


@contextlib.contextmanager
def pinned(*proxies: LazyModule):
    """While inside, a release from another thread waits: a stage's components stay."""
    done: list[LazyModule] = []
    try:
        for proxy in proxies:
            proxy._pin()
            done.append(proxy)
        yield
    finally:
        for proxy in reversed(done):
            proxy._unpin()


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or MemoryError (the CPU and unified memory run out so)."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    while error is not None:
        if isinstance(error, (oom, MemoryError)) or "out of memory" in str(error).lower():
            return True
        error = error.__cause__
    return False


def _describe_failure(error: Exception, spec: ComponentSpec) -> str:
    text = f"{type(error).__name__}: {error}"
    if not is_out_of_memory(error):
        return f"loader failed with {text}"
    size = f" ({spec.nbytes / 2**30:.2f} GiB)" if spec.nbytes else ""
    first_line = text.splitlines()[0][:300]
    return (
        f"out of memory while loading{size}. The device cannot hold it beside what is "
        "already resident: use policy='release' or 'auto', or give a budget "
        f"(`ondeck plan MODEL_DIR --budget ...` shows what fits). Cause: {first_line}"
    )


def _waits_for_weights(transform: Callable[[Any], Any]) -> bool:
    """Whether a pipelined load must be complete before ``transform`` runs: it reads the
    weights, and cannot wait for each block's itself (``while_filling(module, filling)``,
    which defers its changes to a block's weights until they are in place, through
    ``filling.when_in_place``)."""
    return getattr(transform, "reads_weights", True) and not hasattr(transform, "while_filling")


def _leaves_weights(module: Any, method: str, args: tuple, kwargs: dict) -> bool:
    """Whether replaying this call on a module leaves its weights' memory untouched (a
    mode switch, or a move to where the weights already are), so it may run while a
    pipelined load still writes them."""
    if method in ("eval", "train", "requires_grad_"):
        return True
    if method not in ("to", "cuda", "cpu"):
        return False
    import torch

    first = next(iter(module.parameters()), None)
    if first is None:
        return True
    if method == "to":
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except Exception:
            return False
        if dtype is not None or memory_format is not None:
            return False
    else:
        device = torch.device(method, *args[:1]) if method == "cuda" and args else method
    if device is None:
        return True
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device == first.device


class _HooksOnly:
    """A transform declared to leave the weights alone (``reads_weights=False``)."""

    reads_weights = False

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn

    def __call__(self, module: Any) -> Any:
        return self.fn(module)

    def __repr__(self) -> str:
        return repr(self.fn)


def _tell_observers(proxy: Any, observers: list, kind: str, seconds: float) -> None:
    """A pipelined load's news for the observers that listen for it: ``after_wait`` (a
    forward waited for its block) and ``after_fill`` (every weight is in place)."""
    for observer in observers:
        listener = getattr(observer, f"after_{kind}", None)
        if listener is not None:
            listener(proxy, seconds)


def _call_with_optional_module(fn: Callable, module: Any) -> Any:
    """Call a user callback with the module when it takes an argument, else with none."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(module)
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return fn(module) if positional else fn()


class LazyModule:
    """Stands in for a component and loads it on first real use.

    Construction, ``repr``, :func:`is_lazy`, :func:`is_loaded` and reads of what the
    spec knows (``config``, ``dtype``, ``device``, ``isinstance`` against ``spec.cls``)
    never load. Anything else loads the component once, then forwards to it.
    """

    def __init__(self, name: str, loader: Callable[[], Any], *, spec: ComponentSpec | None = None):
        if not callable(loader):
            raise TypeError(f"component '{name}': loader must be a zero-argument callable")
        setter = object.__setattr__
        setter(self, "_ondeck_name", name)
        setter(self, "_ondeck_loader", loader)
        setter(self, "_ondeck_spec", spec or ComponentSpec())
        setter(self, "_ondeck_module", None)
        setter(self, "_ondeck_lock", threading.RLock())
        setter(self, "_ondeck_loading_thread", None)
        setter(self, "_ondeck_transforms", [])
        setter(self, "_ondeck_release_callbacks", [])
        setter(self, "_ondeck_replay", ReplayLog())
        setter(self, "_ondeck_observers", [])
        setter(self, "_ondeck_pins", {})
        setter(self, "_ondeck_pins_changed", threading.Condition(threading.RLock()))
        setter(self, "_ondeck_load_count", 0)
        setter(self, "_ondeck_free_storage", bool(as_loader(loader).returns_fresh_module))
        setter(self, "_ondeck_filling", None)
        setter(self, "_ondeck_changes", 0)

    # -- what is known without loading ------------------------------------------------

    @property
    def name(self) -> str:
        module = object.__getattribute__(self, "_ondeck_module")
        if module is not None and hasattr(module, "name"):
            return module.name
        return object.__getattribute__(self, "_ondeck_name")

    @property
    def spec(self) -> ComponentSpec:
        return object.__getattribute__(self, "_ondeck_spec")

    @property
    def load_count(self) -> int:
        """How many times the loader has run successfully."""
        return object.__getattribute__(self, "_ondeck_load_count")

    @property
    def changes(self) -> int:
        """How many times what a load makes was changed: transforms added, and calls
        (``to``, ``half``, ...) to replay after a load. What a caller keeps of the
        component's outputs (encoded prompts) is stale once this moves."""
        replay = object.__getattribute__(self, "_ondeck_replay")
        return object.__getattribute__(self, "_ondeck_changes") + replay.revision

    @property
    def __class__(self):  # noqa: D401 - answers isinstance() without loading
        module = object.__getattribute__(self, "_ondeck_module")
        if module is not None:
            return type(module)
        declared = object.__getattribute__(self, "_ondeck_spec").cls
        return declared if declared is not None else LazyModule

    @property
    def config(self) -> Any:
        return self._spec_or_loaded("config")

    @property
    def dtype(self) -> Any:
        return self._spec_or_loaded("dtype")

    @property
    def device(self) -> Any:
        return self._spec_or_loaded("device")

    def _spec_or_loaded(self, attribute: str) -> Any:
        module = object.__getattribute__(self, "_ondeck_module")
        if module is None:
            known = getattr(object.__getattribute__(self, "_ondeck_spec"), attribute)
            if known is not None:
                return known
            module = self.materialize()
        return getattr(module, attribute)

    def __repr__(self) -> str:
        name = object.__getattribute__(self, "_ondeck_name")
        spec = object.__getattribute__(self, "_ondeck_spec")
        loaded = object.__getattribute__(self, "_ondeck_module") is not None
        parts = [repr(name), "loaded" if loaded else "unloaded"]
        if spec.cls is not None:
            parts.append(spec.cls.__name__)
        if spec.nbytes is not None:
            parts.append(f"{spec.nbytes / 2**30:.2f} GiB")
        return f"LazyModule({', '.join(parts)})"

    def __bool__(self) -> bool:
        return True

    # -- loading ------------------------------------------------------------------------

    def materialize(self, *, complete: bool = True) -> Any:
        """Return the loaded component, loading it first if needed.

        ``complete=False`` (for calls of the component): a loader that can load pipelined
        (``loader.begin()``) may return a module whose repeated blocks are still arriving;
        its forward waits for each block. Anything else waits for every weight.
        """
        module = object.__getattribute__(self, "_ondeck_module")
        if module is None:
            with object.__getattribute__(self, "_ondeck_lock"):
                module = object.__getattribute__(self, "_ondeck_module")
                if module is None:
                    module = self._load_locked(complete)
        if complete and object.__getattribute__(self, "_ondeck_filling") is not None:
            # A failed fill releases the module; the error's frame here must not keep it.
            module = None
            self._complete_filling()
            return self.materialize()
        return module

    def _complete_filling(self) -> None:
        """Wait for a pipelined load's last weights; a fill that failed releases the
        component (the next access loads it again) and raises its error."""
        filling = object.__getattribute__(self, "_ondeck_filling")
        if filling is None:
            return
        try:
            filling.wait()
        except LoadError:
            self.release()
            raise
        with object.__getattribute__(self, "_ondeck_lock"):
            if object.__getattribute__(self, "_ondeck_filling") is filling:
                object.__setattr__(self, "_ondeck_filling", None)

    def _load_locked(self, complete: bool = True) -> Any:
        name = object.__getattribute__(self, "_ondeck_name")
        if object.__getattribute__(self, "_ondeck_loading_thread") is threading.get_ident():
            raise LoadError(
                f"component '{name}': its loader touched the component it is loading",
                component=name,
            )
        observers = list(object.__getattribute__(self, "_ondeck_observers"))
        for observer in observers:
            observer.before_load(self)
        object.__setattr__(self, "_ondeck_loading_thread", threading.get_ident())
        started = time.perf_counter()
        try:
            module, filling = self._run_loader(name, complete)
        finally:
            object.__setattr__(self, "_ondeck_loading_thread", None)
        seconds = time.perf_counter() - started
        object.__setattr__(self, "_ondeck_module", module)
        object.__setattr__(self, "_ondeck_filling", filling)
        object.__setattr__(self, "_ondeck_load_count", self.load_count + 1)
        nbytes = module_nbytes(module)
        for observer in observers:
            observer.after_load(self, nbytes, seconds)
        if filling is not None:
            filling.add_listener(functools.partial(_tell_observers, self, observers))
        return module

    def _run_loader(self, name: str, complete: bool = True) -> tuple[Any, Any]:
        """The loaded module with transforms and replayed calls applied, and the filling
        still bringing its weights in (None when they are all in place)."""
        loader = as_loader(object.__getattribute__(self, "_ondeck_loader"))
        try:
            module, filling = (loader(), None) if complete else loader.begin()
        except LoadError as error:
            if error.component is None:
                error.component = name
            raise
        except Exception as error:
            raise LoadError(
                f"component '{name}': {_describe_failure(error, self.spec)}", component=name
            ) from error
        if module is None:
            raise LoadError(f"component '{name}': loader returned None", component=name)
        transforms = self._transforms_for_load()
        replay = list(object.__getattribute__(self, "_ondeck_replay"))
        try:
            if filling is not None and (
                any(_waits_for_weights(fn) for fn in transforms)
                or not all(_leaves_weights(module, *call) for call in replay)
            ):
                # A transform or a cast reads the weights: they must all be there first.
                filling.wait()
                filling = None
            for transform in transforms:
                if filling is not None and hasattr(transform, "while_filling"):
                    returned = transform.while_filling(module, filling)
                else:
                    returned = transform(module)
                module = module if returned is None else returned  # None: changed in place
            for method, args, kwargs in replay:
                result = getattr(module, method)(*args, **kwargs)
                if method != "requires_grad_" and result is not None:
                    module = result
        except LoadError as error:
            error.component = name
            self._discard(module, filling)
            raise
        except OndeckError:  # a refusal a transform made (a fuse into streamed blocks)
            self._discard(module, filling)
            raise
        except Exception as error:
            self._discard(module, filling)
            raise LoadError(
                f"component '{name}': applying transforms after load failed with "
                f"{type(error).__name__}: {error}",
                component=name,
            ) from error
        except BaseException:
            # Ctrl-C during a transform (torch.compile, say): the fresh module's bytes
            # must not live on in the traceback's frames.
            self._discard(module, filling)
            raise
        return module, filling

    def _transforms_for_load(self) -> list[Callable[[Any], Any]]:
        """The transforms a load applies, in order: those registered. A subclass may stand
        one step in for several (a fused LoRA re-applied from its factors)."""
        return list(object.__getattribute__(self, "_ondeck_transforms"))

    def _discard(self, module: Any, filling: Any = None) -> None:
        if filling is not None:
            filling.cancel()  # nothing may write into the memory about to be freed
        # What the loader attached to the module (a streamer's slots and hooks) goes
        # with it, or the next load could not place the component another way.
        try:
            as_loader(object.__getattribute__(self, "_ondeck_loader")).unload(module)
        except Exception:  # the failure being raised is the one to report
            pass
        if object.__getattribute__(self, "_ondeck_free_storage"):
            free_module_storages(module)

    # -- releasing ----------------------------------------------------------------------

    def release(self) -> int:
        """Drop every reference the runtime holds and free the memory.

        Returns the bytes freed, 0 when nothing was loaded. The next access loads again.
        """
        # Held from the pin check to the end: a stage cannot pin in between and then
        # lose its component mid-forward. A stage that pins after this reloads.
        with object.__getattribute__(self, "_ondeck_pins_changed"):
            self._wait_until_unpinned()
            with object.__getattribute__(self, "_ondeck_lock"):
                module = object.__getattribute__(self, "_ondeck_module")
                if module is None:
                    return 0
                nbytes = module_nbytes(module)
                filling = object.__getattribute__(self, "_ondeck_filling")
                object.__setattr__(self, "_ondeck_module", None)
                object.__setattr__(self, "_ondeck_filling", None)
                # Observers hear first: a Ctrl-C landing in what follows cannot leave
                # them listing a component that is no longer there.
                for observer in list(object.__getattribute__(self, "_ondeck_observers")):
                    observer.after_release(self, nbytes)
                try:
                    first_error = self._run_release_hooks(module)
                finally:
                    self._discard(module, filling)  # even under Ctrl-C: the bytes go
                    del module
        if first_error is not None:
            raise first_error
        return nbytes

    def _run_release_hooks(self, module: Any) -> BaseException | None:
        """Every callback and the loader's ``unload`` run; the first error is returned."""
        first_error: BaseException | None = None
        hooks = [
            lambda fn=fn: _call_with_optional_module(fn, module)
            for fn in object.__getattribute__(self, "_ondeck_release_callbacks")
        ]
        unload = as_loader(object.__getattribute__(self, "_ondeck_loader")).unload
        hooks.append(lambda: unload(module))
        for hook in hooks:
            try:
                hook()
            except Exception as error:
                first_error = first_error or error
        return first_error

    def _wait_until_unpinned(self) -> None:
        """A stage that still runs holds its components: wait for other threads' stages.

        The caller holds ``_ondeck_pins_changed``.
        """
        me = threading.get_ident()
        changed = object.__getattribute__(self, "_ondeck_pins_changed")
        pins = object.__getattribute__(self, "_ondeck_pins")
        changed.wait_for(lambda: all(owner == me for owner in pins))

    def _pin(self) -> None:
        changed = object.__getattribute__(self, "_ondeck_pins_changed")
        pins = object.__getattribute__(self, "_ondeck_pins")
        me = threading.get_ident()
        with changed:
            pins[me] = pins.get(me, 0) + 1

    def _unpin(self) -> None:
        changed = object.__getattribute__(self, "_ondeck_pins_changed")
        pins = object.__getattribute__(self, "_ondeck_pins")
        me = threading.get_ident()
        with changed:
            pins[me] -= 1
            if pins[me] == 0:
                del pins[me]
            changed.notify_all()

    # -- hooks --------------------------------------------------------------------------

    def add_transform(self, fn: Callable[[Any], Any], *, reads_weights: bool = True) -> LazyModule:
        """Apply ``fn(module) -> module`` after every load, in registration order; an
        ``fn`` that returns None changed the module in place, which is kept.

        If the component is already loaded, ``fn`` is applied to it now as well.
        ``reads_weights=False`` declares that ``fn`` only adds hooks or attributes and
        never touches a parameter or buffer (context parallelism's split and gather
        hooks): a pipelined load then still starts computing before its last block is
        in. Otherwise every weight is in place before ``fn`` runs.
        """
        if not reads_weights:
            fn = _HooksOnly(fn)
        else:
            self._complete_filling()  # a transform may read the weights
        with object.__getattribute__(self, "_ondeck_lock"):
            module = object.__getattribute__(self, "_ondeck_module")
            if module is not None:  # a transform that fails here is not kept
                transformed = self._apply_or_release(fn, module)
                if transformed is not None:
                    object.__setattr__(self, "_ondeck_module", transformed)
            object.__getattribute__(self, "_ondeck_transforms").append(fn)
            self._changed()
        return self

    def remove_transform(self, fn: Callable[[Any], Any]) -> None:
        """Stop applying ``fn`` at later loads (nothing where it is not registered); the
        module loaded now stays as it is."""
        with object.__getattribute__(self, "_ondeck_lock"):
            transforms = object.__getattribute__(self, "_ondeck_transforms")
            if fn in transforms:
                transforms.remove(fn)
                self._changed()

    def _changed(self) -> None:
        """What a load makes changed (see ``changes``)."""
        changes = object.__getattribute__(self, "_ondeck_changes")
        object.__setattr__(self, "_ondeck_changes", changes + 1)

    def _apply_or_release(self, fn: Callable[[Any], Any], module: Any) -> Any:
        """``fn(module)`` on the loaded module; where it raises, the module may be left
        half changed (some layers fused, say), so it is released: the next access loads
        it without ``fn``."""
        try:
            return fn(module)
        except BaseException:
            self.release()
            raise

    def on_release(self, fn: Callable[..., Any]) -> LazyModule:
        """Call ``fn`` (with the module, if it takes an argument) on every release."""
        object.__getattribute__(self, "_ondeck_release_callbacks").append(fn)
        return self

    def add_observer(self, observer: Any) -> None:
        observers = object.__getattribute__(self, "_ondeck_observers")
        if observer not in observers:
            observers.append(observer)

    def remove_observer(self, observer: Any) -> None:
        observers = object.__getattribute__(self, "_ondeck_observers")
        if observer in observers:
            observers.remove(observer)

    # -- forwarding ---------------------------------------------------------------------

    def __getattr__(self, attribute: str) -> Any:
        if attribute in INTERNAL_ATTRIBUTES:
            raise AttributeError(attribute)
        if (
            attribute in _ABSENT_WHILE_UNLOADED
            and object.__getattribute__(self, "_ondeck_module") is None
        ):
            raise AttributeError(attribute)
        module = self.materialize()
        value = getattr(module, attribute)
        if inspect.ismethod(value) and value.__self__ is module:
            return self._wrap_method(attribute, value)
        return value

    def _wrap_method(self, attribute: str, method: Callable) -> Callable:
        proxy = self

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if attribute in REPLAYED_METHODS:
                object.__getattribute__(proxy, "_ondeck_replay").add(attribute, args, kwargs)
            if result is method.__self__:
                # Return the proxy, not the module: a strong reference to the module
                # held by the caller could never be released.
                current = object.__getattribute__(proxy, "_ondeck_module")
                if current is method.__self__:
                    return proxy
            return result

        return call

    def __setattr__(self, attribute: str, value: Any) -> None:
        if attribute in INTERNAL_ATTRIBUTES:
            object.__setattr__(self, attribute, value)
            return
        setattr(self.materialize(), attribute, value)

    def __delattr__(self, attribute: str) -> None:
        delattr(self.materialize(), attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for observer in object.__getattribute__(self, "_ondeck_observers"):
            called = getattr(observer, "component_called", None)
            if called is not None:
                called(self)  # a planner weighs streaming by how often each is called
        # A call may start while a pipelined load still brings blocks in: each block's
        # forward waits for its own weights.
        result = self.materialize(complete=False)(*args, **kwargs)
        for observer in object.__getattribute__(self, "_ondeck_observers"):
            returned = getattr(observer, "component_returned", None)
            if returned is not None:
                returned(self)  # and by how long a call computes
        return result

    def __len__(self) -> int:
        return len(self.materialize())

    def __iter__(self):
        return iter(self.materialize())

    def __getitem__(self, key: Any) -> Any:
        return self.materialize()[key]

    def __contains__(self, item: Any) -> bool:
        return item in self.materialize()
