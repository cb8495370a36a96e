"""``auto`` on a device of any size: never a policy whose plan does not fit it.

The device's size is faked through its one seam, ``ondeck.memory.device_facts``; the
folder is the tiny Wan pipeline as diffusers' ``save_pretrained`` writes it.
"""

from __future__ import annotations

import pytest
import torch

import ondeck
from ondeck import memory
from ondeck.lazy import is_loaded
from ondeck.pipelines.wan import WanTextToVideo

# auto keeps max(1 GiB, 8 % of the card) free; the fake cards below are small enough
# that the 1 GiB floor applies, so a card offers its free bytes less 1 GiB.
GIB = 1 << 30
CALL = {
    "prompt": "a fox",
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "seed": 0,
}


def fake_card(monkeypatch, budget_bytes: int) -> None:
    """A discrete card whose ``auto`` budget is ``budget_bytes``."""

    def facts(device=None):
        return memory.DeviceFacts("cuda:9", False, 2 * GIB, GIB + budget_bytes)

    monkeypatch.setattr(memory, "device_facts", facts)


@pytest.fixture
def sizes(saved_wan_folder) -> dict[str, int]:
    return ondeck.plan(saved_wan_folder, policy="release").component_bytes


def build(folder) -> WanTextToVideo:
    return WanTextToVideo.from_folder(folder, device="cpu", progress=False)


def test_everything_fits_keeps_everything(monkeypatch, saved_wan_folder, sizes):
    fake_card(monkeypatch, 4 * sum(sizes.values()))
    pipe = build(saved_wan_folder)
    assert pipe.policy.name == "budget"
    assert "fit" in pipe.policy.reason
    pipe.generate(**CALL)
    assert all(is_loaded(proxy) for proxy in pipe.deferred.values())


def test_largest_stage_fits_budget_or_release_by_bytes_loaded(monkeypatch, saved_wan_folder, sizes):
    # Room for the transformer and the VAE beside it, not for the text encoder as well.
    fake_card(monkeypatch, sizes["transformer"] + sizes["vae"] + sizes["text_encoder"] // 2)
    pipe = build(saved_wan_folder)
    assert pipe.policy.name in ("budget", "release")
    assert "the largest stage does" in pipe.policy.reason
    assert "per run" in pipe.policy.reason
    plan = pipe.plan()
    assert not plan.streamed and plan.fits()
    frames = pipe.generate(**CALL)
    assert frames is not None
    assert not all(is_loaded(proxy) for proxy in pipe.deferred.values())


def test_a_component_too_large_for_the_card_streams(monkeypatch, saved_wan_folder, sizes):
    fake_card(monkeypatch, int(sizes["transformer"] * 0.6))
    pipe = build(saved_wan_folder)
    assert pipe.policy.name == "budget"
    assert "streaming" in pipe.policy.reason
    plan = pipe.plan()
    assert "transformer" in plan.streamed and plan.fits()
    assert pipe.generate(**CALL) is not None
    assert pipe.policy.streaming.stats()["transformer"]["passes"] > 0


def test_a_text_encoder_too_large_streams_too(monkeypatch, saved_wan_folder, sizes):
    fake_card(monkeypatch, int(sizes["text_encoder"] * 0.6))
    pipe = build(saved_wan_folder)
    assert "text_encoder" in pipe.plan().streamed


def test_nothing_fits_refuses_before_reading_a_byte(monkeypatch, saved_wan_folder, sizes):
    fake_card(monkeypatch, 4096)
    pipe = build(saved_wan_folder)
    assert "does not fit" in pipe.policy.reason
    with pytest.raises(ondeck.BudgetError, match="lower resolution") as raised:
        pipe.generate(**CALL)
    assert "nothing was loaded" in str(raised.value)
    assert not any(is_loaded(proxy) for proxy in pipe.deferred.values())
    assert [event for event in pipe.tracker.events if event.kind == "load"] == []


def test_the_cli_names_autos_choice(monkeypatch, saved_wan_folder, sizes, capsys):
    from ondeck import cli

    fake_card(monkeypatch, int(sizes["transformer"] * 0.6))
    assert cli.main(["plan", str(saved_wan_folder)]) == 0
    out = capsys.readouterr().out
    assert "streaming" in out


def test_unknown_sizes_release(monkeypatch):
    from tests.core.helpers import ThreeStages, three_loaders

    fake_card(monkeypatch, GIB)
    pipe = ThreeStages(three_loaders())
    assert pipe.policy.name == "release"
    assert "unknown sizes" in pipe.policy.reason
    assert pipe.policy.prefetch_next_run
    assert not ThreeStages(three_loaders(), prefetch=False).policy.prefetch_next_run


def test_device_facts_is_the_seam(monkeypatch):
    fake_card(monkeypatch, 12345)
    from ondeck.policy import auto_budget_bytes

    assert auto_budget_bytes(torch.device("cpu")) == (12345, False)
