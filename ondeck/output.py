"""What a run leaves on disk: each file written under a temporary name, then renamed.

A kill, a Ctrl-C or a full disk during a write leaves the previous complete file in
place (or nothing), never a partial one under the final name: the rename is atomic
within one folder, and the temporary file is removed when the write fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from .errors import OndeckError
from .interrupt import interrupts_held


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
        os.chmod(temporary, 0o666 & ~current_umask(path.parent))
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def current_umask(directory: str | os.PathLike | None = None) -> int:
    """The process umask, read without setting it (os.umask would, for every thread):
    from /proc where there is one; elsewhere (macOS, BSD) from the mode a file created
    in ``directory`` (else the temporary folder) gets, the file deleted at once."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _umask_seen(Path(directory or tempfile.gettempdir()))


def _umask_seen(directory: Path) -> int:
    probe = directory / f".ondeck-umask-{os.getpid()}-{threading.get_ident()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o777))
        return 0o777 & ~stat.S_IMODE(os.stat(probe).st_mode)
    except OSError:
        return 0o022
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


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


def write_video(path: str | os.PathLike, frames: Any, *, fps: float = 16) -> Path:
    """An H.264 MP4 through ffmpeg, renamed into place only once it is complete: ffmpeg
    exited 0 and the container lists one video sample per frame. ``OutputError`` naming
    the file otherwise, with the previous file at ``path`` untouched."""
    path = Path(path)
    pixels = _pixels(frames)
    if pixels.ndim != 4 or pixels.shape[0] == 0:
        raise OutputError(f"could not write {path}: no frames to write (shape {pixels.shape})")
    try:
        with atomic_path(path) as temporary:
            _encode(temporary, pixels, fps)
            written = mp4_frame_count(temporary)
            if written != len(pixels):
                raise OSError(
                    f"the encoder wrote {written} of {len(pixels)} frames (disk full, or "
                    "the encoder stopped early?)"
                )
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        raise OutputError(f"could not write {path}: {_reason(error)}") from error
    return path


def _pixels(frames: Any) -> Any:
    import numpy as np

    return (np.clip(np.asarray(frames, dtype=np.float32), 0.0, 1.0) * 255).round().astype("uint8")


def _encode(path: Path, pixels: Any, fps: float) -> None:
    """Raw RGB frames into ffmpeg's stdin; its exit status is checked, not trusted."""
    import subprocess

    try:
        import imageio_ffmpeg
    except ImportError:
        raise ImportError(
            "imageio-ffmpeg is not installed (pip install imageio-ffmpeg); it finds ffmpeg"
        ) from None

    count, height, width, channels = pixels.shape
    if channels not in (1, 3):
        raise ValueError(f"frames have {channels} channels; a video takes 1 or 3")
    pixel_format = "gray" if channels == 1 else "rgb24"
    command = [
        imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error",
        "-f", "rawvideo", "-pix_fmt", pixel_format, "-s", f"{width}x{height}",
        "-r", f"{fps:g}", "-i", "-",
        # H.264 in yuv420p needs even sides: pad odd ones by a pixel, never crop.
        "-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2", "-c:v", "libx264", "-pix_fmt", "yuv420p",
        "-movflags", "+faststart", "-f", "mp4", str(path),
    ]  # fmt: skip
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=errors)
        try:
            try:
                for frame in pixels:
                    process.stdin.write(frame.tobytes())
            except BrokenPipeError:
                pass  # ffmpeg stopped reading: its status and message say why
            finally:
                process.stdin.close()
            status = process.wait()
        except BaseException:
            process.kill()
            process.wait()
            raise
        if status != 0:
            errors.seek(0)
            lines = [line for line in errors.read().decode("utf-8", "replace").splitlines()]
            said = next((line.strip() for line in reversed(lines) if line.strip()), "")
            raise OSError(f"ffmpeg exited with status {status}" + (f": {said}" if said else ""))
    if not path.exists() or path.stat().st_size == 0:
        raise OSError(f"ffmpeg wrote 0 bytes to {path.name}")


