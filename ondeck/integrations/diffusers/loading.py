"""``from_pretrained``: a diffusers pipeline whose heavy components load on demand."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import numbers
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ... import distributed
from ...errors import LoadError, held_logs
from ...hub import resolve_model
from ...lazy import is_lazy
from ...loading import (
    ComponentLoader,
    HostCache,
    LoadOptions,
    ModelFolder,
    component_loader,
    fp8,
    load_auxiliary,
)
from ...loading.options import DeviceChoice, StorageChoice
from ...loading.quantized import quantization_method
from ...loading.safetensors_format import read_header
from ...loading.sharded import ShardedComponentLoader, check_shard, shardable_models
from ...loading.single_file import SAFETENSORS_SUFFIXES, SingleFileFolder, pickle_note
from ...loading.skeleton import SkeletonBuildError, is_model_container, library_of
from ...memory import usable_device
from ...parallel import ContextParallel, resolve_parallel, split_sequences
from ...policy import Policy
from .call_shape import profile_identity
from .component import PipelineComponent, is_plain_value, owned_elsewhere
from .encodings import caches_answers
from .pipeline_class import ondeck_pipeline_class
from .runtime import DiffusersRuntime

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
    device: DeviceChoice = None,
    policy: str | Policy = "auto",
    budget: int | str | None = None,
    prefetch: bool = True,
    host_cache: HostCache | None = None,
    *,
    progress: bool = True,
    libraries: tuple[str, ...] | list[str] = (),
    parallel: str | int | ContextParallel | None = None,
    storage_dtype: StorageChoice = None,
    components: Mapping[str, str | os.PathLike] | None = None,
    loras: Sequence[str | os.PathLike | tuple[str | os.PathLike, float]] = (),
    host_memory: int | str | None = None,
    shard: str | Sequence[str] = (),
    prompt_cache: bool = False,
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

    ``torch_dtype`` (or ``dtype``) follows diffusers: one dtype, or a dict by component name
    with a ``"default"``; when omitted, diffusers models load in float32 and transformers
    models in their checkpoint's dtype; ``device`` defaults to CUDA. ``policy``, ``budget``,
    ``prefetch``, ``host_memory`` are :class:`ondeck.Pipeline`'s; ``host_cache`` is an
    ``ondeck.loading.HostCache``. ``libraries``: installed packages beyond diffusers and
    transformers whose classes model_index.json may name (nothing else is imported for the
    folder). ``parallel`` (``"context"``, a degree or an ``ondeck.parallel.ContextParallel``),
    under ``torchrun``, splits the sequence of every deferred component diffusers gives a
    context-parallel plan over the ranks (see ``ondeck.parallel``). ``storage_dtype``
    (``"fp8"``, or a dict by component) keeps the big components' weights (all but the VAE) in
    fp8, computing in their dtype (``ondeck.loading.fp8``). ``components`` maps a component
    name to a single checkpoint file that replaces its weights: a ``.safetensors`` file in the
    original repository's key names or diffusers' (float8 and fp8_scaled included), or a
    ``.gguf`` file; the rest comes from ``path`` (``ondeck.loading.single_file``). ``loras``
    lists LoRA files (or ``(file, scale)`` pairs, or maps files to scales) loaded with
    ``pipe.load_lora_weights`` and set with ``pipe.set_adapters``. ``shard`` names models
    split over a ``torchrun`` launch's ranks (FSDP2; ``docs/multi-gpu.md``).
    ``prompt_cache``: encoders answer a call made before from host memory, without loading
    (:func:`keep_encoders_answers`; ``ondeck generate`` and ``ondeck serve`` turn it on).
    """
    import diffusers

    for name, value in kwargs.items():
        if (error := owned_elsewhere(name, value)) is not None:
            raise error
    loras = checked_loras(loras)
    dtype = _asked_dtype(path, torch_dtype, kwargs)
    path = _local_folder(path, kwargs)
    folder = _opened(path, components, libraries, kwargs)
    base_class = _pipeline_class(diffusers, folder)
    _require_models(folder, skip=kwargs)
    stored = _stored(folder, storage_dtype, skip=kwargs)
    shard = _shard_names(folder, shard, stored, brought=bool(components or loras), skip=kwargs)
    parallel = _join_ranks(shard, resolve_parallel(parallel))
    device = usable_device(device)
    load = LoadOptions(device=device, host_cache=host_cache, progress=progress)
    found = _defer(folder, load, dtype, stored, skip=kwargs, shard=shard)
    if parallel is not None:
        split_sequences(parallel, found.components, device)
    pipe = _built(base_class, path, folder, found, dtype, device, kwargs)
    identity = _identity(type(pipe), path, dtype, stored, components, loras, parallel, kwargs)
    options = dict(policy=policy, budget=budget, prefetch=prefetch, host_memory=host_memory)
    options.update(device=device, containers=tuple(found.containers), profile_model=identity)
    pipe.ondeck = DiffusersRuntime(pipe, found.deferred, **options)
    pipe.ondeck.parallel = parallel
    if prompt_cache:
        keep_encoders_answers(found.deferred)
    if loras:
        load_loras(pipe, loras)
    return pipe


