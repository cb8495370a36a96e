"""The weights users bring, on one GPU: single files, stored fp8, GGUF and LoRA.

    python benchmarks/weights.py --part single-file     # call 1: file against folder, LoRA, reloads
    python benchmarks/weights.py --part fp8-gguf        # call 2: stored fp8 at 8 GiB, GGUF
    python benchmarks/weights.py --tiny --device cpu --part all --deadline-s 0   # smoke run

The Wan 2.1 14B-shaped folder (``common.build_wan14b_folder``, random weights), and from
its transformer, written when a mode first needs them: the transformer as one file in the
original repository's key names (bf16), the same with the blocks' matrices in
float8_e4m3fn, a GGUF Q8_0 file (the ``gguf`` package's writer, the quantization on the
device), and a rank-32 LoRA on every attention projection. Each mode runs in a process
of its own (clean peaks), ``--runs`` prompts each, 480x832, 33 frames, 4 steps:

- ``eager``: diffusers' WanPipeline on the whole card (VAE float32), the reference: loaded
  by ``from_pretrained`` from the folder, or with ``from_single_file`` of the bf16 file
  when the transformer is held as one file at the time.
- ``folder-release``, ``file-release``: ondeck.diffusers with policy release over the
  folder, and with ``components={"transformer": the bf16 original-key file}``.
- ``folder-24``, ``file-24``, ``folder-8``, ``file-8``: the same under the automatic
  policy on a card emulated at 24 and 8 GiB (``set_per_process_memory_fraction``).
- ``fp8file-release``, ``fp8file-8``: the float8 file (stored fp8, computed in bf16);
  ``fp8file-8-torchcast`` with each layer upcast by torch's conversion
  (``ONDECK_TRITON_UPCAST=0``), not ondeck's kernel; ``fp8file-8-scratch`` with each
  layer's upcast copies written into one device buffer kept for the run instead of
  allocated at every forward (an experiment: what the allocator's part is).
- ``reload``: the transformer loaded from the page cache, from the bf16 file and from the
  float8 file in turns: file GB/s and seconds per load.
- ``gguf-full``, ``gguf-16``, ``gguf-8``: the Q8_0 file through ondeck (auto);
  ``gguf-diffusers``: diffusers' own ``from_single_file`` with a GGUFQuantizationConfig,
  everything on the card.
- ``lora-release``: ``folder-release`` with the LoRA (``loras=``), unfused;
  ``lorafused-release`` the same with ``pipe.fuse_lora()``, replayed at every load.
- ``compile-release``: ``file-release`` with ``compile_repeated_blocks()`` recorded: every
  reload replays the compile on a fresh module; its runs 2-3 against ``file-release``'s
  are the recompile cost per reload.

Disk and time. The machine this was planned for has 64 GiB of disk and a call of at most
ten minutes. The bf16 transformer is held once, either as the folder's shards or as the
one file, and moved between the two (byte copies; the source's space freed as it goes)
when the next mode needs the other; a derived file no later mode reads is deleted before
the next is written. The most on disk at once is about 52 GiB (text encoder and VAE, the
bf16 transformer and the float8 or GGUF file). The modes run in the order given; one that
would not end before ``--deadline-s`` (from the start, its preparation counted; the
estimates in ``MODES`` scaled by how the modes so far compared with theirs) is skipped
and named, with the command that runs it. Each part is planned to fit one call:

- ``single-file`` (about 500 s): folder-release, lora-release, folder-24, folder-8,
  file-release, file-24, file-8, reload, then eager if there is time left (none of this
  part's targets needs it).
- ``fp8-gguf`` (about 470 s): eager, fp8file-8, gguf-diffusers, gguf-16, gguf-8.

Targets (runs 2-3, same call): a single file within 2% of the folder (release, 24, 8);
the fp8 file's reload rate at least 1.8x the bf16 file's, and its 8 GiB run at most
1.06x eager; GGUF Q8_0 completes at 16 and 8 GiB (against eager and diffusers' own GGUF
loading); one LoRA under release at most 1.03x the run without.

Run 1's frames of every mode are compared with eager's (same prompt and seed) where eager
ran, and each file mode's with its folder mode's (0: the same bf16 weights).

With ``ONDECK_BENCH_TRACE=1`` each ondeck mode makes one more run after its timed ones,
under the device's profiler, and the table ends with its stages: seconds, the computing
stream's busy and idle time (idle while copies ran, and not), and its busy time by
kernel kind (products, attention, float8 upcasts, conversions, the rest). Every run
records the allocator's retries and cudaMalloc/cudaFree calls.

Needs diffusers, transformers, gguf and peft where it runs. Writes weights-PART.json to
$OUT after every mode and prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GiB, emit, out_dir, parse_modes, run_child  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode: the seconds it takes on an H200, its process included (an estimate that
    decides what fits before the deadline), the card it emulates (None: the whole card),
    where the bf16 transformer must be ("folder", "file", None: either), and the derived
    files it reads."""

    expected_seconds: float
    memory_gib: int | None = None
    layout: str | None = None
    files: tuple[str, ...] = ()


