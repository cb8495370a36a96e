"""A fused LoRA under ``release``: the first load runs diffusers' and peft's calls, every
later one adds the deltas from the LoRA's factors, with the same frames, bit for bit."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import ondeck

from .conftest import frames, load, reference_frames

pytest.importorskip("peft")

CALLS = 3


@pytest.fixture
def injections(monkeypatch):
    """How many times peft's layers were built on a module with weights: each
    ``load_lora_adapter`` run but the check of a LoRA's shapes on the meta skeleton."""
    from diffusers.loaders.peft import PeftAdapterMixin

    count = [0]
    real = PeftAdapterMixin.load_lora_adapter

    def counting(self, *args, **kwargs):
        count[0] += next(self.parameters()).device.type != "meta"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PeftAdapterMixin, "load_lora_adapter", counting)
    return count


def _fused_setups(lora_files):
    """name -> (the LoRAs with their adapter weights, the fuse's lora_scale)."""
    return {
        "one LoRA, fused at 0.5": ([(lora_files["diffusers"], 1.0)], 0.5),
        "two LoRAs at their own weights": (
            [(lora_files["diffusers"], 0.7), (lora_files["musubi"], 0.2)],
            1.0,
        ),
    }


def _eager_fused(base, loras, lora_scale, **fuse):
    """Plain diffusers, every weight resident, the LoRAs loaded, set and fused."""
    from diffusers import WanPipeline
    from references import in_fresh_tensors

    plain = WanPipeline.from_pretrained(base, dtype=torch.float32)
    for index, (path, _) in enumerate(loras):
        plain.load_lora_weights(str(path), adapter_name=f"lora_{index}")
    plain.set_adapters([f"lora_{i}" for i in range(len(loras))], [w for _, w in loras])
    plain.fuse_lora(lora_scale=lora_scale, **fuse)
    plain.set_progress_bar_config(disable=True)
    return in_fresh_tensors(plain)


def _ondeck_fused(base, loras, lora_scale, **fuse):
    pipe = load(base, "release", loras=loras)
    pipe.fuse_lora(lora_scale=lora_scale, **fuse)
    return pipe


def _frames_of_calls(pipe, calls=CALLS) -> list[torch.Tensor]:
    outputs = []
    for _ in range(calls):
        pipe.ondeck.release_all()
        outputs.append(torch.from_numpy(frames(pipe)))
    return outputs


def _replaying_in_full(monkeypatch):
    """Today's replay: every load runs the recorded calls themselves."""
    from ondeck.integrations.diffusers.fused_lora import FusedLora

    monkeypatch.setattr(FusedLora, "transforms_for_load", lambda self, transforms: transforms)


def _recipe(pipe):
    return object.__getattribute__(pipe.transformer, "_ondeck_fused_lora").recipe


@pytest.mark.parametrize("setup", ["one LoRA, fused at 0.5", "two LoRAs at their own weights"])
def test_a_fused_lora_reapplied_from_its_factors_gives_the_full_replays_frames(
    base, lora_files, reference, injections, monkeypatch, setup
):
    loras, lora_scale = _fused_setups(lora_files)[setup]
    expected = torch.from_numpy(frames(_eager_fused(base, loras, lora_scale)))
    assert not torch.equal(expected, torch.from_numpy(reference)), "the LoRA changes the output"

    injections[0] = 0
    fast = _frames_of_calls(_ondeck_fused(base, loras, lora_scale))
    assert injections[0] == len(loras), "peft built its layers at the first load only"
    with monkeypatch.context() as patch:
        _replaying_in_full(patch)
        full = _frames_of_calls(_ondeck_fused(base, loras, lora_scale))

    for call in range(CALLS):
        assert torch.equal(full[call], expected), f"full replay, call {call + 1}"
        assert torch.equal(fast[call], expected), f"from the factors, call {call + 1}"


