"""Shared by the GPU benchmarks: building Wan 2.1 14B-shaped folders, measuring, tables.

The weights are random (pixels are noise) but the shapes, dtypes and byte counts are
those of Wan 2.1 T2V 14B, so memory and speed are real.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30
HERE = Path(__file__).resolve().parent

# A mode's process that runs past its timeout is sent SIGUSR1 first: every thread's stack
# goes to stderr, so the timeout's report says where it was.
if hasattr(signal, "SIGUSR1"):
    faulthandler.register(signal.SIGUSR1, all_threads=True)


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
    """Read ``paths`` into the page cache, once what was written is on disk: a folder
    just built holds tens of GB of dirty pages whose writeback may still run during the
    first timed process, which no user's downloaded files have. The first process after
    a build spent 3.9-6.6 s in Wan's first encoder turn, the next first-ever process 1.1 s
    (BENCHMARKS.md)."""
    os.sync()
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


class StackSampler:
    """Where the threads' time goes: every thread's Python stack, sampled every few
    milliseconds while open. ``top()``: the most-sampled (thread, innermost frames) with
    the seconds they stood for. Threads idle in the standard library's waits are left
    out. A gap between samples much longer than the interval is time a call held the GIL
    (a C call that does not let go of it); ``gaps`` keeps where each thread was then."""

    IDLE_FILES = ("threading.py", "queue.py", "selectors.py", "concurrent/futures/thread.py")

    def __init__(
        self, interval: float = 0.005, depth: int = 4, gap: float = 0.05, timed: bool = False
    ):
        self.interval, self.depth, self.gap = interval, depth, gap
        self.counts: dict[tuple[str, str], int] = {}
        self.gaps: list[dict] = []
        # ``timed``: every sample too, as (perf_counter reading, thread, frames).
        self.samples: list[tuple[float, str, str]] | None = [] if timed else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _chain(self, frame) -> str | None:
        parts = []
        while frame is not None and len(parts) < self.depth:
            path = frame.f_code.co_filename
            if not parts and path.endswith(self.IDLE_FILES):
                return None
            short = "/".join(Path(path).parts[-2:])
            parts.append(f"{short}:{frame.f_code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        return " < ".join(parts)

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter()
            stacks = {}
            for ident, frame in sys._current_frames().items():
                if ident != me and (chain := self._chain(frame)) is not None:
                    stacks[names.get(ident, str(ident))] = chain
            for key in stacks.items():
                self.counts[key] = self.counts.get(key, 0) + 1
                if self.samples is not None:
                    self.samples.append((now, *key))
            if now - last > self.gap and len(self.gaps) < 50:
                self.gaps.append({"seconds": now - last, "stacks": stacks})
            last = now
            time.sleep(self.interval)

    def top(self, count: int = 25) -> list[list]:
        ranked = sorted(self.counts.items(), key=lambda item: -item[1])[:count]
        return [[thread, round(n * self.interval, 3), chain] for (thread, chain), n in ranked]

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


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


def peak_reserved(row: dict) -> int | None:
    """The largest sampled reserved bytes over a row's runs, None when none was sampled."""
    values = [r.get("sampled_peak_reserved_bytes") for r in row.get("runs", [])]
    values = [v for v in values if v is not None]
    return max(values) if values else None


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


CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_cgroup(name: str, limit_bytes: int) -> Path:
    """A cgroup v2 folder under the root with ``memory.max`` set to ``limit_bytes``;
    raises OSError where the machine does not let this process make one."""
    controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    if "memory" not in controllers:
        raise OSError("no cgroup v2 memory controller at /sys/fs/cgroup")
    subtree = CGROUP_ROOT / "cgroup.subtree_control"
    if "memory" not in subtree.read_text().split():
        subtree.write_text("+memory")
    folder = CGROUP_ROOT / name
    folder.mkdir(exist_ok=True)
    (folder / "memory.max").write_text(str(limit_bytes))
    if (folder / "memory.swap.max").exists():
        (folder / "memory.swap.max").write_text("0")
    return folder


def run_child(args: list[str], *, timeout: float, cgroup: Path | None = None) -> dict:
    """Run one benchmark mode in its own process (clean peaks) and read its JSON line;
    inside ``cgroup`` (a cgroup v2 folder) where given, from its first instruction."""
    command = [sys.executable, *args]
    started = time.perf_counter()

    def enter_cgroup() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=enter_cgroup if cgroup is not None else None,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if hasattr(signal, "SIGUSR1"):
            child.send_signal(signal.SIGUSR1)  # its stacks, then it is killed
            time.sleep(2)
        child.kill()
        stdout, stderr = child.communicate()
        tail = (stdout[-3000:] + stderr)[-8000:]
        return {"error": f"timed out after {timeout:.0f}s", "tail": tail, "args": args}
    done = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
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


