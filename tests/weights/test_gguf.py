"""A GGUF transformer file beside a diffusers base folder, through diffusers' GGUF support."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import ondeck
from ondeck.errors import LoadError

from .conftest import frames, load, reference_frames, stored_blocks, streamed_passes

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_reference(gguf_base, gguf_file):
    """Plain diffusers with the transformer diffusers' own from_single_file loads."""
    return diffusers_gguf_frames(gguf_base, gguf_file[0])


def diffusers_gguf_frames(base, path, lora=None):
    import torch
    from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel
    from references import in_fresh_tensors

    transformer = WanTransformer3DModel.from_single_file(
        str(path),
        config=str(base / "transformer"),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
        local_files_only=True,
    )
    pipe = WanPipeline.from_pretrained(base, transformer=transformer, dtype=torch.float32)
    if lora is not None:
        pipe.load_lora_weights(str(lora), adapter_name="lora_0")
    pipe.set_progress_bar_config(disable=True)
    return frames(in_fresh_tensors(pipe))


def test_the_gguf_file_holds_the_weights_it_was_written_from(gguf_file, gguf_reference):
    # The folder holds the file's weights dequantized once; diffusers dequantizes them
    # at every forward: the same values to float32's rounding, 2e-5 apart in the latents
    # after two steps (a LoRA or another transformer moves them by tenths).
    assert np.allclose(reference_frames(gguf_file[1]), gguf_reference, atol=1e-4)


@pytest.mark.parametrize("policy", ["eager", "release", "budget"])
def test_a_gguf_file_gives_the_dequantized_weights_frames(
    gguf_base, gguf_file, gguf_reference, policy
):
    pipe = load(gguf_base, policy, components={"transformer": gguf_file[0]})
    assert ondeck.is_loaded(pipe.transformer) == (policy == "eager")

    assert np.array_equal(frames(pipe), gguf_reference)
    assert np.array_equal(frames(pipe), gguf_reference)
    if policy == "release":
        assert not ondeck.is_loaded(pipe.transformer), "released after its last stage"
        assert pipe.transformer.load_count == 2
    layer = pipe.transformer.materialize().blocks[0].attn1.to_q
    assert type(layer.weight).__name__ == "GGUFParameter", "stays quantized"


def test_the_plan_of_a_gguf_component_reads_no_weights(gguf_base, gguf_file, monkeypatch):
    from ondeck.loading import quantized

    monkeypatch.setattr(
        quantized.QuantizedComponentLoader, "_load", lambda self: pytest.fail("loaded")
    )
    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]})

    plan = pipe.ondeck.plan()

    assert plan.component_bytes["transformer"] > 0
    assert not ondeck.is_loaded(pipe.transformer)


@pytest.fixture(scope="module")
def gguf_lora(gguf_base, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from .conftest import lora_state, transformer_file

    layers = lora_state(load_file(str(transformer_file(gguf_base))))
    lora = tmp_path_factory.mktemp("gguf-lora") / "lora.safetensors"
    save_file(
        {
            f"transformer.{layer}.lora_{part}.weight": matrix
            for layer, (down, up) in layers.items()
            for part, matrix in (("A", down), ("B", up))
        },
        str(lora),
    )
    return lora


@pytest.mark.parametrize("policy", ["release", "streaming"])
def test_a_lora_on_a_gguf_transformer(gguf_base, gguf_file, gguf_lora, policy):
    expected = diffusers_gguf_frames(gguf_base, gguf_file[0], gguf_lora)
    pipe = load(gguf_base, policy, components={"transformer": gguf_file[0]}, loras=[gguf_lora])

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    if policy == "streaming":
        assert streamed_passes(pipe) > 0


def test_a_lora_for_other_shapes_on_a_gguf_transformer_is_refused_before_loading(
    gguf_base, gguf_file, lora_files
):
    """The LoRA is tried on the model its config builds, unquantized and weightless, as
    on a safetensors component: one made for another width is a LoRA error when the
    pipeline is made, not a load that fails (or one that prefetches, warns and runs
    without it)."""
    with pytest.raises(LoadError, match="lora_diffusers.safetensors: loading it into"):
        load(gguf_base, components={"transformer": gguf_file[0]}, loras=[lora_files["diffusers"]])


def test_a_loras_layers_on_a_gguf_transformer_are_in_its_plan(gguf_base, gguf_file, gguf_lora):
    without = load(gguf_base, components={"transformer": gguf_file[0]})
    given = load(gguf_base, components={"transformer": gguf_file[0]}, loras=[gguf_lora])
    planned = given.ondeck.component_bytes()["transformer"]
    assert planned > without.ondeck.component_bytes()["transformer"]
    frames(given)
    assert given.ondeck.tracker.peak_resident_bytes >= planned


def _file_bytes_of_blocks(path, blocks) -> tuple[int, int]:
    """(the bytes the GGUF file stores for ``blocks`` of the transformer, quantized as
    stored; their bytes dequantized to float32), from its header."""
    import gguf

    names = [["blocks", str(block)] for block in blocks]
    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if t.name.split(".")[:2] in names]
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) * 4 for t in tensors)


