"""A transformer from one original-key checkpoint file, the rest from the base folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ondeck
from ondeck.errors import LoadError
from ondeck.loading import ModelFolder
from ondeck.loading import reads as reader
from ondeck.loading.single_file import AssembledTensor, SingleFileFolder, converted_tensors

from .conftest import frames, load, streamed_passes

POLICIES = ["eager", "release", "budget", "streaming"]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_original_key_file_gives_the_folders_frames_under_each_policy(
    base, original_file, reference, policy
):
    pipe = load(base, policy, components={"transformer": original_file})

    assert np.array_equal(frames(pipe), reference)
    assert np.array_equal(frames(pipe), reference), "and again, after a reload or resident"
    if policy == "streaming":
        assert streamed_passes(pipe) > 0, "the budget streams the transformer's blocks"


def test_the_keys_come_from_diffusers_conversion_read_from_the_header_alone(
    base, original_file, monkeypatch
):
    opened = []
    real = reader.read_into
    monkeypatch.setattr(
        reader, "read_into", lambda jobs, **kw: opened.append(jobs) or real(jobs, **kw)
    )
    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": original_file})

    tensors = folder.tensors("transformer")
    spec = folder.spec("transformer", torch.float32)

    assert "blocks.0.attn1.to_q.weight" in tensors
    assert (
        tensors["blocks.0.attn1.to_q.weight"].name
        == "model.diffusion_model.blocks.0.self_attn.q.weight"
    )
    assert tensors["blocks.0.norm2.weight"].name.endswith("blocks.0.norm3.weight"), "swapped norms"
    assert spec.nbytes == ModelFolder.open(base).spec("transformer", torch.float32).nbytes
    assert opened == [], "nothing but the header is read"


def test_the_conversion_is_the_one_diffusers_from_single_file_uses(
    base, original_file, monkeypatch
):
    """Called, not copied: the function diffusers registers for the class, as it is then."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"]
    registered = entry["checkpoint_mapping_fn"]
    calls = []

    def spying(checkpoint, **kwargs):
        converted = registered(checkpoint, **kwargs)
        calls.append(converted)
        return {**converted, "proj_out.bias": converted["proj_out.weight"]}  # marked

    monkeypatch.setitem(entry, "checkpoint_mapping_fn", spying)
    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": original_file})

    tensors = folder.tensors("transformer")

    assert len(calls) == 1
    assert sorted(tensors) == sorted(calls[0]), "its output, as it is"
    assert tuple(tensors["proj_out.bias"].shape) == tuple(calls[0]["proj_out.weight"].shape)


def test_the_plan_reads_no_weights_and_counts_the_files_bytes(base, original_file, monkeypatch):
    monkeypatch.setattr(reader, "read_into", lambda *a, **k: pytest.fail("a weight was read"))
    pipe = load(base, "release", components={"transformer": original_file})

    plan = pipe.ondeck.plan()

    same_weights = load(base, "release").ondeck.plan()
    assert plan.component_bytes == same_weights.component_bytes
    assert not ondeck.is_loaded(pipe.transformer)


def test_a_file_in_diffusers_names_is_taken_as_it_is(base, reference, tmp_path):
    (source,) = (base / "transformer").glob("*.safetensors")
    copy = tmp_path / "transformer.safetensors"
    copy.write_bytes(source.read_bytes())

    pipe = load(base, "release", components={"transformer": copy})

    assert np.array_equal(frames(pipe), reference)


def test_a_file_in_diffusers_names_lacking_a_tensor_names_that_tensor(base, weights, tmp_path):
    """Not an original-key file whose conversion then fails on names it holds: the file
    lacks the model's ``proj_out.bias``, and the error says so."""
    lacking = tmp_path / "transformer.safetensors"
    save_file({k: v for k, v in weights.items() if k != "proj_out.bias"}, str(lacking))

    with pytest.raises(LoadError, match=r"lacks 1 of the model's tensors: proj_out\.bias$"):
        load(base, "release", components={"transformer": lacking}).ondeck.plan()


@pytest.mark.parametrize("alias", [False, True], ids=["shared-only", "both-names"])
def test_a_t5_file_with_a_tied_embedding_is_the_models_own(base, reference, tmp_path, alias):
    """UMT5/T5 files hold the tied embedding once, as ``shared.weight`` (transformers'
    ``save_pretrained`` and the files people download), or under both its names: either
    is the encoder's, taken as it is."""
    weights = load_file(str(next((base / "text_encoder").glob("*.safetensors"))))
    assert "shared.weight" in weights and "encoder.embed_tokens.weight" not in weights
    if alias:
        weights["encoder.embed_tokens.weight"] = weights["shared.weight"].clone()
    copy = tmp_path / "umt5.safetensors"
    save_file(weights, str(copy))

    pipe = load(base, "release", components={"text_encoder": copy})

    assert np.array_equal(frames(pipe), reference)


