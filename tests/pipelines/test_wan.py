"""The ondeck Wan pipeline against diffusers.WanPipeline on a tiny folder."""

from __future__ import annotations

import itertools
import json
import weakref

import numpy as np
import pytest
import torch
from references import assert_close_to_plain, in_fresh_tensors

import ondeck
from ondeck.cli import main as cli_main
from ondeck.embedded import build_wan_folder
from ondeck.pipelines.wan import WanTextToVideo

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return build_wan_folder(tmp_path_factory.mktemp("wan") / "tiny", preset="tiny")


PROMPTS = ("a fox", "a heron")


@pytest.fixture(scope="module")
def diffusers_frames(wan_folder):
    """diffusers.WanPipeline's frames: as it loads (``plain``), and with its weights in
    fresh tensors (``fresh``), as ondeck's are (see tests/references.py)."""
    from diffusers import WanPipeline

    reference = WanPipeline.from_pretrained(wan_folder, torch_dtype=torch.float32)

    def frames() -> dict:
        return {
            prompt: reference(
                prompt,
                negative_prompt="blurry",
                generator=torch.Generator("cpu").manual_seed(7),
                **SHAPE,
            ).frames
            for prompt in PROMPTS
        }

    plain = frames()
    in_fresh_tensors(reference)
    return {"plain": plain, "fresh": frames()}


def wan(folder, policy, **options):
    return WanTextToVideo.from_folder(
        folder, policy=policy, dtype=torch.float32, device="cpu", progress=False, **options
    )


@pytest.mark.parametrize("policy, options", [("release", {}), ("budget", {"budget": "1GiB"})])
def test_frames_match_diffusers_across_consecutive_runs(
    wan_folder, diffusers_frames, policy, options
):
    pipe = wan(wan_folder, policy, **options)
    for prompt in PROMPTS:
        frames = pipe.generate(prompt, negative_prompt="blurry", seed=7, **SHAPE)
        assert np.array_equal(frames, diffusers_frames["fresh"][prompt])
        assert_close_to_plain(frames, diffusers_frames["plain"][prompt], prompt)


def test_release_peak_is_below_the_sum_and_eager_peak_is_the_sum(wan_folder):
    released = wan(wan_folder, "release")
    released.generate("a fox", seed=0, **SHAPE)
    eager = wan(wan_folder, "eager")
    eager.generate("a fox", seed=0, **SHAPE)
    sizes = released.component_bytes()
    total = sum(sizes.values())
    assert released.tracker.peak_resident_bytes == max(sizes.values()) < total
    assert eager.tracker.peak_resident_bytes == total
    assert not any(ondeck.is_loaded(p) for p in released.deferred.values())


def test_decoding_does_not_hold_the_transformer(wan_folder):
    pipe = wan(wan_folder, "release")
    assert pipe.schedule == {
        "EncodePrompt": ["text_encoder"],
        "PrepareLatents": [],
        "Denoise": ["transformer"],
        "Decode": ["vae"],
    }


def test_building_and_preparing_latents_load_nothing(wan_folder):
    pipe = wan(wan_folder, "release")
    state = {
        "height": 32,
        "width": 32,
        "num_frames": 5,
        "device": torch.device("cpu"),
        "generator": torch.Generator().manual_seed(0),
    }
    state = pipe.stages[1](state)
    assert state["latents"].shape == (1, 16, 2, 4, 4)
    assert all(proxy.load_count == 0 for proxy in pipe.deferred.values())


def test_cached_prompt_does_not_reload_the_text_encoder(wan_folder):
    for policy, options in (("release", {}), ("budget", {"budget": "1GiB"})):
        pipe = wan(wan_folder, policy, **options)
        pipe.generate("a fox", seed=0, **SHAPE)
        if policy == "budget":
            pipe.components["text_encoder"].release()
        loads = pipe.components["text_encoder"].load_count
        pipe.generate("a fox", seed=1, **SHAPE)
        assert pipe.components["text_encoder"].load_count == loads
        assert pipe.prompt_cache.hits >= 1


