"""Tiny Wan folders for fp8 storage: as saved in float32, in bfloat16, and in float8."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ondeck.embedded import build_wan_folder

FP8 = torch.float8_e4m3fn


def resave(folder: Path, name: str, convert) -> None:
    """Rewrite a component's weight file with ``convert(key, tensor)`` applied."""
    for path in (folder / name).glob("*.safetensors"):
        tensors = {key: convert(key, tensor) for key, tensor in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def wan_fp32(tmp_path_factory) -> Path:
    """The tiny Wan folder as the embedded builder saves it: float32 files."""
    return build_wan_folder(tmp_path_factory.mktemp("fp8") / "fp32", preset="tiny")


@pytest.fixture(scope="session")
def wan_bf16(wan_fp32, tmp_path_factory) -> Path:
    """The same weights with the text encoder and transformer saved in bfloat16."""
    path = tmp_path_factory.mktemp("fp8") / "bf16"
    shutil.copytree(wan_fp32, path, dirs_exist_ok=True)
    for name in ("text_encoder", "transformer"):
        resave(path, name, lambda key, t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    return path


@pytest.fixture(scope="session")
def wan_float8(wan_bf16, tmp_path_factory) -> Path:
    """A transformer checkpoint already in float8: what diffusers' save_pretrained writes
    for a bfloat16 model after enable_layerwise_casting (norms and embeddings stay)."""
    from diffusers import WanTransformer3DModel

    path = tmp_path_factory.mktemp("fp8") / "float8"
    shutil.copytree(wan_bf16, path, dirs_exist_ok=True)
    model = WanTransformer3DModel.from_pretrained(
        wan_bf16 / "transformer", torch_dtype=torch.bfloat16
    )
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    stored = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    assert any(tensor.dtype == FP8 for tensor in stored.values())
    for old in (path / "transformer").glob("*.safetensors"):
        old.unlink()
    save_file(stored, str(path / "transformer" / "diffusion_pytorch_model.safetensors"))
    return path


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def transformer_inputs(config, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, config.in_channels, 2, 8, 8, generator=generator).to(dtype)
    text = torch.randn(1, 5, config.text_dim, generator=generator).to(dtype)
    return latents, torch.tensor([500]), text