def run_suite(
    name: str, modes: list[dict], *, folder: str, runs: int = 3, timeout: float = 420
) -> list[dict]:
    """``modes``: dicts with ``mode`` and optional ``memory_gib``, ``budget_gib``,
    ``host_cache_gib``, ``png``. Returns the result rows and writes ``{name}.json``."""
    path, sizes = ready_wan14b_folder(Path(folder))
    rows = []
    for spec in modes:
        options = {key: spec.get(key) for key in ("memory_gib", "budget_gib", "host_cache_gib")}
        args = wan_modes_command(path, spec["mode"], runs, png=spec.get("png"), **options)
        row = run_child(args, timeout=timeout)
        row["label"] = spec.get("label") or f"{spec['mode']} @ {spec.get('memory_gib') or 139} GiB"
        rows.append(row)
        print(summary_line(row), flush=True)
        (out_dir() / f"{name}.json").write_text(
            json.dumps(
                {"folder_bytes": sizes, "rows": rows, "date": time.strftime("%Y-%m-%d")},
                indent=2,
                default=str,
            )
        )
    print()
    print_table(rows)
    return rows


def wan_modes_command(
    path: Path, mode: str, runs: int, *, extra=(), png: str | None = None, **options
) -> list[str]:
    """The wan_modes.py command line of one mode: ``options`` (``memory_gib=24``, ...)
    become flags where set, ``png`` a timeline file in $OUT."""
    command = [str(HERE / "wan_modes.py"), "--folder", str(path), "--mode", mode]
    command += ["--runs", str(runs), *extra]
    for key, value in options.items():
        if value:
            command += [f"--{key.replace('_', '-')}", str(value)]
    if png:
        command += ["--png", str(out_dir() / png)]
    return command


@dataclass(frozen=True)
class Mode:
    """One mode of a comparison: a wan_modes.py mode, on a device emulated at
    ``memory_gib`` (None: the whole card), with the seconds it takes on an H200."""

    wan_mode: str
    memory_gib: int | None
    expected_seconds: float
    extra: tuple[str, ...] = ()


@dataclass
class Comparison:
    """What a comparison ran: rows in order, modes skipped for time, the folder."""

    path: Path
    sizes: dict[str, int]
    started: float
    rows: list[dict] = field(default_factory=list)
    skipped: list[tuple[str, float, float]] = field(default_factory=list)

    def write(self, filename: str, **extra) -> Path:
        """The rows so far, the folder's sizes and the skipped modes, with ``extra``, as
        JSON in ``$OUT``."""
        document = {
            "folder_bytes": self.sizes,
            "rows": self.rows,
            "skipped": [name for name, _, _ in self.skipped],
            **extra,
            "date": time.strftime("%Y-%m-%d"),
        }
        path = out_dir() / filename
        path.write_text(json.dumps(document, indent=2, default=str))
        return path

    def print_total(self, filename: str) -> None:
        print(
            f"\ntotal {time.perf_counter() - self.started:.0f}s; results in {out_dir() / filename}"
        )

    def print_skipped(self, script: str, flags: str = "") -> None:
        if self.skipped:
            names = ",".join(name for name, _, _ in self.skipped)
            print(f"\nskipped for time: {names}; run them with")
            print(f"  python benchmarks/{script} --folder {self.path} --modes {names}{flags}")


def add_comparison_arguments(parser, modes: dict, default_modes: list[str], deadline_s: float):
    parser.add_argument("--folder", default=os.environ.get("WAN14B_FOLDER", "/tmp/wan14b"))
    parser.add_argument(
        "--modes",
        default=",".join(default_modes),
        help=f"comma-separated, in order: {', '.join(modes)}",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=deadline_s)