def test_a_negative_prompt_kept_across_runs_is_encoded_once(wan_folder, monkeypatch):
    from ondeck.pipelines.wan import EncodePrompt

    encoded = []
    encode = EncodePrompt._encode

    def counting(self, prompt, state):
        encoded.append(prompt)
        return encode(self, prompt, state)

    monkeypatch.setattr(EncodePrompt, "_encode", counting)
    pipe = wan(wan_folder, "release")
    pipe.generate("a fox", negative_prompt="blurry", seed=0, **SHAPE)
    pipe.generate("a heron", negative_prompt="blurry", seed=0, **SHAPE)
    assert encoded == ["a fox", "blurry", "a heron"]
    loads = pipe.components["text_encoder"].load_count
    pipe.generate("a heron", negative_prompt="blurry", seed=1, **SHAPE)
    assert pipe.components["text_encoder"].load_count == loads  # nothing to encode
    pipe.generate("a heron", negative_prompt="grainy", seed=0, **SHAPE)
    pipe.generate("a heron", negative_prompt="", guidance_scale=1.0, seed=0, **SHAPE)
    assert encoded == ["a fox", "blurry", "a heron", "grainy"]


def test_budget_keeps_components_across_runs_and_loads_nothing_the_second_time(wan_folder):
    pipe = wan(wan_folder, "budget", budget="1GiB")
    pipe.generate("a fox", seed=0, **SHAPE)
    loaded = pipe.tracker.bytes_loaded
    pipe.generate("a heron", seed=0, **SHAPE)
    assert pipe.tracker.bytes_loaded == loaded
    assert all(ondeck.is_loaded(p) for p in pipe.deferred.values())


class LiveModules:
    """A transform on every component that adds up, at each load, the bytes the tensors of
    every component loaded so far still hold: what a release has really freed, not what
    the tracker was told."""

    def __init__(self):
        self.loaded: list[weakref.ref] = []
        self.peak_bytes = 0

    def __call__(self, module: torch.nn.Module) -> torch.nn.Module:
        self.loaded = [ref for ref in self.loaded if ref() is not None]
        self.loaded.append(weakref.ref(module))
        alive = [ref() for ref in self.loaded]
        held = sum(storage_bytes(module) for module in alive if module is not None)
        self.peak_bytes = max(self.peak_bytes, held)
        return module


def storage_bytes(module: torch.nn.Module) -> int:
    tensors = itertools.chain(module.parameters(), module.buffers())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_plan_predicts_the_resident_peak_measured_in_live_module_bytes(wan_folder):
    sizes = wan(wan_folder, "release").component_bytes()
    for policy, options, expected in (
        ("release", {}, max(sizes.values())),
        ("eager", {}, sum(sizes.values())),
        ("budget", {"budget": "1GiB"}, sum(sizes.values())),
    ):
        pipe = wan(wan_folder, policy, **options)
        live = LiveModules()
        for proxy in pipe.deferred.values():
            proxy.add_transform(live)
        pipe.generate("a fox", seed=0, **SHAPE)
        pipe.generate("a heron", seed=0, **SHAPE)
        assert live.peak_bytes == pipe.plan().peak_bytes == expected, policy


def test_missing_model_index_is_a_load_error_naming_the_file(tmp_path):
    with pytest.raises(ondeck.LoadError, match="model_index.json"):
        WanTextToVideo.from_folder(tmp_path)


def test_generate_command_writes_video_report_and_plot(wan_folder, tmp_path):
    out = tmp_path / "out"
    code = cli_main(
        [
            "generate",
            str(wan_folder),
            "--policy",
            "release",
            "--device",
            "cpu",
            "--height",
            "32",
            "--width",
            "32",
            "--frames",
            "5",
            "--steps",
            "2",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["peak_resident_bytes"] < report["sum_bytes"]
    assert (out / "video.mp4").stat().st_size > 0
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_command_reports_overflow_before_loading(wan_folder, capsys):
    code = cli_main(["plan", str(wan_folder), "--budget", "100KB", "--device", "cpu"])
    output = capsys.readouterr().out
    assert code == 1
    assert "does not fit" in output and "overflows by" in output


def test_a_side_beyond_the_transformers_positions_is_refused_before_loading(wan_folder):
    """The tiny transformer has 32 rotary positions per axis (``rope_max_seq_len``): 528
    pixels are 33 patches of 16. diffusers' forward would fail with a shape error."""
    pipe = wan(wan_folder, "release")
    with pytest.raises(ValueError, match=r"width: 528 .* 33 patches .* at most 512"):
        pipe.generate("a fox", height=32, width=528, num_frames=5, num_inference_steps=1)
    assert pipe.tracker.bytes_loaded == 0
    frames = pipe.generate("a fox", height=32, width=512, num_frames=5, num_inference_steps=1)
    assert frames.shape[2:4] == (32, 512)