def _identity(
    pipeline_class: type,
    path: Path,
    dtype: Any,
    stored: Mapping[str, Any],
    components: Mapping[str, Any] | None,
    loras: Sequence[tuple[Path, float]],
    parallel: ContextParallel | None,
    given: Mapping[str, Any],
) -> str:
    """The model the pipeline's activation profiles are stored under (``call_shape``)."""
    return profile_identity(
        pipeline_class,
        path,
        dtype,
        storage=stored,
        components=components,
        given=[name for name, value in given.items() if isinstance(value, torch.nn.Module)],
        loras=[(str(file), scale) for file, scale in loras],
        parallel_degree=parallel.degree if parallel is not None else None,
    )


def _opened(
    path: Path, components: Mapping[str, Any] | None, libraries: Sequence[str], kwargs: dict
) -> Any:
    """The model folder, with single files standing in for the components they replace."""
    folder = ModelFolder.open(path, variant=kwargs.get("variant"), libraries=libraries)
    return SingleFileFolder(folder, components) if components else folder


def keep_encoders_answers(components: Mapping[str, PipelineComponent]) -> None:
    """Each text or image encoder among ``components`` answers a call it has answered
    before (a negative prompt every run shares, a prompt run again) from host memory,
    without loading (``PipelineComponent.keep_answers``)."""
    for name, proxy in components.items():
        if caches_answers(proxy.spec, name):
            proxy.keep_answers()


def _built(
    base_class: type, path: Path, folder: Any, found: Any, dtype: Any, device: Any, kwargs: dict
) -> Any:
    """The diffusers pipeline over the deferred components ``found``, built by diffusers'
    own ``from_pretrained`` with ondeck's class; what diffusers loaded itself goes where
    the others load."""
    options = dict(kwargs)
    if dtype is not None:
        options["dtype"] = dtype
    parts = {**found.components, **found.containers, **found.auxiliaries}
    with _shaped_from_configs(found.deferred.values()):
        pipe = ondeck_pipeline_class(base_class).from_pretrained(str(path), **parts, **options)
    _route_sub_pipelines(pipe)
    _place_loaded_by_diffusers(pipe, folder, skip=set(parts) | set(kwargs), device=device)
    return pipe


def checked_loras(loras: Any) -> list[tuple[Path, float]]:
    """``loras=`` as ``(file, scale)`` pairs, checked before anything is built: a list of
    files or ``(file, scale)`` pairs, or a ``{file: scale}`` mapping, each scale a finite
    number (as ``--lora`` takes), each file once."""
    if isinstance(loras, Mapping):
        loras = list(loras.items())
    if isinstance(loras, (str, bytes, os.PathLike)):
        raise ValueError(
            f"loras= takes a list of LoRA files or (file, scale) pairs, not one path: "
            f"write loras=[{os.fspath(loras)!r}]"
        )
    checked: list[tuple[Path, float]] = []
    given: dict[Any, Path] = {}  # each file (its inode, or as it resolves) -> as given
    for entry in loras:
        if isinstance(entry, (str, os.PathLike)):
            file, scale = entry, 1.0
        elif isinstance(entry, (tuple, list)) and len(entry) == 2:
            file, scale = entry
        else:
            raise ValueError(f"loras=: {entry!r} is neither a file nor a (file, scale) pair")
        if not isinstance(file, (str, os.PathLike)):
            raise ValueError(f"loras=: {file!r} is not a file's path")
        file = Path(os.fspath(file)).expanduser()
        real = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
        if not real or not math.isfinite(float(scale)):
            raise ValueError(f"LoRA {file}: its scale must be a finite number, got {scale!r}")
        earlier = given.setdefault(_same_file_key(file), file)
        if earlier is not file:
            # Each entry is applied: one file twice doubles its effect without a word.
            spelled = f" (as {earlier} too)" if earlier != file else ""
            raise ValueError(
                f"LoRA {file} is given twice{spelled}; give it once, with the scale you want"
            )
        checked.append((file, float(scale)))
    return checked