MODES = {
    "eager": Mode(55),
    "folder-release": Mode(42, layout="folder"),
    "lora-release": Mode(45, layout="folder", files=("lora",)),
    "lorafused-release": Mode(45, layout="folder", files=("lora",)),
    "folder-24": Mode(45, 24, layout="folder"),
    "folder-8": Mode(55, 8, layout="folder"),
    "file-release": Mode(42, layout="file"),
    "file-24": Mode(45, 24, layout="file"),
    "file-8": Mode(55, 8, layout="file"),
    "reload": Mode(25, layout="file", files=("fp8",)),
    "fp8file-release": Mode(42, files=("fp8",)),
    "fp8file-8": Mode(55, 8, files=("fp8",)),
    # "-torchcast": each layer upcast by torch's conversion, not ondeck's Triton kernel.
    "fp8file-8-torchcast": Mode(55, 8, files=("fp8",)),
    # "-scratch": each layer's upcast copies written into one buffer kept for the run.
    "fp8file-8-scratch": Mode(55, 8, files=("fp8",)),
    # "-cached": the encoders keep their answers, as `ondeck generate`'s do.
    "fp8file-8-cached": Mode(55, 8, files=("fp8",)),
    "folder-8-cached": Mode(55, 8, layout="folder"),
    # "-elastic": an elastic host cache (`--host-cache auto`).
    "fp8file-8-elastic": Mode(60, 8, files=("fp8",)),
    "folder-8-elastic": Mode(60, 8, layout="folder"),
    "gguf-diffusers": Mode(70, files=("gguf",)),
    "gguf-full": Mode(60, files=("gguf",)),
    "gguf-16": Mode(65, 16, files=("gguf",)),
    "gguf-8": Mode(75, 8, files=("gguf",)),
    "compile-release": Mode(200, layout="file"),
}
PARTS = {
    "single-file": [
        "folder-release",
        "lora-release",
        "folder-24",
        "folder-8",
        "file-release",
        "file-24",
        "file-8",
        "reload",
        "eager",
    ],
    "fp8-gguf": ["eager", "fp8file-8", "gguf-diffusers", "gguf-16", "gguf-8"],
}
PARTS["all"] = [
    "eager",
    *PARTS["single-file"][:-1],
    *PARTS["fp8-gguf"][1:],
    "fp8file-release",
    "gguf-full",
    "compile-release",
]
# Seconds of the preparation steps on an H200 (estimates, as the modes'): building the
# folder, moving the transformer between its layouts, writing each derived file.
BUILD_SECONDS = 90
SWITCH_SECONDS = 20
WRITE_SECONDS = {"lora": 6, "fp8": 40, "gguf": 45}

SHAPE = dict(height=480, width=832, num_frames=33, num_inference_steps=4)
TINY_SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2)
PROMPTS = [
    "a red fox trotting through fresh snow at dawn",
    "a grey heron standing in a misty river",
    "a neon-lit city street in the rain at night",
]
SHARD_BYTES = 5 * 10**9  # diffusers' max_shard_size="5GB"
FILE_NAMES = {
    "bf16": "wan2.1_t2v_14B_bf16.safetensors",
    "fp8": "wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
    "gguf": "wan2.1_t2v_14B-Q8_0.gguf",
    "lora": "lora_rank32.safetensors",
}
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
COMFY_PREFIX = "model.diffusion_model."

# diffusers' Wan names -> the original repository's: the inverse of diffusers'
# convert_wan_transformer_to_diffusers, to write a file as users download it.
_TO_ORIGINAL = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"\.norm2\.", ".norm3."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
]


def original_name(key: str) -> str:
    for pattern, replacement in _TO_ORIGINAL:
        key = re.sub(pattern, replacement, key)
    return key


def is_block_matrix(key: str, shape) -> bool:
    """The tensors fp8 and GGUF files of Wan store narrow: the blocks' matrices."""
    return key.startswith("blocks.") and key.endswith(".weight") and len(shape) == 2


# -- the work folder: the base folder, the transformer in one of two layouts, derived files


@dataclasses.dataclass
class Work:
    root: Path

    @property
    def folder(self) -> Path:
        return self.root / "wan14b"

    def file(self, name: str) -> Path:
        return self.root / "files" / FILE_NAMES[name]

    def files(self) -> dict[str, str]:
        return {name: str(self.file(name)) for name in FILE_NAMES}

    def shards(self) -> list[Path]:
        return sorted((self.folder / "transformer").glob("*.safetensors"))

    def layout(self) -> str | None:
        """Where the bf16 transformer is whole: "folder", "file", or None (no folder, or a
        move that did not finish)."""
        if not (self.folder / "model_index.json").exists():
            return None
        shards, single = self.shards(), self.file("bf16").exists()
        if single and not shards:
            return "file"
        if not shards or single:
            return None
        index = self.folder / "transformer" / INDEX_NAME
        if not index.exists():
            return "folder" if len(shards) == 1 else None
        listed = set(json.loads(index.read_text())["weight_map"].values())
        return "folder" if listed == {path.name for path in shards} else None


def transformer_tensors(work: Work) -> dict:
    """``{diffusers name: TensorInfo}`` of the bf16 transformer, in either layout (headers
    only; each info names its file and absolute byte range)."""
    from ondeck.loading import ModelFolder
    from ondeck.loading.single_file import SingleFileFolder

    base = ModelFolder.open(work.folder)
    if work.layout() == "file":
        return SingleFileFolder(base, {"transformer": work.file("bf16")}).tensors("transformer")
    return base.tensors("transformer")


