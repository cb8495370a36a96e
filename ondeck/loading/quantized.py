"""Components whose weights are already quantized: loaded by the quantizer their library
uses.

A component folder whose ``config.json`` carries a ``quantization_config`` is loaded by
its library, which applies the quantizer the config names:

- ``"quant_method": "gguf"`` with one ``.gguf`` file: diffusers' GGUF support
  (``from_single_file`` with a ``GGUFQuantizationConfig``; the ``gguf`` package reads the
  file). The quantized tensors stay quantized on the device and are dequantized per layer
  for compute.
- any other method whose package is installed (``quanto``, ``bitsandbytes``, ...), with
  safetensors weights as the library's ``save_pretrained`` wrote them: the class's own
  ``from_pretrained``, which reads the quantization from the config.

Like any other component it loads on first use and is freed on release. A GGUF
component's quantized bytes also sit in the host cache, when one is given, so a reload
copies them from host memory. A GGUF diffusers model streams by blocks: its ``template``
is the module diffusers builds, on the meta device from the file's header (the quantized
tensors as ``GGUFParameter``, in their stored bytes), and under a ``placement`` it is
built in host memory, its streamed blocks' bytes copied to their host copies and the rest
moved to the device; each streamed tensor comes back as a ``GGUFParameter`` of its
quantization type, so the layers dequantize as they do loaded whole. ondeck's own reader,
pipelined loading, fp8 storage and sharding do not apply to quantized components, and
asking for them is refused before anything loads.

A ``.gguf`` file given for a component (``loading.single_file``) loads so, with the
base folder's config."""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import LoadError, held_logs
from ..lazy import ComponentSpec
from .folder_loader import FolderLoader
from .gguf_file import (
    check_transformers_gguf,
    find_gguf,
    gguf_header,
    gguf_reader,
    gguf_tensors,
    read_gguf,
    refuse_unsupported_types,
)
from .host_cache import file_key
from .model_folder import ModelFolder
from .options import LoadOptions
from .safetensors_format import TensorInfo
from .skeleton import (
    Skeleton,
    Slot,
    build_skeleton,
    get_tensor,
    module_paths,
    set_tensor,
    some_names,
)

if TYPE_CHECKING:
    from .host_cache import HostCache

__all__ = [
    "PACKAGES",
    "QuantizedComponentLoader",
    "describe_method",
    "package_installed",
    "package_name",
    "quantization_method",
]

# The package each quantization method needs: (its module, as imported; its name on PyPI).
PACKAGES = {
    "gguf": ("gguf", "gguf"),
    "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
    "torchao": ("torchao", "torchao"),
    "quanto": ("optimum.quanto", "optimum-quanto"),
}


def quantization_method(folder: ModelFolder, name: str) -> str | None:
    """The ``quant_method`` of ``name``'s ``quantization_config``, lower-cased ("" when it
    names none); None when its config has none (or cannot be read: the load reports
    that)."""
    if name in (getattr(folder, "gguf_files", None) or {}):
        return "gguf"  # a .gguf single file given for the component
    try:
        config = folder.config_dict(name)
    except LoadError:
        return None
    return _method_in(config)


def _method_in(config: dict) -> str | None:
    settings = config.get("quantization_config")
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else None
    return str(method).lower() if method else ""


def package_installed(method: str) -> bool:
    module, _ = PACKAGES.get(method, (None, None))
    return module is not None and importlib.util.find_spec(module.split(".")[0]) is not None


def package_name(method: str) -> str | None:
    """The PyPI name of the package ``method`` needs; None for a method ondeck does not
    know."""
    return PACKAGES.get(method, (None, None))[1]


def describe_method(method: str) -> str:
    """``method`` as the errors quote it."""
    return repr(method) if method else "an unnamed"


