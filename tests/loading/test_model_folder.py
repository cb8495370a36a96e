"""A model folder read from model_index.json, configs and headers: components, specs
known without reading a byte of tensor data, and errors that name the file and component."""

from __future__ import annotations

import builtins
import json

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel
from transformers import PretrainedConfig

from ondeck.errors import LoadError
from ondeck.lazy import ComponentSpec, module_nbytes
from ondeck.loading import ComponentLoader, ModelFolder, reads, ring, safetensors_format
from ondeck.loading import model_folder as folder_module

from .helpers import shard, weights_file


def as_dict(config) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def test_folder_lists_components_from_model_index(wan_template):
    folder = ModelFolder.open(wan_template)
    assert folder.path == wan_template
    assert folder.pipeline_class_name == "WanPipeline"
    # As diffusers' save_pretrained writes them: sorted, absent ones ([null, null]) left out.
    assert folder.component_names == (
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    )
    assert [folder.is_model(n) for n in folder.component_names] == [False, True, False, True, True]
    assert folder.component_class("transformer") is WanTransformer3DModel
    assert folder.component_class("scheduler") is UniPCMultistepScheduler


def test_null_entries_are_skipped(wan_folder):
    index = json.loads((wan_folder / "model_index.json").read_text())
    index["safety_checker"] = [None, None]
    (wan_folder / "model_index.json").write_text(json.dumps(index))
    assert "safety_checker" not in ModelFolder.open(wan_folder).component_names


def test_tensors_carry_their_file(wan_template):
    tensors = ModelFolder.open(wan_template).tensors("vae")
    path = str(weights_file(wan_template / "vae"))
    assert tensors and all(info.path == path for info in tensors.values())
    assert ModelFolder.open(wan_template).file_bytes("vae") == sum(
        info.nbytes for info in tensors.values()
    )


def test_spec_describes_the_loaded_module_exactly(wan_template):
    folder = ModelFolder.open(wan_template)
    for name in ("transformer", "vae", "text_encoder"):
        for dtype in (None, torch.float32, torch.bfloat16, torch.float16):
            spec = folder.spec(name, dtype=dtype)
            loaded = ComponentLoader(folder, name, dtype=dtype)()
            assert isinstance(spec, ComponentSpec)
            assert spec.cls is type(loaded)
            assert spec.nbytes == module_nbytes(loaded), (name, dtype)
            assert spec.dtype == (dtype or torch.float32)
            assert type(spec.config) is type(loaded.config)
            assert as_dict(spec.config) == as_dict(loaded.config)


def test_spec_config_answers_like_the_module_config(wan_template):
    folder = ModelFolder.open(wan_template)
    transformer = folder.spec("transformer").config
    assert transformer.patch_size == [1, 2, 2]
    assert folder.spec("vae").config.scale_factor_temporal == 4
    text_config = folder.spec("text_encoder").config
    assert isinstance(text_config, PretrainedConfig) and text_config.d_model == 32


def test_spec_default_dtype_is_the_files_dominant_float(wan_folder):
    from safetensors.torch import load_file, save_file

    path = weights_file(wan_folder / "vae")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path))
    folder = ModelFolder.open(wan_folder)
    assert folder.spec("vae").dtype == torch.bfloat16
    assert folder.spec("vae", device="cpu").device == torch.device("cpu")


def test_spec_of_a_part_without_weights(wan_template):
    spec = ModelFolder.open(wan_template).spec("scheduler")
    assert spec.cls is UniPCMultistepScheduler and spec.nbytes == 0
    assert spec.config["_class_name"] == "UniPCMultistepScheduler"
    assert spec.config.prediction_type == "flow_prediction"


def test_specs_never_read_tensor_data(wan_template, monkeypatch):
    header_bytes_read = []
    real_open = builtins.open

    class CountingFile:
        def __init__(self, file):
            self.file = file

        def read(self, size=-1):
            data = self.file.read(size)
            header_bytes_read.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    def counting_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return CountingFile(file) if str(path).endswith(".safetensors") else file

    def no_reads(*args, **kwargs):
        raise AssertionError("a spec read tensor data")

    monkeypatch.setattr(safetensors_format, "open", counting_open, raising=False)
    monkeypatch.setattr(reads, "read_into", no_reads)
    monkeypatch.setattr(ring.os, "preadv", no_reads)
    folder = ModelFolder.open(wan_template)
    for name in ("transformer", "vae", "text_encoder"):
        assert folder.spec(name).nbytes > 0
    headers = sum(
        h.data_start for n in ("transformer", "vae", "text_encoder") for h in folder.headers(n)
    )
    assert 0 < sum(header_bytes_read) <= headers


