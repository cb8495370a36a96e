"""Proxies for a diffusers pipeline's components: configuring calls become transforms
that survive a release, placement calls redirect future loads."""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import LoadError, OndeckError
from ...lazy import INTERNAL_ATTRIBUTES, REPLAYED_METHODS, ComponentSpec, LazyModule, loaded_module
from ...loader import as_loader
from ...loading.folder_loader import FolderLoader
from .decode import is_vae
from .encodings import EncodingCache
from .fused_lora import (
    ADAPTER_METHODS,
    FusedLora,
    adapter_bytes,
    asked_by_lora_scaling,
    budget_overrun,
    is_adapter_call,
    mark_recorded,
)

# Attributes diffusers reads to inspect a component (hooks, stateful caches), not to
# use it: answering them must neither load the component nor start its turn.
_PROBES = frozenset(
    {"_hf_hook", "_diffusers_hook", "hf_device_map", "_ondeck_hook", "_reset_stateful_cache"}
)

# Methods that configure a component rather than compute with it. Called through the
# proxy they become transforms: applied now if the component is loaded, and after
# every later load, so a release never loses them; an unloaded component stays so.
_CONFIGURING_METHODS = ADAPTER_METHODS | frozenset(
    {
        # attention, memory and speed settings; a compile applies to each fresh module
        "compile",
        "compile_repeated_blocks",
        "set_attn_processor",
        "set_default_attn_processor",
        "set_attention_backend",
        "reset_attention_backend",
        "fuse_qkv_projections",
        "unfuse_qkv_projections",
        "enable_tiling",
        "disable_tiling",
        "enable_slicing",
        "disable_slicing",
        "enable_forward_chunking",
        "disable_forward_chunking",
        "enable_layerwise_casting",
        "enable_cache",
        "disable_cache",
        "enable_xformers_memory_efficient_attention",
        "disable_xformers_memory_efficient_attention",
        "set_use_memory_efficient_attention_xformers",
        "set_use_npu_flash_attention",
        "set_attention_slice",
        "enable_freeu",
        "disable_freeu",
        "enable_gradient_checkpointing",
        "disable_gradient_checkpointing",
    }
)

_ADAPTER_LOADS = frozenset({"load_lora_adapter", "load_adapter"})
# One adapter call at a time in the process: peft adds an adapter's layers with torch's
# parameter registration patched for every thread (``init_empty_weights``), so a LoRA
# replayed on the prefetch thread would turn another thread's load of one into a failure.
ADAPTER_CALLS = threading.RLock()
# What diffusers and peft read to find a model's adapters: a module a fused LoRA's recipe
# made has none, so asking makes the next load replay the recorded calls in full.
_ADAPTER_STATE = frozenset(
    {
        "peft_config",
        "_hf_peft_config_loaded",
        "active_adapters",
        "modules",
        "named_modules",
        "apply",
    }
)
# Calls that change a loaded component's weights in place.
_FUSING_METHODS = frozenset({"fuse_lora", "unfuse_lora"})
# Methods that only set hooks' state (which cache a call writes to) and never read a
# weight: answered while a pipelined load is still bringing blocks in, so a pipeline
# that enters ``transformer.cache_context(...)`` before each call still starts
# computing on the first blocks.
_HOOK_ONLY_METHODS = frozenset({"cache_context"})

# Placement methods: on a proxy they redirect where (and in which dtype) the loader
# puts the weights, so a reload lands there directly instead of moving afterwards.
_PLACEMENT_METHODS = {
    "to": None,
    "cuda": None,
    "cpu": None,
    "half": torch.float16,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}

# Walks of a component's modules: reading them changes nothing a call answers.
_MODULE_WALKS = frozenset({"modules", "named_modules"})


@functools.cache
def _device_probes() -> frozenset:
    """The code of diffusers' functions that walk a component's modules only to find
    offload hooks, before a text encoder's call (``get_module_execution_device``)."""
    import importlib

    functions = []
    for module_name, name in (
        ("diffusers.utils.torch_utils", "get_module_execution_device"),
        ("diffusers.hooks.group_offloading", "_get_top_level_group_offload_hook"),
    ):
        try:  # diffusers releases before these had no such probe
            functions.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    return frozenset(function.__code__ for function in functions)