def test_a_gguf_transformer_that_does_not_fit_streams_its_blocks(
    gguf_base, gguf_file, gguf_reference
):
    pipe = load(gguf_base, "streaming", components={"transformer": gguf_file[0]})

    assert np.array_equal(frames(pipe), gguf_reference)
    assert np.array_equal(frames(pipe), gguf_reference)
    stats = pipe.ondeck.policy.streaming.stats()["transformer"]
    assert streamed_passes(pipe) > 0 and stats["streamed_blocks"]
    streamed = pipe.transformer.materialize().blocks[stats["streamed_blocks"][0]]
    weight = streamed.attn1.to_q.weight
    assert type(weight).__name__ == "GGUFParameter", "streams quantized"
    assert weight.quant_type == gguf_quant_type("Q8_0")


def test_gguf_streaming_counts_the_quantized_bytes(gguf_base, gguf_file):
    pipe = load(gguf_base, "streaming", components={"transformer": gguf_file[0]})
    layout = pipe.ondeck.plan().streamed["transformer"]

    quantized, dequantized = _file_bytes_of_blocks(gguf_file[0], layout.streamed)
    assert layout.bytes_per_pass == quantized < dequantized
    frames(pipe)
    stats = pipe.ondeck.policy.streaming.stats()["transformer"]
    assert stats["host_copy_bytes"] == quantized


def gguf_quant_type(name: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, name)


def make_unreadable(monkeypatch, path) -> None:
    """From now on, opening ``path`` fails (as root too, unlike a chmod)."""
    import builtins
    import os

    target = os.path.realpath(path)

    def refusing(opener):
        def opened(file, *args, **kwargs):
            if isinstance(file, str | bytes | os.PathLike):
                if os.path.realpath(os.fsdecode(file)) == target:
                    raise PermissionError(f"{path} is read again")
            return opener(file, *args, **kwargs)

        return opened

    monkeypatch.setattr(builtins, "open", refusing(builtins.open))
    monkeypatch.setattr(os, "open", refusing(os.open))
    gguf = pytest.importorskip("gguf")
    with pytest.raises(PermissionError):
        gguf.GGUFReader(str(path))


@pytest.mark.parametrize("policy", ["release", "streaming"])
def test_a_gguf_transformer_reloads_from_the_host_cache_without_reading_the_file(
    gguf_base, gguf_file, gguf_reference, monkeypatch, policy
):
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    pipe = load(gguf_base, policy, components={"transformer": gguf_file[0]}, host_cache=cache)
    loader = object.__getattribute__(pipe.transformer, "_ondeck_loader")
    assert np.array_equal(frames(pipe), gguf_reference)
    assert loader.last_source == "file"

    make_unreadable(monkeypatch, gguf_file[0])
    for _ in range(2):  # the entry outlives a release
        pipe.transformer.release()
        assert np.array_equal(frames(pipe), gguf_reference)
        assert loader.last_source == "host cache"
    assert pipe.transformer.load_count >= 3
    if policy == "streaming":
        assert streamed_passes(pipe) > 0