def run_comparison(
    args,
    names: list[str],
    modes: dict[str, Mode],
    *,
    label: Callable[[str, Mode], str],
    png_prefix: str,
    unavailable: Callable[[str, Mode], str | None] | None = None,
    after_each: Callable[[Comparison], None] | None = None,
) -> Comparison:
    """Run the named modes in order, each in its own process, with the same allocator
    settings; a mode that would not finish before ``args.deadline_s`` (from the start) is
    skipped, and none runs past it. ``unavailable`` names why a mode cannot run at all."""
    # The same allocator settings for every mode; fewer fragments under an emulated cap.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.perf_counter()
    path, sizes = ready_wan14b_folder(Path(args.folder))
    print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}", flush=True)
    result = Comparison(path, sizes, started)
    for name in names:
        mode = modes[name]
        reason = unavailable(name, mode) if unavailable is not None else None
        if reason:
            result.rows.append({"name": name, "label": label(name, mode), "error": reason})
            print(f"{name}: {reason}")
            continue
        left = args.deadline_s - (time.perf_counter() - started)
        if left < mode.expected_seconds:
            result.skipped.append((name, mode.expected_seconds, left))
            print(
                f"{name}: skipped, needs ~{mode.expected_seconds:.0f}s and {max(0, left):.0f}s are left"
            )
            continue
        command = wan_modes_command(
            path,
            mode.wan_mode,
            args.runs,
            extra=mode.extra,
            memory_gib=mode.memory_gib,
            png=f"{png_prefix}-{name}.png" if mode.memory_gib else None,
        )
        row = run_child(command, timeout=max(30.0, left - 5))
        row.update(label=label(name, mode), name=name, runs_asked=args.runs)
        result.rows.append(row)
        print(summary_line(row), flush=True)
        if after_each is not None:
            after_each(result)
    return result


def summary_line(row: dict) -> str:
    if row.get("error") and not row.get("runs"):
        return f"{row['label']}: ERROR {row['error'][:300]}"
    runs = row.get("runs", [])
    times = ", ".join(f"{r['seconds']:.1f}" for r in runs)
    error = f"  ERROR {row['error'][:200]}" if row.get("error") else ""
    return f"{row['label']}: runs {times} s, peak alloc {row.get('peak_allocated_bytes', 0) / GiB:.1f} GiB{error}"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':<38} {'run 1 s':>8} {'runs 2-3 s':>10} {'peak alloc':>10} {'peak RSS':>9} "
        f"{'exposed s':>9} {'loaded/run':>10} {'pred/meas peak':>15}"
    )
    for row in rows:
        runs = row.get("runs", [])
        if not runs:
            print(f"{row['label']:<38} failed: {row.get('error', '')[:90]}")
            continue
        exposed = [r.get("exposed_load_seconds") for r in runs[1:]]
        loaded = [r.get("bytes_loaded") for r in runs[1:]]
        exposed_text = (
            f"{sum(exposed) / len(exposed):.2f}" if exposed and None not in exposed else "-"
        )
        loaded_text = (
            f"{sum(loaded) / len(loaded) / GiB:.1f}G" if loaded and None not in loaded else "-"
        )
        peaks = "-"
        if row.get("predicted_peak_bytes") is not None:
            peaks = f"{row['predicted_peak_bytes'] / GiB:.2f}/{row.get('measured_resident_peak_bytes', 0) / GiB:.2f}"
        print(
            f"{row['label']:<38} {runs[0]['seconds']:>8.1f} {later_seconds(row):>10.1f} "
            f"{row['peak_allocated_bytes'] / GiB:>9.1f}G {row['peak_rss_bytes'] / GiB:>8.1f}G "
            f"{exposed_text:>9} {loaded_text:>10} {peaks:>15}"
        )


def count_reads(pipe) -> dict[str, int]:
    """Bytes each plain ComponentLoader reads, summed over every load (the single run)."""
    reads = {name: 0 for name in pipe.deferred}

    class Observer:
        def before_load(self, proxy) -> None:
            pass

        def after_release(self, proxy, nbytes) -> None:
            pass

        def after_load(self, proxy, nbytes, seconds) -> None:
            for name, candidate in pipe.deferred.items():
                loader = pipe.loaders[name]
                if candidate is proxy and loader.last_source != "host cache":
                    reads[name] += loader.last_load_bytes

    for proxy in pipe.deferred.values():
        proxy.add_observer(Observer())
    return reads


def run_variant(args: list[str], *, timeout: float) -> dict:
    """Run one variant's process (torchrun or plain) and read its ``RESULT`` line.

    On timeout, SIGTERM first: torchrun then stops its workers, which run in sessions of
    their own and would otherwise keep their GPUs busy after a SIGKILL.
    """
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        error = None if process.returncode == 0 else f"exit {process.returncode}"
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        error = f"timed out after {timeout:.0f}s"
    result: dict = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if error:
        result.update(error=error, tail=(stdout + stderr)[-3000:])
    result["process_seconds"] = time.perf_counter() - started
    result["args"] = args
    return result


def union_of(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching intervals joined, in order (a trace's busy spans)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]
