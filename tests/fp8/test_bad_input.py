"""A storage or quantization ondeck cannot apply: one line naming the component and the
method, before anything loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import ondeck.diffusers
from ondeck.errors import LoadError
from ondeck.loading import ComponentLoader, reads
from ondeck.pipelines.wan import WanTextToVideo


@pytest.fixture
def no_reads(monkeypatch):
    def refuse(jobs, **options):
        raise AssertionError("weights were read")

    monkeypatch.setattr(reads, "read_into", refuse)


def quantized_copy(source, tmp_path, method: str | None):
    path = tmp_path / "quantized"
    shutil.copytree(source, path)
    config_path = path / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": method} if method else {"bits": 4}
    config_path.write_text(json.dumps(config))
    return path, config_path


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("method", ["bitsandbytes", "torchao", "awq", None])
def test_a_quantization_ondeck_cannot_load_is_refused_naming_component_and_method(
    method, wan_bf16, tmp_path, no_reads
):
    import importlib.util

    if method in ("bitsandbytes", "torchao") and importlib.util.find_spec(method):
        pytest.skip(f"{method} is installed here")
    path, config_path = quantized_copy(wan_bf16, tmp_path, method)
    with pytest.raises(LoadError) as error:
        WanTextToVideo.from_folder(path, device="cpu", dtype=torch.bfloat16, progress=False)
    text = one_line(error)
    assert text.startswith(f"component 'transformer': {config_path} asks for ")
    assert (repr(method) if method else "an unnamed") in text
    if method in ("bitsandbytes", "torchao"):
        assert f"its package is not installed (pip install {method})" in text
    else:
        assert "ondeck knows no package that loads it" in text
    assert error.value.component == "transformer"


def test_a_gguf_config_without_its_file_is_refused_before_loading(wan_bf16, tmp_path, no_reads):
    pytest.importorskip("gguf")
    path, _ = quantized_copy(wan_bf16, tmp_path, "gguf")
    with pytest.raises(LoadError) as error:
        WanTextToVideo.from_folder(path, device="cpu", dtype=torch.bfloat16, progress=False)
    text = one_line(error)
    assert text.startswith("component 'transformer': its config asks for gguf quantization")
    assert "holds no .gguf file" in text


def test_gguf_says_whether_its_package_is_installed(wan_bf16, tmp_path, no_reads):
    import importlib.util

    path, _ = quantized_copy(wan_bf16, tmp_path, "gguf")
    installed = importlib.util.find_spec("gguf") is not None
    with pytest.raises(LoadError) as error:
        ComponentLoader(path, "transformer")
    state = "installed" if installed else "not installed"
    assert f"its package 'gguf' is {state}" in one_line(error)


def test_diffusers_from_pretrained_refuses_before_loading(wan_bf16, tmp_path, no_reads):
    path, _ = quantized_copy(wan_bf16, tmp_path, "bitsandbytes")
    with pytest.raises(LoadError, match="component 'transformer'.*'bitsandbytes' quantization"):
        ondeck.diffusers.from_pretrained(path, device="cpu")


def test_fp8_storage_on_mps_is_refused(wan_bf16, no_reads):
    with pytest.raises(LoadError) as error:
        ComponentLoader(wan_bf16, "transformer", device="mps", storage_dtype="fp8")
    text = one_line(error)
    assert text.startswith("component 'transformer': float8_e4m3fn storage cannot work on mps")


@pytest.mark.parametrize("storage", ["int8", "fp4", torch.float16])
def test_a_storage_dtype_ondeck_does_not_store_in_is_refused(storage, wan_bf16, no_reads):
    with pytest.raises(LoadError) as error:
        ComponentLoader(wan_bf16, "transformer", dtype=torch.float32, storage_dtype=storage)
    text = one_line(error)
    assert text.startswith("component 'transformer': storage dtype ")
    assert "'fp8' (float8_e4m3fn)" in text


def test_computing_in_fp8_is_refused(wan_bf16, no_reads):
    with pytest.raises(
        LoadError, match="component 'transformer': torch.float8_e4m3fn is a storage"
    ):
        ComponentLoader(wan_bf16, "transformer", dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("compute", [torch.int16, torch.uint8])
def test_fp8_storage_with_a_compute_dtype_that_is_not_a_wider_float_is_refused(
    compute, wan_bf16, no_reads
):
    with pytest.raises(LoadError) as error:
        ComponentLoader(wan_bf16, "transformer", dtype=compute, storage_dtype="fp8")
    assert one_line(error) == (
        f"component 'transformer': fp8 storage needs a wider compute dtype than {compute}"
    )


def test_storage_for_a_component_the_folder_lacks_is_refused(wan_bf16, no_reads):
    with pytest.raises(LoadError, match="storage_dtype names 'unet', not a model component"):
        WanTextToVideo.from_folder(wan_bf16, device="cpu", storage_dtype={"unet": "fp8"})