class QuantizedComponentLoader(FolderLoader):
    """A zero-argument loader for one quantized component, usable as a ``LazyModule``
    loader: each call builds the module through its library's quantizer, onto
    ``device``, computing in ``dtype``. ``spec`` reads only the config and the weight
    files' headers."""

    def __init__(
        self,
        folder: ModelFolder | str | os.PathLike,
        name: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        progress: bool = True,
        storage_dtype: torch.dtype | str | None = None,
        host_cache: HostCache | None = None,
        pipelined: bool | None = None,
    ):
        options = LoadOptions(
            device=device,
            dtype=dtype,
            progress=progress,
            pipelined=pipelined,
            host_cache=host_cache,
        )
        # GGUF tensors can sit in the host cache as they are stored (quantized); other
        # quantized weights come from their files every load.
        super().__init__(folder, name, options)
        self._gguf_layout: dict[str, tuple[torch.dtype, tuple[int, ...], Any]] | None = None
        self._gguf_upcast: int | None = None
        self._template: Skeleton | None = None
        # A transformers model's dequantized tensors in the host cache: (their key, the
        # module's skeleton, the tensors as that load made them).
        self._dequantized: tuple[tuple, Skeleton, list[Slot]] | None = None
        config_path = self.folder.config_path(name)
        self.config = self.folder.config_dict(name)
        given = (getattr(self.folder, "gguf_files", None) or {}).get(name)
        self.method = "gguf" if given is not None else (_method_in(self.config) or "")
        package = package_name(self.method)
        if package is None or not package_installed(self.method):
            state = (
                f"its package is not installed (pip install {package})"
                if package is not None
                else f"ondeck knows no package that loads it (it loads {', '.join(PACKAGES)})"
            )
            raise LoadError(
                f"component '{name}': {config_path} asks for {describe_method(self.method)} "
                f"quantization, and {state}",
                component=name,
                path=str(config_path),
            )
        if storage_dtype is not None:
            raise LoadError(
                f"component '{name}': it is already quantized ({self.method}); fp8 storage "
                "does not apply to it",
                component=name,
            )
        library, _ = self.folder.library_and_class(name)
        self.library = library
        self.cls = self.folder.component_class(name)
        self.directory = self.folder.directory(name)
        if self.method == "gguf":
            # A transformers model (a T5 text encoder) loads a given .gguf file through
            # transformers' own GGUF support, which dequantizes it as it loads.
            through_transformers = library == "transformers" and given is not None
            if not through_transformers and (
                library != "diffusers" or not hasattr(self.cls, "from_single_file")
            ):
                raise LoadError(
                    f"component '{name}': gguf weights load through diffusers' single-file "
                    f"loading, which {library}.{self.cls.__name__} does not have",
                    component=name,
                    path=str(config_path),
                )
            self.path = given if given is not None else find_gguf(self.directory, name)
            if through_transformers:
                check_transformers_gguf(self.path, name, self.config)
        else:
            self.host_cache = None
            self.folder.require_weights(name)
            self.path = self.directory
        self.dtype = (
            self.folder.resolve_dtype(name, dtype) if dtype else _compute_dtype(self.config)
        )
        self._nbytes: int | None = None

    def __repr__(self) -> str:
        return (
            f"QuantizedComponentLoader({str(self.folder.path)!r}, {self.name!r}, "
            f"{self.method}, {self.device}, {self.dtype})"
        )

    @property
    def spec(self) -> ComponentSpec:
        config: Any = self.config
        reader = None  # the GGUF file's header, parsed once here
        if self._nbytes is None and self.method == "gguf":
            reader = gguf_reader(self.path, self.name)
            if self.library == "diffusers":
                refuse_unsupported_types(reader, self.path, self.name)
        if self._nbytes is None and self.places_blocks:
            # The module diffusers builds from the header, tensor for tensor: the file's
            # names may be the original repository's, which the float32-kept modules'
            # names do not match.
            self._nbytes = _module_bytes(self.template.module)
        if self._nbytes is None:
            if self.method == "gguf":
                tensors = [t[:4] for t in gguf_tensors(self.path, self.name, reader)]
                if self.library == "transformers":  # dequantized as it loads
                    tensors = [(key, True, numel, stored) for key, _, numel, stored in tensors]
            else:
                tensors = [
                    (key, info.dtype.is_floating_point, info.numel, info.nbytes)
                    for key, info in self.folder.tensors(self.name).items()
                ]
            kept = tuple(getattr(self.cls, "_keep_in_fp32_modules", None) or ())
            self._nbytes = sum(_device_bytes(*tensor, self.dtype, kept) for tensor in tensors)
            self._nbytes += _computed_buffer_bytes(self.cls, self.library, config)
        if self.library == "diffusers":
            from diffusers.configuration_utils import FrozenDict

            config = FrozenDict(config)  # reads as model.config does
        return ComponentSpec(
            cls=self.cls, config=config, dtype=self.dtype, device=self.device, nbytes=self._nbytes
        )

    @property
    def upcast_bytes(self) -> int:
        """The most bytes one GGUF layer's forward makes beside its stored weight: the
        weight dequantized (half precision, GGUF's scales), then cast to the compute
        dtype. Read from the file's header; 0 for other quantizers (their layers are
        theirs)."""
        if not self.places_blocks:
            return 0
        if self._gguf_upcast is None:
            copies = [0]
            for _, plain, numel, _, dequantized in gguf_tensors(self.path, self.name):
                if not plain:
                    cast = 0 if self.dtype == dequantized else self.dtype.itemsize
                    copies.append(numel * (dequantized.itemsize + cast))
            self._gguf_upcast = max(copies)
        return self._gguf_upcast

    @property
    def places_blocks(self) -> bool:
        """A GGUF diffusers model can stream by blocks (transformers' GGUF loading
        dequantizes into a module of its own making, other quantizers' layers are theirs)."""
        return self.method == "gguf" and self.library == "diffusers"

    @property
    def template(self) -> Skeleton:
        """The module as diffusers loads it, on the meta device: the file's header only."""
        if self._template is None:
            if not self.places_blocks:
                raise LoadError(
                    f"component '{self.name}': a {self.method}-quantized {self.library} model "
                    "has no meta template (it cannot stream)",
                    component=self.name,
                )
            self._template = self._gguf_template()
        return self._template

    def weightless_module(self) -> torch.nn.Module:
        """The model its config builds, unquantized, on the meta device: a LoRA meets the
        layers' shapes there as it meets the quantized layers'. A transformers model's
        quantized skeleton is not built so (the base class's, which its files refuse)."""
        if self.library != "diffusers":
            return super().weightless_module()
        module = _unquantized_on_meta(self.cls, self.config)
        # torch's own move: diffusers' would warn of the modules its model keeps in float32.
        return torch.nn.Module.to(module, self.dtype)

    def unload(self, module: Any) -> None:
        if self.placement is not None:
            self.placement.unload(module)

    def __call__(self) -> torch.nn.Module:
        started = time.perf_counter()
        try:
            module = self._load()
        except BaseException as error:
            # The traceback's frames hold the half-built module and the file's bytes for
            # as long as the caller keeps the error (an out-of-memory retry would fail).
            _clear_frames(error)
            if isinstance(error, LoadError) or not isinstance(error, Exception):
                raise
            raise self._failed(f"loading it {self.method}-quantized", error) from error
        module.eval()
        files = [self.path] if self.path.is_file() else list(self.folder.weight_files(self.name))
        self.last_load_bytes = sum(Path(file).stat().st_size for file in files)
        self.last_load_seconds = time.perf_counter() - started
        return module

    def _load(self) -> torch.nn.Module:
        if self.method == "gguf" and self.library == "transformers":
            cached = self._dequantized_from_cache() if self.host_cache is not None else None
            if cached is not None:
                return cached
            self.last_source = "file"
            options = {"torch_dtype": self.dtype, "local_files_only": True}
            if self.device.type != "cpu":
                options["device_map"] = {"": str(self.device)}
            module = self.cls.from_pretrained(
                str(self.path.parent),
                gguf_file=str(self.path),
                config=self.cls.config_class.from_pretrained(str(self.directory)),
                **options,
            )
            if self.host_cache is not None:
                self._keep_dequantized(module)
            return module
        if self.method == "gguf":
            from diffusers import GGUFQuantizationConfig

            self.last_source = "file"
            source, keep = (
                self._cached_gguf()
                if self.host_cache is not None
                else (read_gguf(self.path, self.name, self.progress), None)
            )
            placement = self.placement
            try:
                module = self.cls.from_single_file(
                    source,
                    config=str(self.directory),
                    quantization_config=GGUFQuantizationConfig(compute_dtype=self.dtype),
                    torch_dtype=self.dtype,
                    # Placed, it is built in host memory: the streamed blocks stay there.
                    device="cpu" if placement is not None else str(self.device),
                    local_files_only=True,
                )
                if placement is not None:
                    self._place(module, placement)
            except BaseException:
                if placement is not None:
                    placement.abort()
                if keep is not None:
                    keep(False)
                raise
            if keep is not None:
                keep(True)  # the bytes are kept only once a module was built from them
            return module
        self.last_source = "file"
        options: dict[str, Any] = {"torch_dtype": self.dtype, "local_files_only": True}
        if self.device.type != "cpu":
            options["device_map"] = {"": str(self.device)}
        return self.cls.from_pretrained(str(self.directory), **options)

    def _dequantized_key(self) -> tuple:
        identity = file_key(self.path.resolve())
        return ("gguf dequantized", *identity, self.cls.__qualname__, str(self.dtype))

    def _keep_dequantized(self, module: torch.nn.Module) -> None:
        """Put what transformers made of the GGUF file (its tensors, dequantized) in the
        host cache, keyed on the file's identity and the compute dtype, and the module's
        skeleton beside it: a reload then builds the module from the config and copies
        the tensors in, neither reading nor dequantizing the file again. The skeleton is
        built here, beside transformers' own load (which sets torch's process-wide default
        dtype for a moment too): a reload only copies it, changing no global state."""
        key = self._dequantized_key()
        loaded = _skeleton_of(module, self.dtype)
        infos = [
            TensorInfo(slot.names[0], torch.uint8, (slot.nbytes,), 0, slot.nbytes, str(self.path))
            for slot in loaded.slots
        ]
        buffers = self.host_cache.reserve(key, infos, owner=self.cache_owner)
        if buffers is None:
            return
        try:
            template = build_skeleton(self.cls, self.directory, self.dtype, component=self.name)
            for slot in loaded.slots:
                tensor = get_tensor(module, slot.names[0]).detach().contiguous()
                buffers[slot.names[0]].copy_(tensor.reshape(-1).view(torch.uint8))
        except BaseException:
            self.host_cache.discard(key)
            raise
        self.host_cache.commit(key, buffers)
        self._dequantized = (key, template, loaded.slots)

    def _dequantized_from_cache(self) -> torch.nn.Module | None:
        """The module from the host cache's dequantized tensors (see
        :meth:`_keep_dequantized`); None when the cache holds none for the file as it is."""
        kept = self._dequantized
        if kept is None or kept[0] != self._dequantized_key():
            return None
        key, template, slots = kept
        entry = self.host_cache.get(key)
        if entry is None:
            return None
        held = {name: slot for slot in slots for name in slot.names}
        skeleton = template.fresh()
        module = skeleton.module
        modules = module_paths(module)
        for slot in skeleton.slots:
            source = held.get(slot.names[0])
            if source is None:
                return None  # the config builds a tensor the file did not give
            data = entry[source.names[0]].view(source.dtype).view(source.shape)
            data = data.to(self.device) if self.device.type != "cpu" else data.clone()
            value = (
                torch.nn.Parameter(data, requires_grad=source.requires_grad)
                if slot.is_parameter
                else data
            )
            for name in slot.names:
                set_tensor(module, name, value, parameter=slot.is_parameter, modules=modules)
        for names in skeleton.extra_buffers.values():
            computed = get_tensor(module, names[0]).to(self.device)
            for name in names:
                set_tensor(module, name, computed, parameter=False, modules=modules)
        if hasattr(module, "tie_weights"):
            module.tie_weights()
        self.last_source = "host cache"
        return module

    def _gguf_template(self) -> Skeleton:
        from diffusers import GGUFQuantizationConfig
        from diffusers.quantizers.gguf.utils import GGUFParameter

        checkpoint = {}
        for name, dtype, shape, quant_type in gguf_header(self.path, self.name):
            meta = torch.empty(shape, dtype=dtype, device="meta")
            checkpoint[name] = (
                GGUFParameter(meta, quant_type=quant_type) if quant_type is not None else meta
            )
        # Another model's file: one error, not diffusers' list of every name it left out.
        with held_logs("diffusers"):
            try:
                module = self.cls.from_single_file(
                    dict(checkpoint),  # its conversion takes the keys out of what it is given
                    config=str(self.directory),
                    quantization_config=GGUFQuantizationConfig(compute_dtype=self.dtype),
                    torch_dtype=self.dtype,
                    device="meta",
                    local_files_only=True,
                )
            except Exception as error:
                doing = "building it from the GGUF header (this model's?)"
                raise self._failed(doing, error) from error
            missing = self._missing_from(module, checkpoint)
            if missing:
                raise LoadError(
                    f"component '{self.name}' from {self.path}: the GGUF file lacks "
                    f"{len(missing)} of {self.cls.__name__}'s tensors "
                    f"({some_names(missing, quoted=False)}); is it another model's?",
                    component=self.name,
                    path=str(self.path),
                )
        return _skeleton_of(module, self.dtype)

    def _missing_from(self, module: torch.nn.Module, checkpoint: dict[str, Any]) -> list[str]:
        """The module's parameters that the GGUF file's tensors, in the model's names
        (diffusers' own single-file conversion, as its load converts them), do not give:
        the load would leave them without weights."""
        from .single_file import MODEL_PREFIX, conversion_for

        wanted = [name for name, _ in module.named_parameters()]
        keys = {key.removeprefix(MODEL_PREFIX) for key in checkpoint}
        convert = conversion_for(self.cls)
        if not set(wanted) <= keys and convert is not None:
            config = self.cls.load_config(str(self.directory))
            keys = set(convert(checkpoint=dict(checkpoint), config=config))
        return [name for name in wanted if name not in keys]

    def _failed(self, doing: str, error: Exception) -> LoadError:
        """The LoadError for ``doing`` (what failed) raising ``error``, naming the file."""
        return LoadError(
            f"component '{self.name}' from {self.path}: {doing} failed with "
            f"{type(error).__name__}: {str(error).split(' If you want to instead ')[0]}",
            component=self.name,
            path=str(self.path),
        )

    def _place(self, module: torch.nn.Module, placement: Any) -> None:
        """``module`` (built in host memory) as its placement wants it: each streamed
        tensor's bytes in its host copy (unless held there already), every other tensor
        moved to the device, then armed (``placement.finish``)."""
        streamed: set[str] = set()
        for slot in self.template.slots:
            given = placement.destination(slot)
            if given is None:
                continue
            host, filled = given
            if not filled:
                with torch._C.DisableTorchFunctionSubclass():
                    host.copy_(get_tensor(module, slot.names[0]))
            streamed.update(slot.names)
        if self.device.type != "cpu":
            _move_tensors(module, self.device, skip=streamed)
        placement.finish(module)

    def _cached_gguf(self) -> tuple[dict[str, torch.Tensor], Callable[[bool], None] | None]:
        """The GGUF checkpoint as diffusers reads it (``load_gguf_checkpoint``), served
        from the host cache once a load has put its quantized bytes there: a reload then
        copies those bytes to the device instead of parsing and reading the file. The
        entry is keyed on the file's identity, so a rewritten file is read again. With it,
        ``keep(built)`` for bytes read now: kept once a module was built from them, else
        given back (None when there is nothing to keep)."""
        from diffusers.quantizers.gguf.utils import GGUFParameter

        status = self.path.stat()
        key = ("gguf", *file_key(self.path.resolve()))
        entry = self.host_cache.get(key)
        if entry is not None and self._gguf_layout is not None:
            self.last_source = "host cache"
            checkpoint = {}
            for name, (dtype, shape, quant_type) in self._gguf_layout.items():
                tensor = entry[name].view(dtype).view(shape)
                if self.device.type == "cpu":
                    tensor = tensor.clone()  # a CPU module would otherwise own the entry
                checkpoint[name] = (
                    GGUFParameter(tensor, quant_type=quant_type)
                    if quant_type is not None
                    else tensor
                )
            return checkpoint, None
        checkpoint = read_gguf(self.path, self.name, self.progress, status)
        plain = {name: tensor.as_subclass(torch.Tensor) for name, tensor in checkpoint.items()}
        layout = {
            name: (tensor.dtype, tuple(tensor.shape), getattr(checkpoint[name], "quant_type", None))
            for name, tensor in plain.items()
        }
        infos = [
            TensorInfo(
                name,
                torch.uint8,
                (t.numel() * t.element_size(),),
                0,
                t.numel() * t.element_size(),
                str(self.path),
            )
            for name, t in plain.items()
        ]
        buffers = self.host_cache.reserve(key, infos, owner=self.cache_owner)
        if buffers is None:
            return checkpoint, None
        try:
            for name, tensor in plain.items():
                buffers[name].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        except BaseException:
            self.host_cache.discard(key)
            raise

        def keep(built: bool) -> None:
            if not built:
                self.host_cache.discard(key)
                return
            self.host_cache.commit(key, buffers)
            self._gguf_layout = layout

        return checkpoint, keep


