"""Whether a component's load on a thread of its own waits for the computing stream.

    python benchmarks/experiments/load_behind_compute.py [--compute-ms 300] [--repeats 5]

`release` loads the next call's first encoder (CLIP-L in SD3.5) on a thread while the
decode computes; in the SD3.5 runs that load took 0.12-0.14 s where CLIP-G's, after the
decode, took 0.03 s. This builds a CLIP-L-shaped text encoder (transformers'
``CLIPTextModelWithProjection``, bf16, 0.25 GB), fills a host cache with it, and times its
load from the host cache on a second thread in three arms, each ``--repeats`` times:

  idle      nothing computes
  behind    the main thread has queued ``--compute-ms`` of matrix products on its stream
            (the default one, as a pipeline's call runs) just before the load starts
  private   the same, the loading thread's current stream a stream of its own
  ops       nothing queued; the main thread issues small device operations in a loop
            while the load runs (as it issues a decode's), the load on its own stream
  ops-fast  the same, with the interpreter's thread switch interval at 0.5 ms (5 ms is
            Python's default) while the load runs
  python    the main thread runs pure Python while the load runs

``--source file`` loads from the safetensors file (the page cache, as ``release`` does)
instead of from a host cache. ``--calls`` also finds which calls into C give up the
interpreter's lock in one load (``attribute_waits``), by name and calling function, on
every thread the load starts; with ``--repeats 0`` it does only that.

Writes load_behind_compute.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import out_dir, write_document  # noqa: E402


def build(folder: Path) -> Path:
    import json

    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    if (folder / "model_index.json").exists():
        return folder
    config = CLIPTextConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, projection_dim=768, vocab_size=49408,
    )  # fmt: skip
    model = CLIPTextModelWithProjection(config).to(torch.bfloat16)
    model.save_pretrained(folder / "text_encoder")
    index = {
        "_class_name": "TextEncoderOnly",
        "text_encoder": ["transformers", type(model).__name__],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def queue_compute(milliseconds: float, a, b) -> None:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ b
    end.record()
    end.synchronize()
    count = max(1, round(milliseconds / start.elapsed_time(end)))
    for _ in range(count):
        a @ b


def timed_load(loader, stream, busy: str | None = None) -> float:
    """One load on a thread of its own; meanwhile the main thread idles (``busy`` None),
    issues small device operations (``"ops"``) or runs pure Python (``"python"``)."""
    import contextlib

    import torch

    seconds = []

    def load() -> None:
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        started = time.perf_counter()
        with context:
            module = loader()
            torch.cuda.current_stream().synchronize()
        seconds.append(time.perf_counter() - started)
        del module

    thread = threading.Thread(target=load)
    small = torch.zeros(1 << 16, device="cuda") if busy == "ops" else None
    thread.start()
    while busy is not None and thread.is_alive():
        if small is not None:
            for _ in range(64):
                small.add_(1.0)
        else:
            total = 0
            for value in range(2000):
                total += value * value
    thread.join()
    return seconds[0]


def attribute_waits(loader, interval: float = 0.02) -> dict[str, dict[str, int]]:
    """Which calls into C give up the interpreter's lock in one load, by name and caller.

    The load runs on a thread of its own while the main thread runs pure Python with a
    thread switch interval of ``interval``: a call that gives the lock up then takes
    about ``interval`` to get it back, so each call that took more than half of it is
    counted as a wait (a handover). Every thread the load starts is profiled too."""
    import collections

    calls: collections.Counter = collections.Counter()
    waits: collections.Counter = collections.Counter()
    local = threading.local()

    def profile(frame, event, arg) -> None:
        if event == "c_call":
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(time.perf_counter())
        elif event in ("c_return", "c_exception"):
            stack = getattr(local, "stack", None)
            if not stack:
                return
            took = time.perf_counter() - stack.pop()
            owner = getattr(arg, "__self__", None)
            owner = type(owner).__name__ if owner is not None else ""
            code = frame.f_code
            name = f"{owner}.{getattr(arg, '__name__', str(arg))} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_name})"
            calls[name] += 1
            if took > interval / 2:
                waits[name] += 1

    def load() -> None:
        sys.setprofile(profile)
        try:
            loader()
        finally:
            sys.setprofile(None)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    threading.setprofile(profile)  # the threads the load starts
    try:
        thread = threading.Thread(target=load)
        thread.start()
        while thread.is_alive():
            total = 0
            for value in range(2000):
                total += value * value
        thread.join()
    finally:
        threading.setprofile(None)
        sys.setswitchinterval(previous)
    return {name: {"waits": waits[name], "calls": calls[name]} for name, _ in waits.most_common()}


ARMS = ("idle", "behind", "private", "ops", "ops-fast", "python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/clip_l"))
    parser.add_argument("--compute-ms", type=float, default=300.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--source", choices=("cache", "file"), default="cache")
    parser.add_argument("--calls", action="store_true", help="count one load's calls into C")
    parser.add_argument("--arms", default=",".join(ARMS), help="which arms, comma-separated")
    parser.add_argument(
        "--slot-mib", type=int, default=None, help="the reading ring's slot size (its default)"
    )
    args = parser.parse_args()

    import torch

    from ondeck.loading import ComponentLoader, HostCache, ModelFolder

    folder = ModelFolder.open(build(args.folder))
    cache = HostCache(2 * 1024**3) if args.source == "cache" else None
    loader = ComponentLoader(
        folder, "text_encoder", device="cuda", dtype=torch.bfloat16, host_cache=cache,
        progress=False, buffer_bytes=args.slot_mib and args.slot_mib * 2**20,
    )  # fmt: skip
    loader()  # fills the host cache (or the page cache): every timed load reads from it
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    private = torch.cuda.Stream()
    wanted = args.arms.split(",")
    if unknown := set(wanted) - set(ARMS):
        parser.error(f"unknown arms: {sorted(unknown)}; known: {', '.join(ARMS)}")
    arms: dict[str, list[float]] = {arm: [] for arm in ARMS if arm in wanted}
    for _ in range(args.repeats):
        for arm in arms:
            torch.cuda.synchronize()
            if arm in ("behind", "private"):
                queue_compute(args.compute_ms, a, b)
            stream = None if arm in ("idle", "behind") else private
            busy = {"ops": "ops", "ops-fast": "ops", "python": "python"}.get(arm)
            interval = sys.getswitchinterval()
            if arm == "ops-fast":
                sys.setswitchinterval(0.0005)
            try:
                arms[arm].append(timed_load(loader, stream, busy))
            finally:
                sys.setswitchinterval(interval)
            torch.cuda.synchronize()
    rows = {arm: statistics.median(values) for arm, values in arms.items() if values}
    calls = attribute_waits(loader) if args.calls else {}
    if calls:
        total = sum(row["waits"] for row in calls.values())
        print(f"\none load beside pure Python: {total} calls gave up the lock; by call:")
        for name, row in list(calls.items())[:40]:
            print(f"{row['waits']:>6} of {row['calls']:>6}  {name}")
    write_document(
        "load_behind_compute",
        {
            "compute_ms": args.compute_ms,
            "arms": arms,
            "medians": rows,
            "source": args.source,
            "slot_mib": args.slot_mib,
            "calls": calls,
        },
    )
    print(
        f"\nCLIP-L-shaped load from the {args.source} ({args.compute_ms:g} ms queued where queued)"
    )
    print(f"{'arm':<10} {'median s':>9}  runs")
    for arm, values in arms.items():
        if not values:
            continue
        print(f"{arm:<10} {rows[arm]:>9.3f}  {', '.join(f'{v:.3f}' for v in values)}")
    print(f"json: {out_dir() / 'load_behind_compute.json'}")


if __name__ == "__main__":
    main()