def _same_file_key(file: Path) -> Any:
    """What makes two paths one file: its device and inode (a hard link, a symbolic
    one), or where a file not there yet would resolve to."""
    try:
        status = file.stat()
    except OSError:
        return file.resolve()
    return (status.st_dev, status.st_ino)


def load_loras(
    pipe: Any, loras: Sequence[str | os.PathLike | tuple[str | os.PathLike, float]]
) -> list[str]:
    """Load each LoRA file into ``pipe`` (on every transformer: Wan 2.2's two experts
    both) and set their scales; returns the adapter names. Nothing loads: the
    calls are recorded on the components and applied at every load."""
    names: list[str] = []
    scales: list[float] = []
    files: list[Path] = []
    for file, scale in checked_loras(loras):
        if not file.is_file():
            raise LoadError(f"LoRA {file} does not exist or is not a file", path=str(file))
        if not file.name.lower().endswith(SAFETENSORS_SUFFIXES):
            raise LoadError(
                f"LoRA {file}: a LoRA is a .safetensors file{pickle_note(file)}",
                path=str(file),
            )
        try:
            read_header(file)  # a truncated or damaged file, said as for a component's
        except LoadError as error:
            raise LoadError(f"LoRA {error}", path=str(file)) from None
        # An adapter's name is a module's name in peft: no '.' (Wan2.1_style_v1.0).
        name = f"lora_{len(names)}_{re.sub(r'[^0-9A-Za-z_]', '_', file.stem)}"
        # diffusers puts a LoRA on one expert a call: the first, or with
        # load_into_transformer_2 the second.
        experts = [{}]
        if getattr(pipe, "transformer_2", None) is not None:
            experts.append({"load_into_transformer_2": True})
        try:
            with held_logs("diffusers", "peft"):
                for expert in experts:
                    pipe.load_lora_weights(str(file), adapter_name=name, **expert)
        except Exception as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            more = f" (and {len(lines) - 2} more lines)" if len(lines) > 2 else ""
            # diffusers' key conversions index into the names they expect: such an error
            # there means a layout they took for one they know, which it is not.
            layout = (
                "; its keys are not a LoRA layout diffusers converts for this pipeline"
                if isinstance(error, (IndexError, KeyError))
                else "; is it a LoRA for another model, or another size of this one?"
            )
            raise LoadError(
                f"LoRA {file}: loading it into {type(pipe).__name__} failed with "
                f"{type(error).__name__}: {' '.join(lines[:2])}{more}{layout}",
                path=str(file),
            ) from error
        names.append(name)
        scales.append(float(scale))
        files.append(file)
    # diffusers' own, loading nothing: each deferred component records its part. It
    # refuses an adapter no component took: diffusers found no layer of that file here.
    try:
        pipe.set_adapters(names, scales)
    except ValueError as error:
        unused = [str(f) for n, f in zip(names, files, strict=True) if n in str(error)]
        raise LoadError(
            f"LoRA {', '.join(unused or map(str, files))}: no layer of it is one of "
            f"{type(pipe).__name__}'s (its keys name none of the modules diffusers loads "
            "LoRAs into here); is it for another model?",
            path=unused[0] if unused else str(files[0]),
        ) from None
    pipe.ondeck.choose_again()  # auto weighs the LoRAs' layers too
    return names


