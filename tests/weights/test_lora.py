"""LoRA on every kind of weights and under every policy: applied once per load, never twice."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import ondeck

from .conftest import frames, load, reference_frames, streamed_passes

pytest.importorskip("peft")

POLICIES = ["eager", "release", "budget", "streaming"]


@pytest.fixture(scope="module")
def lora_reference(base, lora_files):
    return reference_frames(base, loras=[(lora_files["diffusers"], 0.7)])


@pytest.mark.parametrize("layout", ["diffusers", "musubi"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_lora_file_gives_diffusers_frames_under_each_policy(
    base, lora_files, lora_reference, reference, policy, layout
):
    pipe = load(base, policy, loras=[(lora_files[layout], 0.7)])
    assert ondeck.is_loaded(pipe.transformer) == (policy == "eager"), "recorded, not loaded"

    first = frames(pipe)
    assert not np.array_equal(first, reference), "the LoRA changes the output"
    assert np.array_equal(first, lora_reference)
    assert np.array_equal(frames(pipe), lora_reference), "the same after a reload"
    if policy == "streaming":
        assert streamed_passes(pipe) > 0


def test_a_lora_file_written_again_after_loading_changes_nothing(base, lora_files, tmp_path):
    """As plain diffusers: the LoRA is what the file held when it was loaded, at every
    reload (a trainer writes its LoRA file again at each checkpoint)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "lora.safetensors"
    tensors = load_file(str(lora_files["diffusers"]))
    save_file(tensors, str(path))
    pipe = load(base, "release")
    pipe.load_lora_weights(str(path), adapter_name="style")
    first = frames(pipe)

    other = tmp_path / "other.safetensors"
    save_file({name: tensor * 3 for name, tensor in tensors.items()}, str(other))
    with open(path, "r+b") as file:  # the same file, its bytes written again
        file.write(other.read_bytes())
    assert np.array_equal(frames(pipe), first)
    assert pipe.transformer.load_count == 2, "the transformer was loaded again"


def test_what_diffusers_logs_loading_a_lora_is_said_once_not_at_every_reload(
    base, lora_files, caplog, tmp_path
):
    """diffusers warns of keys a second adapter left (each name's own) when it loads; a
    plain pipeline says it once, and so does a pipeline that loads it again per call."""
    second = tmp_path / "second.safetensors"
    second.write_bytes(lora_files["diffusers"].read_bytes())
    pipe = load(base, "release")

    def said() -> int:
        return sum("Loading adapter weights" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="diffusers"):
        pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="a")
        pipe.load_lora_weights(str(second), adapter_name="b")
        assert said() == 1, "said when loaded"
        frames(pipe)
        frames(pipe)
        assert said() == 1, "not again at each reload"
    assert pipe.transformer.load_count == 2


def test_a_lora_on_an_original_key_single_file(base, original_file, lora_files, lora_reference):
    pipe = load(
        base,
        "release",
        components={"transformer": original_file},
        loras=[(lora_files["musubi"], 0.7)],
    )

    assert np.array_equal(frames(pipe), lora_reference)
    assert np.array_equal(frames(pipe), lora_reference)


@pytest.mark.parametrize("policy", ["release", "streaming"])
def test_a_lora_on_a_float8_file(base, float8, lora_files, policy):
    expected = reference_frames(float8[1], loras=[(lora_files["diffusers"], 1.0)])
    pipe = load(
        base, policy, components={"transformer": float8[0]}, loras=[lora_files["diffusers"]]
    )

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)


@pytest.mark.parametrize("policy", ["release", "budget", "streaming"])
def test_a_lora_on_weights_kept_in_fp8(base, lora_files, lora_reference, policy):
    """``storage_dtype="fp8"`` under a LoRA: the LoRA's layers compute beside the fp8
    weights upcast per layer. Every policy gives eager's frames, twice (the LoRA is not
    applied again at a reload); they differ from the fp8 frames without the LoRA and from
    diffusers' full-precision LoRA frames."""
    stored, lora = {"transformer": "fp8"}, [(lora_files["diffusers"], 0.7)]
    expected = frames(load(base, "eager", storage_dtype=stored, loras=lora))
    without = frames(load(base, "eager", storage_dtype=stored))
    pipe = load(base, policy, storage_dtype=stored, loras=lora)

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected), "the same after a reload"
    if policy == "streaming":
        assert streamed_passes(pipe) > 0
    assert not np.array_equal(expected, without), "the LoRA changes the fp8 frames"
    assert not np.array_equal(expected, lora_reference), "the weights were kept in fp8"


