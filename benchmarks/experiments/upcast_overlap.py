"""What computing with fp8-stored weights costs over bf16 weights, per transformer block:
torch's upcast, ondeck's Triton upcast, and an upcast ahead on a second stream.

    python benchmarks/experiments/upcast_overlap.py [--blocks 10] [--passes 4] [--repeats 5]
        [--arms bf16,fp8,fp8-kernel]

A Wan 2.1 14B-shaped block's work at 480x832, 33 frames (14,040 tokens, 512 text
tokens): self-attention's four 5120x5120 projections and its attention, the
cross-attention's projections and attention, the feed-forward's 5120->13824->5120,
with random weights on the device. Arms, each over ``--blocks`` distinct blocks run
``--passes`` times (a call's passes), in turn ``--repeats`` times:

- ``bf16``: the weights in bf16 (what eager computes);
- ``fp8``: the weights stored in float8_e4m3fn, each layer's weight upcast to bf16 by
  torch's ``tensor.to`` just before its product;
- ``fp8-kernel``: the same, upcast by ``ondeck.loading.upcast`` (the Triton kernel the
  stored layers' hooks use);
- ``fp8-ahead``: torch's upcast, each layer's next one in the block upcast on a second
  stream while this one computes (its destination allocated on the compute stream, the
  second stream ordered after the work queued so far), the compute stream waiting for it.

Medians of seconds per pass, and each fp8 arm's excess over bf16 per block; then the
upcasts alone, every weight of the blocks by torch and by the kernel (checked to give
the same bits): GB/s of float8 bytes read and bf16 bytes written. Writes
upcast_overlap.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ondeck.loading.upcast import upcast  # noqa: E402

DIM, FFN, HEADS, TOKENS, TEXT = 5120, 13824, 40, 14040, 512
# (name, in, out, input): the layers in call order; input "x" is the hidden states,
# "ctx" the text's.
LAYERS = [
    ("q1", DIM, DIM, "x"), ("k1", DIM, DIM, "x"), ("v1", DIM, DIM, "x"), ("o1", DIM, DIM, "a"),
    ("q2", DIM, DIM, "x"), ("k2", DIM, DIM, "ctx"), ("v2", DIM, DIM, "ctx"), ("o2", DIM, DIM, "a"),
    ("up", DIM, FFN, "x"), ("down", FFN, DIM, "h"),
]  # fmt: skip


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(1, t.shape[0], HEADS, DIM // HEADS).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
    return out.transpose(1, 2).reshape(q.shape[0], DIM)


def torch_cast(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.bfloat16)


def kernel_cast(weight: torch.Tensor) -> torch.Tensor:
    return upcast(weight, torch.bfloat16)


class Upcaster:
    """Gives each layer's weight in bf16: cast now, or (``ahead``) the one cast while the
    layer before computed."""

    def __init__(self, ahead: bool, cast=torch_cast):
        self.ahead, self.cast = ahead, cast
        self.side = torch.cuda.Stream()
        self.pending: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def weight(self, block: list[torch.Tensor], index: int) -> torch.Tensor:
        stored = block[index]
        if index in self.pending:
            ready, event = self.pending.pop(index)
            torch.cuda.current_stream().wait_event(event)
        else:
            ready = self.cast(stored)
        if self.ahead and index + 1 < len(block):
            following = block[index + 1]
            destination = torch.empty(following.shape, dtype=torch.bfloat16, device="cuda")
            queued = torch.cuda.Event()
            queued.record()
            self.side.wait_event(queued)
            with torch.cuda.stream(self.side):
                destination.copy_(following)
                done = torch.cuda.Event()
                done.record()
            self.pending[index + 1] = (destination, done)
        return ready


def block_pass(block: list[torch.Tensor], x: torch.Tensor, ctx: torch.Tensor, weight) -> None:
    values: dict[str, torch.Tensor] = {"x": x, "ctx": ctx}
    for index, (name, _, _, source) in enumerate(LAYERS):
        if name == "o1":
            values["a"] = attention(values["q1"], values["k1"], values["v1"])
        elif name == "o2":
            values["a"] = attention(values["q2"], values["k2"], values["v2"])
        elif name == "down":
            values["h"] = F.gelu(values["up"], approximate="tanh")
        values[name] = F.linear(values[source], weight(block, index))


def run_arm(arm: str, blocks: dict[str, list[list[torch.Tensor]]], passes: int) -> float:
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, device="cuda")
    ctx = torch.randn(TEXT, DIM, dtype=torch.bfloat16, device="cuda")
    if arm == "bf16":
        chosen = blocks["bf16"]

        def weight(block, index):
            return block[index]
    else:
        chosen = blocks["fp8"]
        cast = kernel_cast if arm == "fp8-kernel" else torch_cast
        weight = Upcaster(ahead=arm == "fp8-ahead", cast=cast).weight
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(passes):
        for block in chosen:
            block_pass(block, x, ctx, weight)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arms", default="bf16,fp8,fp8-kernel")
    args = parser.parse_args()
    torch.manual_seed(0)
    fp8 = [
        [
            (torch.randn(out, inp, device="cuda") * 0.02).to(torch.float8_e4m3fn)
            for _, inp, out, _ in LAYERS
        ]
        for _ in range(args.blocks)
    ]
    blocks = {"fp8": fp8, "bf16": [[w.to(torch.bfloat16) for w in block] for block in fp8]}
    arms = args.arms.split(",")
    for arm in arms:  # warm-up: the kernels' first calls
        run_arm(arm, blocks, 1)
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in arms[repeat % len(arms) :] + arms[: repeat % len(arms)]:
            seconds[arm].append(run_arm(arm, blocks, args.passes))
    medians = {arm: statistics.median(values) for arm, values in seconds.items()}
    rates = cast_rates(fp8, args.repeats)
    result = {
        "device": torch.cuda.get_device_name(),
        "blocks": args.blocks,
        "passes": args.passes,
        "seconds_per_pass": seconds,
        "median_seconds_per_pass": medians,
        "cast_gb_per_s": rates,
    }
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "upcast_overlap.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    print(f"{'arm':<10} {'s/pass':>8} {'ms/block':>9} {'over bf16, ms/block':>20}")
    for arm in arms:
        per_block = medians[arm] / args.blocks * 1000
        excess = (medians[arm] - medians["bf16"]) / args.blocks * 1000
        print(f"{arm:<10} {medians[arm]:>8.4f} {per_block:>9.2f} {excess:>20.3f}")
    print("the casts alone, GB/s of bytes read and written:", end="")
    print("".join(f"  {name} {rate:.0f}" for name, rate in rates.items()))


def cast_rates(fp8: list[list[torch.Tensor]], repeats: int) -> dict[str, float]:
    """Median GB/s (float8 bytes read plus bf16 bytes written) of upcasting every weight
    of the blocks, by torch and by the kernel; the two give the same bits (checked)."""
    weights = [w for block in fp8 for w in block]
    moved = sum(w.numel() * 3 for w in weights)
    casts = {"torch": torch_cast, "kernel": kernel_cast}
    for w in weights[:2]:
        if not torch.equal(
            casts["torch"](w).view(torch.int16), casts["kernel"](w).view(torch.int16)
        ):
            raise SystemExit("the kernel's upcast differs from torch's")
    rates: dict[str, list[float]] = {name: [] for name in casts}
    for _ in range(repeats):
        for name, cast in casts.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            for w in weights:
                cast(w)
            torch.cuda.synchronize()
            rates[name].append(moved / (time.perf_counter() - started) / 1e9)
    return {name: statistics.median(values) for name, values in rates.items()}


if __name__ == "__main__":
    main()