def test_a_file_of_another_model_is_refused_before_anything_loads(base, tmp_path):
    wrong = tmp_path / "other.safetensors"
    save_file({"model.diffusion_model.blocks.0.self_attn.q.weight": torch.zeros(3, 3)}, str(wrong))

    with pytest.raises(LoadError, match=r"component 'transformer'.*other\.safetensors"):
        pipe = load(base, "release", components={"transformer": wrong})
        pipe.ondeck.plan()


def test_another_components_file_is_named_as_not_this_models(base, original_file):
    """The transformer's file given as the VAE: the VAE's conversion finds none of its
    tensors there; the error names the file given, not the folder's config."""
    with pytest.raises(LoadError) as raised:
        pipe = load(base, "release", components={"vae": original_file})
        pipe.ondeck.plan()
    message = str(raised.value)
    assert message.startswith(f"component 'vae' from {original_file}: its tensors are not ")
    assert "finds 0 of the model's" in message and "config.json" not in message


def test_a_checkpoint_holding_the_whole_pipeline_gives_the_transformer_its_part(
    base, original_file, reference, tmp_path
):
    """A file that holds the VAE's and the text encoders' tensors beside the
    transformer's (in their own prefixes) loads the transformer, the rest left out with
    a warning, as diffusers' own single-file loading leaves them."""
    tensors = load_file(str(original_file))
    tensors["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4)
    tensors["text_encoders.t5xxl.shared.weight"] = torch.zeros(8, 4)
    path = tmp_path / "all-in-one.safetensors"
    save_file(tensors, str(path))

    with pytest.warns(UserWarning, match=r"2 tensor\(s\) outside the model are left out"):
        pipe = load(base, "release", components={"transformer": path})
        assert np.array_equal(frames(pipe), reference)

    # A block the config does not have is the model's part all the same: refused.
    tensors["model.diffusion_model.blocks.6.self_attn.q.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(path))
    with pytest.raises(LoadError, match=r"the model does not have: 'blocks\.6\.attn1"):
        load(base, "release", components={"transformer": path}).transformer.materialize()


def test_a_missing_file_or_unknown_component_is_named(base, original_file, tmp_path):
    with pytest.raises(LoadError, match="single file .*absent.safetensors does not exist"):
        load(base, components={"transformer": tmp_path / "absent.safetensors"})
    with pytest.raises(LoadError, match="component 'transformer_9' is not in"):
        load(base, components={"transformer_9": original_file})
    with pytest.raises(LoadError, match=r"\.safetensors \(or \.sft\) or a \.gguf file \(pickle"):
        load(base, components={"transformer": tmp_path / "x.ckpt"})
    with pytest.raises(LoadError, match=r"x\.onnx: a single-file component is .* file$"):
        load(base, components={"transformer": tmp_path / "x.onnx"})
    with pytest.raises(LoadError, match="is a folder; a single-file component is one file"):
        load(base, components={"transformer": tmp_path})
    with pytest.raises(LoadError, match="component 'scheduler' holds no weights"):
        load(base, components={"scheduler": original_file})


def test_a_file_in_foreign_names_for_a_class_diffusers_cannot_convert_says_so(
    base, original_file, monkeypatch
):
    from ondeck.loading import single_file

    monkeypatch.setattr(single_file, "conversion_for", lambda cls: None)
    with pytest.raises(LoadError) as error:
        load(base, "release", components={"transformer": original_file}).transformer.materialize()
    assert "its keys are not WanTransformer3DModel's, and diffusers has no single-file" in str(
        error.value
    )


def test_a_safetensors_file_named_sft_is_read_as_one(base, original_file, reference, tmp_path):
    """Black Forest Labs' own checkpoints are safetensors named .sft."""
    copy = tmp_path / "flux1-dev-like.sft"
    copy.write_bytes(original_file.read_bytes())
    assert np.array_equal(
        frames(load(base, "release", components={"transformer": copy})), reference
    )


# -- the conversion's splits and joins ----------------------------------------------------


def _fused_conversion(checkpoint, **kwargs):
    """A conversion of the kind Flux's and HunyuanVideo's are: a fused qkv split in three,
    the halves of a modulation swapped, a bias renamed, built from diffusers' own
    swap_scale_shift."""
    from diffusers.loaders.single_file_utils import swap_scale_shift

    converted = {}
    q, k, v = torch.chunk(checkpoint.pop("attn.qkv.weight"), 3, dim=0)
    converted.update({"to_q.weight": q, "to_k.weight": k, "to_v.weight": v})
    converted["norm_out.linear.weight"] = swap_scale_shift(
        checkpoint.pop("final_layer.adaLN_modulation.1.weight"), 0
    )
    converted["norm_out.linear.bias"] = checkpoint.pop("final_layer.adaLN_modulation.1.bias")
    converted["flat.weight"] = checkpoint.pop("flat").reshape(2, 6)
    return converted


def test_split_and_swapped_tensors_are_read_as_byte_ranges_into_place(tmp_path):
    from ondeck.loading import read_header

    torch.manual_seed(0)
    original = {
        "attn.qkv.weight": torch.randn(12, 5),
        "final_layer.adaLN_modulation.1.weight": torch.randn(8, 3),
        "final_layer.adaLN_modulation.1.bias": torch.randn(8),
        "flat": torch.randn(12),
    }
    path = tmp_path / "fused.safetensors"
    save_file(original, str(path))
    expected = _fused_conversion({key: value.clone() for key, value in original.items()})

    header = read_header(path)
    tensors = converted_tensors(
        _fused_conversion, header.tensors, component="transformer", path=str(path)
    )

    assert set(tensors) == set(expected)
    assert isinstance(tensors["norm_out.linear.weight"], AssembledTensor)
    assert not isinstance(tensors["to_k.weight"], AssembledTensor), "one byte range"
    assert tensors["to_k.weight"].nbytes == 4 * 5 * 4
    jobs, results = [], {}
    from ondeck.loading.single_file import pieces_of

    for key, info in tensors.items():
        results[key] = torch.empty(expected[key].shape, dtype=torch.float32)
        for part, destination in pieces_of(info, results[key]):
            jobs.append(reader.ReadJob(part, destination))
    reader.read_into(jobs, progress=False)
    for key, value in expected.items():
        assert torch.equal(results[key], value), key


def test_a_conversion_that_computes_with_values_is_refused_naming_the_tensor(tmp_path):
    from ondeck.loading import read_header

    path = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(4, 3)}, str(path))

    def transposing(checkpoint, **kwargs):
        return {"w": checkpoint["w"].t().contiguous()}

    with pytest.raises(LoadError, match=r"computes tensor 'w' \(.*strided view"):
        converted_tensors(
            transposing, read_header(path).tensors, component="transformer", path=str(path)
        )

    def adding(checkpoint, **kwargs):
        return {"w": checkpoint["w"] * 2}

    with pytest.raises(LoadError, match=r"computes tensor 'w' \(mul"):
        converted_tensors(
            adding, read_header(path).tensors, component="transformer", path=str(path)
        )