def test_two_loras_each_at_its_own_scale(base, lora_files):
    loras = [(lora_files["diffusers"], 0.7), (lora_files["musubi"], 0.2)]
    expected = reference_frames(base, loras=loras)
    assert not np.array_equal(expected, reference_frames(base, loras=loras[:1]))
    pipe = load(base, "release", loras=loras)

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected), "each applied once after a reload"


def _fused_reference(base, lora):
    from diffusers import WanPipeline
    from references import in_fresh_tensors

    plain = WanPipeline.from_pretrained(base, dtype=torch.float32)
    plain.load_lora_weights(str(lora), adapter_name="style")
    plain.fuse_lora(lora_scale=0.5)
    plain.unload_lora_weights()
    plain.set_progress_bar_config(disable=True)
    return frames(in_fresh_tensors(plain))


@pytest.mark.parametrize("policy", ["release", "budget"])
def test_a_fused_lora_is_fused_once_per_load(base, lora_files, policy):
    expected = _fused_reference(base, lora_files["diffusers"])
    pipe = load(base, policy)
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    pipe.unload_lora_weights()

    for call in range(3):
        pipe.ondeck.release_all()
        assert np.array_equal(frames(pipe), expected), f"call {call + 1}"


def test_fusing_a_lora_into_a_streamed_component_is_refused_not_lost(base, lora_files):
    pipe = load(base, "streaming")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)

    with pytest.raises(
        ondeck.OndeckError, match="streams its blocks, and fuse_lora would"
    ) as refused:
        frames(pipe)
    # The refusal as the policies that load before fuse_lora make it, not a failed load.
    assert "applying transforms after load failed" not in str(refused.value)


@pytest.fixture
def cache_on_cpu(monkeypatch):
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    return HostCache(budget_bytes=2**30, pin=False)


def test_the_host_cache_holds_weights_before_lora_and_the_lora_is_applied_again(
    base, lora_files, cache_on_cpu
):
    expected = _fused_reference(base, lora_files["diffusers"])
    pipe = load(base, "release", host_cache=cache_on_cpu)
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    assert loader.last_source == "host cache"
    # Changing the adapters needs no new cache entry: the entry is the file's bytes, and
    # each load replays the calls in order (unfusing subtracts what fusing added, to
    # rounding).
    pipe.unfuse_lora()
    pipe.set_adapters(["style"], [0.0])
    assert np.allclose(frames(pipe), reference_frames(base), atol=1e-5)
    assert loader.last_source == "host cache"


def test_compile_repeated_blocks_is_replayed_after_every_reload(base, reference):
    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(len(example_inputs))
        return graph.forward

    pipe = load(base, "release")
    pipe.transformer.compile_repeated_blocks(backend=counting_backend, fullgraph=False)
    assert not ondeck.is_loaded(pipe.transformer)
    seen = []
    pipe.transformer.add_transform(lambda module: seen.append(module) or module)

    assert np.array_equal(frames(pipe), reference)
    assert compiled, "the loaded transformer's blocks were compiled"
    graphs = len(compiled)
    assert np.array_equal(frames(pipe), reference)
    assert pipe.transformer.load_count == 2
    # The reloaded blocks are fresh modules of the same class with tensors of the same
    # shapes and dtypes: torch.compile's cache serves them, nothing compiles again.
    assert len(compiled) == graphs, "a reload compiles nothing new"
    assert len(seen) == 2 and seen[0] is not seen[1], "two loads, two fresh modules"
    for module in seen:
        assert all(block._compiled_call_impl is not None for block in module.blocks)
        assert module._compiled_call_impl is None, "the blocks, not the whole model"


def test_compile_is_replayed_after_every_reload(base, reference):
    pipe = load(base, "release")
    pipe.transformer.compile(backend="eager")
    seen = []
    pipe.transformer.add_transform(lambda module: seen.append(module) or module)

    assert np.array_equal(frames(pipe), reference)
    assert np.array_equal(frames(pipe), reference)
    assert len(seen) == 2 and all(module._compiled_call_impl is not None for module in seen)


@pytest.mark.parametrize("policy", ["release", "budget"])
def test_a_lora_goes_on_both_experts_of_a_two_transformer_pipeline(two_experts, lora_files, policy):
    expected = reference_frames(
        two_experts, loras=[(lora_files["diffusers"], 0.7)], transformer_2=True
    )
    without = reference_frames(two_experts)
    pipe = load(two_experts, policy, loras=[(lora_files["musubi"], 0.7)])

    assert not np.array_equal(expected, without)
    first_only = reference_frames(two_experts, loras=[(lora_files["diffusers"], 0.7)])
    assert not np.array_equal(first_only, expected), "the second expert computes too"
    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    assert pipe.transformer.known_adapters() == pipe.transformer_2.known_adapters() != []