@pytest.mark.parametrize("policy", ["release", "budget"])
def test_a_gguf_text_encoder_loads_through_transformers(base, text_encoder_gguf, reference, policy):
    import torch
    from diffusers import WanPipeline
    from references import in_fresh_tensors
    from transformers import UMT5EncoderModel

    encoder = UMT5EncoderModel.from_pretrained(
        str(text_encoder_gguf.parent),
        gguf_file=str(text_encoder_gguf),
        config=UMT5EncoderModel.config_class.from_pretrained(base / "text_encoder"),
        torch_dtype=torch.float32,
    )
    plain = WanPipeline.from_pretrained(base, text_encoder=encoder, dtype=torch.float32)
    plain.set_progress_bar_config(disable=True)
    expected = frames(in_fresh_tensors(plain))
    assert not np.array_equal(expected, reference), "the Q8_0 encoder differs from the folder's"
    pipe = load(base, policy, components={"text_encoder": text_encoder_gguf})
    assert not ondeck.is_loaded(pipe.text_encoder)

    assert np.array_equal(frames(pipe), expected)
    assert np.array_equal(frames(pipe), expected)
    assert pipe.ondeck.plan().component_bytes["text_encoder"] > 0


def test_a_gguf_file_transformers_cannot_load_for_the_component_is_refused_when_given(
    base, gguf_file, text_encoder_gguf, tmp_path
):
    with pytest.raises(LoadError, match=r"component 'text_encoder': transformers cannot load "):
        load(base, "release", components={"text_encoder": gguf_file[0]})  # the transformer's

    folder = tmp_path / "t5"  # the same encoder's file, for a component said to be CLIP's
    shutil.copytree(base, folder)
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    (folder / "text_encoder" / "config.json").write_text(
        json.dumps({**config, "model_type": "clip_text_model"})
    )
    with pytest.raises(
        LoadError, match=r"holds a umt5 model, and the component is a clip_text_model model"
    ):
        load(folder, "release", components={"text_encoder": text_encoder_gguf})


def test_a_gguf_text_encoder_reloads_from_the_host_cache_without_reading_the_file(
    base, text_encoder_gguf, monkeypatch
):
    from ondeck.loading import HostCache

    expected = frames(load(base, "release", components={"text_encoder": text_encoder_gguf}))
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    pipe = load(base, "release", components={"text_encoder": text_encoder_gguf}, host_cache=cache)
    loader = object.__getattribute__(pipe.text_encoder, "_ondeck_loader")
    assert np.array_equal(frames(pipe), expected)
    assert loader.last_source == "file"

    make_unreadable(monkeypatch, text_encoder_gguf)
    for _ in range(2):  # the entry outlives a release
        assert np.array_equal(frames(pipe), expected)
        assert loader.last_source == "host cache"
    assert pipe.text_encoder.load_count == 3


