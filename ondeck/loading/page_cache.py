"""Whether a file's bytes already sit in the OS page cache, checked with mincore on a sample."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

__all__ = ["cached_fraction", "describe_source"]

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


try:
    _LIBC = _libc() if hasattr(os, "sched_getaffinity") else None  # Linux only
except OSError:
    _LIBC = None


def cached_fraction(path: str | os.PathLike, *, samples: int = 64) -> float | None:
    """Fraction of ``samples`` evenly spread pages of the file resident in the page cache.

    None when it cannot be told (no mincore, empty file, mapping refused).
    """
    if _LIBC is None:
        return None
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        address = _LIBC.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            return None
        try:
            page = mmap.PAGESIZE
            pages = (size + page - 1) // page
            picks = sorted({(i * pages) // samples for i in range(min(samples, pages))})
            vector = ctypes.create_string_buffer(1)
            resident = 0
            for index in picks:
                if _LIBC.mincore(address + index * page, page, vector) != 0:
                    return None
                resident += vector.raw[0] & 1
            return resident / len(picks)
        finally:
            _LIBC.munmap(address, size)
    finally:
        os.close(fd)


def describe_source(paths: list[str]) -> str:
    """'page cache' when most sampled pages of these files are resident, else 'disk'."""
    fractions = [cached_fraction(path) for path in paths]
    known = [fraction for fraction in fractions if fraction is not None]
    if known and sum(known) / len(known) >= 0.5:
        return "page cache"
    return "disk"
