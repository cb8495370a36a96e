"""GGUF files read as diffusers' GGUF support makes their tensors: the header alone (for
plans, templates and sizes) or every tensor, read by ondeck's reader in parallel into
host memory. The ``gguf`` package parses the header; a type diffusers cannot dequantize
is refused from it, before anything is read."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError
from .safetensors_format import FileIdentity, TensorInfo

__all__ = [
    "check_transformers_gguf",
    "find_gguf",
    "gguf_header",
    "gguf_reader",
    "gguf_tensors",
    "plain_types",
    "read_gguf",
    "refuse_unsupported_types",
    "torch_dtype",
]


def find_gguf(directory: Path, name: str) -> Path:
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


def gguf_header(path: Path, name: str) -> list[tuple[str, torch.dtype, tuple[int, ...], Any]]:
    """``(name, dtype, shape, quantization type)`` of each tensor as diffusers'
    ``load_gguf_checkpoint`` makes it: F32 and F16 as tensors of theirs (type None), any
    other type as its bytes (uint8), rows of quantized blocks. Reads the header only."""
    reader = gguf_reader(path, name)
    plain = plain_types()
    return [
        (
            tensor.name,
            torch_dtype(tensor.data.dtype),
            tuple(int(size) for size in tensor.data.shape),
            None if tensor.tensor_type in plain else tensor.tensor_type,
        )
        for tensor in reader.tensors
    ]


def read_gguf(
    path: Path, name: str, progress: bool = False, status: os.stat_result | None = None
) -> dict[str, torch.Tensor]:
    """The GGUF file's tensors as diffusers' ``load_gguf_checkpoint`` makes them (F32 and
    F16 as tensors of theirs, any other type as a ``GGUFParameter`` of its bytes), read
    by ondeck's reader: in parallel straight into host memory, where diffusers copies
    each tensor out of a memory map on one thread (about 4 s of a 15 GB file's 7 s
    reload). A type diffusers cannot dequantize is refused before anything is read, and
    so is a file that is not the one ``status`` (taken before its header is read) saw."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    from . import reads
    from .chunks import ReadJob

    plain = plain_types()
    identity = FileIdentity.of(path.stat() if status is None else status, b"")
    jobs = []
    checkpoint: dict[str, torch.Tensor] = {}
    reader = gguf_reader(path, name)
    refuse_unsupported_types(reader, path, name)
    for tensor in reader.tensors:
        quant_type = None if tensor.tensor_type in plain else tensor.tensor_type
        shape = tuple(int(size) for size in tensor.data.shape)  # the header's, not read
        destination = torch.empty(shape, dtype=torch_dtype(tensor.data.dtype))
        start = int(tensor.data_offset)
        end = start + int(tensor.n_bytes)
        info = TensorInfo(tensor.name, destination.dtype, shape, start, end, str(path), identity)
        if info.nbytes != destination.nbytes:
            raise LoadError(
                f"component '{name}': {path}: tensor {tensor.name!r} holds {info.nbytes} "
                f"bytes where its shape needs {destination.nbytes}",
                component=name,
                path=str(path),
            )
        jobs.append(ReadJob(info, destination))
        checkpoint[tensor.name] = (
            GGUFParameter(destination, quant_type=quant_type)
            if quant_type is not None
            else destination
        )
    reads.read_into(jobs, progress=progress, component=name)
    return checkpoint


def torch_dtype(dtype: Any) -> torch.dtype:
    import numpy

    return torch.from_numpy(numpy.empty(0, dtype=dtype)).dtype


def gguf_tensors(
    path: Path, name: str, reader: Any = None
) -> list[tuple[str, bool, int, int, torch.dtype]]:
    """``(name, plain, elements, bytes stored, dtype dequantized to)`` of each tensor in
    the GGUF file's header (``reader``, where it is parsed already). Plain (F32, F16):
    diffusers loads it as a float tensor. Every other type, BF16 included, stays bytes
    that each forward dequantizes: BF16 to float32, the quantized types to float16 (their
    scales' dtype)."""
    import gguf

    reader = reader if reader is not None else gguf_reader(path, name)
    types = gguf.GGMLQuantizationType
    plain = plain_types()
    return [
        (
            tensor.name,
            tensor.tensor_type in plain,
            int(tensor.n_elements),
            int(tensor.n_bytes),
            torch.float32 if tensor.tensor_type == types.BF16 else torch.float16,
        )
        for tensor in reader.tensors
    ]


def refuse_unsupported_types(reader: Any, path: Path, name: str) -> None:
    """A tensor quantized in a type diffusers cannot dequantize (MXFP4, say), refused
    from the header: a plan or a first call says so before anything is read."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    plain = plain_types()
    for tensor in reader.tensors:
        if tensor.tensor_type not in plain and tensor.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES:
            raise LoadError(
                f"component '{name}': {path}: tensor {tensor.name!r} is quantized as "
                f"{tensor.tensor_type.name}, which diffusers cannot dequantize",
                component=name,
                path=str(path),
            )


def plain_types() -> set[Any]:
    """The GGUF types diffusers loads as float tensors (F32, F16); any other stays bytes."""
    import gguf

    return {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def gguf_reader(path: Path, name: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as error:
        size = path.stat().st_size if path.exists() else 0
        raise LoadError(
            f"component '{name}': {path} is not a readable GGUF file: a truncated "
            f"download, or not GGUF ({size} bytes; {type(error).__name__}: {error})",
            component=name,
            path=str(path),
        ) from error


def check_transformers_gguf(path: Path, name: str, config: dict) -> None:
    """A LoadError, before anything loads, where transformers' GGUF support would refuse
    ``path`` for component ``name`` at its first load: a file of an architecture it does
    not read, or of another model type than the component's ``config``. Reads the
    header through transformers' own parsing, once per file as it is now."""
    try:
        held = _gguf_model_type(str(path), os.stat(path).st_mtime_ns)
    except Exception as error:  # transformers' refusal, or a header it cannot parse
        raise LoadError(
            f"component '{name}': transformers cannot load {path}: {error}",
            component=name,
            path=str(path),
        ) from error
    wanted = str(config.get("model_type") or "")
    # Only types of no kinship are refused: umt5 and t5 (T5's files serve both) hold one
    # within the other, a family's versions begin alike (qwen2_vl, qwen2_5_vl).
    kin = held in wanted or wanted in held or held[:4] == wanted[:4]
    if held and wanted and not kin:
        raise LoadError(
            f"component '{name}': {path} holds a {held} model, and the component is a "
            f"{wanted} model (its config.json's model_type)",
            component=name,
            path=str(path),
        )


@functools.lru_cache(maxsize=16)
def _gguf_model_type(path: str, modified: int) -> str:
    """The model type transformers reads from a GGUF file's header (a large tokenizer
    makes this seconds: kept per file and modification time)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(path, return_tensors=False)
    return str(parsed.get("config", {}).get("model_type") or "")