def in_bf16(base, path, **options):
    """ondeck over ``base`` with the GGUF transformer ``path``, computed in bf16."""
    import torch

    import ondeck.diffusers

    pipe = ondeck.diffusers.from_pretrained(
        base,
        dtype=torch.bfloat16,
        device="cpu",
        progress=False,
        components={"transformer": path},
        **{"policy": "release", **options},
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_a_gguf_file_in_original_names_is_sized_as_it_loads_in_bf16(gguf_base, gguf_file):
    """The file's float tensors in the original repository's names (``modulation``,
    ``time_embedding``), computed in bf16: the modules the model keeps in float32 are
    sized in float32, as they load. Sized from the names alone, the plan undercounted the
    component, took its blocks for a share of it, and refused to stream them."""
    import torch

    pipe = in_bf16(gguf_base, gguf_file[0])
    planned = pipe.ondeck.component_bytes()["transformer"]
    module = pipe.transformer.materialize()
    tensors = list(module.parameters()) + list(module.buffers())
    assert planned == sum(t.numel() * t.element_size() for t in tensors)
    assert any(t.dtype == torch.float32 for t in module.blocks[0].parameters())


def test_auto_streams_a_gguf_transformer_too_large_for_the_card(gguf_base, gguf_file, monkeypatch):
    from ondeck import memory

    sizes = stored_blocks(load(gguf_base, "release", components={"transformer": gguf_file[0]}))
    budget = sizes.other_bytes + 2 * max(sizes.block_bytes) + 2 * max(sizes.packed_bytes)
    gib = 2**30
    card = memory.DeviceFacts("cuda:9", False, 2 * gib, gib + budget)
    monkeypatch.setattr(memory, "device_facts", lambda device=None: card)
    pipe = in_bf16(gguf_base, gguf_file[0], policy="auto")
    assert "block streaming" in pipe.ondeck.policy.reason, pipe.ondeck.policy.reason
    assert "transformer" in pipe.ondeck.plan().streamed


def test_a_gguf_layers_dequantized_copies_are_what_the_plan_reserves(
    gguf_base, gguf_file, monkeypatch
):
    """Each GGUF layer dequantizes its weight for its forward (half precision, then the
    compute dtype): the loader's ``upcast_bytes``, read from the header before anything
    loads, is the largest of those copies, so the plan's upcast reserve covers them."""
    pipe = in_bf16(gguf_base, gguf_file[0])
    planned, copies = planned_and_made_upcasts(pipe, monkeypatch)
    assert copies and max(copies) == planned
    assert pipe.ondeck.snapshot().upcast_bytes == {"transformer": planned}  # the plan's


def test_a_gguf_file_is_read_by_ondecks_reader(gguf_base, gguf_file, gguf_reference, monkeypatch):
    """In parallel into host memory, not copied out of a memory map on one thread."""
    import gguf

    from ondeck.loading import reads

    read_from_gguf = []
    read_into = reads.read_into

    def recording(jobs, **options):
        if {job.info.path for job in jobs} == {str(gguf_file[0])}:
            read_from_gguf.append(sum(job.info.nbytes for job in jobs))
        return read_into(jobs, **options)

    monkeypatch.setattr(reads, "read_into", recording)
    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]})
    assert np.array_equal(frames(pipe), gguf_reference)
    tensors = gguf.GGUFReader(str(gguf_file[0])).tensors
    assert read_from_gguf == [sum(int(tensor.n_bytes) for tensor in tensors)]