def _asked_dtype(path: Any, torch_dtype: Any, kwargs: dict[str, Any]) -> Any:
    """The dtype asked for, as ``torch_dtype`` or diffusers' ``dtype`` (taken out of
    ``kwargs``), not both; a custom pipeline is refused."""
    dtype = kwargs.pop("dtype", None)
    if torch_dtype is not None and dtype is not None:
        raise ValueError("pass torch_dtype or dtype, not both")
    if kwargs.get("custom_pipeline") is not None:
        raise LoadError(
            f"{path}: custom_pipeline={kwargs['custom_pipeline']!r}: ondeck runs diffusers' "
            "own pipeline classes only; load a custom pipeline with diffusers itself",
            path=str(path),
        )
    return dtype if dtype is not None else torch_dtype


def _stored(
    folder: ModelFolder, storage_dtype: StorageChoice, skip: Mapping[str, Any]
) -> dict[str, torch.dtype]:
    """The storage dtype of each model ondeck builds (``skip``: components passed in)."""
    models = {
        name: folder.component_class(name)
        for name in folder.component_names
        if name not in skip and issubclass(folder.component_class(name), torch.nn.Module)
    }
    return fp8.storage_by_component(storage_dtype, models)


def _join_ranks(shard: tuple[str, ...], parallel: ContextParallel | None) -> Any:
    """Join the process group of a ``torchrun`` launch where sharding or splitting the
    sequence; before the device is resolved, since joining selects this rank's GPU."""
    if shard:
        distributed.init()
    if parallel is not None:
        parallel.join()
    return parallel


def _shard_names(
    folder: ModelFolder,
    shard: str | Sequence[str],
    stored: Mapping[str, torch.dtype],
    *,
    brought: bool,
    skip: Mapping[str, Any],
) -> tuple[str, ...]:
    """The models to shard, each one ondeck reads from the folder by rows."""
    if not shard:
        return ()
    if set(stored) & set((shard,) if isinstance(shard, str) else shard):
        raise ValueError(f"cannot shard components stored in fp8 ({sorted(stored)})")
    if brought:
        raise LoadError(
            "sharding reads each rank's rows from the folder's own safetensors files; a "
            "single-file component or a LoRA (components=, loras=; --transformer, "
            "--component, --lora) cannot be sharded: leave them out to shard",
            path=str(folder.path),
        )
    return check_shard(folder, shard, shardable_models(folder, skip))


def _require_models(folder: ModelFolder, skip: Mapping[str, Any]) -> None:
    """Refuse an untrusted library before diffusers imports it, a model without
    readable safetensors weights now rather than when a call first needs it (a gguf
    component's loader looks for its file), and a scheduler without its config (diffusers
    would name the model's folder, not the component). ``skip``: components passed in."""
    for name in folder.component_names:
        if name in skip:
            continue
        cls = folder.component_class(name)
        if issubclass(cls, torch.nn.Module):
            if quantization_method(folder, name) != "gguf":
                folder.require_weights(name)
        elif isinstance(getattr(cls, "config_name", None), str):
            folder.config_path(name)  # a scheduler's config, named here when it is missing


@dataclass
class _Found:
    """What ``from_pretrained`` builds itself: deferred components, containers over
    deferred models, every deferred model by runtime name (the components, and the
    models inside containers: ``controlnet.nets.1``), and the transformers parts."""

    components: dict[str, PipelineComponent] = field(default_factory=dict)
    containers: dict[str, torch.nn.Module] = field(default_factory=dict)
    deferred: dict[str, PipelineComponent] = field(default_factory=dict)
    auxiliaries: dict[str, Any] = field(default_factory=dict)