def test_a_pipelined_load_adds_each_blocks_deltas_as_its_weights_land(
    base, lora_files, monkeypatch
):
    """The transformer loaded pipelined, each block its own group: the deltas from the
    factors wait for each block's weights, not for the whole load, and the frames are
    diffusers' fused ones."""
    from ondeck.loading import components, pipelined

    monkeypatch.setattr(components, "MIN_PIPELINED_BYTES", 1)
    monkeypatch.setattr(pipelined, "MIN_GROUP_BYTES", 1)
    loras, lora_scale = _fused_setups(lora_files)["two LoRAs at their own weights"]
    expected = torch.from_numpy(frames(_eager_fused(base, loras, lora_scale)))
    pipe = _ondeck_fused(base, loras, lora_scale)
    pipe.ondeck.release_all()
    events = []
    wait, when_in_place = pipelined.Filling.wait, pipelined.Filling.when_in_place

    def waiting(filling):
        events.append(("wait", filling.component))
        return wait(filling)

    def deferring(filling, block, change):
        events.append(("deferred", filling.component, block))
        return when_in_place(filling, block, change)

    monkeypatch.setattr(pipelined.Filling, "wait", waiting)
    monkeypatch.setattr(pipelined.Filling, "when_in_place", deferring)
    computing = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, _: events.append(type(module).__name__)
    )
    try:
        outputs = _frames_of_calls(pipe, 2)
    finally:
        computing.remove()

    assert _recipe(pipe) is not None
    blocks = len(pipe.transformer.materialize().blocks)
    first_block = events.index("WanTransformerBlock")
    deferred = [e[2] for e in events[:first_block] if e[:2] == ("deferred", "transformer")]
    assert sorted(set(deferred)) == list(range(blocks)), "every block's deltas waited for it"
    assert ("wait", "transformer") not in events[:first_block], "computing before the end"
    for call, output in enumerate(outputs):
        assert torch.equal(output, expected), f"call {call + 1}"


def test_peft_injects_a_fused_lora_once_not_at_every_reload(base, lora_files, injections):
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)

    _frames_of_calls(pipe)
    assert pipe.transformer.load_count == CALLS + 1, "fuse_lora loaded it, then each call"
    assert injections[0] == 1


def test_the_weights_from_the_factors_equal_diffusers_fused_weights(base, lora_files):
    loras, lora_scale = _fused_setups(lora_files)["two LoRAs at their own weights"]
    plain = _eager_fused(base, loras, lora_scale).transformer.state_dict()
    expected = {key.replace(".base_layer.", "."): value for key, value in plain.items()}
    expected = {key: value for key, value in expected.items() if ".lora_" not in key}
    pipe = _ondeck_fused(base, loras, lora_scale)
    pipe.ondeck.release_all()

    rebuilt = pipe.transformer.materialize().state_dict()
    assert _recipe(pipe) is not None
    assert rebuilt.keys() == expected.keys(), "plain layers, no peft ones"
    assert all(torch.equal(rebuilt[key], expected[key]) for key in expected)


def test_the_recipe_keeps_the_factors_not_full_size_deltas(base, lora_files, weights):
    from .conftest import lora_state

    pipe = _ondeck_fused(base, [(lora_files["diffusers"], 1.0)], 0.5)
    recipe = _recipe(pipe)

    factors = lora_state(weights).values()
    assert len(recipe.layers) == len(factors)
    assert recipe.nbytes == sum(down.nbytes + up.nbytes for down, up in factors)


def test_asking_for_the_adapters_after_a_reload_from_the_factors_finds_them(
    base, lora_files, injections
):
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    _frames_of_calls(pipe, 2)
    assert injections[0] == 1

    assert pipe.get_list_adapters() == {"transformer": ["style"]}
    assert pipe.get_active_adapters() == ["style"]
    assert injections[0] == 2, "the module from the factors was rebuilt with peft's layers"