def test_a_conversion_joining_tensors_it_cannot_read_as_byte_ranges_is_refused(tmp_path):
    """A join along a later dimension interleaves its parts' bytes, and a join of two dtypes
    has no one dtype to read them in: each is refused, naming the tensor."""
    from ondeck.loading import read_header

    path = tmp_path / "t.safetensors"
    save_file(
        {"a": torch.randn(4, 3), "b": torch.randn(4, 3), "c": torch.randn(4, 3).half()},
        str(path),
    )

    def convert(dim, second):
        def conversion(checkpoint, **kwargs):
            return {"w": torch.cat([checkpoint["a"], checkpoint[second]], dim=dim)}

        return converted_tensors(
            conversion, read_header(path).tensors, component="transformer", path=str(path)
        )

    assert convert(0, "b")["w"].shape == (8, 3), "rows after rows: one byte range after another"
    with pytest.raises(LoadError, match=r"computes tensor 'w' \(cat along dim 1 .*interleave"):
        convert(1, "b")
    with pytest.raises(LoadError, match=r"tensor 'w' joins file tensors of different dtypes"):
        convert(0, "c")


def test_single_file_tensors_match_the_original_after_a_round_trip(weights, original_file):
    read = load_file(str(original_file))
    assert len(read) == len(weights)


# -- a conversion that assembles tensors, through the whole loader -------------------------


