"""A video VAE's decode in a tight room: seconds, peak and the allocator's retries, whole
frames against the tiles ondeck would choose, with and without the cache given back first.

    python benchmarks/experiments/tight_decode.py [--family hunyuan,wan] [--rooms 1.1,1.5]

Builds the family's VAE at full size with random weights (HunyuanVideo's in bf16 at
480x848x33, Wan 2.1's in float32 at 480x832x33, as ``families.py`` decodes them). On
the whole card it times each tiling (median of three after a warm-up) and reads its
peak above the weights. Then, for each tiling and each room (a multiple of that
tiling's own peak), it caps the process at the weights plus the room
(``set_per_process_memory_fraction``), leaves the allocator's cache as a transformer's
turn would (tensors of other sizes freed, not given back) and decodes three times,
counting the allocator's retries (``num_alloc_retries``): once as is, once after
``torch.cuda.empty_cache()``. Writes tight_decode.json to $OUT (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

GiB = 2**30
SHAPES = {"hunyuan": (480, 848, 33), "wan": (480, 832, 33)}


def build(family: str):
    import torch

    if family == "hunyuan":
        from diffusers import AutoencoderKLHunyuanVideo

        with torch.device("cuda"):
            vae = AutoencoderKLHunyuanVideo().to(torch.bfloat16).eval()
        channels, dtype = vae.config.latent_channels, torch.bfloat16
    else:
        from diffusers import AutoencoderKLWan

        with torch.device("cuda"):
            vae = AutoencoderKLWan().eval()
        channels, dtype = vae.config.z_dim, torch.float32
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.normal_(0, 0.02)
    height, width, frames = SHAPES[family]
    shape = (1, channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    return vae, torch.randn(shape, device="cuda", dtype=dtype)


def crowd(nbytes: int) -> None:
    """Leave the allocator's cache as a turn of other work would: tensors of many sizes
    allocated and freed, cached but not given back."""
    import torch

    held, total, size = [], 0, 3 * 2**20
    while total < nbytes:
        try:
            held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
        total += size
        size = size * 7 % (97 * 2**20) + 2**20
    del held


def decode_once(vae, latents, tiles) -> tuple[float, int, int]:
    """Seconds, peak above what was allocated before, and allocator retries of one decode."""
    import torch

    from ondeck.integrations.diffusers.decode import tiling_style

    saved = {n: getattr(vae, n) for n in tiling_style(type(vae)).names if hasattr(vae, n)}
    if tiles is not None:
        tiling_style(type(vae)).apply(vae, tiles, 8)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    started = time.perf_counter()
    try:
        with torch.no_grad():
            out = vae.decode(latents, return_dict=False)[0]
        del out
        torch.cuda.synchronize()
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() - base
    return seconds, peak, torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries


def family_rows(family: str, rooms: list[float], fractions: list[float]) -> list[dict]:
    import torch

    from ondeck.tiles import decode_tiles

    vae, latents = build(family)
    height, width, _ = SHAPES[family]
    tilings = [("whole", None)]
    for fraction in fractions:
        tiles = decode_tiles(height, width, fraction)
        if tiles is not None and all(t[1] != tiles for t in tilings):
            tilings.append((f"{tiles.count} tiles ({tiles.area:.2f})", tiles))
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    for label, tiles in tilings:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        runs = [decode_once(vae, latents, tiles) for _ in range(4)]
        seconds = statistics.median(r[0] for r in runs[1:])
        peak = max(r[1] for r in runs)
        row = {"family": family, "tiling": label, "seconds": seconds, "peak": peak, "tight": []}
        print(f"{family} {label}: {seconds:.3f} s, peak {peak / GiB:.2f} GiB", flush=True)
        for room in rooms:
            for give_back in (False, True):
                torch.cuda.empty_cache()
                limit = torch.cuda.memory_allocated() + int(room * peak)
                torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
                timed = []
                try:
                    for _ in range(3):
                        crowd(int(room * peak * 0.9))
                        if give_back:
                            torch.cuda.empty_cache()
                        timed.append(decode_once(vae, latents, tiles))
                    result = {
                        "room": room,
                        "empty_cache_first": give_back,
                        "seconds": statistics.median(t[0] for t in timed),
                        "retries": [t[2] for t in timed],
                    }
                except torch.OutOfMemoryError:
                    result = {"room": room, "empty_cache_first": give_back, "oom": True}
                row["tight"].append(result)
                print(
                    f"   room {room}x{' +empty_cache' if give_back else ''}: {result}", flush=True
                )
        rows.append(row)
    torch.cuda.set_per_process_memory_fraction(1.0)
    del vae, latents
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="hunyuan,wan")
    parser.add_argument("--rooms", default="1.1,1.5")
    parser.add_argument("--fractions", default="0.6,0.4,0.27")
    args = parser.parse_args()

    import torch

    rooms = [float(r) for r in args.rooms.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for family in args.family.split(","):
        rows.extend(family_rows(family, rooms, fractions))
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "rows": rows,
    }
    (out / "tight_decode.json").write_text(json.dumps(result, indent=2))
    print(
        f"{'family':<8} {'tiling':<18} {'s (full)':>8} {'peak GiB':>8}  tight: room x, s, retries"
    )
    for row in rows:
        tight = "; ".join(
            f"{t['room']}{'e' if t['empty_cache_first'] else ''} "
            + ("oom" if t.get("oom") else f"{t['seconds']:.2f} {t['retries']}")
            for t in row["tight"]
        )
        print(
            f"{row['family']:<8} {row['tiling']:<18} {row['seconds']:>8.3f} "
            f"{row['peak'] / GiB:>8.2f}  {tight}"
        )


if __name__ == "__main__":
    main()