def _plain_unfused(base, lora):
    """Plain diffusers: the LoRA loaded, fused at 0.5 and unfused. The adapter stays
    active, so its layers compute it beside the restored weights."""
    from diffusers import WanPipeline
    from references import in_fresh_tensors

    pipe = WanPipeline.from_pretrained(base, dtype=torch.float32)
    pipe.load_lora_weights(str(lora), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    pipe.transformer.unfuse_lora()
    pipe.set_progress_bar_config(disable=True)
    return frames(in_fresh_tensors(pipe))


def test_an_adapter_call_on_a_module_from_the_factors_gets_peft_layers_to_act_on(
    base, lora_files, weights, reference
):
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    pipe.ondeck.release_all()
    pipe.transformer.materialize()  # from the factors: no peft layers to unfuse

    pipe.transformer.unfuse_lora()
    layer = pipe.transformer.materialize().get_submodule("blocks.0.attn1.to_q")
    # Unfusing subtracts what fusing added, to rounding.
    file_weight = weights["blocks.0.attn1.to_q.weight"]
    assert torch.allclose(getattr(layer, "base_layer", layer).weight, file_weight, atol=1e-6)
    expected = _plain_unfused(base, lora_files["diffusers"])
    assert not np.allclose(expected, reference, atol=1e-2), "the unfused adapter still acts"
    assert np.array_equal(frames(pipe), expected)


def test_the_pipelines_unfuse_lora_holds_at_every_reload(base, lora_files, reference):
    """``pipe.unfuse_lora()`` (the pipeline's, not the component's) on a transformer that
    is not loaded: every later load unfuses again, so each call computes the adapter
    beside the restored weights, as plain diffusers does."""
    expected = _plain_unfused(base, lora_files["diffusers"])
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    pipe.ondeck.release_all()
    pipe.unfuse_lora()

    for call, output in enumerate(_frames_of_calls(pipe)):
        assert np.array_equal(output.numpy(), expected), f"call {call + 1}"


def test_a_transform_of_your_own_after_the_fuse_sees_peft_layers(base, lora_files):
    from peft.tuners.tuners_utils import BaseTunerLayer

    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.fuse_lora(lora_scale=0.5)
    pipe.ondeck.release_all()
    pipe.transformer.materialize()  # from the factors
    seen = []

    def look(module):
        seen.append(any(isinstance(layer, BaseTunerLayer) for layer in module.modules()))
        return module

    pipe.transformer.add_transform(look)
    frames(pipe)
    frames(pipe)
    assert seen and all(seen), "every module it saw had peft's layers"


def _unload_after_fusing(pipe):
    pipe.unload_lora_weights()


def _set_adapters_after_fusing(pipe):
    pipe.set_adapters(["lora_0"], [0.3])


def _delete_adapters_after_fusing(pipe):
    pipe.delete_adapters("lora_0")


@pytest.mark.parametrize(
    "after, fuse",
    [
        (_set_adapters_after_fusing, {}),
        (_delete_adapters_after_fusing, {}),
        (None, {"safe_fusing": True}),
    ],
    ids=["set_adapters", "delete_adapters", "safe_fusing"],
)
def test_calls_a_recipe_does_not_cover_replay_in_full_with_diffusers_frames(
    base, lora_files, injections, after, fuse
):
    loras = [(lora_files["diffusers"], 1.0)]
    plain = _eager_fused(base, loras, 0.5, **fuse)
    if after is not None:
        after(plain)
    expected = torch.from_numpy(frames(plain))
    injections[0] = 0
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="lora_0")
    pipe.fuse_lora(lora_scale=0.5, **fuse)
    if after is not None:
        after(pipe)

    for call, output in enumerate(_frames_of_calls(pipe)):
        assert torch.equal(output, expected), f"call {call + 1}"
    assert _recipe(pipe) is None
    assert injections[0] == pipe.transformer.load_count, "peft at every load"