def test_a_gguf_type_diffusers_cannot_dequantize_is_refused_naming_the_tensor(tmp_path):
    import gguf

    from ondeck.errors import LoadError
    from ondeck.loading.gguf_file import read_gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_tensor("head.head.weight", np.zeros((1, 4), dtype=np.float32))
    odd = gguf.GGMLQuantizationType.Q8_1  # 32 values in 40 bytes; diffusers has no kernel
    writer.add_tensor("blocks.0.q.weight", np.zeros((2, 40), dtype=np.uint8), raw_dtype=odd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(LoadError, match=r"odd\.gguf.*'blocks\.0\.q\.weight'.*Q8_1"):
        read_gguf(path, "transformer")


def test_a_gguf_file_replaced_after_its_header_was_read_is_not_read(gguf_file, tmp_path):
    import os
    import shutil

    from ondeck.errors import LoadError
    from ondeck.loading.gguf_file import read_gguf

    path = tmp_path / "transformer.gguf"
    shutil.copy(gguf_file[0], path)
    as_read = path.stat()
    replacement = tmp_path / "other.gguf"
    shutil.copy(gguf_file[0], replacement)
    os.replace(replacement, path)  # the same bytes, another file

    with pytest.raises(LoadError, match="transformer.gguf.*changed"):
        read_gguf(path, "transformer", status=as_read)
    assert read_gguf(path, "transformer"), "read as it is now"


def _gguf_without(gguf_base, path, drop, extra=None):
    """The transformer as an F32 GGUF file in the original key names, less ``drop``,
    with the arrays of ``extra`` (name: array) beside them."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from .conftest import original_name, transformer_file

    writer = gguf.GGUFWriter(str(path), arch="wan")
    for key, tensor in load_file(str(transformer_file(gguf_base))).items():
        if key not in drop:
            name = original_name(key).removeprefix("model.diffusion_model.")
            writer.add_tensor(name, tensor.to(torch.float32).numpy())
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_missing_tensors_is_refused_naming_them_before_anything_loads(
    gguf_base, tmp_path
):
    """As a safetensors file lacking them is: when the plan first sizes the component,
    not at its load after the prompt was encoded ("Cannot copy out of meta tensor")."""
    from ondeck.errors import LoadError

    dropped = ("blocks.0.attn1.to_q.weight", "blocks.0.norm2.weight")
    path = _gguf_without(gguf_base, tmp_path / "missing.gguf", dropped)
    with pytest.raises(LoadError, match=r"lacks 2 of .*blocks\.0\.attn1\.to_q\.weight") as error:
        load(gguf_base, "release", components={"transformer": path}).ondeck.plan()
    assert "missing.gguf" in str(error.value) and "'transformer'" in str(error.value)


def test_another_models_gguf_is_one_error_without_the_librarys_log(gguf_base, tmp_path):
    """Tensors the model has not (and lacking its own): diffusers logs every unused
    name before ondeck's error names the missing ones; the error alone is said."""
    import logging

    from ondeck.errors import LoadError

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    extra = {f"other_model.layers.{i}.weight": np.ones((32, 32), np.float32) for i in range(3)}
    path = _gguf_without(gguf_base, tmp_path / "other.gguf", ("blocks.0.norm2.weight",), extra)
    logger = logging.getLogger("diffusers")
    collector = Collect(level=logging.DEBUG)
    logger.addHandler(collector)
    try:
        with pytest.raises(LoadError, match=r"lacks 1 of .*blocks\.0\.norm2\.weight"):
            load(gguf_base, "release", components={"transformer": path}).ondeck.plan()
    finally:
        logger.removeHandler(collector)
    assert not [r for r in records if "other_model" in r.getMessage()]


def test_a_gguf_load_that_fails_keeps_nothing_in_the_host_cache(
    gguf_base, gguf_file, tmp_path, monkeypatch
):
    """The file's bytes are kept only once a module was built from them; a failed build
    gives them back, and the next load reads the file again."""
    from diffusers import WanTransformer3DModel

    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]}, host_cache=cache)
    pipe.ondeck.plan()  # the header's skeleton is built before the failure is set up
    real = WanTransformer3DModel.from_single_file.__func__

    def failing(cls, *args, **kwargs):
        raise RuntimeError("the build failed")

    monkeypatch.setattr(WanTransformer3DModel, "from_single_file", classmethod(failing))
    with pytest.raises(Exception, match="the build failed"):
        frames(pipe)
    assert not [key for key in cache.keys() if key[0] == "gguf"]  # (the text encoder's stays)
    monkeypatch.setattr(WanTransformer3DModel, "from_single_file", classmethod(real))
    frames(pipe)
    assert [key for key in cache.keys() if key[0] == "gguf"]


def planned_and_made_upcasts(pipe, monkeypatch) -> tuple[int, list[int]]:
    """The transformer loader's ``upcast_bytes``, and the bytes each GGUF layer's forward
    made dequantizing its weight and casting it to bfloat16, over one call."""
    import torch
    from diffusers.quantizers.gguf import utils

    planned = object.__getattribute__(pipe.transformer, "_ondeck_loader").upcast_bytes
    copies: list[int] = []
    dequantize = utils.dequantize_gguf_tensor

    def counted(tensor):
        weight = dequantize(tensor)
        if hasattr(tensor, "quant_type"):
            copies.append(weight.numel() * (weight.element_size() + torch.bfloat16.itemsize))
        return weight

    monkeypatch.setattr(utils, "dequantize_gguf_tensor", counted)
    frames(pipe)
    return planned, copies


def test_an_elastic_cache_takes_no_gguf_component_the_plan_keeps_loaded(
    gguf_base, gguf_file, monkeypatch
):
    """A GGUF entry's key is the file's, not (folder, component): the loader names its
    component, so the elastic cache takes nothing of a transformer no run reloads."""
    from ondeck.loading import HostCache
    from ondeck.policy import BudgetPolicy

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(2**30, pin=False, elastic=True)
    pipe = load(
        gguf_base,
        BudgetPolicy(2**30),
        components={"transformer": gguf_file[0]},
        host_cache=cache,
    )
    for _ in range(2):
        frames(pipe)
    assert all("transformer" in resident for _, resident, _ in pipe.ondeck.plan().stages)

    assert cache.keys() == []
