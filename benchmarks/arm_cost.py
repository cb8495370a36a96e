"""What arming a loaded transformer for block streaming, and installing its tensors,
cost on the load's path.

    python benchmarks/arm_cost.py [--device cpu|cuda] [--streamed 27] [--slots 3]

When a component with streamed blocks loads, its module is armed before the stage can
start: slots allocated, hooks registered, and every streamed tensor bound to a view of
a slot. The work is per tensor, not per byte, so a Wan 2.1 transformer of 40 blocks with
tiny dimensions (27 tensors a block, as the 14B has) costs what the 14B's does. This
loads it ``--loads`` times with ``--streamed`` of its blocks streamed through
``--slots`` slots, releasing it after each, and times the installing of its tensors in
the module (``components._install``), the arming alone (``_Armed.__init__``) and the
release's (``BlockStreamer.unload``). Prints the medians (the first load warms up and is
left out); writes arm_cost.json to $OUT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_document  # noqa: E402

BLOCKS = 40


def build_folder(path: Path) -> Path:
    import torch
    from diffusers import WanTransformer3DModel

    if (path / "model_index.json").exists():
        return path
    model = WanTransformer3DModel(
        num_layers=BLOCKS,
        num_attention_heads=2,
        attention_head_dim=8,
        ffn_dim=32,
        text_dim=16,
        freq_dim=16,
        in_channels=4,
        out_channels=4,
    ).to(torch.bfloat16)
    model.save_pretrained(path / "transformer")
    index = {
        "_class_name": "WanTransformerOnly",
        "transformer": ["diffusers", model.__class__.__name__],
    }
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--streamed", type=int, default=27)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--loads", type=int, default=11)
    args = parser.parse_args()

    import torch

    from ondeck.loading import ComponentLoader, components
    from ondeck.streaming import BlockStreamer, StreamLayout, describe_blocks, find_blocks
    from ondeck.streaming import streamer as streamer_module

    folder = build_folder(Path(tempfile.gettempdir()) / "ondeck-arm-cost")
    device = torch.device(args.device)
    template = ComponentLoader(folder, "transformer", dtype=torch.bfloat16).template
    sizes, tensors = describe_blocks(template, find_blocks(template.module))
    resident_count = BLOCKS - args.streamed
    resident = tuple(round((i + 0.5) * BLOCKS / resident_count) for i in range(resident_count))
    streamed = tuple(i for i in range(BLOCKS) if i not in resident)
    slot_bytes = max(sizes.packed_bytes[i] for i in streamed)
    layout = StreamLayout(
        sizes.path,
        BLOCKS,
        resident,
        streamed,
        args.slots,
        slot_bytes,
        0,
        sum(sizes.packed_bytes[i] for i in streamed),
    )
    streamer = BlockStreamer("transformer", sizes, tensors, device)
    streamer.use_layout(layout)
    loader = ComponentLoader(
        folder,
        "transformer",
        device=device,
        dtype=torch.bfloat16,
        placement=streamer,
        pipelined=False,
        progress=False,
    )
    armed: list[float] = []
    installed: list[float] = []
    released: list[float] = []
    arm, install = streamer_module._Armed.__init__, components._install

    def timed_arm(self, *arguments, **options):
        started = time.perf_counter()
        arm(self, *arguments, **options)
        armed.append(time.perf_counter() - started)

    def timed_install(*arguments, **options):
        started = time.perf_counter()
        install(*arguments, **options)
        installed.append(time.perf_counter() - started)

    streamer_module._Armed.__init__ = timed_arm
    components._install = timed_install
    try:
        for _ in range(args.loads):
            module = loader()
            started = time.perf_counter()
            streamer.unload(module)
            released.append(time.perf_counter() - started)
            del module
    finally:
        streamer_module._Armed.__init__ = arm
        components._install = install
    rows = {
        "install_seconds": installed[1:],
        "arm_seconds": armed[1:],
        "unload_seconds": released[1:],
        "install_median_ms": statistics.median(installed[1:]) * 1e3,
        "arm_median_ms": statistics.median(armed[1:]) * 1e3,
        "unload_median_ms": statistics.median(released[1:]) * 1e3,
    }
    fields = {"rows": rows, "streamed_blocks": len(streamed), "slots": args.slots}
    fields["tensors_per_block"] = len(tensors[0])
    write_document("arm_cost", fields)
    print(
        f"{len(streamed)} of {BLOCKS} blocks streamed, {args.slots} slots, "
        f"{len(tensors[0])} tensors a block, on {device}: installing "
        f"{rows['install_median_ms']:.1f} ms, arming {rows['arm_median_ms']:.1f} ms, "
        f"release {rows['unload_median_ms']:.1f} ms (medians of {args.loads - 1} loads)"
    )


if __name__ == "__main__":
    main()
