"""What a release and a reload must keep: the adapters and scales last asked for, each
applied once, and nothing half-applied after a failure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .conftest import frames, load

pytest.importorskip("peft")


def _plain(base, lora):
    """Plain diffusers over ``base``, every weight resident, the LoRA loaded as "style"."""
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(base, dtype=torch.float32)
    plain.load_lora_weights(str(lora), adapter_name="style")
    plain.set_progress_bar_config(disable=True)
    return plain


def _plain_frames(plain):
    from references import in_fresh_tensors

    return frames(in_fresh_tensors(plain))


def _after_unfusing_set_to_zero(pipe):
    pipe.unfuse_lora()
    pipe.set_adapters(["style"], [0.0])


def _after_unfusing_unloaded(pipe):
    pipe.unfuse_lora()
    pipe.unload_lora_weights()


@pytest.mark.parametrize(
    "after", [_after_unfusing_set_to_zero, _after_unfusing_unloaded], ids=["set_to_zero", "unload"]
)
@pytest.mark.parametrize("policy", ["release", "budget"])
def test_the_pipelines_unfuse_lora_is_kept_after_a_reload(
    base, lora_files, reference, policy, after
):
    """``pipe.unfuse_lora()`` (diffusers' own, through the pipeline) takes the fused delta
    out; every later call, after a release and a reload, must not have it back."""
    plain = _plain(base, lora_files["diffusers"])
    plain.fuse_lora(lora_scale=0.5)
    fused = _plain_frames(plain)
    after(plain)
    expected = _plain_frames(plain)
    assert np.allclose(expected, reference, atol=1e-5), "no LoRA left in diffusers"

    pipe = load(base, policy)
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    assert np.array_equal(frames(pipe), fused)
    after(pipe)
    for call in range(3):
        output = frames(pipe)
        assert not np.array_equal(output, fused), f"call {call + 1}: the fused delta is back"
        assert np.array_equal(output, expected), f"call {call + 1}"
        pipe.ondeck.release_all()


@pytest.fixture
def fill_held_after_first_block(monkeypatch):
    """Pipelined loads of the transformer, one block a group, whose blocks after the first
    arrive only once the returned event is set (a load still filling, as a prefetch
    leaves it between two calls)."""
    import threading

    from ondeck.loading import components, pipelined
    from ondeck.loading.components import ComponentLoader

    monkeypatch.setattr(components, "MIN_PIPELINED_BYTES", 1)
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)
    gate = threading.Event()
    real = ComponentLoader._group_filler

    def held(self, *args, **kwargs):
        fill, _, finished, reads_back = real(self, *args, **kwargs)
        groups = [0]

        def fill_one(group):
            groups[0] += 1
            if groups[0] > 1:
                assert gate.wait(10), "the test never let the fill go on"
            fill(group)

        return fill_one, None, finished, reads_back

    monkeypatch.setattr(ComponentLoader, "_group_filler", held)
    # Whatever waits for the fill lets it go on (else it would wait for the gate forever).
    from ondeck.lazy import LazyModule

    complete = LazyModule._complete_filling

    def complete_filling(self):
        gate.set()
        return complete(self)

    monkeypatch.setattr(LazyModule, "_complete_filling", complete_filling)
    return gate


@pytest.mark.parametrize("policy", ["release", "budget"])
def test_a_fuse_recorded_while_the_blocks_still_arrive_is_not_overwritten(
    base, lora_files, fill_held_after_first_block, policy
):
    """A recorded call made while a pipelined load of the component is still bringing its
    blocks in (a prefetch for the next call) must act on the weights from the files, not
    on memory the fill overwrites afterwards."""
    plain = _plain(base, lora_files["diffusers"])
    plain.fuse_lora(lora_scale=0.5)
    expected = _plain_frames(plain)

    pipe = load(base, policy)
    pipe.transformer.materialize(complete=False)
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.transformer.fuse_lora(lora_scale=0.5)
    fill_held_after_first_block.set()

    assert np.array_equal(frames(pipe), expected), "the call that follows"
    pipe.ondeck.release_all()
    assert np.array_equal(frames(pipe), expected), "after a reload"


@pytest.fixture(scope="module")
def lora_bad_last_layer(lora_files, tmp_path_factory):
    """The diffusers-layout LoRA with a non-finite factor in the last block's last layer:
    a safe fuse refuses it only after fusing the layers before it."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(lora_files["diffusers"]))
    last = max(key for key in state if key.startswith("transformer.blocks.5.ffn.net.2"))
    state[last] = state[last].clone()
    state[last][0, 0] = float("inf")
    path = tmp_path_factory.mktemp("lora-bad") / "lora_bad.safetensors"
    save_file(state, str(path))
    return path


def test_a_fuse_that_fails_on_a_loaded_component_leaves_no_layer_fused(
    base, lora_bad_last_layer, reference
):
    """A recorded call that raises on the loaded component is not kept; the module it
    failed on must not keep what it did before failing either: the output after it is
    the output after the next reload."""
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_bad_last_layer), adapter_name="style")
    pipe.transformer.materialize()
    with pytest.raises(ValueError):
        pipe.transformer.fuse_lora(lora_scale=0.5, safe_fusing=True)
    pipe.unload_lora_weights()

    first = frames(pipe)
    pipe.ondeck.release_all()
    assert np.array_equal(frames(pipe), reference), "reloaded: no LoRA"
    assert np.array_equal(first, reference), "the loaded module kept half a fuse"