def _skeleton_of(module: torch.nn.Module, dtype: torch.dtype) -> Skeleton:
    """The skeleton of ``module`` with its tensors as they are (on the meta device for a
    template): one slot per tensor (tied names together), a GGUF parameter's slot wrapping
    its views back into one of its type; buffers the model computes (not persistent)
    apart."""
    slots: dict[int, Slot] = {}
    extra_buffers: dict[int, list[str]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        tables = ((submodule._parameters, True), (submodule._buffers, False))
        for table, is_parameter in tables:
            for attribute, tensor in table.items():
                if tensor is None:
                    continue
                name = f"{dot}{attribute}"
                if not is_parameter and attribute in submodule._non_persistent_buffers_set:
                    extra_buffers.setdefault(id(tensor), []).append(name)
                elif id(tensor) in slots:
                    slots[id(tensor)].names.append(name)
                else:
                    slots[id(tensor)] = Slot(
                        [name],
                        is_parameter,
                        tuple(tensor.shape),
                        tensor.dtype,
                        tensor.requires_grad,
                        _wrap_of(tensor),
                    )
    return Skeleton(module, list(slots.values()), extra_buffers, library="diffusers", dtype=dtype)


def _wrap_of(tensor: torch.Tensor) -> Any:
    quant_type = getattr(tensor, "quant_type", None)
    if quant_type is None:
        return None
    return functools.partial(type(tensor), quant_type=quant_type)


def _move_tensors(module: torch.nn.Module, device: torch.device, skip: set[str]) -> None:
    """Every parameter and buffer of ``module`` not named in ``skip`` moved to ``device``,
    keeping its class (a GGUF parameter keeps its quantization type through ``to``) and
    tied tensors tied."""
    moved: dict[int, torch.Tensor] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for table in (submodule._parameters, submodule._buffers):
            for attribute, tensor in list(table.items()):
                if tensor is None or f"{dot}{attribute}" in skip:
                    continue
                if id(tensor) not in moved:
                    value = tensor.to(device)
                    if isinstance(tensor, torch.nn.Parameter) and not isinstance(
                        value, torch.nn.Parameter
                    ):
                        value = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
                    moved[id(tensor)] = value
                table[attribute] = moved[id(tensor)]


def _clear_frames(error: BaseException | None) -> None:
    """Clear the finished frames of ``error``'s traceback and of the errors it came from."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _compute_dtype(config: dict) -> torch.dtype:
    settings = config.get("quantization_config") or {}
    named = settings.get("compute_dtype") if isinstance(settings, dict) else None
    resolved = getattr(torch, str(named).removeprefix("torch."), None) if named else None
    return resolved if isinstance(resolved, torch.dtype) else torch.float32


def _device_bytes(
    name: str, is_float: bool, numel: int, stored: int, dtype: torch.dtype, kept: tuple[str, ...]
) -> int:
    """Bytes one file tensor takes on the device: quantized (not float) as stored, float in
    the compute ``dtype``, and in float32 (dequantized) when it belongs to a module the
    model keeps in float32 (``kept``, matched on whole name parts, as diffusers matches
    them)."""
    if any(module in name.split(".") for module in kept):
        return numel * torch.float32.itemsize
    return numel * dtype.itemsize if is_float else stored


def _module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (on the meta device too)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _computed_buffer_bytes(cls: type, library: str, config: dict) -> int:
    """Bytes of the buffers the model computes for itself (rotary tables), which no file
    holds: the module built on the meta device from its config, quantization left out."""
    if library != "diffusers":
        return 0  # transformers models' computed buffers are counted when loaded
    module = _unquantized_on_meta(cls, config)
    persistent = set(module.state_dict())
    return sum(
        buffer.numel() * buffer.element_size()
        for name, buffer in module.named_buffers()
        if name not in persistent
    )


def _unquantized_on_meta(cls: type, config: dict) -> torch.nn.Module:
    """The diffusers model ``config`` builds, its quantization left out, on the meta
    device: no memory, no weights."""
    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    with torch.device("meta"):
        return cls.from_config(plain)