def test_module_is_built_once_per_dtype_and_copied_for_loads(wan_template, monkeypatch):
    from ondeck.loading import model_folder as folder_module
    from ondeck.loading import skeleton as skeleton_module

    builds = []
    real_build = skeleton_module.build_skeleton

    def counting_build(*args, **kwargs):
        builds.append(args[2])
        return real_build(*args, **kwargs)

    monkeypatch.setattr(folder_module, "build_skeleton", counting_build)
    folder = ModelFolder.open(wan_template)
    folder.spec("vae", dtype=torch.float32)
    folder.spec("vae", dtype=torch.float32)
    assert builds == [torch.float32]

    # Loads copy the module built for the spec: torch's process-wide default dtype, which
    # a thread running the model relies on, is never touched by a load.
    default_changes = []
    monkeypatch.setattr(torch, "set_default_dtype", default_changes.append)
    first = ComponentLoader(folder, "vae", dtype=torch.float32)()
    second = ComponentLoader(folder, "vae", dtype=torch.float32)()
    assert builds == [torch.float32] and default_changes == []
    assert first is not second and first.config is not second.config
    assert first.decoder.conv_in.weight is not second.decoder.conv_in.weight


def test_sharded_weights_are_found_through_their_index(wan_folder):
    shard(wan_folder / "transformer", parts=2)
    folder = ModelFolder.open(wan_folder)
    assert len(folder.weight_files("transformer")) == 2
    loaded = ComponentLoader(folder, "transformer")()
    assert folder.spec("transformer").nbytes == module_nbytes(loaded)


def test_variant_files_are_chosen_on_request(wan_folder):
    import shutil

    directory = wan_folder / "vae"
    plain = weights_file(directory)
    variant = directory / "diffusion_pytorch_model.fp16.safetensors"
    shutil.copy(plain, variant)
    assert ModelFolder.open(wan_folder).weight_files("vae") == [str(plain)]
    assert ModelFolder.open(wan_folder, variant="fp16").weight_files("vae") == [str(variant)]
    plain.unlink()
    assert ModelFolder.open(wan_folder).weight_files("vae") == [str(variant)]


# -- what goes wrong, said plainly ----------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(LoadError, match="does not exist") as caught:
        ComponentLoader(tmp_path / "nowhere", "vae")
    assert "nowhere" in str(caught.value) and "'vae'" in str(caught.value)


def test_missing_model_index(wan_folder):
    (wan_folder / "model_index.json").unlink()
    with pytest.raises(LoadError, match="no model_index.json") as caught:
        ComponentLoader(wan_folder, "vae")
    assert str(wan_folder) in str(caught.value) and "'vae'" in str(caught.value)


def test_missing_config(wan_folder):
    (wan_folder / "vae" / "config.json").unlink()
    with pytest.raises(LoadError, match="is missing") as caught:
        ModelFolder.open(wan_folder).spec("vae")
    assert "vae/config.json" in str(caught.value) and "'vae'" in str(caught.value)


def test_missing_component_folder(wan_folder):
    import shutil

    shutil.rmtree(wan_folder / "vae")
    with pytest.raises(LoadError, match="is missing") as caught:
        ModelFolder.open(wan_folder).spec("vae")
    assert "'vae'" in str(caught.value)


def test_component_not_in_model_index(wan_template):
    with pytest.raises(LoadError, match="not in .*model_index.json"):
        ModelFolder.open(wan_template).spec("unet")


def test_unknown_class_names_component_class_and_library_version(wan_folder):
    import diffusers

    index = json.loads((wan_folder / "model_index.json").read_text())
    index["vae"] = ["diffusers", "AutoencoderKLFuture"]
    (wan_folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError) as caught:
        ModelFolder.open(wan_folder).spec("vae")
    message = str(caught.value)
    assert "'vae'" in message and "AutoencoderKLFuture" in message
    assert diffusers.__version__ in message


def test_shard_index_pointing_at_a_missing_shard(wan_folder):
    files = shard(wan_folder / "transformer", parts=2)
    files[1].unlink()
    with pytest.raises(LoadError, match="is missing") as caught:
        ModelFolder.open(wan_folder).spec("transformer")
    assert files[1].name in str(caught.value) and "'transformer'" in str(caught.value)


def test_shard_index_naming_a_tensor_its_shard_lacks(wan_folder):
    shard(wan_folder / "transformer", parts=2)
    index_path = next((wan_folder / "transformer").glob("*.index.json"))
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(LoadError, match="ghost.weight"):
        ModelFolder.open(wan_folder).tensors("transformer")


def test_damaged_header_names_file_and_component(wan_folder):
    path = weights_file(wan_folder / "vae")
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"#!@$"
    path.write_bytes(bytes(raw))
    with pytest.raises(LoadError, match="not valid JSON") as caught:
        ModelFolder.open(wan_folder).spec("vae")
    assert str(path) in str(caught.value) and "'vae'" in str(caught.value)


def test_truncated_weights_name_file_and_component(wan_folder):
    path = weights_file(wan_folder / "vae")
    path.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(LoadError, match="truncated download") as caught:
        ComponentLoader(wan_folder, "vae")()
    assert str(path) in str(caught.value) and "'vae'" in str(caught.value)


def test_folder_module_has_no_weight_reading(monkeypatch):
    assert not hasattr(folder_module, "read_into")
