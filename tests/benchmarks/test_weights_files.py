"""benchmarks/weights.py's files: the bf16 transformer moved between the folder's shards
and one original-key file without changing a byte of any tensor, and its Q8_0 being the
gguf package's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def weights(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for name in ("common", "weights"):
        sys.modules.pop(name, None)
    import weights

    yield weights
    for name in ("common", "weights"):
        sys.modules.pop(name, None)


def contents(work, weights) -> dict[str, torch.Tensor]:
    return {
        key: weights.read_tensor(info) for key, info in weights.transformer_tensors(work).items()
    }


def test_the_transformer_moves_between_its_layouts_byte_for_byte(weights, tmp_path, monkeypatch):
    work = weights.Work(tmp_path)
    weights.tiny_folder(work.folder)
    before = contents(work, weights)
    assert work.layout() == "folder"

    weights.to_single_file(work)
    assert work.layout() == "file" and not work.shards()
    in_file = contents(work, weights)
    monkeypatch.setattr(weights, "SHARD_BYTES", 150_000)
    weights.to_folder(work)
    assert work.layout() == "folder" and len(work.shards()) > 2, "shards of at most 150 kB"
    assert not work.file("bf16").exists()
    in_shards = contents(work, weights)

    for moved in (in_file, in_shards):
        assert moved.keys() == before.keys()
        for key, tensor in before.items():
            assert moved[key].dtype == tensor.dtype and torch.equal(moved[key], tensor), key


def test_q8_0_is_the_gguf_packages(weights):
    gguf = pytest.importorskip("gguf")
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(6, 96, generator=generator) * torch.logspace(-3, 2, 96)
    tensor[2, :32] = 0  # a block of zeros: scale 0
    tensor[3, :32] = torch.arange(-16, 16) + 0.5  # half steps: rounded away from zero
    tensor[3, 0] = 127  # so that the block's scale is 1
    tensor = tensor.to(torch.bfloat16)

    ours = weights.quantize_q8_0(tensor).numpy()

    expected = gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.dtype == expected.dtype and (ours == expected).all()