@pytest.fixture(scope="module")
def swapped_file(weights, tmp_path_factory):
    """The original-key file with the halves of every block matrix swapped, as Flux's and
    HunyuanVideo's originals store their modulations (shift before scale)."""
    from diffusers.loaders.single_file_utils import swap_scale_shift

    from .conftest import original_name

    stored = {}
    for key, tensor in weights.items():
        swapped = key.startswith("blocks.") and tensor.dim() == 2
        stored[original_name(key)] = swap_scale_shift(tensor, 0) if swapped else tensor
    path = tmp_path_factory.mktemp("swapped") / "wan_swapped.safetensors"
    save_file(stored, str(path))
    return path


@pytest.fixture
def swapping_conversion(monkeypatch):
    """diffusers' Wan conversion, then the halves of every block matrix swapped back with
    diffusers' swap_scale_shift: each such tensor is read as two byte ranges."""
    from diffusers.loaders.single_file_utils import (
        convert_wan_transformer_to_diffusers,
        swap_scale_shift,
    )

    from ondeck.loading import single_file

    def convert(checkpoint, **kwargs):
        converted = convert_wan_transformer_to_diffusers(checkpoint, **kwargs)
        for key, tensor in converted.items():
            if key.startswith("blocks.") and tensor.dim() == 2:
                converted[key] = swap_scale_shift(tensor, 0)
        return converted

    monkeypatch.setattr(single_file, "conversion_for", lambda cls: convert)


@pytest.mark.parametrize("policy", POLICIES)
def test_assembled_tensors_load_in_place_under_each_policy(
    base, swapped_file, swapping_conversion, reference, policy
):
    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": swapped_file})
    assert isinstance(folder.tensors("transformer")["blocks.0.attn1.to_q.weight"], AssembledTensor)
    pipe = load(base, policy, components={"transformer": swapped_file})

    assert np.array_equal(frames(pipe), reference)
    assert np.array_equal(frames(pipe), reference)
    if policy == "streaming":
        assert streamed_passes(pipe) > 0


def test_assembled_tensors_load_pipelined(base, weights, swapped_file, swapping_conversion):
    from ondeck.loading import ComponentLoader

    folder = SingleFileFolder(ModelFolder.open(base), {"transformer": swapped_file})
    loader = ComponentLoader(folder, "transformer", dtype=torch.float32, pipelined=True)

    module = loader()

    state = module.state_dict()
    for key, tensor in weights.items():
        assert torch.equal(state[key], tensor), key


def test_assembled_tensors_reload_from_the_host_cache(
    base, swapped_file, swapping_conversion, reference, monkeypatch
):
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    pipe = load(base, "release", components={"transformer": swapped_file}, host_cache=cache)
    loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")

    assert np.array_equal(frames(pipe), reference)
    assert np.array_equal(frames(pipe), reference)
    assert loader.last_source == "host cache"


def test_a_conversion_that_changes_a_tensor_in_place_is_refused(tmp_path):
    from ondeck.loading import read_header

    path = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(4, 3), "b": torch.randn(4)}, str(path))

    def scaling(checkpoint, **kwargs):
        weight = checkpoint.pop("w")
        weight.mul_(2)
        first, second = checkpoint.pop("b").chunk(2)  # unpacking a split is fine
        return {"w": weight, "b0": first, "b1": second}

    with pytest.raises(LoadError, match=r"computes tensor 'w' \(mul_ \(changes it in place"):
        converted_tensors(
            scaling, read_header(path).tensors, component="transformer", path=str(path)
        )


def test_the_second_expert_from_an_original_key_file(two_experts, tmp_path):
    """``--component transformer_2=FILE``: a Wan 2.2 low-noise expert downloaded alone; the
    base folder's own second expert (other weights here) is not read."""
    import shutil

    from .conftest import original_name, reference_frames

    (source,) = (two_experts / "transformer_2").glob("*.safetensors")
    weights = load_file(str(source))
    expert = tmp_path / "wan2.2_low_noise.safetensors"
    save_file({original_name(k): v for k, v in weights.items()}, str(expert))
    base = Path(shutil.copytree(two_experts, tmp_path / "base"))
    for old in (base / "transformer_2").glob("*.safetensors"):
        save_file({k: v * 0.5 for k, v in weights.items()}, str(old))
    expected = reference_frames(two_experts)
    assert not np.array_equal(reference_frames(base), expected)

    pipe = load(base, "release", components={"transformer_2": expert})

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    assert pipe.transformer_2.load_count == 2