def test_fusing_then_unloading_reloads_from_the_factors_with_diffusers_frames(
    base, lora_files, injections
):
    """diffusers' "fuse, then unload the LoRA": the fused weights stay, peft's layers go.
    Every later load adds the deltas from the factors and gives that module again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    loras = [(lora_files["diffusers"], 1.0)]
    plain = _eager_fused(base, loras, 0.5)
    _unload_after_fusing(plain)
    expected = torch.from_numpy(frames(plain))
    pipe = load(base, "release")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="lora_0")
    pipe.fuse_lora(lora_scale=0.5)
    _unload_after_fusing(pipe)
    injections[0] = 0

    for call, output in enumerate(_frames_of_calls(pipe)):
        assert torch.equal(output, expected), f"call {call + 1}"
    assert _recipe(pipe) is not None
    assert injections[0] == 1, "peft built its layers at the first load only"
    module = pipe.transformer.materialize()
    assert not any(isinstance(layer, BaseTunerLayer) for layer in module.modules())
    loads = pipe.transformer.load_count
    assert not getattr(pipe.transformer, "_hf_peft_config_loaded", None)
    assert pipe.transformer.load_count == loads, "nothing to replay: it has no adapters"


def test_an_unfused_lora_replays_in_full(base, lora_files, injections):
    loras = [(lora_files["diffusers"], 0.7)]
    expected = torch.from_numpy(reference_frames(base, loras=loras))
    injections[0] = 0
    pipe = load(base, "release", loras=loras)

    for output in _frames_of_calls(pipe):
        assert torch.equal(output, expected)
    assert injections[0] == pipe.transformer.load_count == CALLS
    assert _recipe(pipe) is None


def _factor_of(pipe) -> weakref.ref:
    recipe = _recipe(pipe)
    assert recipe is not None
    return weakref.ref(recipe.layers[0].adapters[0].down)


def test_the_factors_are_freed_when_the_recorded_calls_change(base, lora_files):
    pipe = _ondeck_fused(base, [(lora_files["diffusers"], 1.0)], 0.5)
    pipe.ondeck.release_all()
    factor = _factor_of(pipe)

    pipe.transformer.unfuse_lora()
    gc.collect()
    assert factor() is None


def test_the_factors_are_freed_when_the_pipeline_closes(base, lora_files):
    pipe = _ondeck_fused(base, [(lora_files["diffusers"], 1.0)], 0.5)
    factor = _factor_of(pipe)

    pipe.ondeck.close()
    gc.collect()
    assert factor() is None
    assert not ondeck.is_loaded(pipe.transformer)
    assert np.array_equal(
        frames(pipe), frames(_eager_fused(base, [(lora_files["diffusers"], 1.0)], 0.5))
    )


# -- which recorded calls a recipe covers, and which layers it can be taken from ------


def _recorded(method, *args, **kwargs):
    from ondeck.integrations.diffusers.fused_lora import mark_recorded

    def apply(module):
        return module

    mark_recorded(apply, method, args, kwargs)
    return apply


def _user_transform(module):
    return module


@pytest.mark.parametrize(
    "methods, span",
    [
        (["load_lora_adapter", "fuse_lora"], (0, 2)),
        (["load_lora_into_transformer", "load_lora_adapter", "set_adapters", "fuse_lora"], (0, 4)),
        (
            [_user_transform, "setattr", "load_lora_into_transformer", "fuse_lora", "compile"],
            (2, 4),
        ),
        (["load_lora_adapter", "set_adapters"], None),
        (["load_lora_adapter", "fuse_lora", "unfuse_lora"], None),
        (["load_lora_adapter", "fuse_lora", "unload_lora"], (0, 3)),
        (["load_lora_adapter", "fuse_lora", "unload_lora", "load_lora_adapter"], None),
        (["load_lora_adapter", "unload_lora", "fuse_lora"], None),
        (["load_lora_adapter", "fuse_lora", "set_adapters"], None),
        (["load_lora_adapter", "fuse_lora", "delete_adapters"], None),
        (["load_lora_adapter", "fuse_lora", "load_lora_adapter", "fuse_lora"], None),
        (["load_lora_adapter", "compile", "fuse_lora"], None),
        (["load_lora_adapter", "disable_lora", "load_lora_adapter", "fuse_lora"], None),
        (["set_adapters", "fuse_lora"], None),
        (["load_lora_adapter", "fuse_lora", _user_transform], None),
    ],
)
def test_a_recipe_stands_in_only_for_adapter_loads_and_one_fuse(methods, span):
    from ondeck.integrations.diffusers.fused_lora import fused_span

    transforms = [m if callable(m) else _recorded(m) for m in methods]
    assert fused_span(transforms) == span


def test_a_safe_fuse_is_not_covered():
    from ondeck.integrations.diffusers.fused_lora import fused_span

    load_call = _recorded("load_lora_adapter")
    assert fused_span([load_call, _recorded("fuse_lora", 0.5, safe_fusing=False)]) == (0, 2)
    assert fused_span([load_call, _recorded("fuse_lora", 0.5, safe_fusing=True)]) is None
    assert fused_span([load_call, _recorded("fuse_lora", 0.5, True)]) is None


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.proj = torch.nn.Linear(8, 6)
        self.out = torch.nn.Linear(6, 4)
        self.conv = torch.nn.Conv2d(2, 2, 3)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


def _merged_lora(module, merge="all", **config):
    """``module`` with a random LoRA injected by peft, merged into ``"all"`` its layers,
    the ``"first"`` or ``"none"``, and its tensors' snapshot from before."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from ondeck.integrations.diffusers.fused_lora import snapshot_tensors

    before = snapshot_tensors(module)
    config = LoraConfig(r=2, lora_alpha=4, **{"target_modules": ["proj"], **config})
    inject_adapter_in_model(config, module, adapter_name="style")
    generator = torch.Generator().manual_seed(4)
    layers = [layer for layer in module.modules() if isinstance(layer, BaseTunerLayer)]
    for layer in layers:
        with torch.no_grad():
            for parameter in layer.lora_B.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    for layer in {"all": layers, "first": layers[:1], "none": []}[merge]:
        layer.merge()
    return module, before


