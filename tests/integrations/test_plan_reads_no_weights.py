"""``ondeck plan`` and ``ondeck inspect`` read headers and configs, never weight bytes."""

from __future__ import annotations

import pytest
import safetensors
import safetensors.torch
import torch

import ondeck
from ondeck import cli
from ondeck.loading import components as component_loading


class WeightRead(AssertionError):
    pass


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Every way ondeck, diffusers or transformers read tensor data raises."""

    def refuse(*args, **kwargs):
        raise WeightRead(f"weights were read: {args[:1]}")

    monkeypatch.setattr(component_loading.ComponentLoader, "begin", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors.torch, "load", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    monkeypatch.setattr(ModelMixin, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize("family", ["wan", "flux", "sd3"])
def test_plan_and_inspect_read_no_weights(family, folders, no_weight_reads, capsys):
    folder = folders[family]
    assert cli.main(["plan", str(folder)]) in (0, 1)
    assert cli.main(["inspect", str(folder)]) == 0
    plan = ondeck.plan(folder)
    assert plan.component_bytes and all(n > 0 for n in plan.component_bytes.values())
    out = capsys.readouterr().out
    assert "transformer" in out


def test_a_saved_wan_folder_plans_on_wans_stages(folders):
    from ondeck.folder_pipelines import pipeline_for_folder
    from ondeck.pipelines.wan import WanTextToVideo

    folder = folders["wan"]
    assert '"transformer_2"' in (folder / "model_index.json").read_text()
    assert isinstance(pipeline_for_folder(folder, device="cpu"), WanTextToVideo)
