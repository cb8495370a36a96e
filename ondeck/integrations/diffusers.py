"""Any diffusers pipeline, with its heavy components loaded on demand.

``from_pretrained(path)`` returns the genuine diffusers pipeline object (an instance of
the class ``model_index.json`` names), whose ``nn.Module`` components are
:class:`PipelineComponent` proxies: nothing is loaded until a call first uses a
component, and the policy decides when it goes.

A call of the pipeline is modelled as ondeck stages, one per component, in the order
the call first touches them (``model_cpu_offload_seq`` until a call has been seen).
A stage starts when its component is first touched in the call and holds every
component the call touches until the next stage starts, so ``release`` frees a
component once no later stage needs it, and ``budget`` keeps components resident
across calls, evicts by next use and prefetches the next one, exactly as for an
ondeck :class:`~ondeck.Pipeline`.

What survives a release, because it is re-applied after every load:

- transforms: ``pipe.ondeck.add_transform("transformer", torch.compile)``;
- LoRA: ``pipe.load_lora_weights(...)`` and the adapter methods of the components
  (``set_adapters``, ``fuse_lora``, ``delete_adapters``, ...), which are recorded as
  transforms instead of loading the component;
- settings made through a component: ``pipe.vae.enable_tiling()``,
  ``pipe.transformer.compile()``, ``pipe.transformer.set_attention_backend(...)``,
  ``pipe.vae.use_framewise_decoding = False`` (plain values);
- placement: ``pipe.to(device)`` and ``pipe.vae.to(dtype)`` redirect future loads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError, OndeckError
from ..lazy import _INTERNAL, _REPLAYED_METHODS, ComponentSpec, LazyModule, is_lazy
from ..memory import resolve_device
from ..stages import Pipeline, Stage

__all__ = ["DiffusersRuntime", "PipelineComponent", "ComponentTurn", "from_pretrained"]

# Attributes diffusers reads to inspect a component (hooks, stateful caches), not to
# use it: answering them must neither load the component nor start its turn.
_PROBES = frozenset(
    {"_hf_hook", "_diffusers_hook", "hf_device_map", "_ondeck_hook", "_reset_stateful_cache"}
)

# Methods that configure a component rather than compute with it. Called through the
# proxy they become transforms: applied now if the component is loaded, and after
# every later load, so a release never loses them; an unloaded component stays so.
_CONFIGURING_METHODS = frozenset(
    {
        # PEFT adapters (diffusers' PeftAdapterMixin)
        "load_lora_adapter",
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
        # attention, memory and speed settings
        "compile",
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
    }
)

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

_PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(item) for item in value)
    return isinstance(value, _PLAIN_TYPES)


def _fresh(value: Any) -> Any:
    """Tensors copied, containers rebuilt: a replayed call must not share storage with
    the module it built before, since a release frees that module's storage."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((key, _fresh(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_fresh(item) for item in value)
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
        setter(self, "_ondeck_settings", {})

    # -- touches ------------------------------------------------------------------------

    def materialize(self) -> Any:
        runtime = object.__getattribute__(self, "_ondeck_runtime")
        if runtime is not None:
            runtime.component_touched(self)
        return LazyModule.materialize(self)

    # -- attribute access ---------------------------------------------------------------

    def __getattr__(self, attribute: str) -> Any:
        if attribute in _INTERNAL or attribute.startswith("_ondeck_"):
            raise AttributeError(attribute)
        module = object.__getattribute__(self, "_ondeck_module")
        declared = object.__getattribute__(self, "_ondeck_spec").cls
        if attribute in _PROBES:
            if module is not None:
                return getattr(module, attribute)
            if attribute == "_reset_stateful_cache" and hasattr(declared, attribute):
                return _nothing_to_reset
            raise AttributeError(attribute)
        if attribute in _PLACEMENT_METHODS and self._can_retarget():
            return self._placement_call(attribute)
        if attribute in _CONFIGURING_METHODS and hasattr(declared or type(module), attribute):
            return self._recorded_call(attribute)
        if module is None:
            if attribute in _REPLAYED_METHODS:
                return self._deferred_replay(attribute)
            stand_in = object.__getattribute__(self, "_ondeck_stand_in")
            if stand_in is not None:
                value = stand_in.plain_attribute(attribute)
                if value is not None:
                    return value
        return LazyModule.__getattr__(self, attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        if attribute in _INTERNAL or attribute.startswith("_ondeck_"):
            object.__setattr__(self, attribute, value)
            return
        if not _is_plain(value):
            LazyModule.__setattr__(self, attribute, value)
            return
        # A plain setting (a flag, a size) is kept and set again after every load.
        settings = object.__getattribute__(self, "_ondeck_settings")
        first = not settings
        settings[attribute] = value
        if first:
            self._add_transform_checked(_apply_settings(settings))
        else:
            module = object.__getattribute__(self, "_ondeck_module")
            if module is not None:
                setattr(module, attribute, value)

    # -- recorded calls -----------------------------------------------------------------

    def _recorded_call(self, method: str) -> Callable[..., None]:
        proxy = self

        def call(*args: Any, **kwargs: Any) -> None:
            if "_pipeline" in kwargs:
                # diffusers hands the pipeline over to manage offload hooks; probing it
                # would load every component, and ondeck places nothing with hooks.
                kwargs["_pipeline"] = None

            def apply(module: Any) -> Any:
                getattr(module, method)(*_fresh(args), **_fresh(kwargs))
                return module

            apply.__qualname__ = f"{method} (recorded)"
            proxy._add_transform_checked(apply)

        call.__name__ = method
        return call

    def _add_transform_checked(self, fn: Callable[[Any], Any]) -> None:
        """Register ``fn`` after every load; a call that fails is not kept.

        Applied now when loaded, so a mistake raises at once. When it only fails at a
        later load, that load raises and the transform is dropped, so the next
        access loads without it.
        """
        transforms = object.__getattribute__(self, "_ondeck_transforms")

        def guarded(module: Any) -> Any:
            try:
                return fn(module)
            except BaseException:
                if guarded in transforms:
                    transforms.remove(guarded)
                raise

        guarded.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        with object.__getattribute__(self, "_ondeck_lock"):
            module = object.__getattribute__(self, "_ondeck_module")
            if module is not None:
                result = fn(module)
                if result is not None and result is not module:
                    object.__setattr__(self, "_ondeck_module", result)
            transforms.append(guarded)

    def _deferred_replay(self, method: str) -> Callable[..., Any]:
        """``eval()``, ``requires_grad_(False)``, ... on an unloaded component: remembered
        and applied at load, like the base proxy does after loading."""
        proxy = self

        def call(*args: Any, **kwargs: Any) -> Any:
            with object.__getattribute__(proxy, "_ondeck_lock"):
                if object.__getattribute__(proxy, "_ondeck_module") is not None:
                    return LazyModule.__getattr__(proxy, method)(*args, **kwargs)
                replay = object.__getattribute__(proxy, "_ondeck_replay")
                replay.pop(method, None)
                replay[method] = (args, kwargs)
            return proxy

        call.__name__ = method
        return call

    # -- placement ----------------------------------------------------------------------

    def _can_retarget(self) -> bool:
        return object.__getattribute__(self, "_ondeck_make_loader") is not None

    def _placement_call(self, method: str) -> Callable[..., Any]:
        proxy = self

        def call(*args: Any, **kwargs: Any) -> Any:
            device, dtype = _placement_of(method, args, kwargs)
            with object.__getattribute__(proxy, "_ondeck_lock"):
                proxy.retarget(device, dtype)
                module = object.__getattribute__(proxy, "_ondeck_module")
                if module is not None:
                    getattr(module, method)(*args, **kwargs)
            return proxy

        call.__name__ = method
        return call

    def retarget(self, device: Any = None, dtype: torch.dtype | None = None) -> None:
        """Load onto ``device`` in ``dtype`` from now on (None keeps the current one).

        Does not move a loaded module; callers that want that move it themselves.
        """
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
        object.__setattr__(self, "_ondeck_spec", new_loader.spec)


def _apply_settings(settings: dict[str, Any]) -> Callable[[Any], Any]:
    def apply(module: Any) -> Any:
        for attribute, value in settings.items():
            setattr(module, attribute, value)
        return module

    apply.__qualname__ = "attribute settings (recorded)"
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


class ComponentTurn(Stage):
    """The stretch of a diffusers call that starts when ``name`` is first touched.

    It holds every component the call touches before the next turn starts. The call
    itself runs the work; this stage only marks where residency decisions fall.
    """

    def __init__(self, name: str, components: list[LazyModule]):
        super().__init__()
        self.name = name
        self.components = components

    def forward(self, state: Any) -> Any:
        return state


class _CallRecord:
    """What one call did: components in first-touch order, and what each turn touched."""

    def __init__(self) -> None:
        self.first_touch: list[str] = []
        self.held: dict[str, list[str]] = {}

    def touched(self, name: str) -> None:
        if name not in self.held:
            self.first_touch.append(name)
            self.held[name] = [name]
            return
        turn = self.held[self.first_touch[-1]]
        if name not in turn:
            turn.append(name)

    def turns(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(name, tuple(self.held[name])) for name in self.first_touch]


class DiffusersRuntime(Pipeline):
    """ondeck's runtime for one diffusers pipeline: available as ``pipe.ondeck``.

    Each component's turn is a stage; ``plan()``, ``report()``, ``tracker``,
    ``policy``, ``release_all()`` and ``schedule`` work as for any ondeck pipeline.
    """

    def __init__(
        self,
        pipe: Any,
        components: dict[str, PipelineComponent],
        *,
        policy: Any = "auto",
        budget: Any = None,
        device: Any = None,
        prefetch: bool = True,
    ):
        self.pipe = pipe
        self.lazy_components = tuple(components)
        sequence = [
            name
            for name in (type(pipe).model_cpu_offload_seq or "").split("->")
            if name in components
        ]
        order = sequence + [name for name in components if name not in sequence]
        self._turns: list[tuple[str, tuple[str, ...]]] = [(name, (name,)) for name in order]
        self._learned_from: set[str] | None = None
        self._record: _CallRecord | None = None
        self._acting = 0
        super().__init__(components, policy=policy, budget=budget, device=device, prefetch=prefetch)
        for proxy in components.values():
            object.__setattr__(proxy, "_ondeck_runtime", self)

    # -- stages -------------------------------------------------------------------------

    def create_stages(self) -> list[Stage]:
        return [
            ComponentTurn(name, [self.components[held] for held in holding])
            for name, holding in self._turns
        ]

    @property
    def order(self) -> list[str]:
        """The components' turns, in the order a call starts them."""
        return [name for name, _ in self._turns]

    def _turn_index(self, name: str) -> int | None:
        for index, stage in enumerate(self.stages):
            if stage.name == name:
                return index
        return None

    # -- calls --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the diffusers pipeline."""
        return self.pipe(*args, **kwargs)

    def run(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one call of the pipeline (``call(*args, **kwargs)``) under the policy."""
        me = threading.get_ident()
        if self._running_thread == me:  # a pipeline calling itself: part of the outer call
            return call(*args, **kwargs)
        # Concurrent calls from other threads queue here and run one after another.
        with self._run_lock:
            self._running_thread = me
            try:
                self._begin_call()
                try:
                    result = call(*args, **kwargs)
                except BaseException:
                    self._abort_call()
                    raise
                self._end_call()
                return result
            finally:
                self._record = None
                self._current_index = None
                self._running_thread = None

    @contextlib.contextmanager
    def _deciding(self) -> Iterator[None]:
        """Loads the policy makes are the policy's, not touches by the call."""
        self._acting += 1
        try:
            yield
        finally:
            self._acting -= 1

    def _begin_call(self) -> None:
        self.stage_uses()
        self._current_index = None
        with self._deciding():
            self.policy.before_run()
        self.tracker.run_started()
        self._record = _CallRecord()

    def component_touched(self, proxy: PipelineComponent) -> None:
        """A call used ``proxy``: start its turn if that turn lies ahead."""
        if (
            self._record is None
            or self._acting
            or threading.get_ident() != self._running_thread
            or self.policy.in_prefetch_thread()
        ):
            return
        name = self._name_of(proxy)
        if name not in self.deferred:
            return
        self._record.touched(name)
        index = self._turn_index(name)
        if index is None or (self._current_index is not None and index <= self._current_index):
            return  # used again after its turn: it loads if it has to, and goes later
        with self._deciding():
            self._advance_to(index)

    def _advance_to(self, index: int) -> None:
        previous = self._current_index
        if previous is not None:
            self._finish_turn(previous)
        # Whatever only earlier turns hold is not needed again in this call.
        for earlier in range(index):
            if earlier != previous:
                self._after_stage(earlier, failed=False)
        self._current_index = index
        self.tracker.stage_started(self.stages[index].name)
        self.policy.before_stage(index)

    def _finish_turn(self, index: int) -> None:
        record = self.tracker.stage_finished(self.stages[index].name, self._loading_bytes())
        self.policy.stage_measured(index, record)
        self._after_stage(index, failed=False)

    def _end_call(self) -> None:
        with self._deciding():
            if self._current_index is not None:
                self._finish_turn(self._current_index)
                self._current_index = None
            # Components touched outside their turns go too, where the policy frees.
            for index in range(len(self.stages)):
                self._after_stage(index, failed=False)
            self.policy.after_run()
        self._learn(self._record)

    def _abort_call(self) -> None:
        with self._deciding():
            if self._current_index is not None:
                self.tracker.stage_finished(self.stages[self._current_index].name)
            try:
                self.policy.cancel_prefetch()
            finally:
                self._release_deferred_quietly()

    def _learn(self, record: _CallRecord | None) -> None:
        """Take the turns a complete call showed as the model for the next calls.

        A call that skipped components (prompt embeddings passed in, say) teaches
        nothing: its turns would drop stages the next full call needs.
        """
        if record is None or not record.first_touch:
            return
        touched = set(record.first_touch)
        if self._learned_from is not None and not touched >= self._learned_from:
            return
        self._learned_from = touched
        # Components no call has touched keep a turn of their own, placed first: no
        # prefetch looks backwards, so nothing loads them for a turn that never comes.
        untouched = [(name, (name,)) for name, _ in self._turns if name not in touched]
        turns = untouched + record.turns()
        if turns != self._turns:
            self._turns = turns
            self._rebuild_stages()

    # -- what the call is about to see --------------------------------------------------

    @contextlib.contextmanager
    def _deferred_hidden(self) -> Iterator[None]:
        """Deferred components read as None to diffusers code that would load them."""
        attributes = self.pipe.__dict__
        saved = {name: attributes[name] for name in self.deferred if name in attributes}
        for name in saved:
            attributes[name] = None
        try:
            yield
        finally:
            attributes.update(saved)

    def place(self, device: Any = None, dtype: torch.dtype | None = None) -> None:
        """Load every deferred component onto ``device`` in ``dtype`` from now on,
        and move those already loaded."""
        for proxy in self.deferred.values():
            with object.__getattribute__(proxy, "_ondeck_lock"):
                proxy.retarget(device, dtype)
                module = object.__getattribute__(proxy, "_ondeck_module")
                if module is not None:
                    module.to(device=device, dtype=dtype)
        if device is not None and resolve_device(device) != self.device:
            self.device = resolve_device(device)
            self.tracker.device = str(self.device)
            self._choose_policy()

    def _choose_policy(self) -> None:
        if getattr(self, "policy", None) is not None:
            self.cancel_prefetch_quietly()
        super()._choose_policy()

    def swap(self, name: str, value: Any) -> None:
        """``pipe.<name> = value`` after loading: the old proxy is released and the new
        value takes its turn; a module given ready-made is no longer deferred."""
        if self.components.get(name) is value:
            return
        if self._running_thread is not None:
            raise OndeckError(f"component '{name}' cannot be replaced while a call runs")
        self.cancel_prefetch_quietly()
        self.components[name] = value
        if issubclass(type(value), PipelineComponent):
            object.__setattr__(value, "_ondeck_runtime", self)

    # -- transforms ---------------------------------------------------------------------

    def add_transform(self, name: str, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn(module) -> module`` to component ``name`` now and after every load.

        A component passed in ready-made is never released, so ``fn`` runs on it once.
        """
        component = getattr(self.pipe, name)
        if is_lazy(component):
            component.add_transform(fn)
            return
        transformed = fn(component)
        if transformed is None:
            raise OndeckError(f"component '{name}': transform {fn!r} returned None")
        setattr(self.pipe, name, transformed)

    # -- generating ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        *,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        negative_prompt: str | None = None,
        progress: Any = None,
        **kwargs: Any,
    ) -> Any:
        """One call of the pipeline, seeded on the CPU; returns its frames as numpy.

        Arguments the pipeline does not take (``num_frames`` for an image pipeline)
        are left out. Video pipelines return ``frames`` (B×F×H×W×C); image pipelines
        return their images as one-frame videos (B×1×H×W×C), so callers can treat
        both alike. ``progress`` (a tqdm bar) advances once per denoising step.
        """
        import numpy as np

        parameters = inspect.signature(type(self.pipe).__call__).parameters
        wanted = {
            "prompt": prompt,
            "height": height,
            "width": width,
            "num_frames": num_frames,
            "num_inference_steps": num_inference_steps,
            "guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt,
        }
        arguments = {k: v for k, v in wanted.items() if v is not None and k in parameters}
        if seed is not None:
            arguments["generator"] = torch.Generator("cpu").manual_seed(seed)
        if "output_type" in parameters:
            arguments["output_type"] = "np"
        bar_config = None
        if progress is not None and "callback_on_step_end" in parameters:

            def advance(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
                progress.update(1)
                return {}

            arguments["callback_on_step_end"] = advance
            bar_config = dict(getattr(self.pipe, "_progress_bar_config", {}))
            self.pipe.set_progress_bar_config(**{**bar_config, "disable": True})
        arguments.update(kwargs)
        try:
            output = self.pipe(**arguments)
        finally:
            if bar_config is not None:
                self.pipe._progress_bar_config = bar_config
        frames = getattr(output, "frames", None)
        if frames is not None:
            return frames
        images = np.asarray(output.images)
        return images[:, None] if images.ndim == 4 else images

    # -- reporting ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        report = super().report()
        report["pipeline"] = type(self.pipe).__name__
        report["turns"] = {name: list(holding) for name, holding in self._turns}
        return report

    def __repr__(self) -> str:
        return f"<ondeck runtime of {type(self.pipe).__name__}: policy {self.policy.name}>"


# -- the pipeline class ------------------------------------------------------------------

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
        with runtime._deferred_hidden():
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
    for attribute in dir(cls):
        if attribute.startswith("load_lora_into_"):
            static = inspect.getattr_static(cls, attribute)
            if isinstance(static, classmethod):
                namespace[attribute] = classmethod(_lora_into_component(static.__func__))
    return type(cls.__name__, (cls,), namespace)


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
            fresh = {name: _fresh(value) for name, value in arguments.items()}
            fresh[key] = module
            call = inspect.BoundArguments(signature, fresh)
            function(*call.args, **call.kwargs)
            return module

        apply.__qualname__ = f"{function.__name__} (recorded)"
        proxy._add_transform_checked(apply)
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
        return object.__getattribute__(component, "_ondeck_module")
    return component


# -- loading -----------------------------------------------------------------------------

_HUB_OPTIONS = (
    "cache_dir",
    "force_download",
    "proxies",
    "local_files_only",
    "token",
    "revision",
    "variant",
    "use_safetensors",
)


def from_pretrained(
    path: str | os.PathLike,
    torch_dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    device: Any = None,
    policy: Any = "auto",
    budget: int | str | None = None,
    prefetch: bool = True,
    host_cache: Any = None,
    *,
    progress: bool = True,
    **kwargs: Any,
) -> Any:
    """Load a diffusers pipeline with its heavy components on demand.

    Returns the genuine diffusers pipeline (``isinstance(pipe, diffusers.WanPipeline)``
    holds for a Wan folder): its ``nn.Module`` components with safetensors weights are
    :class:`PipelineComponent` proxies that load straight onto ``device`` when a call
    first needs them; tokenizers, schedulers and other parts load as diffusers loads
    them. Components passed in ``kwargs`` are used as given and stay resident.
    ``pipe.ondeck`` is the runtime: ``plan()``, ``report()``, ``policy``,
    ``release_all()``, ``add_transform()``, ``generate()``.

    ``torch_dtype`` (or ``dtype``) follows diffusers: one dtype, or a dict by component
    name with a ``"default"``; when omitted, diffusers models load in float32 and
    transformers models in their checkpoint's dtype. ``device`` defaults to CUDA when
    present. ``policy``, ``budget`` and ``prefetch`` are those of :class:`ondeck.Pipeline`;
    ``host_cache`` is an :class:`ondeck.loading.HostCache` for fast reloads.
    """
    import diffusers

    from ..loading import ModelFolder

    dtype = kwargs.pop("dtype", None)
    if torch_dtype is not None and dtype is not None:
        raise ValueError("pass torch_dtype or dtype, not both")
    dtype = dtype if dtype is not None else torch_dtype
    path = _local_folder(path, kwargs)
    folder = ModelFolder.open(path, variant=kwargs.get("variant"))
    base_class = _pipeline_class(diffusers, folder)
    device = resolve_device(device)

    components: dict[str, PipelineComponent] = {}
    for name in folder.component_names:
        if name in kwargs or not _can_defer(folder, name):
            continue
        component = _deferred_component(
            folder, name, device, _component_dtype(dtype, name, folder), host_cache, progress
        )
        if component is not None:
            components[name] = component

    pipeline_class = ondeck_pipeline_class(base_class)
    options = dict(kwargs)
    if dtype is not None:
        options["dtype"] = dtype
    with _shaped_from_configs(components.values()):
        pipe = pipeline_class.from_pretrained(str(path), **components, **options)
    _place_loaded_by_diffusers(pipe, folder, skip=set(components) | set(kwargs), device=device)
    pipe.ondeck = DiffusersRuntime(
        pipe, components, policy=policy, budget=budget, device=device, prefetch=prefetch
    )
    return pipe


def _local_folder(path: str | os.PathLike, kwargs: dict[str, Any]) -> Path:
    if Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    from diffusers import DiffusionPipeline

    # A hub id: diffusers fetches the snapshot (files only; nothing is loaded yet).
    options = {key: kwargs[key] for key in _HUB_OPTIONS if key in kwargs}
    return Path(DiffusionPipeline.download(str(path), **options))


def _pipeline_class(diffusers: Any, folder: Any) -> type:
    name = folder.pipeline_class_name
    found = getattr(diffusers, name, None) if name else None
    if not isinstance(found, type) or not issubclass(found, diffusers.DiffusionPipeline):
        raise LoadError(
            f"{folder.path / 'model_index.json'}: _class_name {name!r} is not a diffusers "
            f"pipeline in diffusers {diffusers.__version__}",
            path=str(folder.path / "model_index.json"),
        )
    return found


def _can_defer(folder: Any, name: str) -> bool:
    """Models ondeck can build from a config and fill from safetensors files."""
    from ..loading.skeleton import library_of

    try:
        cls = folder.component_class(name)
        return (
            issubclass(cls, torch.nn.Module)
            and library_of(cls) in ("diffusers", "transformers")
            and bool(folder.weight_files(name))
        )
    except LoadError:
        return False


def _component_dtype(dtype: Any, name: str, folder: Any) -> torch.dtype | None:
    from ..loading.skeleton import library_of

    if isinstance(dtype, dict):
        return dtype.get(name, dtype.get("default", torch.float32))
    if dtype is not None:
        return dtype
    # As diffusers: its own models load in float32, transformers models as saved.
    return torch.float32 if library_of(folder.component_class(name)) == "diffusers" else None


def _deferred_component(
    folder: Any, name: str, device: torch.device, dtype: Any, host_cache: Any, progress: bool
) -> PipelineComponent | None:
    from ..loading import ComponentLoader

    def make_loader(target_device: torch.device, target_dtype: Any) -> ComponentLoader:
        return ComponentLoader(
            folder,
            name,
            device=target_device,
            dtype=target_dtype,
            host_cache=host_cache,
            progress=progress,
        )

    try:
        loader = make_loader(device, dtype)
        spec = loader.spec
    except LoadError as error:
        warnings.warn(
            f"component '{name}' loads with diffusers and stays resident: {error}", stacklevel=3
        )
        return None
    return PipelineComponent(name, loader, spec=spec, make_loader=make_loader)


class _ConfigShape:
    """The component built without weights, for attributes a pipeline's __init__ reads
    (LTX reads ``vae.spatial_compression_ratio``); built once, on first need."""

    def __init__(self, proxy: PipelineComponent):
        self.proxy = proxy
        self.module: Any = None
        self.failed = False

    def plain_attribute(self, attribute: str) -> Any:
        """The attribute's value when it is a plain value (a number, a flag), else None."""
        if self.module is None and not self.failed:
            loader = object.__getattribute__(self.proxy, "_ondeck_loader")
            try:
                self.module = loader.folder.skeleton(loader.name, loader.dtype).module
            except (LoadError, AttributeError):
                self.failed = True  # the real component will answer, loaded
        value = getattr(self.module, attribute, None) if self.module is not None else None
        return value if _is_plain(value) else None


@contextlib.contextmanager
def _shaped_from_configs(proxies: Any) -> Iterator[None]:
    proxies = list(proxies)
    for proxy in proxies:
        object.__setattr__(proxy, "_ondeck_stand_in", _ConfigShape(proxy))
    try:
        yield
    finally:
        for proxy in proxies:
            object.__setattr__(proxy, "_ondeck_stand_in", None)


def _place_loaded_by_diffusers(pipe: Any, folder: Any, *, skip: set[str], device: Any) -> None:
    """Models diffusers loaded itself (no safetensors, say) go where the others load."""
    for name in folder.component_names:
        if name in skip:
            continue
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module) and not is_lazy(module):
            if getattr(module, "device", device) != device:
                module.to(device)