def _defer(
    folder: ModelFolder,
    load: LoadOptions,
    dtype: Any,
    stored: Mapping[str, torch.dtype],
    skip: Mapping[str, Any],
    shard: tuple[str, ...] = (),
) -> _Found:
    """A deferred proxy for every model ondeck can defer, each loading as ``load`` says
    in its own dtype, those in ``shard`` as this rank's rows over every rank; ``skip``:
    components passed in."""
    found = _Found()
    mesh = distributed.device_mesh(load.device) if shard else None
    for name in folder.component_names:
        if name in skip:
            continue
        if _is_transformers_auxiliary(folder, name):
            # Loaded here, not by diffusers, so that a tokenizer's auto_map never runs.
            found.auxiliaries[name] = load_auxiliary(folder, name)
            continue
        component_dtype = _component_dtype(dtype, name, folder)
        if _is_container(folder, name):
            container = _deferred_container(folder, name, load.replace(dtype=component_dtype))
            if container is not None:
                found.containers[name], parts = container
                found.deferred.update(parts)
            continue
        if not _can_defer(folder, name):
            continue
        options = load.replace(dtype=component_dtype, storage_dtype=stored.get(name))
        component = _deferred_component(
            folder,
            name,
            options,
            mesh=mesh if name in shard else None,
            # Beside sharded models, every plain one counts what each rank reads too.
            count_reads=bool(shard) and quantization_method(folder, name) is None,
        )
        if component is not None:
            found.components[name] = found.deferred[name] = component
    unsharded = sorted(set(shard) - set(found.components))
    if unsharded:  # diffusers loads it whole (a warning said why)
        raise LoadError(f"cannot shard {unsharded}: ondeck does not load them itself")
    return found


def _route_sub_pipelines(pipe: Any) -> None:
    """A combined pipeline (Kandinsky's) runs sub-pipelines it built over the same
    components; they get ondeck's class too, so that asking them for their execution
    device walks no deferred component (which would load it out of turn)."""
    from diffusers import DiffusionPipeline

    for value in vars(pipe).values():
        if isinstance(value, DiffusionPipeline) and value is not pipe:
            value.__class__ = ondeck_pipeline_class(type(value))


def _local_folder(path: str | os.PathLike, kwargs: dict[str, Any]) -> Path:
    if Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    if not set(_HUB_OPTIONS) & set(kwargs):  # the cache, else a safetensors-only download
        return resolve_model(path)
    from diffusers import DiffusionPipeline

    # A hub id: diffusers fetches the snapshot (files only; nothing is loaded yet).
    options = {key: kwargs[key] for key in _HUB_OPTIONS if key in kwargs}
    return Path(DiffusionPipeline.download(str(path), **options))


def _pipeline_class(diffusers: Any, folder: Any) -> type:
    name = folder.pipeline_class_name
    if name is not None and not isinstance(name, str):
        raise LoadError(
            f"{folder.path / 'model_index.json'}: _class_name {name!r} names a custom "
            "pipeline; ondeck runs diffusers' own pipeline classes only",
            path=str(folder.path / "model_index.json"),
        )
    if name is None:
        raise LoadError(
            f"{folder.path / 'model_index.json'} has no _class_name (the pipeline class to run)",
            path=str(folder.path / "model_index.json"),
        )
    found = getattr(diffusers, name, None) if name else None
    if not isinstance(found, type) or not issubclass(found, diffusers.DiffusionPipeline):
        raise LoadError(
            f"{folder.path / 'model_index.json'}: _class_name {name!r} is not a diffusers "
            f"pipeline in diffusers {diffusers.__version__}",
            path=str(folder.path / "model_index.json"),
        )
    return found


def _can_defer(folder: Any, name: str) -> bool:
    """Models ondeck can build from a config and fill from safetensors files, and gguf
    models. A model it cannot defer loads with diffusers and stays resident; one warning
    says why."""
    try:
        cls = folder.component_class(name)
        if not issubclass(cls, torch.nn.Module):
            return False
        if library_of(cls) not in ("diffusers", "transformers"):
            why = f"{cls.__module__}.{cls.__name__} is not a diffusers or transformers model"
        elif quantization_method(folder, name) == "gguf":
            return True  # its loader reads the .gguf file through diffusers
        elif not folder.weight_files(name):
            why = f"{folder.path / name} holds no safetensors weights"
        else:
            return True
    except LoadError as error:
        why = str(error)
    warnings.warn(
        f"component '{name}' is not deferred: {why}; it loads with diffusers and stays resident",
        stacklevel=3,
    )
    return False


def _is_container(folder: Any, name: str) -> bool:
    try:
        return is_model_container(folder.component_class(name))
    except LoadError:
        return False


