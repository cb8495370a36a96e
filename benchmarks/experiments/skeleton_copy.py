"""What copying a large model's skeleton costs: ``copy.deepcopy`` against ondeck's
``copy_module``, on the CPU (no weights: every model is built on the meta device).

    python benchmarks/experiments/skeleton_copy.py [--repeats 5]

An SD3.5 Large-shaped transformer, a Wan 2.1 14B-shaped transformer and T5-XXL; the
median seconds of each way of copying, interleaved. Prints a table; writes
skeleton_copy.json to $OUT.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import umt5_xxl_config, write_document  # noqa: E402
from families import SD35_TRANSFORMER  # noqa: E402


def models() -> dict:
    import torch
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    with torch.device("meta"):
        return {
            "SD3.5 Large-shaped transformer": SD3Transformer2DModel(**SD35_TRANSFORMER),
            "Wan 2.1 14B-shaped transformer": WanTransformer3DModel(),  # its default: 14B
            "UMT5-XXL encoder": UMT5EncoderModel(umt5_xxl_config()),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from ondeck.loading.skeleton import copy_module

    rows = []
    for name, module in models().items():
        times: dict[str, list[float]] = {"deepcopy": [], "copy_module": []}
        for _ in range(args.repeats):
            for way, copier in (("deepcopy", copy.deepcopy), ("copy_module", copy_module)):
                started = time.perf_counter()
                copier(module)
                times[way].append(time.perf_counter() - started)
        rows.append({"model": name, **{way: statistics.median(t) for way, t in times.items()}})
    write_document("skeleton_copy", {"repeats": args.repeats, "rows": rows})
    print(f"{'model':<32} {'deepcopy s':>10} {'copy_module s':>13} {'ratio':>6}")
    for row in rows:
        ratio = row["deepcopy"] / row["copy_module"]
        print(
            f"{row['model']:<32} {row['deepcopy']:>10.3f} {row['copy_module']:>13.3f} {ratio:>6.1f}"
        )


if __name__ == "__main__":
    main()
