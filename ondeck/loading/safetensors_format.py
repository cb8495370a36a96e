"""The safetensors header: what a file holds and where, read without touching tensor data."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field

import torch

from ..errors import LoadError

__all__ = [
    "FileIdentity",
    "SafetensorsHeader",
    "TensorInfo",
    "check_unchanged",
    "file_kind",
    "format_bytes",
    "open_regular_file",
    "parse_header",
    "read_header",
]

# The reference implementation refuses headers above 100 MB. A real header is about 150
# bytes per tensor (a 14B model's: 170 KB); 16 MB is room for 100,000 tensors and bounds
# what parsing one can cost (a JSON header takes several times its size in memory).
MAX_HEADER_BYTES = 16_000_000
# Summed over one component's shards: many large headers add up.
MAX_COMPONENT_HEADER_BYTES = 64_000_000


def _optional(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


# Every dtype the format defines. None: valid in the format, but this torch cannot hold it.
DTYPES: dict[str, torch.dtype | None] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": _optional("uint16"),
    "I16": torch.int16,
    "U32": _optional("uint32"),
    "I32": torch.int32,
    "U64": _optional("uint64"),
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": _optional("float8_e4m3fn"),
    "F8_E5M2": _optional("float8_e5m2"),
    "F8_E4M3FNUZ": _optional("float8_e4m3fnuz"),
    "F8_E5M2FNUZ": _optional("float8_e5m2fnuz"),
    "F8_E8M0": _optional("float8_e8m0fnu"),
    # Sub-byte types: their shapes count 4- or 6-bit elements, which no torch dtype matches.
    "F4": None,
    "F6_E2M3": None,
    "F6_E3M2": None,
}

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items() if dtype}


@dataclass(frozen=True)
class FileIdentity:
    """A weight file as its header was read: a read of other bytes under the same name
    (a file replaced or rewritten since) would fill the model with garbage."""

    size: int
    mtime_ns: int
    inode: int
    device: int
    header_nbytes: int  # the length prefix and the JSON
    header_sha256: str

    @classmethod
    def of(cls, status: os.stat_result, header: bytes) -> FileIdentity:
        return cls(
            status.st_size,
            status.st_mtime_ns,
            status.st_ino,
            status.st_dev,
            len(header),
            hashlib.sha256(header).hexdigest(),
        )

    def change(self, status: os.stat_result) -> str | None:
        """What differs in ``status`` from the file as it was read; None: nothing."""
        if (status.st_ino, status.st_dev) != (self.inode, self.device):
            return "it is another file now (its inode changed)"
        if status.st_size != self.size:
            return f"its size changed from {self.size} to {status.st_size} bytes"
        if status.st_mtime_ns != self.mtime_ns:
            return "it was modified"
        return None


def check_unchanged(
    path: str, identity: FileIdentity | None, *, component: str | None = None, descriptor: int
) -> None:
    """Refuse to read ``path`` (open as ``descriptor``) when it is not the file whose
    header was read: another inode, size or modification time, or other header bytes."""
    if identity is None:
        return
    change = identity.change(os.fstat(descriptor))
    if change is None:
        header = _read_start(descriptor, identity.header_nbytes)
        if hashlib.sha256(header).hexdigest() != identity.header_sha256:
            change = "its header bytes changed"
    if change is not None:
        raise LoadError(
            f"{_where(path, component)}: the file changed after its header was read ({change}); "
            "it is not read: open the model folder again (build the pipeline again) to use "
            "the file as it is now",
            component=component,
            path=path,
        )


def _read_start(descriptor: int, nbytes: int) -> bytes:
    """The file's first ``nbytes``: a positional read where there is one (``os.pread``
    is missing on Windows), else a seek and a read, before any reading thread uses the
    descriptor."""
    if hasattr(os, "pread"):
        return os.pread(descriptor, nbytes, 0)
    os.lseek(descriptor, 0, os.SEEK_SET)
    return os.read(descriptor, nbytes)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: dtype, shape and absolute byte range ``[start, end)`` in its file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int
    path: str | None = field(default=None, compare=False)
    identity: FileIdentity | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: tensors by name, the free-form metadata, and the file's layout."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    identity: FileIdentity | None = field(default=None, compare=False, repr=False)

    @property
    def data_nbytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def __iter__(self):
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)


def format_bytes(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def read_header(path: str | os.PathLike, *, component: str | None = None) -> SafetensorsHeader:
    """Parse a safetensors file's header. Reads the header only, never the tensor data."""
    path = os.fspath(path)
    try:
        with open_regular_file(path) as file:
            status = os.fstat(file.fileno())
            file_size = status.st_size
            prefix = file.read(8)
            raw = prefix
            if len(prefix) == 8:
                (length,) = struct.unpack("<Q", prefix)
                if length <= min(MAX_HEADER_BYTES, file_size - 8):
                    raw += file.read(length)
    except OSError as error:
        raise LoadError(
            f"{_where(path, component)}: cannot read: {error.strerror or error}",
            component=component,
            path=path,
        ) from error
    identity = FileIdentity.of(status, raw)
    return parse_header(raw, file_size, path, component=component, identity=identity)