def _deferred_container(
    folder: ModelFolder, name: str, options: LoadOptions
) -> tuple[torch.nn.Module, dict[str, PipelineComponent]] | None:
    """The container built over a deferred proxy for each model in it, found as diffusers
    finds them (``name``, ``name_1``, ... beside each other); None, with one warning,
    when a model in it cannot be deferred (diffusers then loads the container whole)."""
    cls = folder.component_class(name)
    parts: list[str] = []
    while (folder.path / (name if not parts else f"{name}_{len(parts)}")).is_dir():
        parts.append(name if not parts else f"{name}_{len(parts)}")
    try:
        classes = {part: _saved_class_name(folder.path / part) for part in parts}
        # The models inside are listed nowhere; a folder that names them lets ondeck read
        # each one exactly as it reads a component.
        inner = ModelFolder(
            folder.path,
            {part: ["diffusers", class_name] for part, class_name in classes.items()},
            variant=folder.variant,
            libraries=folder.libraries,
        )
        proxies = {}
        for index, part in enumerate(parts):
            if not inner.weight_files(part):
                raise LoadError(f"{folder.path / part} holds no safetensors weights")
            proxy = _deferred_component(inner, part, options)
            if proxy is None:
                raise LoadError(f"'{part}' inside it cannot be built", component=name)
            proxies[f"{name}.nets.{index}"] = proxy
        if not proxies:
            raise LoadError(f"no model folder {folder.path / name}", component=name)
    except LoadError as error:
        warnings.warn(
            f"component '{name}' ({cls.__name__}) is not deferred: {error}; it loads with "
            "diffusers and stays resident",
            stacklevel=3,
        )
        return None
    return cls(list(proxies.values())), proxies


def _saved_class_name(directory: Path) -> str:
    config = directory / "config.json"
    try:
        class_name = json.loads(config.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as error:
        raise LoadError(f"{config}: unreadable ({error})", path=str(config)) from None
    if not isinstance(class_name, str):
        raise LoadError(f"{config}: no _class_name naming the model", path=str(config))
    return class_name


def _is_transformers_auxiliary(folder: Any, name: str) -> bool:
    cls = folder.component_class(name)
    return cls.__module__.startswith("transformers") and not issubclass(cls, torch.nn.Module)


def _component_dtype(dtype: Any, name: str, folder: Any) -> torch.dtype | None:
    if isinstance(dtype, dict):
        return dtype.get(name, dtype.get("default", torch.float32))
    if dtype is not None:
        return dtype
    # As diffusers: its own models load in float32, transformers models as saved.
    return torch.float32 if library_of(folder.component_class(name)) == "diffusers" else None


def _deferred_component(
    folder: ModelFolder,
    name: str,
    options: LoadOptions,
    *,
    mesh: Any = None,
    count_reads: bool = False,
) -> PipelineComponent | None:
    def make_loader(
        target_device: torch.device, target_dtype: torch.dtype | None
    ) -> ComponentLoader:
        target = options.replace(device=target_device, dtype=target_dtype)
        if mesh is not None or count_reads:
            return ShardedComponentLoader(folder, name, target, mesh=mesh)
        return component_loader(folder, name, target)

    try:
        loader = make_loader(options.device, options.dtype)
        spec = loader.spec
    except SkeletonBuildError as error:
        # Only a class ondeck cannot build falls back: a folder whose config and weights
        # disagree must not be handed to diffusers to build at the size the config says.
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
        # Plain data (numbers, flags, and lists, tuples and dicts of them, such as the Wan
        # VAE's temperal_downsample) is answered with a copy; modules and tensors load.
        return copy.deepcopy(value) if _is_plain_data(value) else None


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


def _is_plain_data(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain_data(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_plain_data(item) for key, item in value.items())
    return value is not None and is_plain_value(value)


def _place_loaded_by_diffusers(pipe: Any, folder: Any, *, skip: set[str], device: Any) -> None:
    """Models diffusers loaded itself (no safetensors, say) go where the others load."""
    for name in folder.component_names:
        if name in skip:
            continue
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module) and not is_lazy(module):
            if getattr(module, "device", device) != device:
                module.to(device)
