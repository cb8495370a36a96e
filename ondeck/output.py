"""What a run leaves on disk: each file written under a temporary name, then renamed.

A kill, a Ctrl-C or a full disk during a write leaves the previous complete file in
place (or nothing), never a partial one under the final name: the rename is atomic
within one folder, and the temporary file is removed when the write fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import OndeckError


class OutputError(OndeckError):
    """A result could not be written; the message names the file and the reason."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` on success.

    The temporary name keeps the suffix (writers such as ffmpeg and matplotlib pick the
    format from it) and starts with a dot, so a listing does not show it as a result.
    """
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent
    )
    os.close(descriptor)
    temporary = Path(temporary)
    try:
        yield temporary
        _flush_to_disk(temporary)
        # mkstemp's file is private (0600); the result gets the mode a plain open() gives.
        os.chmod(temporary, 0o666 & ~current_umask())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def current_umask() -> int:
    """The process umask, read without setting it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _flush_to_disk(path: Path) -> None:
    # Without it, a crash soon after the rename can leave the new name on an empty file.
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def write_text(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    try:
        with atomic_path(path) as temporary:
            _write_file(temporary, text.encode("utf-8"))
    except OSError as error:
        raise OutputError(f"could not write {path}: {error.strerror or error}") from error
    return path


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)


def write_json(path: str | os.PathLike, document: Any) -> Path:
    return write_text(path, json.dumps(document, indent=2, default=str))


def write_frames(path: str | os.PathLike, frames: Any) -> Path:
    """Frames as a ``.npy`` array (F×H×W×C floats in [0, 1]), for ``numpy.load``."""
    import io

    import numpy as np

    path = Path(path)
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(frames))
    try:
        with atomic_path(path) as temporary:
            _write_file(temporary, buffer.getbuffer())
    except OSError as error:
        raise OutputError(f"could not write {path}: {error.strerror or error}") from error
    return path


def write_video(path: str | os.PathLike, frames: Any, *, fps: int = 16) -> Path:
    """An H.264 MP4 through imageio's ffmpeg; ``OutputError`` naming the file if it fails."""
    import numpy as np

    path = Path(path)
    pixels = (np.clip(frames, 0.0, 1.0) * 255).round().astype("uint8")
    try:
        with atomic_path(path) as temporary:
            _encode(temporary, pixels, fps)
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        raise OutputError(f"could not write {path}: {_reason(error)}") from error
    return path


def _encode(path: Path, pixels: Any, fps: int) -> None:
    import imageio.v2 as imageio

    # ffmpeg by name: left to choose by suffix, imageio takes whatever writer is
    # installed when its ffmpeg plugin is not (tifffile, say), which rejects ``fps``.
    with imageio.get_writer(path, format="FFMPEG", fps=fps, macro_block_size=1) as writer:
        for frame in pixels:
            writer.append_data(frame)
    if path.stat().st_size == 0:
        raise OSError(f"ffmpeg wrote 0 bytes to {path.name}")


def _reason(error: BaseException) -> str:
    """The last meaningful line of an error: ffmpeg's are pages of build flags."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = lines[-1] if lines else type(error).__name__
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
        if error.filename is not None:  # ffmpeg itself missing, say
            reason = f"{reason}: {error.filename}"
    return f"{type(error).__name__}: {reason}"


def check_writable_folder(folder: str | os.PathLike, names: tuple[str, ...] = ()) -> Path:
    """Create ``folder`` if needed and prove a file can be written there, before any work.

    ``names`` are the files a run will write there; one that exists as a folder is an
    error now rather than after the generation.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(prefix=".ondeck-write-check.", dir=folder)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise OutputError(f"cannot write to {folder}: {error.strerror or error}") from error
    for name in names:
        if (folder / name).is_dir():
            raise OutputError(f"{folder / name} is a folder; the run writes a file there")
    return folder