class NotARegularFile(OSError):
    """A path that names a FIFO, a device, a socket or a folder where a file belongs."""


def open_regular_file(path: str | os.PathLike):
    """Open ``path`` for binary reading, refusing anything but a regular file.

    Opened without blocking and checked on the open file: a FIFO named like a weight or
    config file would otherwise block the first read forever, and a check before opening
    could be raced by a swap.
    """
    file = open(path, "rb", opener=_open_without_blocking)
    try:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(
                errno.EINVAL, f"not a regular file ({file_kind(mode)})", os.fspath(path)
            )
        os.set_blocking(file.fileno(), True)
    except BaseException:
        file.close()
        raise
    return file


def _open_without_blocking(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a file"


def parse_header(
    raw: bytes,
    file_size: int,
    path: str | os.PathLike,
    *,
    component: str | None = None,
    identity: FileIdentity | None = None,
) -> SafetensorsHeader:
    """Validate and parse a header from the file's leading bytes (length prefix included).

    Every problem raises :class:`LoadError` naming the file (and tensor).
    """
    path = os.fspath(path)
    where = _where(path, component)

    def fail(problem: str) -> LoadError:
        return LoadError(f"{where}: {problem}", component=component, path=path)

    if file_size < 8 or len(raw) < 8:
        raise fail(f"file holds {file_size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", raw[:8])
    if length < 2 or length > MAX_HEADER_BYTES:
        raise fail(f"header length {length} is not plausible (not a safetensors file?)")
    if 8 + length > file_size:
        raise fail(
            f"header says its header is {format_bytes(length)}, file holds "
            f"{format_bytes(file_size)} (truncated download?)"
        )
    if len(raw) < 8 + length:
        raise fail("header is cut short")
    try:
        document = json.loads(raw[8 : 8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise fail(f"header is not valid JSON ({type(error).__name__}: {error})") from None
    if not isinstance(document, dict):
        raise fail(f"header is a JSON {type(document).__name__}, not an object")

    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise fail("__metadata__ must map strings to strings")

    data_start = 8 + length
    tensors: dict[str, TensorInfo] = {}
    for name, entry in document.items():
        tensors[name] = _parse_entry(name, entry, data_start, path, fail, identity)

    _check_layout(tensors, data_start, file_size, fail)
    return SafetensorsHeader(path, tensors, metadata, data_start, file_size, identity)


def _parse_entry(
    name: str, entry: object, data_start: int, path: str, fail, identity: FileIdentity | None
) -> TensorInfo:
    where = f"tensor '{name}'"
    if not isinstance(entry, dict):
        raise fail(f"{where}: entry is not an object")
    dtype_name = entry.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise fail(f"{where}: unknown dtype {dtype_name!r}")
    dtype = DTYPES[dtype_name]
    if dtype is None:
        raise fail(f"{where}: dtype {dtype_name} is not supported by torch {torch.__version__}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise fail(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
    ):
        raise fail(f"{where}: data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise fail(f"{where}: data_offsets {offsets} end before they begin")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise fail(
            f"{where}: data_offsets span {end - begin} bytes, but shape {shape} of "
            f"{dtype_name} needs {expected}"
        )
    return TensorInfo(
        name, dtype, tuple(shape), data_start + begin, data_start + end, path, identity
    )


def _check_layout(tensors: dict[str, TensorInfo], data_start: int, file_size: int, fail) -> None:
    regions = sorted((info for info in tensors.values() if info.nbytes), key=lambda i: i.start)
    for previous, current in zip(regions, regions[1:], strict=False):
        if current.start < previous.end:
            raise fail(
                f"tensor '{current.name}' overlaps tensor '{previous.name}' "
                f"(bytes {current.start - data_start}.. and ..{previous.end - data_start})"
            )
    # Empty tensors count too: an offset past the end is a damaged header either way.
    data_end = max((info.end for info in tensors.values()), default=data_start)
    if data_end > file_size:
        raise fail(
            f"header says {format_bytes(data_end - data_start)} of data, file holds "
            f"{format_bytes(file_size - data_start)} (truncated download?)"
        )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _where(path: str, component: str | None) -> str:
    return f"component '{component}' from {path}" if component else path
