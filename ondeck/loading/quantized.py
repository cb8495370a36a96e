"""Components whose weights are already quantized: loaded by the quantizer diffusers uses.

A component folder whose ``config.json`` carries ``"quantization_config": {"quant_method":
"gguf", ...}`` and holds one ``.gguf`` file is loaded through diffusers' GGUF support
(``from_single_file`` with a ``GGUFQuantizationConfig``; the ``gguf`` package reads the
file): the quantized tensors stay quantized on the device and are dequantized per layer
for compute. Like any other component it loads on first use and is freed on release;
ondeck's own reader, host cache, pipelined loading, block streaming, fp8 storage and
sharding do not apply to it, and asking for them is refused before anything loads.
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

__all__ = ["GGUFComponentLoader", "quantization_method"]


def quantization_method(folder: ModelFolder, name: str) -> str | None:
    """The ``quant_method`` of ``name``'s ``quantization_config``, lower-cased; None when
    its config has none (or cannot be read: the load reports that)."""
    try:
        config = folder.config_dict(name)
    except LoadError:
        return None
    settings = config.get("quantization_config")
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else None
    return str(method).lower() if method else ""


def gguf_installed() -> bool:
    return importlib.util.find_spec("gguf") is not None


class GGUFComponentLoader:
    """A zero-argument loader for one GGUF-quantized component, usable as a
    ``LazyModule`` loader: each call builds the module with diffusers' GGUF quantizer,
    straight onto ``device``, computing in ``dtype``. ``spec`` reads only the config and
    the GGUF file's header."""

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
        self.host_cache = None  # quantized bytes come from their file every load
        self.pipelined = pipelined
        config_path = self.folder.config_path(name)
        if not gguf_installed():
            raise LoadError(
                f"component '{name}': {config_path} asks for 'gguf' quantization, and its "
                "package 'gguf' is not installed (pip install gguf)",
                component=name,
                path=str(config_path),
            )
        if storage_dtype is not None:
            raise LoadError(
                f"component '{name}': it is already quantized (gguf); fp8 storage does not "
                "apply to it",
                component=name,
            )
        library, _ = self.folder.library_and_class(name)
        self.cls = self.folder.component_class(name)
        if library != "diffusers" or not hasattr(self.cls, "from_single_file"):
            raise LoadError(
                f"component '{name}': gguf weights load through diffusers' single-file "
                f"loading, which {library}.{self.cls.__name__} does not have",
                component=name,
                path=str(config_path),
            )
        self.directory = self.folder.directory(name)
        self.path = _gguf_file(self.directory, name)
        self.dtype = (
            self.folder.resolve_dtype(name, dtype)
            if dtype
            else _compute_dtype(self.folder.config_dict(name))
        )
        self._nbytes: int | None = None
        self.last_load_bytes = 0
        self.last_load_seconds = 0.0
        self.last_source: str | None = None
        self.last_readers: str | None = None

    def __repr__(self) -> str:
        return (
            f"GGUFComponentLoader({str(self.folder.path)!r}, {self.name!r}, {self.device}, "
            f"{self.dtype})"
        )

    @property
    def spec(self) -> ComponentSpec:
        if self._nbytes is None:
            kept = getattr(self.cls, "_keep_in_fp32_modules", None) or ()
            self._nbytes = _device_bytes(self.path, self.name, self.dtype, tuple(kept))
            self._nbytes += _computed_buffer_bytes(self.cls, self.folder.config_dict(self.name))
        from diffusers.configuration_utils import FrozenDict

        return ComponentSpec(
            cls=self.cls,
            config=FrozenDict(self.folder.config_dict(self.name)),  # reads as model.config
            dtype=self.dtype,
            device=self.device,
            nbytes=self._nbytes,
        )

    def __call__(self) -> torch.nn.Module:
        from diffusers import GGUFQuantizationConfig

        started = time.perf_counter()
        try:
            module = self.cls.from_single_file(
                str(self.path),
                config=str(self.directory),
                quantization_config=GGUFQuantizationConfig(compute_dtype=self.dtype),
                torch_dtype=self.dtype,
                device=str(self.device),
                local_files_only=True,
            )
        except LoadError:
            raise
        except Exception as error:
            raise LoadError(
                f"component '{self.name}' from {self.path}: diffusers' GGUF loading failed "
                f"with {type(error).__name__}: {error}",
                component=self.name,
                path=str(self.path),
            ) from error
        module.eval()
        self.last_load_bytes = self.path.stat().st_size
        self.last_load_seconds = time.perf_counter() - started
        self.last_source = "file"
        return module


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


def _device_bytes(path: Path, name: str, dtype: torch.dtype, kept: tuple[str, ...]) -> int:
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


def _computed_buffer_bytes(cls: type, config: dict) -> int:
    """Bytes of the buffers the model computes for itself (rotary tables), which no file
    holds: the module built on the meta device from its config, quantization left out."""
    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    with torch.device("meta"):
        module = cls.from_config(plain)
    persistent = set(module.state_dict())
    return sum(
        buffer.numel() * buffer.element_size()
        for name, buffer in module.named_buffers()
        if name not in persistent
    )