def mp4_frame_count(path: str | os.PathLike) -> int:
    """Video samples the MP4 at ``path`` lists (its first video track's ``stsz``), read
    from the container's boxes; ``OSError`` for a file that is not a complete MP4."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        # Every top-level box must fit the file: a cut in the media data after a complete
        # 'moov' is a partial video too.
        top = list(_boxes(file, 0, size))
        moov = next(((start, end) for start, end, name in top if name == b"moov"), None)
        if moov is None:
            raise OSError("the file has no complete 'moov' box (not a complete MP4)")
        for *trak, _ in _boxes(file, *moov, b"trak"):
            mdia = _find_box(file, *trak, b"mdia")
            if mdia is None:
                continue
            handler = _find_box(file, *mdia, b"hdlr")
            if handler is None:
                continue
            file.seek(handler[0] + 8)
            if file.read(4) != b"vide":
                continue
            stsz = _find_path(file, mdia, (b"minf", b"stbl", b"stsz"))
            if stsz is None:
                raise OSError("the video track has no sample table")
            file.seek(stsz[0] + 8)
            header = file.read(4)
            if len(header) < 4:
                raise OSError("the video track's sample table is cut short")
            (count,) = struct.unpack(">I", header)
            return count
    raise OSError("the file has no video track")


def _boxes(
    file: Any, start: int, end: int, kind: bytes | None = None
) -> Iterator[tuple[int, int, bytes]]:
    """``(content start, content end, name)`` of each box in ``[start, end)`` (of ``kind``)."""
    position = start
    while position + 8 <= end:
        file.seek(position)
        size, name = struct.unpack(">I4s", file.read(8))
        header = 8
        if size == 1:
            large = file.read(8)
            if len(large) < 8:
                raise OSError("a box header is cut short")
            (size,) = struct.unpack(">Q", large)
            header = 16
        elif size == 0:
            size = end - position
        if size < header or position + size > end:
            raise OSError(f"box '{name.decode('latin-1')}' runs past the end of the file")
        if kind is None or name == kind:
            yield position + header, position + size, name
        position += size


def _find_box(file: Any, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    found = next(_boxes(file, start, end, kind), None)
    return None if found is None else found[:2]


def _find_path(file: Any, box: tuple[int, int], kinds: tuple[bytes, ...]) -> tuple[int, int] | None:
    for kind in kinds:
        found = _find_box(file, *box, kind)
        if found is None:
            return None
        box = found
    return box


def write_images(
    folder: str | os.PathLike,
    images: Any,
    *,
    stem: str = "image",
    earlier: Collection[str] = (),
) -> list[Path]:
    """``image.png``, or ``image-1.png`` … ``image-N.png`` for several, each complete
    (read back and checked) before any is renamed into place: a set is replaced whole or
    not at all. Images of an earlier set (``earlier``: the names an earlier run wrote)
    that this one does not replace are removed."""
    from PIL import Image

    folder = Path(folder)
    pixels = _pixels(images)
    if pixels.ndim != 4 or pixels.shape[0] == 0:
        raise OutputError(f"could not write {folder / (stem + '.png')}: no image to write")
    names = image_names(len(pixels), stem)
    written = [folder / name for name in names]
    path = written[0]
    try:
        # All renamed into place as it closes, with no interrupt between two renames.
        with interrupts_held(), contextlib.ExitStack() as renames:
            for path, image in zip(written, pixels, strict=True):
                temporary = renames.enter_context(atomic_path(path))
                picture = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
                picture.save(temporary, format="PNG")
                with Image.open(temporary) as check:
                    check.load()
                    if check.size != picture.size:
                        raise OSError(f"read back as {check.size}, written as {picture.size}")
    except (OSError, ValueError, TypeError) as error:
        raise OutputError(f"could not write {path}: {_reason(error)}") from error
    remove_earlier_results(folder, written, stem, video=False, earlier=earlier)
    return written


def remove_earlier_results(
    folder: Path,
    results: list[Path],
    stem: str = "image",
    *,
    video: bool = True,
    earlier: Collection[str] = (),
) -> None:
    """Once ``results`` are written: an earlier run's results in ``folder`` that they do
    not replace (image-3.png after a run of two images; with ``video``, video.mp4 after
    images and images after a video) go, so none passes for this run's. Only those an
    earlier run wrote (``earlier``, the names its report listed): a file of such a name
    that ondeck did not write is the user's, and stays."""
    keep = {path.name for path in results}
    stale = [path for path in folder.glob(f"{stem}*.png") if _is_image_name(path.name, stem)]
    if video:
        stale.append(folder / "video.mp4")
    for path in stale:
        # A folder of such a name is not a result (nothing here writes one): it stays.
        if path.name in earlier and path.name not in keep and not path.is_dir():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def earlier_results(folder: Path) -> set[str]:
    """The results an earlier run wrote in ``folder``: the names its ``report.json`` lists,
    as written (``output.files``) or as perhaps written (``output.pending``: a run that
    failed or stopped while writing its result); none where there is no such report, or
    it cannot be read."""
    try:
        report = json.loads((folder / "report.json").read_text())
        found = report["output"]
        names = [*found.get("files", ()), *found.get("pending", ())]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    return {name for name in names if isinstance(name, str) and Path(name).name == name}