def test_a_recipe_from_a_merged_linear_lora_rebuilds_the_merged_weights():
    from ondeck.integrations.diffusers.fused_lora import capture_fused_lora

    merged, before = _merged_lora(_Tiny())
    recipe = capture_fused_lora(merged, before)
    fresh = _Tiny()
    assert recipe is not None and recipe.fits(fresh)
    recipe.apply(fresh)

    assert torch.equal(fresh.proj.weight, merged.proj.base_layer.weight)
    assert not torch.equal(fresh.proj.weight, _Tiny().proj.weight)
    assert torch.equal(fresh.conv.weight, _Tiny().conv.weight)
    assert not recipe.fits(_Tiny().to(torch.float64)), "another dtype: replay in full"


def test_a_bias_changed_beside_the_merge_leaves_no_recipe():
    from ondeck.integrations.diffusers.fused_lora import capture_fused_lora

    merged, before = _merged_lora(_Tiny())
    with torch.no_grad():
        merged.conv.bias.add_(1.0)

    assert capture_fused_lora(merged, before) is None


@pytest.mark.parametrize(
    "merge, config",
    [
        ("all", {"use_dora": True}),
        ("all", {"target_modules": ["conv"]}),
        ("all", {"target_modules": ["proj", "conv"]}),
        ("all", {"lora_bias": True}),
        ("first", {"target_modules": ["proj", "out"]}),
    ],
    ids=["dora", "conv", "linear-and-conv", "lora-bias", "one-layer-unmerged"],
)
def test_no_recipe_is_taken_from_what_it_cannot_repeat(merge, config):
    from ondeck.integrations.diffusers.fused_lora import capture_fused_lora

    merged, before = _merged_lora(_Tiny(), merge=merge, **config)
    assert capture_fused_lora(merged, before) is None


def test_deltas_added_in_a_forward_under_autocast_are_those_of_a_merge_outside_it(base, lora_files):
    import copy

    from ondeck.integrations.diffusers.fused_lora import _add_deltas

    pipe = _ondeck_fused(base, [(lora_files["diffusers"], 1.0)], 0.5)
    layers = _recipe(pipe).layers
    module = pipe.transformer.materialize()
    outside, inside = copy.deepcopy(module), copy.deepcopy(module)
    _add_deltas(outside, layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a pre-hook runs in the forward's
        _add_deltas(inside, layers)
    for layer in layers:
        weights = [m.get_submodule(layer.path).weight for m in (outside, inside)]
        assert torch.equal(*weights), layer.path


@pytest.mark.parametrize("policy", ["eager", "release"])
def test_fusing_into_weights_kept_in_float8_is_refused_and_the_lora_stays_unfused(
    base, lora_files, policy
):
    """torch cannot add a LoRA to float8 weights in their dtype: one clear refusal (it was
    torch's "Promotion for Float8 Types is not supported"), and the calls after it give
    the unfused LoRA's frames."""
    from ondeck.errors import OndeckError

    pipe = load(base, policy, storage_dtype="fp8")
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    unfused = frames(pipe)
    with pytest.raises(
        OndeckError, match=r"keeps its weights in torch\.float8_e4m3fn, and fuse_lora"
    ):
        pipe.fuse_lora(lora_scale=0.5)
        frames(pipe)  # under release the fuse applies at the next load
    assert np.array_equal(frames(pipe), unfused)
