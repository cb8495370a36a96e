"""GGUF files beyond Q8_0: BF16 matrices, and a load that fails part way."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file

from ondeck.errors import LoadError

from .conftest import _is_stored, load, original_name, transformer_file
from .test_gguf import in_bf16, planned_and_made_upcasts

gguf = pytest.importorskip("gguf")


def _transformer_gguf(base, path, kind, *, quantized: int | None = None):
    """The base's transformer as a GGUF file, its stored layers in ``kind`` (the first
    ``quantized`` of them; all where None), the rest as float32."""
    writer = gguf.GGUFWriter(str(path), arch="wan")
    for key, tensor in load_file(str(transformer_file(base))).items():
        name = original_name(key).removeprefix("model.diffusion_model.")
        array = tensor.to(torch.float32).numpy()
        if _is_stored(key, tensor) and (quantized is None or quantized > 0):
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
            quantized = None if quantized is None else quantized - 1
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bf16_gguf(gguf_base, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-bf16") / "wan2.1_t2v_tiny-BF16.gguf"
    return _transformer_gguf(gguf_base, path, gguf.GGMLQuantizationType.BF16)


def test_a_bf16_gguf_layers_dequantized_copies_are_covered_by_the_plan(
    gguf_base, bf16_gguf, monkeypatch
):
    """diffusers loads a BF16 GGUF tensor as a GGUFParameter (bytes) and every layer holding
    one dequantizes it for its forward (to float32, then the compute dtype), as a Q8_0 layer
    does. The loader's ``upcast_bytes`` (the plan's reserve for those copies) covers
    them, at float32 for BF16."""
    pipe = in_bf16(gguf_base, bf16_gguf)
    planned, copies = planned_and_made_upcasts(pipe, monkeypatch)

    assert copies, "the BF16 layers dequantize per forward"
    assert planned >= max(copies), f"the plan reserves {planned} bytes for {max(copies)}"


def test_a_gguf_load_that_fails_keeps_no_module_or_file_bytes_alive(
    gguf_base, gguf_file, monkeypatch
):
    """The device runs out of memory while diffusers builds the GGUF transformer (here: at
    the last moment, once every tensor is in place). The error a caller (or an OOM retry)
    holds keeps neither the half-built module nor the file's quantized bytes alive."""
    import diffusers.loaders.single_file_model as single_file_model

    pipe = load(gguf_base, "release", components={"transformer": gguf_file[0]})
    seen: list[weakref.ref] = []
    original = single_file_model.load_model_dict_into_meta

    def out_of_memory(model, state_dict, *args, **kwargs):
        original(model, state_dict, *args, **kwargs)
        seen.append(weakref.ref(model))
        seen.extend(weakref.ref(tensor) for tensor in state_dict.values())
        del model, state_dict, args, kwargs  # this frame keeps nothing
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(single_file_model, "load_model_dict_into_meta", out_of_memory)

    with pytest.raises(LoadError) as caught:
        pipe.transformer.materialize()
    gc.collect()

    assert seen
    alive = [ref() for ref in seen if ref() is not None]
    assert not alive, (
        f"the error keeps {len(alive)} objects of the failed load alive "
        f"({sum(isinstance(a, torch.nn.Module) for a in alive)} module(s))"
    )
    del caught


def test_a_type_diffusers_cannot_dequantize_is_refused_by_the_plan(
    gguf_base, tmp_path, monkeypatch
):
    """An MXFP4 tensor is named from the header, when the pipeline is made or planned:
    before, the plan said "fits" and the first call failed after its text encoder ran."""
    from ondeck.loading import reads as reader

    kind = gguf.GGMLQuantizationType.MXFP4
    path = _transformer_gguf(gguf_base, tmp_path / "wan-MXFP4.gguf", kind, quantized=1)
    monkeypatch.setattr(reader, "read_into", lambda *a, **k: pytest.fail("read weights"))

    with pytest.raises(LoadError, match=r"component 'transformer': .*is quantized as MXFP4"):
        load(gguf_base, components={"transformer": path}).ondeck.plan()


def test_a_gguf_of_narrower_layers_is_refused_without_advice_a_user_cannot_take(
    gguf_base, tmp_path
):
    """A GGUF whose first stored matrix has half its rows: the error names the file and
    the mismatch, without diffusers' advice to pass loading arguments ondeck makes."""
    path = tmp_path / "narrower.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    narrowed = False
    for key, tensor in load_file(str(transformer_file(gguf_base))).items():
        name = original_name(key).removeprefix("model.diffusion_model.")
        array = tensor.to(torch.float32).numpy()
        if not narrowed and _is_stored(key, tensor):
            array, narrowed = array[: array.shape[0] // 2], True
        writer.add_tensor(name, array)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file):
        write()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(LoadError, match=r"narrower\.gguf") as caught:
        load(gguf_base, "release", components={"transformer": path}).transformer.materialize()
    assert "shape" in str(caught.value)
    assert "ignore_mismatched_sizes" not in str(caught.value)