def safetensors_header(entries: list[tuple[str, object, tuple, int]]) -> bytes:
    """The header of a safetensors file holding ``entries`` (name, torch dtype, shape,
    bytes) back to back in that order, padded to 8 bytes."""
    from ondeck.loading.safetensors_format import DTYPE_NAMES

    document: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        document[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(document, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def copy_bytes(source: int, start: int, nbytes: int, destination: int, at: int) -> None:
    """``nbytes`` of file ``source`` from ``start`` to file ``destination`` at ``at``: in the
    kernel where it can, else through a buffer."""
    done = 0
    try:
        while done < nbytes:
            copied = os.copy_file_range(source, destination, nbytes - done, start + done, at + done)
            if copied <= 0:
                break
            done += copied
    except (AttributeError, OSError):
        pass
    chunk = 64 << 20
    while done < nbytes:
        data = os.pread(source, min(chunk, nbytes - done), start + done)
        if not data:
            raise OSError(f"the source ends {nbytes - done} bytes short of the range copied")
        os.pwrite(destination, data, at + done)
        done += len(data)


def write_tensor_file(path: Path, entries: list[tuple[str, object, tuple, int, object]]) -> None:
    """A safetensors file of ``entries`` (name, dtype, shape, bytes, (source path, start)),
    each copied from its source; written under a temporary name and renamed when whole."""
    header = safetensors_header([entry[:4] for entry in entries])
    partial = path.with_name(path.name + ".partial")
    sources: dict[str, int] = {}
    destination = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(destination, header, 0)
        at = len(header)
        for _, _, _, nbytes, (source, start) in entries:
            if source not in sources:
                sources[source] = os.open(source, os.O_RDONLY)
            copy_bytes(sources[source], start, nbytes, destination, at)
            at += nbytes
    finally:
        os.close(destination)
        for descriptor in sources.values():
            os.close(descriptor)
    partial.rename(path)


def to_single_file(work: Work) -> None:
    """The folder's transformer shards into the one original-key bf16 file, each shard
    deleted once copied (the disk holds one shard more, not the transformer twice)."""
    tensors = transformer_tensors(work)
    ordered = sorted(tensors.items(), key=lambda item: (item[1].path, item[1].start))
    entries = [
        (COMFY_PREFIX + original_name(key), info.dtype, info.shape, info.nbytes)
        for key, info in ordered
    ]
    header = safetensors_header(entries)
    target = work.file("bf16")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    destination = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(destination, header, 0)
        at = len(header)
        shard, source = None, None
        for _, info in ordered:
            if info.path != shard:
                if source is not None:
                    os.close(source)
                    Path(shard).unlink()
                shard, source = info.path, os.open(info.path, os.O_RDONLY)
            copy_bytes(source, info.start, info.nbytes, destination, at)
            at += info.nbytes
        if source is not None:
            os.close(source)
            Path(shard).unlink()
    finally:
        os.close(destination)
    partial.rename(target)
    (work.folder / "transformer" / INDEX_NAME).unlink(missing_ok=True)


def to_folder(work: Work) -> None:
    """The one bf16 file back into diffusers-named shards of at most 5 GB (the layout
    ``save_pretrained`` writes): the shards are cut from the file's end, and the file is
    truncated after each, so the disk holds one shard more, not the transformer twice."""
    tensors = transformer_tensors(work)
    ordered = sorted(tensors.items(), key=lambda item: item[1].start, reverse=True)
    groups: list[list] = [[]]
    size = 0
    for key, info in ordered:
        if groups[-1] and size + info.nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((key, info))
        size += info.nbytes
    count = len(groups)
    source_path = work.file("bf16")
    weight_map = {}
    for number, group in zip(range(count, 0, -1), groups, strict=True):
        name = f"diffusion_pytorch_model-{number:05d}-of-{count:05d}.safetensors"
        group = sorted(group, key=lambda item: item[1].start)
        entries = [
            (key, info.dtype, info.shape, info.nbytes, (str(source_path), info.start))
            for key, info in group
        ]
        write_tensor_file(work.folder / "transformer" / name, entries)
        weight_map.update({key: name for key, _ in group})
        os.truncate(source_path, group[0][1].start)
    total = sum(info.nbytes for info in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (work.folder / "transformer" / INDEX_NAME).write_text(json.dumps(index, indent=2))
    source_path.unlink()


def derived_bytes(work: Work) -> dict[str, int]:
    """The bytes each derived file will take, from the transformer's header."""
    tensors = transformer_tensors(work)
    fp8 = gguf = 0
    for key, info in tensors.items():
        narrow = is_block_matrix(key, info.shape)
        fp8 += info.numel if narrow else info.nbytes
        gguf += info.numel * 34 // 32 if narrow and info.shape[-1] % 32 == 0 else info.numel * 4
    return {"fp8": fp8, "gguf": gguf, "lora": 256 << 20, "switch": SHARD_BYTES}


def require_disk(work: Work, nbytes: int, what: str) -> None:
    free = shutil.disk_usage(work.root).free
    if free < nbytes + GiB:
        raise RuntimeError(
            f"{what} needs {nbytes / GiB:.1f} GiB of disk and {free / GiB:.1f} GiB are free "
            f"under {work.root} (--workdir elsewhere?)"
        )


# -- the derived files, each written in a child process (the device casts) ---------------


def read_tensor(info):
    """A tensor's bytes from its file, as a CPU tensor of its dtype and shape."""
    import torch

    descriptor = os.open(info.path, os.O_RDONLY)
    try:
        data = bytearray(info.nbytes)
        view, done = memoryview(data), 0
        while done < info.nbytes:
            read = os.preadv(descriptor, [view[done:]], info.start + done)
            if not read:
                raise OSError(f"{info.path} ends inside tensor {info.name}")
            done += read
    finally:
        os.close(descriptor)
    return torch.frombuffer(data, dtype=info.dtype).reshape(info.shape)


def write_fp8(work: Work, device: str) -> None:
    """The original-key file with the blocks' matrices in float8_e4m3fn, the rest as the
    bf16 weights are (how fp8 checkpoints of Wan are saved)."""
    import torch

    tensors = transformer_tensors(work)
    stored = {}
    for key, info in tensors.items():
        dtype = torch.float8_e4m3fn if is_block_matrix(key, info.shape) else info.dtype
        stored[key] = (dtype, info.numel * dtype.itemsize)
    entries = [
        (COMFY_PREFIX + original_name(k), d, tensors[k].shape, n) for k, (d, n) in stored.items()
    ]
    header = safetensors_header(entries)
    target = work.file("fp8")
    partial = target.with_name(target.name + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)  # the first derived file, maybe
    with open(partial, "wb") as handle:
        handle.write(header)
        for key, (dtype, _) in stored.items():
            tensor = read_tensor(tensors[key])
            if dtype != tensor.dtype:
                tensor = tensor.to(device).to(dtype).cpu()
            handle.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
    partial.rename(target)


def quantize_q8_0(tensor):
    """GGUF's Q8_0 of a float tensor whose last dimension 32 divides, computed where the
    tensor is, as the gguf package computes it (``gguf.quants.Q8_0``): per block of 32, a
    float16 scale (the largest magnitude over 127) and 32 int8 values rounded half away
    from zero. Returns the bytes as a uint8 tensor, the last dimension in bytes."""
    import torch

    blocks = tensor.to(torch.float32).reshape(-1, 32)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    floored = magnitude.floor()
    rounded = torch.sign(scaled) * (floored + (2 * (magnitude - floored)).floor())
    packed = torch.cat(
        [
            scale.to(torch.float16).view(torch.uint8),
            rounded.to(torch.int8).view(torch.uint8),
        ],
        dim=1,
    )
    return packed.reshape(*tensor.shape[:-1], tensor.shape[-1] // 32 * 34)


def write_gguf(work: Work, device: str) -> dict:
    """The blocks' matrices Q8_0, everything else F32, in the original key names (as
    city96's GGUF conversions of Wan name them), written tensor by tensor with the gguf
    package's writer. The first quantized tensor's first rows are checked byte for byte
    against the gguf package's own Q8_0."""
    import gguf
    import numpy as np
    import torch

    tensors = transformer_tensors(work)
    quantized = {
        key: is_block_matrix(key, info.shape) and info.shape[-1] % 32 == 0
        for key, info in tensors.items()
    }
    target = work.file("gguf")
    partial = target.with_name(target.name + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(partial), arch="wan")
    for key, info in tensors.items():
        if quantized[key]:
            byte_shape = (*info.shape[:-1], info.shape[-1] // 32 * 34)
            writer.add_tensor_info(
                original_name(key),
                byte_shape,
                np.dtype(np.uint8),
                info.numel // 32 * 34,
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor_info(
                original_name(key), info.shape, np.dtype(np.float32), info.numel * 4
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    checked = None
    for key, info in tensors.items():
        tensor = read_tensor(info)
        if quantized[key]:
            data = quantize_q8_0(tensor.to(device)).cpu().numpy()
            if checked is None:
                rows = tensor[:8].to(torch.float32).numpy()
                expected = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
                checked = bool(np.array_equal(expected, data[:8]))
        else:
            data = tensor.to(torch.float32).numpy()
        writer.write_tensor_data(data)
    writer.close()
    partial.rename(target)
    return {"q8_0_checked_against_gguf": checked}


def write_lora(work: Work) -> None:
    """A rank-32 LoRA on every attention projection, in diffusers' layout, from the
    transformer's shapes (headers only)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    lora = {}
    for key, info in sorted(transformer_tensors(work).items()):
        if re.search(r"\.attn[12]\.to_(q|k|v|out\.0)\.weight$", key):
            layer = key.removesuffix(".weight")
            out_features, in_features = info.shape
            down = torch.randn(32, in_features, generator=generator) * 0.01
            up = torch.randn(out_features, 32, generator=generator) * 0.01
            lora[f"transformer.{layer}.lora_A.weight"] = down.to(torch.bfloat16)
            lora[f"transformer.{layer}.lora_B.weight"] = up.to(torch.bfloat16)
    work.file("lora").parent.mkdir(parents=True, exist_ok=True)
    save_file(lora, str(work.file("lora")))


def tiny_folder(path: Path) -> Path:
    """A six-block tiny Wan folder, widths GGUF blocks divide (the smoke run)."""
    import torch
    from diffusers import WanTransformer3DModel

    from ondeck.embedded import PRESETS, build_wan_folder

    build_wan_folder(path, preset="tiny")
    config = dict(PRESETS["tiny"]["transformer"], attention_head_dim=32, ffn_dim=128, num_layers=6)
    transformer = WanTransformer3DModel(**config).eval()
    for old in (path / "transformer").glob("*"):
        old.unlink()
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.normal_(0, 0.05)
    transformer.to(torch.bfloat16).save_pretrained(path / "transformer")
    return path


def build(work: Work, tiny: bool) -> None:
    from common import build_wan14b_folder

    shutil.rmtree(work.root, ignore_errors=True)
    work.root.mkdir(parents=True)
    if tiny:
        tiny_folder(work.folder)
    else:
        require_disk(work, 38 * GiB, "the Wan 14B-shaped folder")
        build_wan14b_folder(work.folder)


# -- one mode, in a child process ----------------------------------------------------------


def pipeline_for(mode: str, work: Work, device: str, tiny: bool):
    import torch

    files = work.files()
    if mode in ("eager", "gguf-diffusers"):
        from diffusers import (
            AutoencoderKLWan,
            GGUFQuantizationConfig,
            WanPipeline,
            WanTransformer3DModel,
        )

        parts = {
            "vae": AutoencoderKLWan.from_pretrained(work.folder / "vae", torch_dtype=torch.float32)
        }
        if mode == "gguf-diffusers":
            parts["transformer"] = WanTransformer3DModel.from_single_file(
                files["gguf"],
                config=str(work.folder / "transformer"),
                quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
                torch_dtype=torch.bfloat16,
                local_files_only=True,
            )
        elif work.layout() == "file":  # diffusers' own single-file loading of the same bytes
            parts["transformer"] = WanTransformer3DModel.from_single_file(
                files["bf16"],
                config=str(work.folder / "transformer"),
                torch_dtype=torch.bfloat16,
                local_files_only=True,
            )
        pipe = WanPipeline.from_pretrained(work.folder, torch_dtype=torch.bfloat16, **parts)
        return pipe.to(device)
    import ondeck.diffusers

    options: dict = {}
    source = mode.split("-")[0]
    if source in ("file", "fp8file", "gguf", "compile"):
        key = {"file": "bf16", "fp8file": "fp8", "gguf": "gguf", "compile": "bf16"}[source]
        options["components"] = {"transformer": files[key]}
    if mode.endswith("release"):
        options["policy"] = "release"
    if mode.endswith("-cached"):
        options["prompt_cache"] = True
    if mode.endswith("-torchcast"):
        os.environ["ONDECK_TRITON_UPCAST"] = "0"
    if mode.endswith("-scratch"):
        upcast_into_scratch()
    if mode.endswith("-elastic"):
        from ondeck.loading import HostCache

        options["host_cache"] = HostCache(elastic=True)
    if mode in ("lora-release", "lorafused-release"):
        options["loras"] = [files["lora"]]
    pipe = ondeck.diffusers.from_pretrained(
        work.folder,
        torch_dtype={"default": torch.bfloat16, "vae": torch.float32},
        device=device,
        progress=False,
        **options,
    )
    if mode == "lorafused-release":
        pipe.fuse_lora()  # recorded: every load of the transformer fuses again
    if mode == "compile-release":
        # The smoke run checks the replay, not inductor's compile time on a CPU.
        backend = {"backend": "eager"} if tiny else {}
        pipe.transformer.compile_repeated_blocks(fullgraph=True, **backend)
    return pipe


def upcast_into_scratch() -> None:
    """``-scratch``: the stored layers' hooks write their upcast copies into one device
    buffer per dtype, reused by every layer, rather than ask the allocator for new ones
    at each forward. Sound only where nothing keeps a copy past its layer's forward
    (inference, one stream): an experiment, in the benchmark only."""
    import torch

    import ondeck.loading.fp8 as fp8
    from ondeck.loading import upcast as kernel

    buffers: dict = {}

    def swap_in(layers, storage, compute, stored) -> None:
        used = 0
        for layer in layers:
            for table in (layer._parameters, layer._buffers):
                for name, tensor in table.items():
                    if tensor is None or tensor.dtype != storage:
                        continue
                    stored.append((table, name, tensor))
                    key = (tensor.device.index, tensor.dtype, compute)
                    if key not in kernel._built:
                        table[name] = kernel.upcast(tensor, compute)  # builds the kernel
                        continue
                    count = tensor.numel()
                    buffer = buffers.get((tensor.device, compute))
                    if buffer is None or buffer.numel() < used + count:
                        # Views made from the buffer it replaces keep theirs alive.
                        buffer = buffers[(tensor.device, compute)] = torch.empty(
                            used + count, dtype=compute, device=tensor.device
                        )
                    out = buffer[used : used + count].view(tensor.shape)
                    kernel._launch(kernel._kernel(), tensor.contiguous(), out)
                    table[name] = out
                    used += count

    fp8._swap_in = swap_in


def run_mode(args) -> dict:
    import numpy as np
    import torch
    from common import peak_rss_bytes
    from wan_modes import allocator_counts, emulate_device

    cuda = args.device.startswith("cuda")
    mode = MODES[args.child]
    if cuda:
        emulate_device(mode.memory_gib)
    work = Work(Path(args.workdir))
    shape = TINY_SHAPE if args.tiny else SHAPE
    result: dict = {"mode": args.child, "memory_gib": mode.memory_gib, "runs": []}
    result["layout"] = work.layout()
    result["device"] = torch.cuda.get_device_name() if cuda else args.device
    result["torch"] = torch.__version__
    started = time.perf_counter()
    try:
        pipe = pipeline_for(args.child, work, args.device, args.tiny)
    except Exception as error:  # a BudgetError names why; the table shows it
        result["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
        return result
    pipe.set_progress_bar_config(disable=True)
    runtime = getattr(pipe, "ondeck", None)
    if runtime is not None:
        result["policy_reason"] = runtime.policy.reason
    traced = cuda and runtime is not None and os.environ.get("ONDECK_BENCH_TRACE") == "1"
    result["setup_seconds"] = time.perf_counter() - started
    for run, prompt in enumerate(PROMPTS[: args.runs]):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            counted = allocator_counts()
        started = time.perf_counter()
        try:
            generator = torch.Generator("cpu").manual_seed(run)
            output = pipe(prompt, generator=generator, **shape)
            if cuda:
                torch.cuda.synchronize()
        except Exception as error:
            result["error"] = f"run {run + 1}: {type(error).__name__}: {error}".splitlines()[0]
            break
        row = {"seconds": time.perf_counter() - started}
        if run == 0:  # compared with other modes' by the parent
            frames_path = work.root / "frames" / f"{args.child}.npy"
            frames_path.parent.mkdir(exist_ok=True)
            np.save(frames_path, np.asarray(output.frames, dtype=np.float32))
            result["frames_file"] = str(frames_path)
        if cuda:
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["allocator"] = allocator_counts(since=counted)
        if runtime is not None:
            loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")
            row["transformer_source"] = getattr(loader, "last_source", None)
            row["transformer_load_seconds"] = getattr(loader, "last_load_seconds", None)
            # Run 1's share: page-locking the streamed blocks' host copies, then filling them.
            for name in ("transformer", "text_encoder"):
                component = object.__getattribute__(getattr(pipe, name), "_ondeck_loader")
                for part in ("allocate", "placed_read"):
                    seconds = getattr(component, f"last_{part}_seconds", None)
                    row[f"{name}_{part}_seconds"] = seconds
        result["runs"].append(row)
        print(f"{args.child} run {run + 1}: {row['seconds']:.2f}s", file=sys.stderr, flush=True)
    if traced and "error" not in result:  # one more run, traced: the timed ones are not
        generator = torch.Generator("cpu").manual_seed(args.runs)
        trace_run(pipe, PROMPTS[-1], generator, shape, len(result["runs"]) + 1, result)
    result["peak_rss_bytes"] = peak_rss_bytes()
    if runtime is not None:  # what each run loaded, waited for and computed, event by event
        result["report"] = runtime.report()
    return result


def trace_run(pipe, prompt, generator, shape: dict, run: int, result: dict) -> None:
    """The pipeline's ``run``-th call under the device's profiler (``ONDECK_BENCH_TRACE=1``),
    after the timed runs and apart from them: in ``result["trace"]`` each stage's device
    time by kernel kind and its idle time (``experiments/run_trace.py``'s analysis)."""
    import tempfile

    from experiments.run_trace import analyse, traced_run

    path = Path(tempfile.mkdtemp()) / "trace.json"
    entry = traced_run(pipe, lambda: pipe(prompt, generator=generator, **shape), run, path)
    result["trace"] = analyse(json.loads(path.read_text()), entry)
    result["trace"]["seconds"] = entry["seconds"]
    shutil.rmtree(path.parent, ignore_errors=True)


def reload_rates(args) -> dict:
    """The transformer loaded from the page cache, bf16 file and float8 file in turns."""
    import torch

    from ondeck.loading import ComponentLoader, ModelFolder
    from ondeck.loading.single_file import SingleFileFolder

    work = Work(Path(args.workdir))
    files = work.files()
    base = ModelFolder.open(work.folder)
    arms = {name: SingleFileFolder(base, {"transformer": files[name]}) for name in ("bf16", "fp8")}
    loaders = {
        name: ComponentLoader(
            folder, "transformer", device=args.device, dtype=torch.bfloat16, progress=False
        )
        for name, folder in arms.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    file_bytes = {name: Path(files[name]).stat().st_size for name in loaders}
    for attempt in range(args.reload_attempts + 1):
        for name, loader in loaders.items():
            started = time.perf_counter()
            module = loader()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            if attempt:  # the first load of each warms the page cache and the allocator
                seconds[name].append(elapsed)
            del module
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return {
        "mode": "reload",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "arms": {
            name: {
                "file_bytes": file_bytes[name],
                "median_seconds": statistics.median(values),
                "gb_per_second": file_bytes[name] / statistics.median(values) / 1e9,
                "bf16_bytes_per_second": file_bytes["bf16"] / statistics.median(values) / 1e9,
            }
            for name, values in seconds.items()
        },
    }


def run_step(args) -> dict:
    """A preparation step that touches the device (the folder's build, a derived file)."""
    work = Work(Path(args.workdir))
    started = time.perf_counter()
    result: dict = {"step": args.child}
    if args.child == "build":
        build(work, args.tiny)
    elif args.child == "write-fp8":
        write_fp8(work, args.device)
    elif args.child == "write-gguf":
        result.update(write_gguf(work, args.device))
    elif args.child == "write-lora":
        write_lora(work)
    result["seconds"] = time.perf_counter() - started
    return result


# -- the parent: prepare what each mode needs, run it, the table ---------------------------


class Runner:
    """Runs the chosen modes in order, each after what it needs is in place, skipping the
    ones that would not end before the deadline."""

    def __init__(self, args, modes: list[str]):
        self.args = args
        self.modes = modes
        self.work = Work(Path(args.workdir))
        self.started = time.perf_counter()
        self.rows: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.skipped: list[str] = []
        self.paces: list[float] = []  # each finished mode's seconds over its estimate

    def left(self) -> float:
        if not self.args.deadline_s:
            return float("inf")
        return self.args.deadline_s - (time.perf_counter() - self.started)

    def child(self, name: str, timeout: float) -> dict:
        command = [
            __file__,
            "--child", name,
            "--workdir", str(self.work.root),
            "--runs", str(self.args.runs),
            "--reload-attempts", str(self.args.reload_attempts),
            "--device", self.args.device,
        ] + (["--tiny"] if self.args.tiny else [])  # fmt: skip
        return run_child(command, timeout=max(30.0, timeout))

    def step(self, name: str, expected: float) -> None:
        row = self.child(name, min(self.left(), expected * 4))
        self.steps.append(row)
        done = row.get("error") or f"{row.get('seconds', 0):.0f}s"
        print(f"{name}: {done}", flush=True)
        if row.get("error"):
            raise RuntimeError(f"{name} failed: {row['error']} {row.get('tail', '')[-800:]}")

    def preparation(self, index: int) -> list[tuple[str, float]]:
        """The steps mode ``index`` needs first, with their expected seconds."""
        mode = MODES[self.modes[index]]
        layout = self.work.layout()
        steps: list[tuple[str, float]] = []
        if layout is None:
            steps.append(("build", BUILD_SECONDS))
            layout = "folder"
        missing = [name for name in mode.files if not self.work.file(name).exists()]
        wanted = mode.layout
        if missing and wanted is None:
            # Derived files are written in the layout a later mode needs, so that no move
            # happens while they take disk as well.
            later_layouts = (MODES[m].layout for m in self.modes[index:] if MODES[m].layout)
            wanted = next(later_layouts, None)
        if wanted and wanted != layout:
            steps.append((f"to-{wanted}", SWITCH_SECONDS))
        steps += [(f"write-{name}", WRITE_SECONDS[name]) for name in missing]
        return steps

    def prepare(self, index: int) -> None:
        for name, expected in self.preparation(index):
            if name.startswith("write-"):
                self.drop_unneeded(index)
                derived = name.removeprefix("write-")
                require_disk(self.work, derived_bytes(self.work)[derived], name)
            if name.startswith("to-"):
                self.drop_unneeded(index)
                require_disk(self.work, SHARD_BYTES, name)
                began = time.perf_counter()
                (to_single_file if name == "to-file" else to_folder)(self.work)
                seconds = time.perf_counter() - began
                self.steps.append({"step": name, "seconds": seconds})
                print(f"{name}: {seconds:.0f}s", flush=True)
                continue
            self.step(name, expected)

    def drop_unneeded(self, index: int) -> None:
        """Delete the derived files no mode from ``index`` on reads (the disk is small)."""
        needed = {name for mode in self.modes[index:] for name in MODES[mode].files}
        for name in ("fp8", "gguf"):
            if name not in needed and self.work.file(name).exists():
                self.work.file(name).unlink()
                print(f"(deleted {self.work.file(name).name}: no later mode reads it)")

    def run(self) -> None:
        for index, name in enumerate(self.modes):
            mode = MODES[name]
            # The estimates scaled by how the modes so far compared with theirs.
            pace = statistics.median(self.paces) if self.paces else 1.0
            preparing = sum(seconds for _, seconds in self.preparation(index))
            expected = pace * mode.expected_seconds + preparing
            if expected > self.left():
                self.skipped.append(name)
                print(
                    f"{name}: skipped, needs ~{expected:.0f}s and {max(0, self.left()):.0f}s are left"
                )
                continue
            try:
                self.prepare(index)
            except Exception as error:
                self.rows[name] = {"error": f"preparing: {error}"}
                print(f"{name}: {self.rows[name]['error']}", flush=True)
                continue
            timeout = min(self.left(), mode.expected_seconds * 3) if self.args.deadline_s else 1800
            row = self.child(name, timeout)
            self.rows[name] = row
            if not row.get("error"):
                self.paces.append(row["process_seconds"] / mode.expected_seconds)
            print(f"{name}: {progress_line(row)}", flush=True)
            self.write()

    def write(self, final: bool = False) -> Path:
        """The rows so far as ``weights-PART.json`` in $OUT (after every mode: a call cut
        short keeps what it measured; the frames are compared in the last). Written
        without touching the device: this process holds no CUDA context while the modes
        run."""
        summary = summarise(self.rows)
        if final:
            summary["frames"] = frame_differences(self.rows)
        devices = [row["device"] for row in self.rows.values() if row.get("device")]
        document = {
            "rows": self.rows,
            "steps": self.steps,
            "skipped": self.skipped,
            "summary": summary,
            "seconds": time.perf_counter() - self.started,
            "date": time.strftime("%Y-%m-%d"),
            "device": devices[0] if devices else self.args.device,
            "command": "python benchmarks/weights.py " + " ".join(sys.argv[1:]),
        }
        path = out_dir() / f"weights-{self.args.part if not self.args.modes else 'modes'}.json"
        path.write_text(json.dumps(document, indent=2, default=str))
        return path


def progress_line(row: dict) -> str:
    if row.get("error"):
        return f"ERROR {row['error'][:300]}"
    if row.get("arms"):
        return ", ".join(f"{n} {a['median_seconds']:.3f}s a load" for n, a in row["arms"].items())
    runs = ", ".join(f"{r['seconds']:.2f}" for r in row.get("runs", []))
    return f"runs {runs} s ({row.get('process_seconds', 0):.0f}s in all)"


def later(row: dict) -> float | None:
    runs = row.get("runs") or []
    if not runs:
        return None
    return statistics.median([r["seconds"] for r in runs[1:]] or [runs[0]["seconds"]])


def ratio(rows: dict, mode: str, against: str) -> float | None:
    a, b = later(rows.get(mode, {})), later(rows.get(against, {}))
    return a / b if a and b else None


def summarise(rows: dict) -> dict:
    reload = rows.get("reload", {}).get("arms", {})
    bf16_seconds = reload.get("bf16", {}).get("median_seconds")
    fp8_seconds = reload.get("fp8", {}).get("median_seconds")
    recompile = None
    if rows.get("compile-release", {}).get("runs") and rows.get("file-release", {}).get("runs"):
        recompile = later(rows["compile-release"]) - later(rows["file-release"])
    return {
        "file_vs_folder": {
            card: ratio(rows, f"file-{card}", f"folder-{card}") for card in ("release", "24", "8")
        },
        "fp8_reload_rate_vs_bf16": bf16_seconds / fp8_seconds
        if bf16_seconds and fp8_seconds
        else None,
        "fp8file_8_vs_eager": ratio(rows, "fp8file-8", "eager"),
        "fp8file_8_torchcast_vs_eager": ratio(rows, "fp8file-8-torchcast", "eager"),
        "gguf_vs_eager": {m: ratio(rows, m, "eager") for m in ("gguf-full", "gguf-16", "gguf-8")},
        "gguf_vs_diffusers_gguf": {
            m: ratio(rows, m, "gguf-diffusers") for m in ("gguf-full", "gguf-16", "gguf-8")
        },
        "gguf_diffusers_vs_eager": ratio(rows, "gguf-diffusers", "eager"),
        "lora_vs_without": ratio(rows, "lora-release", "folder-release"),
        "fused_lora_vs_without": ratio(rows, "lorafused-release", "folder-release"),
        "recompile_seconds_per_reload": recompile,
        "compile_first_run_seconds": (rows.get("compile-release", {}).get("runs") or [{}])[0].get(
            "seconds"
        ),
    }


def frame_differences(rows: dict) -> dict:
    """Run 1's frames against eager's (where eager ran) and each file mode's against its
    folder mode's: max and mean absolute difference, pixels in [0, 1]."""
    import numpy as np

    def difference(mode: str, against: str):
        a, b = rows.get(mode, {}).get("frames_file"), rows.get(against, {}).get("frames_file")
        if not a or not b or not Path(a).exists() or not Path(b).exists():
            return None
        gap = np.abs(np.load(a) - np.load(b))
        return {"max": float(gap.max()), "mean": float(gap.mean())}

    found = {}
    for mode in rows:
        if mode != "eager" and (gap := difference(mode, "eager")) is not None:
            found[f"{mode} vs eager"] = gap
        if mode.startswith("file-") and (gap := difference(mode, "folder-" + mode[5:])):
            found[f"{mode} vs folder-{mode[5:]}"] = gap
    return found


def print_table(rows: dict, summary: dict, skipped: list[str]) -> None:
    print()
    print(f"{'mode':<16} {'runs 2+ s':>9} {'x eager':>8} {'peak GiB':>9} {'RSS GiB':>8}  note")
    for mode, row in rows.items():
        if mode == "reload":
            continue
        seconds = later(row)
        peaks = [r.get("peak_allocated_bytes", 0) for r in row.get("runs", [])]
        versus = ratio(rows, mode, "eager")
        note = row.get("error") or (row.get("runs") or [{}])[-1].get("transformer_source") or ""
        print(
            f"{mode:<16} {seconds if seconds is not None else float('nan'):>9.2f} "
            f"{versus if versus is not None else float('nan'):>8.3f} "
            f"{max(peaks, default=0) / GiB:>9.2f} {row.get('peak_rss_bytes', 0) / GiB:>8.1f}  "
            f"{note[:60]}"
        )
    for name, arm in rows.get("reload", {}).get("arms", {}).items():
        print(
            f"reload {name:<9} {arm['median_seconds']:>9.3f} s a load, "
            f"{arm['gb_per_second']:.1f} GB/s of file, {arm['bf16_bytes_per_second']:.1f} GB/s "
            "as bf16 bytes"
        )
    if rows.get("reload", {}).get("error"):
        print(f"reload: {rows['reload']['error']}")

    def shown(value):
        if isinstance(value, dict):
            return ", ".join(f"{k} {shown(v)}" for k, v in value.items())
        return "n/a" if value is None else f"{value:.3f}"

    print()
    print("target                                  measured")
    print(f"single file / folder (<= 1.02)          {shown(summary['file_vs_folder'])}")
    print(f"fp8 reload rate / bf16 file's (>= 1.8)  {shown(summary['fp8_reload_rate_vs_bf16'])}")
    print(f"fp8 file at 8 GiB / eager (<= 1.06)     {shown(summary['fp8file_8_vs_eager'])}")
    print(f"GGUF Q8_0 / eager                       {shown(summary['gguf_vs_eager'])}")
    print(f"GGUF Q8_0 / diffusers' GGUF             {shown(summary['gguf_vs_diffusers_gguf'])}")
    print(f"one LoRA under release / without (1.03) {shown(summary['lora_vs_without'])}")
    print(f"  the LoRA fused at every load          {shown(summary['fused_lora_vs_without'])}")
    print(
        f"recompile seconds per reload            {shown(summary['recompile_seconds_per_reload'])}"
    )
    if summary.get("frames"):
        print("frames of run 1: max / mean absolute difference")
        for pair, gap in summary["frames"].items():
            print(f"  {pair:<30} {gap['max']:.3e} / {gap['mean']:.3e}")
    if skipped:
        print(f"skipped for time: {', '.join(skipped)}")
    print_traces(rows)


def print_traces(rows: dict) -> None:
    """The traced runs (``ONDECK_BENCH_TRACE=1``): per stage, seconds, the compute
    stream's busy and idle seconds, and its busy seconds by kernel kind."""
    for mode, row in rows.items():
        trace = row.get("trace")
        if not trace:
            continue
        counts = [run.get("allocator") for run in row.get("runs", [])]
        print(
            f"\ntraced run of {mode} ({trace['seconds']:.2f} s): copies {trace['copies']}; "
            f"allocator by timed run {counts}"
        )
        for stage in trace["stages"]:
            kinds = " ".join(
                f"{kind} {seconds:.3f}/{stage['kernels'][kind]}"
                for kind, seconds in stage["kinds"].items()
            )
            print(
                f"  {stage['stage']:<13} {stage['seconds']:7.3f} s, busy {stage['gpu_busy_s']:.3f},"
                f" idle {stage['idle_copying_s']:.3f} copying + {stage['idle_no_copy_s']:.3f}; "
                f"{kinds}"
            )
        for gap in trace["gaps"][:3]:  # the longest idle spans with no copy under way
            print(
                f"  gap {gap['ms']} ms at {gap['at_s']} s ({gap['stage']}): {gap['main_thread'][:1]}"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=list(PARTS), default="all")
    parser.add_argument(
        "--modes", help=f"comma-separated, in order, instead of the part's: {', '.join(MODES)}"
    )
    parser.add_argument("--workdir", default="/tmp/ondeck-weights")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reload-attempts", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=510,
        help="seconds from the start after which no mode runs (0: none)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny folder: smoke-test the modes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        if args.child == "reload":
            emit(reload_rates(args))
        elif args.child in MODES:
            emit(run_mode(args))
        else:
            emit(run_step(args))
        return
    if args.tiny and args.workdir == parser.get_default("workdir"):
        args.workdir = str(out_dir() / "weights-tiny")
    modes = parse_modes(parser, args.modes, MODES) if args.modes else PARTS[args.part]
    # The same allocator settings for every mode (as the other benchmarks): fewer
    # fragments under an emulated card.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    runner = Runner(args, modes)
    print(
        f"{'modes' if args.modes else args.part}: {', '.join(modes)}; about {sum(MODES[m].expected_seconds for m in modes):.0f}s "
        f"of modes, deadline {args.deadline_s or 'none'}",
        flush=True,
    )
    runner.run()
    path = runner.write(final=True)
    summary = json.loads(path.read_text())["summary"]
    for row in runner.rows.values():  # the frames are compared; they need not stay
        if row.get("frames_file"):
            Path(row["frames_file"]).unlink(missing_ok=True)
    print(f"wrote {path} after {time.perf_counter() - runner.started:.0f}s")
    if runner.skipped:
        flags = " --tiny --device cpu" if args.tiny else ""
        if args.workdir != parser.get_default("workdir"):
            flags += f" --workdir {args.workdir}"
        print(
            f"to run the skipped modes: python benchmarks/weights.py --modes "
            f"{','.join(runner.skipped)}{flags}"
        )
    print_table(runner.rows, summary, runner.skipped)


if __name__ == "__main__":
    main()
