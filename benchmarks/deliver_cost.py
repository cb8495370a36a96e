"""What the copying thread spends, per chunk, to hand a read chunk to the device.

    python benchmarks/deliver_cost.py [--rounds 40] [--chunks 48]

A read through the reading processes has one Python thread that feeds them and issues
every copy (and, for fp8 storage, every cast). On the H200 that thread is busy for most
of a read (``cast_rate.py``'s busy column), more so when it casts: any jitter then
leaves the copy engine idle. This measures the thread's CPU seconds per chunk for the
delivery alone, with no reading processes: the same pinned 4 MiB slot copied into
successive chunks of a 192 MiB bf16 tensor, through ``reader._deliver`` with the
reader's own streams and cast staging. Arms: bf16 (a copy into the destination), and
fp8 (a copy into the staging half, the half's casts issued when it is full) with the
reader's staging and with 64 and 128 MiB of it (halves of 8 and 16 chunks); each copy
and slot event through the CUDA driver (the reader's default, ``reader.DRIVER_COPIES``)
or, in the "torch copies" arms, through torch. Each round
issues ``--chunks`` chunks, timed by ``time.thread_time``, then waits for the device;
rounds take turns between arms. Prints microseconds per chunk (median of rounds) and
writes deliver_cost.json to $OUT.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_document  # noqa: E402

MiB = 2**20
SLOT = 4 * MiB


def arm_chunks(arm: str, count: int, device):
    """A job of ``count`` slots' bytes of bf16, to a bf16 or fp8 destination, chunked as
    the reader chunks it."""
    import torch

    from ondeck.loading.chunks import ReadJob, plan_chunks
    from ondeck.loading.safetensors_format import TensorInfo

    elements = count * SLOT // 2
    info = TensorInfo("blocks.0.weight", torch.bfloat16, (elements,), 0, count * SLOT, "x")
    dtype = torch.float8_e4m3fn if arm.startswith("fp8") else torch.bfloat16
    job = ReadJob(info, torch.empty(elements, dtype=dtype, device=device))
    chunks, _ = plan_chunks([job], SLOT, "blocks")
    return list(chunks), job


def one_round(arm: str, chunks, slot, device, staging_bytes: int) -> float:
    """CPU seconds the thread spent delivering ``chunks`` (the device waited for after)."""
    import torch

    from ondeck.loading import reader

    fence = reader._recorded(torch.cuda.current_stream(device))
    before = torch.cuda.current_stream(device)
    streams = reader._side_streams({device: fence})
    driver = None if arm.endswith("torch copies") else reader._driver_for(streams)
    casts = {}
    if arm.startswith("fp8"):
        buffer = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
        casts = {device: reader._DeviceCasts(buffer, streams[device], fence, SLOT, driver)}
    if driver is None:
        marked = reader._Slot(slot)
    else:
        marked = reader._DriverSlot(slot, driver, streams[device])
    try:
        started = time.thread_time()
        for chunk in chunks:
            stream = reader._deliver(chunk, slot, streams, casts, driver)
            marked.mark_copying(stream)  # as the feeding thread marks the slot copying
        for device_casts in casts.values():
            device_casts.flush()
        spent = time.thread_time() - started
        for device_casts in casts.values():
            device_casts.casts.synchronize()
        streams[device].synchronize()
    finally:
        torch.cuda.set_stream(before)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--chunks", type=int, default=48)
    args = parser.parse_args()

    import torch

    from ondeck.loading import reader

    device = torch.device("cuda", torch.cuda.current_device())
    slot = torch.empty(SLOT, dtype=torch.uint8, pin_memory=True)
    staging = {"bf16": 0, "fp8": reader._staging_bytes(SLOT, 1)}
    staging.update({"bf16, torch copies": 0, "fp8, torch copies": staging["fp8"]})
    staging.update({"fp8, 64 MiB staging": 64 * MiB, "fp8, 128 MiB staging": 128 * MiB})
    arms = tuple(staging)
    prepared = {arm: arm_chunks(arm, args.chunks, device) for arm in arms}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for attempt in range(1 + args.rounds):  # the first warms every arm
        for turn in range(len(arms)):
            arm = arms[(attempt + turn) % len(arms)]
            chunks, _ = prepared[arm]
            spent = one_round(arm, chunks, slot, device, staging[arm])
            if attempt:
                seconds[arm].append(spent)
    rows = {
        arm: {
            "seconds": values,
            "microseconds_per_chunk": statistics.median(values) / args.chunks * 1e6,
        }
        for arm, values in seconds.items()
    }
    fields = {"rows": rows, "chunks_per_round": args.chunks, "slot_bytes": SLOT}
    write_document("deliver_cost", fields)
    base = rows["bf16"]["microseconds_per_chunk"]
    print(f"\n{'arm':<28} {'us/chunk':>9} {'- bf16':>8}  (CPU of the copying thread, medians)")
    for arm, row in rows.items():
        cost = row["microseconds_per_chunk"]
        print(f"{arm:<28} {cost:>9.1f} {cost - base:>8.1f}")


if __name__ == "__main__":
    main()
