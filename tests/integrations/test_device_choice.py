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
