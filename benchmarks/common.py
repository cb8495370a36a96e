"""Shared by the GPU benchmarks: building Wan 2.1 14B-shaped folders, measuring, tables.

The weights are random (pixels are noise) but the shapes, dtypes and byte counts are
those of Wan 2.1 T2V 14B, so memory and speed are real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

GiB = 2**30


def umt5_xxl_config():
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=256384,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        tie_word_embeddings=False,
    )


def _randomise(module) -> None:
    import torch

    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.02)


def build_transformer_folder(path: Path, *, num_layers: int = 40) -> Path:
    """A WanTransformer3DModel (14B config, fewer layers if asked) in bf16, diffusers format."""
    import torch
    from diffusers import WanTransformer3DModel

    if (path / "model_index.json").exists():
        return path
    with torch.device("cuda"):
        transformer = WanTransformer3DModel(num_layers=num_layers).to(torch.bfloat16)
    _randomise(transformer)
    transformer.save_pretrained(path / "transformer", max_shard_size="5GB")
    del transformer
    torch.cuda.empty_cache()
    index = {
        "_class_name": "WanTransformerOnly",
        "transformer": ["diffusers", "WanTransformer3DModel"],
    }
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def build_wan14b_folder(path: Path) -> Path:
    """The full Wan 2.1 T2V 14B-shaped pipeline folder (text encoder, transformer, VAE),
    written by diffusers' own ``WanPipeline.save_pretrained``, as users' folders are."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import ByT5Tokenizer, UMT5EncoderModel

    if (path / "model_index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("cuda"):
        text_encoder = UMT5EncoderModel(umt5_xxl_config()).to(torch.bfloat16)
        transformer = WanTransformer3DModel().to(torch.bfloat16)
        vae = AutoencoderKLWan()
    for module in (text_encoder, transformer, vae):
        _randomise(module)
    pipeline = WanPipeline(
        tokenizer=ByT5Tokenizer(),
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    )
    pipeline.save_pretrained(path, max_shard_size="5GB")
    del pipeline, text_encoder, transformer, vae
    torch.cuda.empty_cache()
    return path


def folder_bytes(path: Path) -> dict[str, int]:
    return {
        sub.name: sum(f.stat().st_size for f in sub.glob("*.safetensors"))
        for sub in sorted(path.iterdir())
        if sub.is_dir()
    }


def drop_page_cache(paths) -> None:
    """Evict files from the page cache (clean pages), so the next read comes from disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        pass


def reload_arm_loader(folder, name: str, arm: str):
    """A ``ComponentLoader`` of component ``name`` on CUDA for a reload arm named like
    ``"fp8, ..."`` or ``"bf16, whole"``: fp8 storage when the arm starts with fp8, loaded
    whole when it ends with whole, pipelined as the pipelines load otherwise."""
    import torch

    from ondeck.loading import ComponentLoader

    return ComponentLoader(
        folder,
        name,
        device="cuda",
        dtype=torch.bfloat16,
        storage_dtype="fp8" if arm.startswith("fp8") else None,
        progress=False,
        pipelined=False if arm.endswith("whole") else None,
    )


def warm_page_cache(paths) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass


def rss_bytes() -> int:
    """This process's RSS plus the memory its children (reading processes) hold alone: a
    ring they share with this process is counted once, here."""
    import psutil

    process = psutil.Process()
    total = process.memory_info().rss
    for child in process.children():
        try:
            total += child.memory_full_info().uss
        except psutil.Error:
            pass
    return total


def reset_peak_rss() -> None:
    """Reset VmHWM so the next reading is the peak of what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5\n")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return rss_bytes()


class PeakSampler:
    """Samples ``read()`` every few milliseconds; ``.peak`` is the largest reading."""

    def __init__(self, read, interval: float = 0.005):
        self.read = read
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self.peak = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


class RssSampler(PeakSampler):
    """Samples RSS every few milliseconds; ``.peak`` is the largest reading."""

    def __init__(self, interval: float = 0.005):
        super().__init__(rss_bytes, interval)


class PhaseClock:
    """Times calls of named functions while it is open: each call's label, component (the
    ``name`` of the object it was called on, if any), start (seconds since the clock's
    last ``take``), seconds and thread. ``targets``: ``{label: (owner, attribute)}``, an
    owner being a module or a class; each is patched back on close. Calls nest: a phase
    holds the time of the phases it calls. ``events=False`` keeps only each label's
    total seconds and calls (``totals``, ``counts``): less work per call, for functions
    called per chunk."""

    def __init__(self, targets: dict[str, tuple[object, str]], *, events: bool = True):
        self.targets = targets
        self.keep_events = events
        self.events: list[dict] = []
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._zero = time.perf_counter()
        self._saved: list[tuple[object, str, object]] = []

    def _wrapped(self, label: str, function):
        import functools

        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._record(label, started, time.perf_counter(), args)

        return timed

    def _record(self, label: str, started: float, ended: float, args: tuple) -> None:
        if not self.keep_events:
            with self._lock:
                self.totals[label] = self.totals.get(label, 0.0) + ended - started
                self.counts[label] = self.counts.get(label, 0) + 1
            return
        event = {
            "phase": label,
            "component": _component_of(args[0]) if args else "",
            "start": round(started - self._zero, 6),
            "seconds": round(ended - started, 6),
            "thread": threading.current_thread().name,
        }
        with self._lock:
            self.events.append(event)

    def __enter__(self) -> PhaseClock:
        for label, (owner, attribute) in self.targets.items():
            own = vars(owner).get(attribute)  # None: inherited (a class) or absent
            self._saved.append((owner, attribute, own))
            if isinstance(own, staticmethod):
                wrapped = staticmethod(self._wrapped(label, own.__func__))
            else:
                wrapped = self._wrapped(label, getattr(owner, attribute))
            setattr(owner, attribute, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attribute, own in reversed(self._saved):
            if own is None:
                delattr(owner, attribute)  # inherited again
            else:
                setattr(owner, attribute, own)
        self._saved.clear()

    def take(self) -> list[dict]:
        with self._lock:
            events, self.events = self.events, []
            self._zero = time.perf_counter()
        return events


class CollectorClock:
    """Python's cyclic garbage collector's passes while it is open, by generation:
    ``take()`` returns ``{"collections", "collector_seconds", "oldest_collections",
    "longest_seconds"}`` since the last take. A pass holds the interpreter lock
    throughout: every thread that issues copies waits for it."""

    def __init__(self):
        self._started: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.counts = {
            "collections": 0,
            "collector_seconds": 0.0,
            "oldest_collections": 0,
            "longest_seconds": 0.0,
        }

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        counts = self.counts
        counts["collections"] += 1
        counts["collector_seconds"] += seconds
        counts["longest_seconds"] = max(counts["longest_seconds"], seconds)
        if info.get("generation") == 2:
            counts["oldest_collections"] += 1

    def __enter__(self) -> CollectorClock:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def take(self) -> dict:
        counts = self.counts
        self._reset()
        return counts


def _component_of(owner) -> str:
    """The component an object belongs to, read without ``__getattr__`` (a lazy
    proxy's would load it)."""
    for attribute in ("_ondeck_name", "name", "component"):
        try:
            value = object.__getattribute__(owner, attribute)
        except (AttributeError, TypeError):
            continue
        if isinstance(value, str):
            return value
    return ""


def phase_totals(events: list[dict]) -> dict[str, dict]:
    """``{"phase component": {"seconds": total, "calls": n, "longest": s}}`` of ``events``."""
    totals: dict[str, dict] = {}
    for event in events:
        key = f"{event['phase']} {event['component']}".strip()
        row = totals.setdefault(key, {"seconds": 0.0, "calls": 0, "longest": 0.0})
        row["seconds"] += event["seconds"]
        row["calls"] += 1
        row["longest"] = max(row["longest"], event["seconds"])
    return totals


def parse_modes(parser, text: str, known, kind: str = "modes") -> list[str]:
    """The comma-separated names of ``text``, in order; an unknown one is a usage error."""
    modes = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in modes if name not in known]
    if unknown:
        parser.error(f"unknown {kind} {unknown}; choose from {', '.join(known)}")
    return modes


def ready_wan14b_folder(folder: Path) -> tuple[Path, dict[str, int]]:
    """Build the Wan 2.1 14B-shaped folder (once) and read it into the page cache, so every
    mode starts from the same warm files. Returns its path and bytes per component."""
    started = time.perf_counter()
    path = build_wan14b_folder(Path(folder))
    sizes = folder_bytes(path)
    print(f"folder {path}: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in sizes.items() if v))
    warm_page_cache(sorted(str(p) for p in path.glob("*/*.safetensors")))
    print(f"(folder ready and in the page cache after {time.perf_counter() - started:.0f}s)")
    return path, sizes


def later_seconds(row: dict) -> float:
    """Median wall time of a mode's runs 2 and later (run 1 when there is only one)."""
    runs = row["runs"]
    return median([r["seconds"] for r in runs[1:]] or [runs[0]["seconds"]])


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def run_child(args: list[str], *, timeout: float) -> dict:
    """Run one benchmark mode in its own process (clean peaks) and read its JSON line."""
    command = [sys.executable, *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "args": args}
    result = None
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if result is None:
        tail = (done.stdout + done.stderr)[-3000:]
        result = {"error": f"exit {done.returncode}", "tail": tail}
    result["process_seconds"] = time.perf_counter() - started
    result["args"] = args
    return result


WARM_UP = """
import torch, diffusers, transformers, ondeck
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
from transformers import AutoTokenizer, UMT5EncoderModel
if torch.cuda.is_available():
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    v = torch.randn(1, 4, 4, 8, 8, device="cuda")
    torch.nn.functional.conv3d(v, torch.randn(4, 4, 3, 3, 3, device="cuda")).sum().item()
"""


def warm_libraries() -> float:
    """One throwaway process that imports what every mode imports and touches CUDA, cuBLAS
    and cuDNN: the first mode then starts with compiled bytecode and shared libraries in
    the page cache, as every later one does. Returns its seconds."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", WARM_UP], capture_output=True, timeout=600)
    return time.perf_counter() - started


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result, default=str), flush=True)


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or "bench-out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_document(script: str, fields: dict) -> Path:
    """``fields`` with the date, device, torch version and command line, written as
    ``{script}.json`` to the output folder; returns its path."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    document = {
        **fields,
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "torch": torch.__version__,
        "command": f"python benchmarks/{script}.py " + " ".join(sys.argv[1:]),
    }
    path = out_dir() / f"{script}.json"
    path.write_text(json.dumps(document, indent=2))
    return path


def decode_report(pipe) -> dict | None:
    """How the last run decoded: tiles (0: whole frames), one tile's share of a frame,
    and decodes that ran out of memory and were retried in smaller tiles. None for a
    pipeline without ondeck's tiling decode."""
    decoders = list(getattr(pipe, "decoders", {}).values())  # the diffusers path's VAEs
    for stage in decoders + list(getattr(pipe, "stages", None) or ()):
        if hasattr(stage, "last_tiles") and hasattr(stage, "last_retries"):
            tiles = stage.last_tiles
            return {
                "tiles": 0 if tiles is None else tiles.count,
                "tile_area": 1.0 if tiles is None else tiles.area,
                "retries": stage.last_retries,
            }
    return None
