"""A CUDA device asked of ``from_pretrained`` where torch has none is one clear error,
made before any component is deferred, not torch's bare assertion at the first call."""

from __future__ import annotations

import pytest
import torch

import ondeck.diffusers


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_says_so_and_what_to_use(folders, monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"CUDA is not available here .*use device='cpu'"):
        ondeck.diffusers.from_pretrained(folders["flux"], device=device)


def test_moving_a_pipeline_to_cuda_without_cuda_says_so_and_changes_nothing(folders, monkeypatch):
    """``pipe.to("cuda")`` is refused as ``from_pretrained(device="cuda")`` is, at once
    (diffusers' own ``to`` refuses it there too), and the pipeline stays usable."""
    from .tiny_pipelines import FAMILIES, run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pipe = ondeck.diffusers.from_pretrained(folders["flux"], device="cpu", policy="release")
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match=r"CUDA is not available here"):
        pipe.to("cuda")
    assert pipe.ondeck.device == torch.device("cpu")
    assert run(pipe, FAMILIES["flux"]) is not None


def test_mps_without_mps_says_so_before_anything_is_deferred(folders, monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'mps' asked for, but Apple's Metal \(mps\) is not"):
        ondeck.diffusers.from_pretrained(folders["flux"], device="mps")
