from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ondeck.embedded import PRESETS, build_wan_folder

BLOCKS = 6


def build_six_block_folder(path: Path, **transformer: int) -> Path:
    """The tiny Wan folder with a six-block transformer: enough blocks to keep some
    resident and stream the others. ``transformer`` overrides its config."""
    from diffusers import WanTransformer3DModel

    build_wan_folder(path, preset="tiny")
    # Wider than the tiny preset, so the transformer is the largest component.
    config = dict(
        PRESETS["tiny"]["transformer"], attention_head_dim=24, ffn_dim=96, num_layers=BLOCKS
    )
    config.update(transformer)
    generator = torch.Generator().manual_seed(1)
    transformer = WanTransformer3DModel(**config).eval()
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    for old in (path / "transformer").glob("*"):
        old.unlink()
    transformer.save_pretrained(path / "transformer")
    return path


@pytest.fixture(scope="session")
def six_block_folder(tmp_path_factory) -> Path:
    return build_six_block_folder(tmp_path_factory.mktemp("wan-six") / "tiny6")


def transformer_blocks(folder: Path):
    """The six-block transformer's sizes, from its meta skeleton (float32, as in the tests)."""
    from ondeck.loading import ModelFolder
    from ondeck.streaming import describe_blocks, find_blocks

    template = ModelFolder.open(folder).template("transformer", torch.float32)
    sizes, _ = describe_blocks(template, find_blocks(template.module))
    return sizes


def budget_keeping(sizes, resident: int, slots: int = 2) -> int:
    """The budget under which exactly ``resident`` blocks fit beside the slots."""
    return sizes.other_bytes + resident * max(sizes.block_bytes) + slots * max(sizes.packed_bytes)


@pytest.fixture
def file_reads(monkeypatch) -> list[str]:
    """Names of the tensors read from the files, in order."""
    from ondeck.loading import reads

    names: list[str] = []
    real = reads.read_into

    def read_into(jobs, **kwargs):
        names.extend(job.info.name for job in jobs)
        return real(jobs, **kwargs)

    monkeypatch.setattr(reads, "read_into", read_into)
    return names
