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

Like any other component it loads on first use and is freed on release. ondeck's own
reader, host cache, pipelined loading, block streaming, fp8 storage and sharding do not
apply to it, and asking for them is refused before anything loads.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError
from ..lazy import ComponentSpec
from .folder import ModelFolder

__all__ = ["PACKAGES", "QuantizedComponentLoader", "quantization_method"]

# The package each quantization method needs, as its module is imported.
PACKAGES = {
    "gguf": "gguf",
    "bitsandbytes": "bitsandbytes",
    "torchao": "torchao",
    "quanto": "optimum.quanto",
}


def quantization_method(folder: ModelFolder, name: str) -> str | None:
    """The ``quant_method`` of ``name``'s ``quantization_config``, lower-cased ("" when it
    names none); None when its config has none (or cannot be read: the load reports
    that)."""
    try:
        config = folder.config_dict(name)
    except LoadError:
        return None
    settings = config.get("quantization_config")
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else None
    return str(method).lower() if method else ""


def package_installed(method: str) -> bool:
    module = PACKAGES.get(method)
    return module is not None and importlib.util.find_spec(module.split(".")[0]) is not None


def package_name(method: str) -> str | None:
    module = PACKAGES.get(method)
    return module.replace("optimum.", "optimum-") if module else None


class QuantizedComponentLoader:
    """A zero-argument loader for one quantized component, usable as a ``LazyModule``
    loader: each call builds the module through its library's quantizer, onto
    ``device``, computing in ``dtype``. ``spec`` reads only the config and the weight
    files' headers."""

    returns_fresh_module = True

    def __init__(
        self,
        folder: ModelFolder | str | os.PathLike,
        name: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        progress: bool = True,
        storage_dtype: Any = None,
        host_cache: Any = None,
        pipelined: bool | None = None,
    ):
        self.folder = folder if isinstance(folder, ModelFolder) else ModelFolder.open(folder)
        self.name = name
        self.device = torch.device(device)
        self.progress = progress
        self.host_cache = None  # quantized weights come from their files every load
        self.pipelined = pipelined
        config_path = self.folder.config_path(name)
        self.method = quantization_method(self.folder, name) or ""
        package = package_name(self.method)
        if package is None or not package_installed(self.method):
            method_text = repr(self.method) if self.method else "an unnamed"
            state = (
                f"its package is not installed (pip install {package})"
                if package is not None
                else f"ondeck knows no package that loads it (it loads {', '.join(PACKAGES)})"
            )
            raise LoadError(
                f"component '{name}': {config_path} asks for {method_text} quantization, "
                f"and {state}",
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
            if library != "diffusers" or not hasattr(self.cls, "from_single_file"):
                raise LoadError(
                    f"component '{name}': gguf weights load through diffusers' single-file "
                    f"loading, which {library}.{self.cls.__name__} does not have",
                    component=name,
                    path=str(config_path),
                )
            self.path = _gguf_file(self.directory, name)
        else:
            self.folder.require_weights(name)
            self.path = self.directory
        config = self.folder.config_dict(name)
        self.dtype = self.folder.resolve_dtype(name, dtype) if dtype else _compute_dtype(config)
        self._nbytes: int | None = None
        self.last_load_bytes = 0
        self.last_load_seconds = 0.0
        self.last_source: str | None = None
        self.last_readers: str | None = None

    def __repr__(self) -> str:
        return (
            f"QuantizedComponentLoader({str(self.folder.path)!r}, {self.name!r}, "
            f"{self.method}, {self.device}, {self.dtype})"
        )

    @property
    def spec(self) -> ComponentSpec:
        config = self.folder.config_dict(self.name)
        if self._nbytes is None:
            kept = tuple(getattr(self.cls, "_keep_in_fp32_modules", None) or ())
            if self.method == "gguf":
                self._nbytes = _gguf_device_bytes(self.path, self.name, self.dtype, kept)
            else:
                self._nbytes = self._file_device_bytes(kept)
            self._nbytes += _computed_buffer_bytes(self.cls, self.library, config)
        if self.library == "diffusers":
            from diffusers.configuration_utils import FrozenDict

            config = FrozenDict(config)  # reads as model.config does
        return ComponentSpec(
            cls=self.cls, config=config, dtype=self.dtype, device=self.device, nbytes=self._nbytes
        )

    def _file_device_bytes(self, kept: tuple[str, ...]) -> int:
        """Bytes from the safetensors headers: the quantized tensors (integer data) as
        stored, float ones in the compute dtype, those of modules kept in float32 so."""
        total = 0
        for key, info in self.folder.tensors(self.name).items():
            if not info.dtype.is_floating_point:
                total += info.nbytes
            elif any(module in key.split(".") for module in kept):
                total += info.numel * torch.float32.itemsize
            else:
                total += info.numel * self.dtype.itemsize
        return total

    def __call__(self) -> torch.nn.Module:
        started = time.perf_counter()
        try:
            module = self._load()
        except LoadError:
            raise
        except Exception as error:
            raise LoadError(
                f"component '{self.name}' from {self.path}: loading it {self.method}-quantized "
                f"failed with {type(error).__name__}: {error}",
                component=self.name,
                path=str(self.path),
            ) from error
        module.eval()
        files = [self.path] if self.path.is_file() else list(self.folder.weight_files(self.name))
        self.last_load_bytes = sum(Path(file).stat().st_size for file in files)
        self.last_load_seconds = time.perf_counter() - started
        self.last_source = "file"
        return module

    def _load(self) -> torch.nn.Module:
        if self.method == "gguf":
            from diffusers import GGUFQuantizationConfig

            return self.cls.from_single_file(
                str(self.path),
                config=str(self.directory),
                quantization_config=GGUFQuantizationConfig(compute_dtype=self.dtype),
                torch_dtype=self.dtype,
                device=str(self.device),
                local_files_only=True,
            )
        options: dict[str, Any] = {"torch_dtype": self.dtype, "local_files_only": True}
        if self.device.type != "cpu":
            options["device_map"] = {"": str(self.device)}
        return self.cls.from_pretrained(str(self.directory), **options)


def _gguf_file(directory: Path, name: str) -> Path:
    found = sorted(directory.glob("*.gguf"))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files"
        raise LoadError(
            f"component '{name}': its config asks for gguf quantization and {directory} "
            f"holds {what}; one is needed",
            component=name,
            path=str(directory),
        )
    return found[0]


def _compute_dtype(config: dict) -> torch.dtype:
    settings = config.get("quantization_config") or {}
    named = settings.get("compute_dtype") if isinstance(settings, dict) else None
    resolved = getattr(torch, str(named).removeprefix("torch."), None) if named else None
    return resolved if isinstance(resolved, torch.dtype) else torch.float32


def _gguf_device_bytes(path: Path, name: str, dtype: torch.dtype, kept: tuple[str, ...]) -> int:
    """Bytes the component takes on the device, from the file's header: quantized tensors
    as stored, float ones in the compute dtype, and those of the modules the model keeps
    in float32 (``kept``, matched on whole name parts, as diffusers matches them) in
    float32, dequantized."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as error:
        raise LoadError(
            f"component '{name}': {path} is not a readable GGUF file "
            f"({type(error).__name__}: {error})",
            component=name,
            path=str(path),
        ) from error
    floats = {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
    }
    total = 0
    for tensor in reader.tensors:
        if any(module in tensor.name.split(".") for module in kept):
            total += int(tensor.n_elements) * torch.float32.itemsize
        elif tensor.tensor_type in floats:
            total += int(tensor.n_elements) * dtype.itemsize
        else:
            total += int(tensor.n_bytes)
    return total


def _computed_buffer_bytes(cls: type, library: str, config: dict) -> int:
    """Bytes of the buffers the model computes for itself (rotary tables), which no file
    holds: the module built on the meta device from its config, quantization left out."""
    if library != "diffusers":
        return 0  # transformers models' computed buffers are counted when loaded
    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    with torch.device("meta"):
        module = cls.from_config(plain)
    persistent = set(module.state_dict())
    return sum(
        buffer.numel() * buffer.element_size()
        for name, buffer in module.named_buffers()
        if name not in persistent
    )
