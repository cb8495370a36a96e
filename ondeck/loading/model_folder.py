"""A diffusers-format model folder: its components, configs and weight layout, no weights read."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import stat
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError
from ..lazy import ComponentSpec
from .config_bounds import MAX_JSON_BYTES, check_component_configs
from .safetensors_format import (
    MAX_COMPONENT_HEADER_BYTES,
    SafetensorsHeader,
    TensorInfo,
    file_kind,
    open_regular_file,
    read_header,
)
from .skeleton import build_skeleton

__all__ = ["ModelFolder"]

# Preferred weight file stems, in order: diffusers models, then transformers models.
_WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
# Libraries a model_index.json may name without the caller's say-so. A folder is data:
# naming any other module would make opening it run that module's code.
TRUSTED_LIBRARIES = ("diffusers", "transformers")
# Config files of the parts that are not models, tried when the class does not say.
_CONFIG_NAMES = (
    "config.json",
    "scheduler_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer_config.json",
)


def _find_spec(name: str):
    """The import spec of a top-level name, found without running its code."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


class ModelFolder:
    """What a diffusers-format folder holds, known from its JSON files and headers alone."""

    def __init__(
        self,
        path: Path,
        model_index: dict[str, Any],
        *,
        variant: str | None = None,
        libraries: tuple[str, ...] | list[str] = (),
    ):
        self.path = path
        self.model_index = model_index
        self.variant = variant
        self.libraries = tuple(TRUSTED_LIBRARIES) + tuple(libraries)
        self._entries: dict[str, tuple[str, str]] = {}
        for name, entry in model_index.items():
            if name.startswith("_") or not isinstance(entry, (list, tuple)) or len(entry) != 2:
                continue
            if not _is_plain_name(name):
                # A component name is a folder name: "../x" or "/etc" would read (and let a
                # library load) whatever lies there.
                raise LoadError(
                    f"{path / 'model_index.json'}: component name {name!r} is not a plain "
                    "folder name inside the model folder",
                    path=str(path / "model_index.json"),
                )
            library, class_name = entry
            if library is None or class_name is None:
                continue
            self._entries[name] = (str(library), str(class_name))
        self._lock = threading.RLock()
        self._headers: dict[str, list[SafetensorsHeader]] = {}
        self._templates: dict[tuple[str, torch.dtype], Any] = {}

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        variant: str | None = None,
        libraries: tuple[str, ...] | list[str] = (),
    ) -> ModelFolder:
        """Open a folder; ``libraries`` names installed packages, beyond diffusers and
        transformers, whose classes model_index.json may name."""
        path = Path(path).expanduser()
        if not path.is_dir():
            raise LoadError(
                f"model folder {path} does not exist or is not a folder", path=str(path)
            )
        index_path = path / "model_index.json"
        if not index_path.is_file():
            raise LoadError(
                f"model folder {path}: no model_index.json (not a diffusers-format folder?)",
                path=str(index_path),
            )
        model_index = _read_json(index_path, component=None)
        folder = cls(path, model_index, variant=variant, libraries=libraries)
        folder.check_configs()
        return folder

    def check_configs(self) -> None:
        """Refuse, before anything is built, a part whose config asks for an implausible
        allocation, or a pipeline in a part's place (``config_bounds``)."""
        for name, (library, class_name) in self._entries.items():
            directory = self.path / name
            if directory.is_dir():
                check_component_configs(directory, name, library, class_name, _read_json)

    def __repr__(self) -> str:
        return f"ModelFolder({str(self.path)!r}, {self.pipeline_class_name})"

    # -- components ---------------------------------------------------------------------

    @property
    def pipeline_class_name(self) -> str | None:
        return self.model_index.get("_class_name")

    @property
    def component_names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def library_and_class(self, name: str) -> tuple[str, str]:
        try:
            return self._entries[name]
        except KeyError:
            raise LoadError(
                f"component '{name}' is not in {self.path / 'model_index.json'} "
                f"(it lists {', '.join(self._entries) or 'nothing'})",
                component=name,
                path=str(self.path / "model_index.json"),
            ) from None

    def directory(self, name: str) -> Path:
        self.library_and_class(name)
        directory = _inside(self.path, name, f"component '{name}'")
        if not directory.is_dir():
            raise LoadError(
                f"component '{name}': folder {directory} is missing",
                component=name,
                path=str(directory),
            )
        _refuse_special_files(directory, name)
        return directory

    def component_class(self, name: str) -> type:
        """Import the class model_index.json names for ``name``."""
        library, class_name = self.library_and_class(name)
        try:
            module = importlib.import_module(self._trusted_module(name, library, class_name))
        except ImportError as error:
            raise LoadError(
                f"component '{name}': library '{library}' for class {class_name} is not "
                f"installed ({error})",
                component=name,
            ) from error
        try:
            found = getattr(module, class_name)
        except (AttributeError, ImportError, RuntimeError) as error:
            version = getattr(module, "__version__", "unknown version")
            raise LoadError(
                f"component '{name}': class {class_name} is not in {library} {version} "
                f"(model_index.json names it; a newer {library} may have it)",
                component=name,
            ) from error
        if not isinstance(found, type):
            raise LoadError(f"component '{name}': {library}.{class_name} is not a class")
        return found

    def _trusted_module(self, name: str, library: str, class_name: str) -> str:
        """The module to import for ``library``, refusing any library not trusted."""
        top = library.split(".")[0]
        where = f"component '{name}': {self.path / 'model_index.json'} names class {class_name}"
        local = self._local_code(top) if top not in TRUSTED_LIBRARIES else None
        if top in self.libraries and local is None:
            return library
        # diffusers names its own pipeline packages by their short name ("ltx").
        if library.isidentifier() and importlib.util.find_spec("diffusers") is not None:
            module = f"diffusers.pipelines.{library}"
            if importlib.util.find_spec(module) is not None:
                return module
        if local is not None:
            advice = (
                f"'{top}' is {local}, code beside the model or in the working directory, "
                "not an installed package: ondeck never imports it"
            )
        elif _find_spec(top) is not None:
            advice = f"pass libraries=['{top}'] or --library {top} to trust the installed package"
        else:
            advice = f"no installed package provides '{top}'"
        raise LoadError(
            f"{where} from library '{library}'; ondeck imports classes only from "
            f"{', '.join(self.libraries)} ({advice})",
            component=name,
            path=str(self.path / "model_index.json"),
        )

    def _local_code(self, top: str) -> Path | None:
        """Where ``top`` would be imported from, when that is inside the model folder or the
        working directory (on ``sys.path`` under ``python -m``); None otherwise."""
        spec = _find_spec(top)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or []) or [spec.origin or ""]
        roots = [self.path.resolve(), Path.cwd().resolve()]
        # What an environment installed is installed, wherever the environment lives.
        environments = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
        for location in locations:
            if not location:
                continue
            resolved = Path(location).resolve()
            if any(env in resolved.parents for env in environments):
                continue
            if any(resolved == root or root in resolved.parents for root in roots):
                return resolved
        return None

    def is_model(self, name: str) -> bool:
        """True for components with weights (an nn.Module class or safetensors files)."""
        try:
            if issubclass(self.component_class(name), torch.nn.Module):
                return True
        except LoadError:
            pass
        directory = self.path / name
        return directory.is_dir() and bool(_weight_candidates(directory))

    def config_path(self, name: str) -> Path:
        directory = self.directory(name)
        names: list[str] = []
        try:
            declared = getattr(self.component_class(name), "config_name", None)
            if isinstance(declared, str):
                names.append(declared)
        except LoadError:
            pass
        if not names and self.is_model(name):
            names.append("config.json")
        names += [candidate for candidate in _CONFIG_NAMES if candidate not in names]
        for candidate in names:
            if (directory / candidate).is_file():
                return directory / candidate
            if (directory / candidate).exists():
                raise LoadError(
                    f"component '{name}': {directory / candidate} is not a regular file",
                    component=name,
                    path=str(directory / candidate),
                )
        raise LoadError(
            f"component '{name}': {directory / names[0]} is missing",
            component=name,
            path=str(directory / names[0]),
        )

    def config_dict(self, name: str) -> dict[str, Any]:
        return _read_json(self.config_path(name), component=name)

    # -- weights ------------------------------------------------------------------------

    def headers(self, name: str) -> list[SafetensorsHeader]:
        """The parsed headers of every weight file of ``name`` (empty for parts without)."""
        with self._lock:
            if name not in self._headers:
                self._headers[name] = self._read_headers(name)
            return self._headers[name]

    def tensors(self, name: str) -> dict[str, TensorInfo]:
        """Every tensor of the component by name; each ``TensorInfo.path`` names its file."""
        tensors: dict[str, TensorInfo] = {}
        for header in self.headers(name):
            for key, info in header.tensors.items():
                if key in tensors:
                    raise LoadError(
                        f"component '{name}': tensor '{key}' is in both {tensors[key].path} "
                        f"and {header.path}",
                        component=name,
                        path=header.path,
                    )
                tensors[key] = info
        return tensors

    def weight_files(self, name: str) -> list[str]:
        return [header.path for header in self.headers(name)]

    def require_weights(self, name: str) -> list[SafetensorsHeader]:
        """The headers of a model component, refusing one without safetensors weights.

        Reads headers only, so a pipeline can call it for every model when it is built:
        a missing or unreadable file then fails at once, not after the stages before it.
        """
        headers = self.headers(name)
        if not headers:
            directory = self.directory(name)
            pickles = _pickle_weights(directory)
            also = (
                f"; it holds only pickle weights ({', '.join(pickles)}), which ondeck does "
                "not read (unpickling can run code): save them as safetensors"
                if pickles
                else ""
            )
            raise LoadError(
                f"component '{name}' from {directory}: no safetensors weights there "
                f"(expected diffusion_pytorch_model.safetensors, model.safetensors or a "
                f"*.safetensors.index.json){also}",
                component=name,
                path=str(directory),
            )
        return headers

    def file_bytes(self, name: str) -> int:
        """Bytes of tensor data in the component's weight files."""
        return sum(header.data_nbytes for header in self.headers(name))

    def _read_headers(self, name: str) -> list[SafetensorsHeader]:
        directory = self.directory(name)
        files, weight_map = _select_weights(directory, self.variant, name)
        headers = []
        header_bytes = 0
        for path in files:
            headers.append(read_header(path, component=name))
            header_bytes += headers[-1].data_start
            if header_bytes > MAX_COMPONENT_HEADER_BYTES:
                raise LoadError(
                    f"component '{name}' from {directory}: its shards' headers add up to more "
                    f"than {MAX_COMPONENT_HEADER_BYTES // 10**6} MB (real ones are kilobytes "
                    "each); not a plausible checkpoint",
                    component=name,
                    path=path,
                )
        by_file = {os.path.basename(header.path): header for header in headers}
        for key, filename in (weight_map or {}).items():
            if key not in by_file[filename].tensors:
                raise LoadError(
                    f"component '{name}': the shard index puts tensor '{key}' in {filename}, "
                    "but that file does not hold it",
                    component=name,
                    path=by_file[filename].path,
                )
        return headers

    # -- specs --------------------------------------------------------------------------

    def default_dtype(self, name: str) -> torch.dtype | None:
        """The floating dtype holding most of the component's bytes in its files."""
        weights = Counter()
        for info in self.tensors(name).values():
            if info.dtype.is_floating_point:
                weights[info.dtype] += info.nbytes
        return weights.most_common(1)[0][0] if weights else None

    def resolve_dtype(self, name: str, dtype: torch.dtype | str | None) -> torch.dtype:
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(resolved, torch.dtype):
                raise LoadError(f"component '{name}': unknown dtype {dtype!r}", component=name)
            return resolved
        return dtype or self.default_dtype(name) or torch.float32

    def skeleton(self, name: str, dtype: torch.dtype | str | None = None):
        """A fresh module for ``name`` on the meta device, with its slots to fill."""
        return self._template(name, self.resolve_dtype(name, dtype)).fresh()

    def template(self, name: str, dtype: torch.dtype | str | None = None):
        """The shared skeleton for ``name``: read it, never fill it (``.fresh()`` to fill)."""
        return self._template(name, self.resolve_dtype(name, dtype))

    def _template(self, name: str, dtype: torch.dtype):
        # Built once per (component, dtype); loads copy it. Building changes process-wide
        # torch state for a moment, so it should happen when the spec is first asked for
        # (pipeline setup), not in a loader thread while another thread computes.
        with self._lock:
            template = self._templates.get((name, dtype))
            if template is None:
                cls = self.component_class(name)
                # The config must be a JSON object, and the weights' headers readable,
                # before the library builds anything from them.
                config_path = self.config_path(name)
                _read_json(config_path, component=name)
                self.require_weights(name)
                template = build_skeleton(
                    cls,
                    self.directory(name),
                    dtype,
                    tensors=self.tensors(name),
                    component=name,
                    config_path=config_path,
                )
                self._refuse_integer_weights(name, template.module, config_path)
                self._templates[(name, dtype)] = template
            return template

    def _refuse_integer_weights(self, name: str, module: Any, config_path: Path) -> None:
        """An integer or boolean tensor in the file where the model has a floating
        parameter is refused: cast, it would load as whole numbers (or 0 and 1) with no
        word. Already quantized components (a ``quantization_config``) store integers by
        design and are left to their library."""
        if "quantization_config" in _read_json(config_path, component=name):
            return
        tensors = self.tensors(name)
        for key, value in module.state_dict(keep_vars=True).items():
            info = tensors.get(key)
            if info is None or not value.is_floating_point():
                continue
            if not (info.dtype.is_floating_point or info.dtype.is_complex):
                stored = str(info.dtype).removeprefix("torch.")
                raise LoadError(
                    f"component '{name}' from {info.path}: tensor '{key}' is stored as "
                    f"{stored}, but the model's parameter is {str(value.dtype).removeprefix('torch.')}"
                    " (a floating type); ondeck does not cast whole numbers into weights",
                    component=name,
                    path=info.path,
                )

    def spec(
        self,
        name: str,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> ComponentSpec:
        """What the loaded component will be, from configs and headers only."""
        cls = self.component_class(name)
        device = torch.device(device) if device is not None else None
        if not issubclass(cls, torch.nn.Module):
            config = self._auxiliary_config(name, cls)
            return ComponentSpec(cls=cls, config=config, dtype=None, device=device, nbytes=0)
        resolved = self.resolve_dtype(name, dtype)
        template = self._template(name, resolved)
        return ComponentSpec(
            cls=cls,
            config=template.module.config,
            dtype=resolved,
            device=device,
            nbytes=template.nbytes,
        )

    def _auxiliary_config(self, name: str, cls: type) -> Any:
        if not self._has_config(name):
            return None
        config = self.config_dict(name)
        if hasattr(cls, "load_config"):
            # diffusers parts answer attribute reads on their config (scheduler.config.x).
            from diffusers.configuration_utils import FrozenDict

            return FrozenDict(config)
        return config

    def _has_config(self, name: str) -> bool:
        try:
            self.config_path(name)
        except LoadError:
            return False
        return True


def _read_json(path: Path, *, component: str | None) -> dict[str, Any]:
    where = f"component '{component}': {path}" if component else str(path)
    try:
        with open_regular_file(path) as file:
            text = file.read(MAX_JSON_BYTES + 1)
        if len(text) > MAX_JSON_BYTES:
            raise LoadError(
                f"{where}: larger than {MAX_JSON_BYTES // 10**6} MB, not a config file",
                component=component,
                path=str(path),
            )
        document = json.loads(text.decode("utf-8"))
    except OSError as error:
        raise LoadError(
            f"{where}: cannot read ({error.strerror or error})", component=component, path=str(path)
        ) from error
    except (ValueError, RecursionError) as error:
        raise LoadError(
            f"{where}: not valid JSON ({error})", component=component, path=str(path)
        ) from error
    if not isinstance(document, dict):
        raise LoadError(
            f"{where}: holds a JSON {_json_kind(document)}, not an object",
            component=component,
            path=str(path),
        )
    return document


def _json_kind(document: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if document is None else kinds.get(type(document), type(document).__name__)


def _is_plain_name(name: str) -> bool:
    """A single path component: no separators, not "." or "..", not absolute."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
    )


def _inside(root: Path, name: str, what: str) -> Path:
    """``root / name`` for a plain ``name``, else a LoadError.

    Checked on the names, not on resolved paths: a Hub snapshot's files are symlinks into
    its blob store, outside the snapshot folder, and are the folder's own files.
    """
    if not _is_plain_name(name):
        raise LoadError(f"{what}: {name!r} is not a plain file name inside {root}", path=str(root))
    path = root / name
    if not Path(os.path.normpath(path)).is_relative_to(os.path.normpath(root)):
        raise LoadError(f"{what}: {path} is outside {root}", path=str(path))
    return path


def _refuse_special_files(directory: Path, component: str) -> None:
    """Refuse a FIFO, socket or device among a component's files: the libraries that read
    tokenizer and scheduler files open them blindly, and a FIFO would block for ever."""
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                mode = os.stat(entry.path).st_mode
            except OSError:
                continue  # a dangling link (an unused file of a partial download) is no risk
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise LoadError(
                    f"component '{component}': {entry.path} is not a regular file "
                    f"({file_kind(mode)}); ondeck reads regular files only",
                    component=component,
                    path=entry.path,
                )


def _pickle_weights(directory: Path) -> list[str]:
    return sorted(
        p.name for p in directory.iterdir() if p.name.endswith((".bin", ".pt", ".pth", ".ckpt"))
    )


def _weight_candidates(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.iterdir()
        if p.name.endswith(".safetensors")
        or (".safetensors.index." in p.name and p.name.endswith(".json"))
    )


def _select_weights(
    directory: Path, variant: str | None, component: str
) -> tuple[list[str], dict[str, str] | None]:
    """The weight files of one component: a single file, or the shards an index names."""
    names = {p.name for p in _weight_candidates(directory)}
    if not names:
        return [], None
    variants = [variant, None] if variant else [None]
    for wanted in variants:
        for stem in _WEIGHT_STEMS:
            index = (
                f"{stem}.safetensors.index.{wanted}.json"
                if wanted
                else f"{stem}.safetensors.index.json"
            )
            single = f"{stem}.{wanted}.safetensors" if wanted else f"{stem}.safetensors"
            if index in names:
                return _shards(directory / index, component)
            if single in names:
                return [str(directory / single)], None
    # No preferred name: one unambiguous file or index, e.g. a single-variant folder.
    indexes = sorted(n for n in names if n.endswith(".json"))
    if len(indexes) == 1:
        return _shards(directory / indexes[0], component)
    singles = sorted(n for n in names if n.endswith(".safetensors"))
    if len(singles) == 1:
        return [str(directory / singles[0])], None
    raise LoadError(
        f"component '{component}': cannot tell which weights in {directory} to load "
        f"({', '.join(sorted(names))}); pass variant=",
        component=component,
        path=str(directory),
    )


def _shards(index_path: Path, component: str) -> tuple[list[str], dict[str, str]]:
    index = _read_json(index_path, component=component)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise LoadError(
            f"component '{component}': {index_path} has no valid weight_map",
            component=component,
            path=str(index_path),
        )
    files: list[str] = []
    for filename in dict.fromkeys(weight_map.values()):
        if not _is_plain_name(filename):
            raise LoadError(
                f"component '{component}': {index_path} names shard {filename!r}, which is "
                "not a plain file name beside the index (shards stay inside the model folder)",
                component=component,
                path=str(index_path),
            )
        shard = index_path.parent / filename
        if not os.path.lexists(shard):
            raise LoadError(
                f"component '{component}': {index_path.name} names shard {filename}, "
                f"but {shard} is missing",
                component=component,
                path=str(shard),
            )
        files.append(str(shard))
    return files, weight_map
