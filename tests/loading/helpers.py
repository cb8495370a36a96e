"""Safetensors files written byte by byte, so tests control layout, alignment and damage."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ondeck.loading.safetensors_format import DTYPE_NAMES


def raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def header_bytes(entries: dict, metadata: dict | None = None, *, pad: int = 0) -> bytes:
    document = dict(entries)
    if metadata is not None:
        document["__metadata__"] = metadata
    text = json.dumps(document).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], *, pad: int = 0) -> Path:
    """Write tensors in the given order, back to back: odd sizes leave later ones unaligned."""
    entries, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = raw_bytes(tensor)
        entries[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    path.write_bytes(header_bytes(entries, pad=pad) + b"".join(chunks))
    return path


def write_raw(path: Path, entries: dict, data: bytes) -> Path:
    path.write_bytes(header_bytes(entries) + data)
    return path


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (NaNs included for floats: compare bytes, not values)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def weights_file(component_dir: Path) -> Path:
    return next(component_dir.glob("*.safetensors"))


def rewrite_weights(component_dir: Path, edit) -> Path:
    """Load a component's single weight file, let ``edit`` change the dict, save it back."""
    path = weights_file(component_dir)
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def shard(component_dir: Path, parts: int = 2) -> list[Path]:
    """Split a component's single weight file into ``parts`` shards plus an index."""
    path = weights_file(component_dir)
    stem = path.name.removesuffix(".safetensors")
    tensors = load_file(str(path))
    names = sorted(tensors)
    weight_map, files = {}, []
    for part in range(parts):
        filename = f"{stem}-{part + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {name: tensors[name] for name in names[part::parts]}
        save_file(chunk, str(component_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, filename))
        files.append(component_dir / filename)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (component_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index))
    path.unlink()
    return files


def copy_folder(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def _models():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    return {
        "transformer": WanTransformer3DModel,
        "vae": AutoencoderKLWan,
        "text_encoder": UMT5EncoderModel,
    }


MODELS = _models()


def from_pretrained(folder, name, dtype):
    """The same component loaded the usual way, for comparison."""
    cls = MODELS[name]
    keyword = "dtype" if name == "text_encoder" else "torch_dtype"
    return cls.from_pretrained(str(folder / name), **{keyword: dtype})


def assert_same_state(loaded, reference):
    """Same keys, dtypes and values, buffers included (non-persistent ones too)."""
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    for (name, ours_buffer), (_, their_buffer) in zip(
        loaded.named_buffers(), reference.named_buffers(), strict=True
    ):
        assert ours_buffer.dtype == their_buffer.dtype, name
        assert torch.equal(ours_buffer, their_buffer), name


def jobs_for(path, dtype: torch.dtype | None = None, device: str = "cpu") -> list:
    """A read of every tensor of a file into a fresh tensor (of ``dtype``, else the file's)."""
    from ondeck.loading import ReadJob, read_header

    return [
        ReadJob(info, torch.empty(info.shape, dtype=dtype or info.dtype, device=device))
        for info in read_header(path).tensors.values()
    ]


def raise_after(monkeypatch, owner, attribute: str, calls: int, error: BaseException) -> dict:
    """Let ``owner.attribute`` run ``calls`` times, then raise ``error`` on every call.
    Returns the live call count ({"n": ...})."""
    original = getattr(owner, attribute)
    count = {"n": 0}

    def failing(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, failing)
    return count


# The reading processes exist only on the fast read path (``ONDECK_READ_PATH=portable``
# reads on threads alone) and where ``memfd_create`` does.
NO_READING_PROCESSES = (
    not hasattr(os, "memfd_create") or os.environ.get("ONDECK_READ_PATH") == "portable"
)
WHY_NO_READING_PROCESSES = "no reading processes here (no memfd_create, or the portable path)"