def _one_adapter_call_at_a_time(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` (an adapter call, its marks kept) holding ``ADAPTER_CALLS``."""

    @functools.wraps(fn)
    def one_at_a_time(module: Any) -> Any:
        with ADAPTER_CALLS:
            return fn(module)

    return one_at_a_time


def _asked_by_device_probe() -> bool:
    """Whether the attribute being read was asked for by one of ``_device_probes``:
    an unloaded component has no hooks, and answering the walk with the proxy alone
    lets a call whose answer is kept skip the load."""
    caller = sys._getframe(2)  # this function, PipelineComponent.__getattr__, the asker
    return caller.f_code in _device_probes()


_PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


def is_plain_value(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(is_plain_value(item) for item in value)
    return isinstance(value, _PLAIN_TYPES)


def fresh_copy(value: Any, copy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """Tensors copied (by ``copy``, else a clone each), containers rebuilt: a replayed
    call must not share storage with the module it built before, since a release frees
    that module's storage."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if copy is None else copy(value)
    if isinstance(value, dict):
        return type(value)((key, fresh_copy(item, copy)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(fresh_copy(item, copy) for item in value)
    return value


def _nothing_to_reset(*args: Any, **kwargs: Any) -> None:
    """An unloaded component has no stateful hooks to reset."""


class PipelineComponent(LazyModule):
    """A :class:`~ondeck.LazyModule` that belongs to a diffusers pipeline.

    It tells the pipeline's runtime when a call touches it, answers diffusers' hook
    probes without loading, records configuring calls as transforms, and turns
    placement calls into a new target for its loader.
    """

    def __init__(
        self,
        name: str,
        loader: Callable[[], Any],
        *,
        spec: ComponentSpec | None = None,
        make_loader: Callable[[torch.device, torch.dtype], Any] | None = None,
    ):
        super().__init__(name, loader, spec=spec)
        setter = object.__setattr__
        setter(self, "_ondeck_runtime", None)
        setter(self, "_ondeck_stand_in", None)
        setter(self, "_ondeck_make_loader", make_loader)
        setter(self, "_ondeck_adapters", [])
        # A textual inversion's rows of the embedding table (``pipeline_lora._AddedRows``).
        setter(self, "_ondeck_added_rows", None)
        setter(self, "_ondeck_fused_lora", FusedLora())
        # An encoder's answers by their inputs (see ``keep_answers``); None: not kept.
        setter(self, "_ondeck_answers", None)
        setter(self, "_ondeck_lora_scale", None)  # (transform, modules scaled) while held
        # The bytes of the adapters' layers a load adds, counted in the spec's nbytes.
        setter(self, "_ondeck_adapter_bytes", 0)

    # -- touches ------------------------------------------------------------------------

    @property
    def ondeck_runtime(self) -> Any:
        """The runtime of the pipeline this component belongs to (its touches start
        turns there, its decode is sized there); None once it belongs to none."""
        return object.__getattribute__(self, "_ondeck_runtime")

    def belong_to(self, runtime: Any) -> None:
        """Make ``runtime`` the one this component reports to (None: no runtime)."""
        object.__setattr__(self, "_ondeck_runtime", runtime)

    def materialize(self, *, complete: bool = True) -> Any:
        runtime = object.__getattribute__(self, "_ondeck_runtime")
        if runtime is not None:
            runtime.component_touched(self)
        return LazyModule.materialize(self, complete=complete)

    # -- answers kept across calls ------------------------------------------------------

    def keep_answers(self) -> None:
        """Answer a call this component has answered before from host memory, without
        loading it. For encoders: a negative prompt every run shares, a prompt run again
        with a new seed. A change made to the loaded module other than through this
        proxy's attributes (through ``modules()`` or ``config``) is not seen: call
        ``answers.clear()`` after one."""
        object.__setattr__(self, "_ondeck_answers", EncodingCache())

    @property
    def answers(self) -> EncodingCache | None:
        """The answers kept (``hits``, ``misses``, ``len``), or None when none are."""
        return object.__getattribute__(self, "_ondeck_answers")

    def _forget_answers(self) -> None:
        """Something other than a call reached the component (it may change what a call
        answers): nothing kept is trusted any more."""
        answers = object.__getattribute__(self, "_ondeck_answers")
        if answers is not None:
            answers.clear()

    def _hold_lora_scale(self, kind: str, weight: Any) -> None:
        """diffusers' ``scale_lora_layers`` (``kind`` "scale") or ``unscale_lora_layers``
        on this component. The scale is held as a transform until it is taken back: a
        component released and loaded again in between (another encoder's turn) computes
        at it, and only the modules it scaled are scaled back, never a fresh load."""
        from diffusers.utils.peft_utils import scale_lora_layers, unscale_lora_layers

        transforms = object.__getattribute__(self, "_ondeck_transforms")
        with object.__getattribute__(self, "_ondeck_lock"):
            held = object.__getattribute__(self, "_ondeck_lora_scale")
            object.__setattr__(self, "_ondeck_lora_scale", None)
            if held is not None and held[0] in transforms:
                transforms.remove(held[0])
                self._changed()
            if kind == "unscale":
                module = object.__getattribute__(self, "_ondeck_module")
                if held is not None and module is not None and module in held[1]:
                    unscale_lora_layers(module, weight)
                return
        scaled: weakref.WeakSet = weakref.WeakSet()

        def scale(module: Any) -> Any:
            scale_lora_layers(module, weight)
            scaled.add(module)
            return module

        scale.__qualname__ = f"LoRA scale {weight} (held until scaled back)"
        self.add_transform(scale, reads_weights=False)  # its layers' scale, no weight
        added = next(t for t in reversed(transforms) if getattr(t, "fn", t) is scale)
        object.__setattr__(self, "_ondeck_lora_scale", (added, scaled))

    def _has_adapters(self) -> bool:
        module = object.__getattribute__(self, "_ondeck_module")
        adapters = object.__getattribute__(self, "_ondeck_adapters")  # named or not
        return bool(adapters or getattr(module, "peft_config", None))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        answers = object.__getattribute__(self, "_ondeck_answers")
        runtime = object.__getattribute__(self, "_ondeck_runtime")
        key = None
        if answers is not None and not self._has_adapters():
            key = answers.key(args, kwargs)
        if key is None:
            result = LazyModule.__call__(self, *args, **kwargs)
        else:
            found = answers.get(key)
            if found is not None:
                if runtime is not None:
                    runtime.call_ended(self, computed=False)
                return found
            generation = answers.generation
            result = LazyModule.__call__(self, *args, **kwargs)
            module = object.__getattribute__(self, "_ondeck_module")
            if module is not None and not module.training:  # dropout would make it random
                answers.put(key, result, generation)
        if runtime is not None:
            runtime.call_ended(self)  # may start the next turn, releasing this component
        return result

    # -- attribute access ---------------------------------------------------------------

    def __getattr__(self, attribute: str) -> Any:
        if attribute in INTERNAL_ATTRIBUTES or attribute.startswith("_ondeck_"):
            raise AttributeError(attribute)
        module = object.__getattribute__(self, "_ondeck_module")
        declared = object.__getattribute__(self, "_ondeck_spec").cls
        if attribute in _PROBES:
            if module is not None:
                return getattr(module, attribute)
            if attribute == "_reset_stateful_cache" and hasattr(declared, attribute):
                return _nothing_to_reset
            raise AttributeError(attribute)
        if attribute in _MODULE_WALKS:
            if module is None and _asked_by_device_probe():
                return lambda: iter((self,))  # no offload hooks to find: nothing loads
            scaling = asked_by_lora_scaling()
            if scaling is not None:
                self._hold_lora_scale(*scaling)
                return lambda: iter(())  # done here, on every load while it is held
        else:
            self._forget_answers()
        if attribute in _ADAPTER_STATE:
            self._drop_module_without_adapters()
        if attribute in _PLACEMENT_METHODS and self._can_retarget():
            return self._placement_call(attribute)
        if attribute in _HOOK_ONLY_METHODS and hasattr(declared or type(module), attribute):
            return getattr(self.materialize(complete=False), attribute)
        if attribute == "decode" and is_vae(declared):
            runtime = object.__getattribute__(self, "_ondeck_runtime")
            decoder = runtime.fitting_decode(self) if runtime is not None else None
            if decoder is not None:
                return decoder  # sized to fit, tiles if need be
        if attribute in _CONFIGURING_METHODS:
            if hasattr(declared or type(module), attribute):
                return self._recorded_call(attribute)
            if module is None and declared is not None:
                # A probe such as diffusers' ``hasattr(m, "set_attention_slice")``: the
                # declared class answers it, and nothing loads.
                raise AttributeError(attribute)
        if module is None:
            if attribute in REPLAYED_METHODS:
                return self._deferred_replay(attribute)
            stand_in = object.__getattribute__(self, "_ondeck_stand_in")
            if stand_in is not None:
                value = stand_in.plain_attribute(attribute)
                if value is not None:
                    return value
        return LazyModule.__getattr__(self, attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        if attribute in INTERNAL_ATTRIBUTES or attribute.startswith("_ondeck_"):
            object.__setattr__(self, attribute, value)
            return
        self._forget_answers()
        if not is_plain_value(value):
            LazyModule.__setattr__(self, attribute, value)
            return
        # A plain setting (a flag, a size) is kept and set again after every load, in
        # its place among the recorded calls: settings one after the other share one
        # transform, a setting after a recorded call starts a new one.
        transforms = object.__getattribute__(self, "_ondeck_transforms")
        settings = getattr(transforms[-1], "settings", None) if transforms else None
        if settings is None:
            self.add_checked_transform(_apply_settings({attribute: value}))
            return
        with object.__getattribute__(self, "_ondeck_lock"):
            module = object.__getattribute__(self, "_ondeck_module")
            if module is not None:
                setattr(module, attribute, value)  # a refused setting is not kept
            settings[attribute] = value
            self._changed()

    def __delattr__(self, attribute: str) -> None:
        self._forget_answers()
        LazyModule.__delattr__(self, attribute)
        # A deleted setting is not set again at the next load.
        for fn in object.__getattribute__(self, "_ondeck_transforms"):
            getattr(fn, "settings", {}).pop(attribute, None)

    # -- recorded calls -----------------------------------------------------------------

    def _recorded_call(self, method: str) -> Callable[..., None]:
        proxy = self

        def call(*args: Any, **kwargs: Any) -> None:
            if "_pipeline" in kwargs:
                # diffusers hands the pipeline over to manage offload hooks; probing it
                # would load every component, and ondeck places nothing with hooks.
                kwargs["_pipeline"] = None

            def apply(module: Any) -> Any:
                if method in _FUSING_METHODS:
                    proxy.refuse_fusing_streamed(method)
                getattr(module, method)(*fresh_copy(args), **fresh_copy(kwargs))
                return module

            apply.__qualname__ = f"{method} (recorded)"
            mark_recorded(apply, method, args, kwargs)
            if method in ADAPTER_METHODS:
                apply.on_skeleton = True
            if method in _ADAPTER_LOADS:
                proxy.load_adapter_checked(apply, kwargs.get("adapter_name"))
                return
            proxy.add_checked_transform(apply)
            if method == "delete_adapters":
                proxy.forget_adapters(args[0] if args else kwargs.get("adapter_names", ()))
            elif method == "unload_lora":
                proxy.forget_adapters(None)

        call.__name__ = method
        return call

    def add_checked_transform(self, fn: Callable[[Any], Any]) -> None:
        """Register ``fn`` after every load; a call that fails is not kept.

        Applied now when loaded, so a mistake raises at once. When it only fails at a
        later load, that load raises and the transform is dropped, so the next
        access loads without it.
        """
        transforms = object.__getattribute__(self, "_ondeck_transforms")
        self._forget_answers()
        if getattr(fn, "on_skeleton", False):
            fn = _one_adapter_call_at_a_time(fn)

        def guarded(module: Any) -> Any:
            try:
                return fn(module)
            except BaseException:
                # Not from a load ahead, whose error is a warning: the stage's own load
                # would then succeed without the call. It fails there too, and says so.
                if guarded in transforms and not self.in_load_ahead():
                    transforms.remove(guarded)
                raise

        guarded.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        if hasattr(fn, "recorded_call"):
            guarded.recorded_call = fn.recorded_call
        if hasattr(fn, "settings"):
            guarded.settings = fn.settings
        guarded.on_skeleton = getattr(fn, "on_skeleton", False)
        if is_adapter_call(guarded):
            self._drop_module_without_adapters()
        self._complete_filling()  # the call may change weights still arriving
        with object.__getattribute__(self, "_ondeck_lock"):
            module = object.__getattribute__(self, "_ondeck_module")
            if module is not None:
                result = self._apply_or_release(fn, module)
                if result is not None and result is not module:
                    object.__setattr__(self, "_ondeck_module", result)
            transforms.append(guarded)
            self._changed()
            object.__getattribute__(self, "_ondeck_fused_lora").keep_only_for(transforms)

    def in_load_ahead(self) -> bool:
        """Whether this thread loads ahead of the call (a prefetch, the next call's)."""
        runtime = object.__getattribute__(self, "_ondeck_runtime")
        return runtime is not None and runtime.executor.in_prefetch_thread()

    def add_transform(self, fn: Callable[[Any], Any], *, reads_weights: bool = True) -> LazyModule:
        """:meth:`LazyModule.add_transform`; a module made by a fused LoRA's recipe is
        released first, since ``fn`` might look for its adapters."""
        if reads_weights:
            self._drop_module_without_adapters()
        self._forget_answers()
        LazyModule.add_transform(self, fn, reads_weights=reads_weights)
        with object.__getattribute__(self, "_ondeck_lock"):
            transforms = object.__getattribute__(self, "_ondeck_transforms")
            object.__getattribute__(self, "_ondeck_fused_lora").keep_only_for(transforms)
        return self

    def _transforms_for_load(self) -> list[Callable[[Any], Any]]:
        """The recorded calls, with a fused LoRA's loads and fuse replaced by its recipe
        once a load has taken one (not while the blocks stream: fusing is refused)."""
        transforms = LazyModule._transforms_for_load(self)
        if self._streams_blocks():
            return transforms
        return object.__getattribute__(self, "_ondeck_fused_lora").transforms_for_load(transforms)

    def _drop_module_without_adapters(self) -> None:
        """A module made by a fused LoRA's recipe has no peft layers to find or change:
        before anything looks for them, it is released, and the next load replays the
        recorded calls in full."""
        fused = object.__getattribute__(self, "_ondeck_fused_lora")
        module = loaded_module(self)
        if fused.recipe is None or (module is not None and not fused.built_fast(module)):
            return
        fused.full_next = True
        if module is not None:
            self.release()

    def forget_fused_lora(self) -> None:
        """Drop the fused LoRA's recipe (its factors); the next load replays in full."""
        with object.__getattribute__(self, "_ondeck_lock"):
            object.__getattribute__(self, "_ondeck_fused_lora").forget()

    def _deferred_replay(self, method: str) -> Callable[..., Any]:
        """``eval()``, ``requires_grad_(False)``, ... on an unloaded component: remembered
        and applied at load, like the base proxy does after loading."""
        proxy = self

        def call(*args: Any, **kwargs: Any) -> Any:
            with object.__getattribute__(proxy, "_ondeck_lock"):
                if object.__getattribute__(proxy, "_ondeck_module") is not None:
                    return LazyModule.__getattr__(proxy, method)(*args, **kwargs)
                object.__getattribute__(proxy, "_ondeck_replay").add(method, args, kwargs)
            return proxy

        call.__name__ = method
        return call

    def refuse_fusing_streamed(self, method: str) -> None:
        """A fused LoRA changes the weights in place; the blocks that stream are brought
        in from their host copies before every pass, which hold the weights before it,
        so the fusion would silently be lost for those blocks. Weights kept in float8
        cannot take the sum in their own dtype (torch has no float8 arithmetic)."""
        loader = object.__getattribute__(self, "_ondeck_loader")
        stored = loader.storage_dtype if isinstance(loader, FolderLoader) else None
        if stored is not None and stored.itemsize == 1:
            raise OndeckError(
                f"component '{self._ondeck_name}' keeps its weights in {stored}, and "
                f"{method} would add the LoRA to them in that dtype, which torch cannot do; "
                "keep the LoRA unfused (set_adapters)"
            )
        if self._streams_blocks():
            raise OndeckError(
                f"component '{self._ondeck_name}' streams its blocks, and {method} would "
                "change weights that stream in again from their host copies before every "
                "pass; keep the LoRA unfused (set_adapters), or give the budget room for "
                "the whole component"
            )

    def _streams_blocks(self) -> bool:
        loader = object.__getattribute__(self, "_ondeck_loader")
        return isinstance(loader, FolderLoader) and loader.placement is not None

    def try_on_skeleton(
        self, fn: Callable[[Any], Any], *, loaded_too: bool = False
    ) -> tuple[set[str], Any] | None:
        """Apply the adapter calls recorded so far (those marked ``on_skeleton``), then
        ``fn``, to a weightless copy of this unloaded component (its skeleton, on the
        meta device): a call that cannot apply (a LoRA for other shapes, an adapter name
        in use) fails now, as it would on a loaded module, not at a later load. Returns
        the adapters the copy had before ``fn`` and the copy after it; None where the
        component is loaded (it applies the call for real; ``loaded_too``: tried all the
        same) or has no skeleton to build."""
        loader = object.__getattribute__(self, "_ondeck_loader")
        loaded = loaded_module(self) is not None and not loaded_too
        if loaded or not isinstance(loader, FolderLoader):
            return None
        try:
            module = loader.weightless_module()
        except LoadError:
            return None  # the load itself reports what is wrong with the folder
        with ADAPTER_CALLS:
            try:
                for earlier in object.__getattribute__(self, "_ondeck_transforms"):
                    if getattr(earlier, "on_skeleton", False):
                        earlier(module)
            except Exception:
                return None  # one a weightless copy cannot take (a safe fuse reads values)
            before = set(getattr(module, "peft_config", None) or {})
            fn(module)
        return before, module

    def load_adapter_checked(self, fn: Callable[[Any], Any], name: str | None) -> None:
        """Record ``fn``, a call that loads adapters, once it applied to the skeleton (or
        to the loaded module), and note the adapters it added there: none where the
        LoRA holds nothing for this component, and the name diffusers gives an unnamed
        one. Without a skeleton, ``name`` (None: named as it loads)."""
        # Loaded under a budget, the copy sizes the adapters before they go on it.
        tried = self.try_on_skeleton(fn, loaded_too=self._over_budget(None))
        if tried is not None and self._over_budget(adapter_bytes(tried[1])):
            self.release()  # before they are added to it: its next load holds them
        self.add_checked_transform(fn)
        module = loaded_module(self)
        if module is not None:
            before, after = set(), module  # added for real: what it has now
        elif tried is not None:
            before, after = tried
        else:
            self.record_adapter(name)
            return
        for added in getattr(after, "peft_config", None) or {}:
            if added not in before:
                self.record_adapter(added)
        self._count_adapter_bytes(after)

    def _count_adapter_bytes(self, module: Any) -> None:
        """The plan counts the adapters' layers as a load will hold them: ``module`` (the
        skeleton after every adapter load so far, or the loaded module) holds them all.
        Added to the resident module, they count at once, and outside a call a budget
        they overrun frees the module (its next load holds them)."""
        adapters = adapter_bytes(module)
        spec = object.__getattribute__(self, "_ondeck_spec")
        counted = object.__getattribute__(self, "_ondeck_adapter_bytes")
        if spec.nbytes is None or adapters == counted:
            return
        object.__setattr__(
            self, "_ondeck_spec", spec.with_updates(nbytes=spec.nbytes - counted + adapters)
        )
        object.__setattr__(self, "_ondeck_adapter_bytes", adapters)
        runtime = self.ondeck_runtime
        name = runtime.deferred_name(self) if runtime is not None else None
        if name is not None and module is loaded_module(self) and name in runtime.tracker.resident:
            runtime.tracker.resized(name, runtime.tracker.resident[name] - counted + adapters)
            if budget_overrun(runtime, 0):
                self.release()

    def _over_budget(self, adapters: int | None) -> bool:
        """Whether this module, resident, with adapters of ``adapters`` bytes in all (those
        counted so far replaced), takes the pipeline over its budget outside a call
        (None: whether a budget binds it so)."""
        counted = object.__getattribute__(self, "_ondeck_adapter_bytes")
        added = None if adapters is None else adapters - counted
        return loaded_module(self) is not None and budget_overrun(self.ondeck_runtime, added)

    def added_rows(self, make: Callable[[], Any]) -> Any:
        """What textual inversions added to this encoder's embedding table, kept with
        the component (made by ``make`` the first time)."""
        rows = object.__getattribute__(self, "_ondeck_added_rows")
        if rows is None:
            rows = make()
            object.__setattr__(self, "_ondeck_added_rows", rows)
        return rows

    def record_adapter(self, name: str | None) -> None:
        """Note that a recorded call loads adapter ``name`` into this component (None:
        one diffusers names as it loads)."""
        adapters = object.__getattribute__(self, "_ondeck_adapters")
        if name is None or name not in adapters:
            adapters.append(name)

    def forget_adapters(self, names: str | Sequence[str] | None) -> None:
        """Recorded calls delete adapters ``names`` (one name, several, None: every one)."""
        names = [names] if isinstance(names, str) else names
        adapters = object.__getattribute__(self, "_ondeck_adapters")
        adapters[:] = [] if names is None else [a for a in adapters if a not in names]

    def known_adapters(self) -> list[str] | None:
        """The adapters this component has, without loading it: the loaded module's,
        else those the recorded calls load; None when one of those is named only as it
        loads."""
        module = loaded_module(self)
        fused = object.__getattribute__(self, "_ondeck_fused_lora")
        if module is not None and not fused.built_fast(module):
            return list(getattr(module, "peft_config", None) or {})
        adapters = object.__getattribute__(self, "_ondeck_adapters")
        return None if None in adapters else list(adapters)

    # -- placement ----------------------------------------------------------------------

    def _can_retarget(self) -> bool:
        return object.__getattribute__(self, "_ondeck_make_loader") is not None

    def _placement_call(self, method: str) -> Callable[..., Any]:
        proxy = self

        def call(*args: Any, **kwargs: Any) -> Any:
            device, dtype = _placement_of(method, args, kwargs)
            proxy.retarget(
                device, dtype, move=lambda module: getattr(module, method)(*args, **kwargs)
            )
            return proxy

        call.__name__ = method
        return call

    def retarget(
        self,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        move: Callable[[Any], Any] | None = None,
    ) -> None:
        """Load onto ``device`` in ``dtype`` from now on (None keeps the current one).

        ``move(module)``, if given, moves a module already loaded, once all its weights
        have arrived (a pipelined load may still be filling it).
        """
        if move is not None:
            self._complete_filling()
        self._forget_answers()
        if _resizes(loaded_module(self), dtype):
            # Cast in place, it would hold other bytes than the plan counts for it: it
            # goes, and loads again in the new dtype where its turn puts it.
            self.release()
        with object.__getattribute__(self, "_ondeck_lock"):
            self._retarget_locked(device, dtype)
            module = object.__getattribute__(self, "_ondeck_module")
            if move is not None and module is not None:
                move(module)
        if dtype is not None:
            self._record_cast(dtype)

    def _record_cast(self, dtype: torch.dtype) -> None:
        """A cast reaches every floating tensor, as ``module.to(dtype)`` does, the layers
        the model keeps in float32 when loaded in ``dtype`` included: a load in the new
        dtype keeps them, so the cast is replayed after it (the latest cast alone). Not
        where the weights are stored narrower (float8, GGUF): their upcast is per layer; nor
        where the blocks stream."""
        stored = as_loader(object.__getattribute__(self, "_ondeck_loader")).upcast_bytes
        if stored or not dtype.is_floating_point:  # float8 or GGUF: upcast per layer
            return
        transforms = object.__getattribute__(self, "_ondeck_transforms")
        with object.__getattribute__(self, "_ondeck_lock"):
            transforms[:] = [fn for fn in transforms if not hasattr(fn, "cast_to")]

        proxy = self

        def cast(module: Any) -> Any:
            # Streamed blocks' tensors view the device slots: the load put them in the
            # dtype, and a cast would copy them out of the slots.
            return module if proxy._streams_blocks() else module.to(dtype)

        cast.__qualname__ = f"to({dtype}) (recorded)"
        cast.cast_to = dtype
        self.add_transform(cast, reads_weights=False)

    def _retarget_locked(self, device: Any, dtype: torch.dtype | None) -> None:
        make_loader = object.__getattribute__(self, "_ondeck_make_loader")
        loader = object.__getattribute__(self, "_ondeck_loader")
        if make_loader is None:
            raise OndeckError(f"component '{self._ondeck_name}' has no loader to retarget")
        new_device = torch.device(device) if device is not None else loader.device
        new_dtype = dtype if dtype is not None else loader.dtype
        if new_device == loader.device and new_dtype == loader.dtype:
            return
        new_loader = make_loader(new_device, new_dtype)
        object.__setattr__(self, "_ondeck_loader", new_loader)
        self._changed()
        # The recorded adapters replay on the new loader's loads: their bytes stay counted.
        spec, adapters = new_loader.spec, object.__getattribute__(self, "_ondeck_adapter_bytes")
        if spec.nbytes is not None:
            spec = spec.with_updates(nbytes=spec.nbytes + adapters)
        object.__setattr__(self, "_ondeck_spec", spec)


def owned_elsewhere(name: str, value: Any, runtime: Any = None) -> OndeckError | None:
    """The error for giving ``value`` as component ``name`` of a pipeline (``runtime``'s,
    or one being made) when it is a deferred component of another ondeck pipeline: its
    runtime loads and frees it, and a proxy reports to one runtime."""
    owner = value.ondeck_runtime if issubclass(type(value), PipelineComponent) else None
    if owner is None or owner is runtime:
        return None
    return OndeckError(
        f"component '{name}' is a deferred component of another ondeck pipeline (a "
        f"{type(owner.pipe).__name__}), whose runtime loads and frees it; it belongs to one "
        "pipeline at a time. Take it out of that pipeline first (assign None or another "
        f"module to its '{owner.deferred_name(value) or name}'), load each pipeline with "
        "ondeck.diffusers.from_pretrained (one host_cache=HostCache(...) given to both keeps "
        "one host copy of the files they share), or give a module you loaded yourself (it "
        "stays resident)"
    )


def _resizes(module: Any, dtype: torch.dtype | None) -> bool:
    """Whether casting ``module`` to ``dtype`` changes the bytes it holds."""
    if module is None or dtype is None or not dtype.is_floating_point:
        return False
    return any(
        tensor.is_floating_point() and tensor.element_size() != dtype.itemsize
        for tensor in (*module.parameters(), *module.buffers())
    )


def _apply_settings(settings: dict[str, Any]) -> Callable[[Any], Any]:
    def apply(module: Any) -> Any:
        for attribute, value in settings.items():
            setattr(module, attribute, value)
        return module

    apply.__qualname__ = "attribute settings (recorded)"
    apply.settings = settings
    mark_recorded(apply, "setattr", (), {})
    return apply


def _placement_of(method: str, args: tuple, kwargs: dict) -> tuple[Any, torch.dtype | None]:
    if method == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return device, dtype
    if method == "cuda":
        index = args[0] if args else kwargs.get("device")
        if isinstance(index, torch.device):
            return index, None
        return (torch.device("cuda", index) if index is not None else torch.device("cuda")), None
    if method == "cpu":
        return torch.device("cpu"), None
    return None, _PLACEMENT_METHODS[method]