def pending_results(folder: Path, earlier: Collection[str], names: Collection[str]) -> list[str]:
    """What a report written before a run's result is in place lists as ``pending``: the
    results an earlier run wrote (``earlier``), and this run's ``names`` not in the folder
    yet. Should the run fail or stop before its report lists its files, the next run into
    the folder removes those of them it does not replace; a file of such a name there
    now, not an earlier run's, is the user's and is left out."""
    new = {name for name in names if not (folder / name).exists()}
    return sorted({*earlier, *new})


def image_names(count: int, stem: str = "image") -> list[str]:
    """The files ``count`` images are written as."""
    return [f"{stem}.png"] if count == 1 else [f"{stem}-{i}.png" for i in range(1, count + 1)]


def _is_image_name(name: str, stem: str) -> bool:
    number = name[len(stem) + 1 : -len(".png")]
    return name == f"{stem}.png" or (name.startswith(f"{stem}-") and number.isdigit())


def _reason(error: BaseException) -> str:
    """The last meaningful line of an error: ffmpeg's are pages of build flags."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = lines[-1] if lines else type(error).__name__
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
        if error.filename is not None:  # ffmpeg itself missing, say
            reason = f"{reason}: {error.filename}"
    return f"{type(error).__name__}: {reason}"


class FolderInUse(OutputError):
    """Another run holds the output folder."""


@contextlib.contextmanager
def holding_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold ``folder`` for one run: a second run into it is refused while this one lasts,
    so two runs never leave one's video beside the other's report.

    An advisory lock on ``.ondeck-run.lock`` (holding the holder's pid), removed when
    the run ends; a lock a killed run left behind is released with its process.
    """
    folder = Path(folder)
    lock_path = folder / ".ondeck-run.lock"
    try:
        import fcntl
    except ImportError:  # no advisory locks here (Windows): runs are not serialised
        yield folder
        return
    while True:
        try:
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise OutputError(f"cannot write to {folder}: {error.strerror or error}") from error
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(descriptor)
            os.close(descriptor)
            raise FolderInUse(
                f"{folder} is in use by another ondeck run{holder}; wait for it to finish "
                "or give another --output"
            ) from None
        # The previous holder may have removed the file between our open and our lock:
        # then we hold a lock on a name no one else can see, so take the lock again.
        try:
            same = os.path.samestat(os.fstat(descriptor), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(descriptor)
    try:
        try:
            os.ftruncate(descriptor, 0)
            os.write(descriptor, str(os.getpid()).encode())
        except OSError as error:  # a full disk, say
            raise OutputError(f"cannot write to {lock_path}: {error.strerror or error}") from error
        yield folder
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(descriptor)


def _read_holder(descriptor: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(descriptor, 32, 0).decode().strip())
        return f" (pid {pid})"
    return ""


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
