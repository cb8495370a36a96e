"""What a reload costs a compiled transformer: the compile replayed on the fresh module.

    python benchmarks/experiments/recompile.py [--device cpu] [--preset default] [--reloads 8]

A Wan folder of the embedded preset (random weights) through ``ondeck.diffusers`` under
``release``; the transformer alone is called on one latent (``--frames``, ``--size``),
three ways: not compiled, ``compile_repeated_blocks(fullgraph=True)`` and
``compile(fullgraph=True)`` recorded on the proxy (inductor, the default backend). Per
way: the first call (a load, and the first compile), then ``--reloads`` times a release
and a call (a reload, the compile replayed, the call), and as often a call with the
module resident. The recompile cost per reload is a compiled way's median reload-and-call
seconds less its resident call's, less the same difference not compiled (the reload
alone); beside it, the graphs torch.compile made after the first call (0: the reloaded
module ran the code compiled for the first). Writes recompile.json to $OUT; prints a
table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_document  # noqa: E402

WAYS = ("plain", "compile_repeated_blocks", "compile")


def inputs(transformer, frames: int, size: int, device: str):
    import torch

    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(1, config.in_channels, frames, size, size, generator=generator)
    text = torch.randn(1, 16, config.text_dim, generator=generator)
    return latent.to(device), torch.tensor([500], device=device), text.to(device)


def measure(folder: Path, way: str, args) -> dict:
    import torch
    from torch._dynamo.utils import counters

    import ondeck.diffusers

    torch._dynamo.reset()
    counters.clear()
    pipe = ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device=args.device, policy="release", progress=False
    )
    transformer = pipe.transformer
    if way != "plain":
        getattr(transformer, way)(fullgraph=True)
    latent, timestep, text = inputs(transformer, args.frames, args.size, args.device)

    def call() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            transformer(latent, timestep, text)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    first = call()
    graphs = counters["stats"]["unique_graphs"]
    reloads, resident = [], []
    for _ in range(args.reloads):
        transformer.release()
        reloads.append(call())
        resident.append(call())
    return {
        "way": way,
        "first_call_seconds": first,
        "reload_and_call_seconds": statistics.median(reloads),
        "resident_call_seconds": statistics.median(resident),
        "graphs_first_call": graphs,
        "graphs_after_reloads": counters["stats"]["unique_graphs"] - graphs,
        "loads": transformer.load_count,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="default", help="ondeck.embedded's preset")
    parser.add_argument("--reloads", type=int, default=8)
    parser.add_argument("--frames", type=int, default=3, help="latent frames")
    parser.add_argument("--size", type=int, default=16, help="latent height and width")
    args = parser.parse_args(argv)

    from ondeck.embedded import build_wan_folder

    folder = build_wan_folder(Path(tempfile.mkdtemp(prefix="ondeck-recompile-")) / args.preset)
    rows = {way: measure(folder, way, args) for way in WAYS}
    plain = rows["plain"]
    reload_alone = plain["reload_and_call_seconds"] - plain["resident_call_seconds"]
    for row in rows.values():
        extra = row["reload_and_call_seconds"] - row["resident_call_seconds"] - reload_alone
        row["recompile_seconds_per_reload"] = extra
    path = write_document("recompile", {"rows": rows, "arguments": vars(args)})
    print(f"wrote {path}")
    print()
    print(
        f"{'way':<24} {'first call s':>12} {'reload+call s':>13} {'resident s':>10} "
        f"{'recompile s/reload':>18} {'graphs after reloads':>20}"
    )
    for way, row in rows.items():
        print(
            f"{way:<24} {row['first_call_seconds']:>12.2f} {row['reload_and_call_seconds']:>13.3f} "
            f"{row['resident_call_seconds']:>10.3f} {row['recompile_seconds_per_reload']:>18.3f} "
            f"{row['graphs_after_reloads']:>20}"
        )


if __name__ == "__main__":
    main()