def test_a_lora_for_other_shapes_is_refused_when_given_not_dropped_later(base, weights, tmp_path):
    """A LoRA trained on a wider model of the same family (its feed-forward factors 64
    wide, the model's 96): refused when it is given, naming the file, as plain diffusers
    refuses it at load_lora_weights. Checked on the weightless skeleton, so nothing loads;
    before, the first run failed at the transformer's load and later runs went on without
    the LoRA."""
    from safetensors.torch import save_file

    from ondeck.errors import LoadError

    from .conftest import lora_state

    wider = {}
    for key, tensor in weights.items():
        if ".ffn.net.0.proj.weight" in key:
            tensor = torch.zeros(64, tensor.shape[1])
        elif ".ffn.net.2.weight" in key:
            tensor = torch.zeros(tensor.shape[0], 64)
        wider[key] = tensor
    layout = {}
    for layer, (down, up) in lora_state(wider).items():
        layout[f"transformer.{layer}.lora_A.weight"] = down
        layout[f"transformer.{layer}.lora_B.weight"] = up
    path = tmp_path / "lora_for_a_wider_model.safetensors"
    save_file(layout, str(path))

    with pytest.raises(LoadError, match=r"lora_for_a_wider_model.*size mismatch"):
        load(base, "release", loras=[path])
    pipe = load(base, "release")
    with pytest.raises(RuntimeError, match="size mismatch"):
        pipe.load_lora_weights(str(path), adapter_name="wider")
    assert pipe.ondeck.deferred["transformer"].load_count == 0
    assert np.array_equal(frames(pipe), reference_frames(base))  # nothing of it was kept


def test_the_plan_counts_a_loras_layers_before_anything_loads(base, lora_files):
    """A LoRA's layers are bytes a load holds: the plan counts them from the skeleton it
    was tried on, before the component ever loads (a rank-128 LoRA on a 14B transformer
    is hundreds of MB the plan would otherwise leave out)."""

    without = load(base, "release").ondeck.plan().component_bytes["transformer"]
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    planned = pipe.ondeck.plan().component_bytes["transformer"]
    assert not ondeck.is_loaded(pipe.transformer)
    adapters = planned - without

    # Moved before it loads (a new loader, a new spec), it still counts them.
    plain = load(base, "release")
    for each in (plain, pipe):
        each.transformer.to(torch.float64)
    moved = plain.ondeck.plan().component_bytes["transformer"]
    assert (
        moved != without and pipe.ondeck.plan().component_bytes["transformer"] == moved + adapters
    )
    for each in (plain, pipe):
        each.transformer.to(torch.float32)

    frames(pipe)
    assert planned == pipe.ondeck.report()["component_bytes"]["transformer"] > without


def test_autos_reason_counts_a_loras_layers(base, lora_files):
    """``auto`` chooses once the LoRAs given are on the components: the sizes its reason
    quotes are the plan's, the LoRA's layers in them."""
    from ondeck.memory import format_bytes

    pipe = load(base, "auto", loras=[lora_files["diffusers"]])
    without = load(base, "auto")
    total = sum(pipe.ondeck.component_bytes().values())
    assert total > sum(without.ondeck.component_bytes().values())
    assert f"components ({format_bytes(total)})" in pipe.ondeck.policy.reason


def test_the_calls_of_one_load_share_one_copy_of_each_lora_tensor():
    """diffusers hands an SD pipeline's UNet and each text encoder the whole state dict:
    the recorded calls own one copy of each tensor between them, not one each."""
    import gc

    from ondeck.integrations.diffusers import pipeline_lora

    state = {"unet.a.lora_A.weight": torch.ones(4, 2), "alpha": 4.0}
    first, second = pipeline_lora._owned(state), pipeline_lora._owned([state])[0]
    assert first["unet.a.lora_A.weight"] is second["unet.a.lora_A.weight"]
    assert first["unet.a.lora_A.weight"].data_ptr() != state["unet.a.lora_A.weight"].data_ptr()
    assert first["alpha"] == 4.0
    before = len(pipeline_lora._owned_copies)
    del state, second
    gc.collect()
    assert len(pipeline_lora._owned_copies) == before - 1, "the entry goes with its source"
    assert torch.equal(first["unet.a.lora_A.weight"], torch.ones(4, 2)), "the copy stays"
