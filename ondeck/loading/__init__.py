"""Safetensors reading for diffusers-format folders: headers, specs, and fast loads."""

from .components import ComponentLoader, component_loader, load_auxiliary, load_component
from .folder_loader import FolderLoader
from .host_cache import HostCache, HostCopy
from .model_folder import ModelFolder
from .options import LoadOptions
from .quantized import QuantizedComponentLoader
from .reads import ReadJob, ReadStats, read_into
from .safetensors_format import SafetensorsHeader, TensorInfo, parse_header, read_header

__all__ = [
    "ComponentLoader",
    "FolderLoader",
    "HostCache",
    "HostCopy",
    "LoadOptions",
    "ModelFolder",
    "ReadJob",
    "QuantizedComponentLoader",
    "ReadStats",
    "SafetensorsHeader",
    "TensorInfo",
    "component_loader",
    "load_auxiliary",
    "load_component",
    "parse_header",
    "read_header",
    "read_into",
]
