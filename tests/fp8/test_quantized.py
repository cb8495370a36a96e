"""A component already quantized (a GGUF file; quanto's safetensors) loads on demand
through the quantizer its library uses and is freed on release like any other; what
cannot apply to it is refused before loading."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ondeck.errors import LoadError
from ondeck.loading import QuantizedComponentLoader, component_loader
from ondeck.pipelines.wan import WanTextToVideo

gguf = pytest.importorskip("gguf")

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=2)


def write_gguf(tensors: dict[str, torch.Tensor], path: Path) -> int:
    """Write ``tensors`` under their diffusers names: Q8_0 where a row is whole blocks of
    32, float32 otherwise. Returns how many were quantized."""
    writer = gguf.GGUFWriter(str(path), arch="wan")
    quantized = 0
    for name, tensor in tensors.items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[-1] % 32 == 0:
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
            quantized += 1
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


@pytest.fixture(scope="module")
def wan_wide(wan_fp32, tmp_path_factory) -> Path:
    """The tiny Wan folder with a transformer 32 wide, so that its layers quantize to Q8_0
    (blocks of 32 values)."""
    from diffusers import WanTransformer3DModel

    path = tmp_path_factory.mktemp("gguf") / "wide"
    shutil.copytree(wan_fp32, path)
    directory = path / "transformer"
    config = WanTransformer3DModel.load_config(directory)
    config.update(num_attention_heads=2, attention_head_dim=16, ffn_dim=64)
    shutil.rmtree(directory)
    torch.manual_seed(0)
    WanTransformer3DModel.from_config(config).save_pretrained(directory)
    return path


@pytest.fixture(scope="module")
def wan_gguf(wan_wide, tmp_path_factory) -> Path:
    """The same folder with its transformer as a GGUF file and a config that says so."""
    path = tmp_path_factory.mktemp("gguf") / "wan"
    shutil.copytree(wan_wide, path)
    directory = path / "transformer"
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    for index in directory.glob("*.index.json"):
        index.unlink()
    assert write_gguf(tensors, directory / "transformer-Q8_0.gguf") >= 10
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "gguf", "compute_dtype": "float32"}
    config_path.write_text(json.dumps(config))
    return path


def generate(folder: Path, **options):
    pipe = WanTextToVideo.from_folder(
        folder, device="cpu", dtype=torch.float32, progress=False, **options
    )
    return pipe, pipe.generate("a fox", seed=0, output_type="latent", **SHAPE)


def test_the_pipeline_loads_the_gguf_transformer_through_diffusers_quantizer(wan_wide, wan_gguf):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    pipe, latents = generate(wan_gguf, policy="budget")
    transformer = pipe.components["transformer"]
    assert isinstance(pipe.loaders["transformer"], QuantizedComponentLoader)
    quantized = [p for p in transformer.parameters() if isinstance(p, GGUFParameter)]
    assert len(quantized) >= 10
    assert all(p.quant_type == gguf.GGMLQuantizationType.Q8_0 for p in quantized)
    # The plan's bytes, from the file's header, are what the loaded module holds.
    tensors = [*transformer.parameters(), *transformer.buffers()]
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert pipe.loaders["transformer"].spec.nbytes == held
    float_pipe, reference = generate(wan_wide, policy="budget")
    assert held < 0.6 * float_pipe.loaders["transformer"].spec.nbytes
    # Q8_0 rounds each weight to one of 255 steps of its block's scale: close, not equal.
    difference = (latents - reference).abs().max().item()
    assert 0 < difference < 0.05 * reference.abs().max().item()


def test_release_frees_the_quantized_module_and_the_next_run_loads_it_again(wan_gguf):
    pipe = WanTextToVideo.from_folder(
        wan_gguf, device="cpu", dtype=torch.float32, policy="release", progress=False
    )
    seen = []
    pipe.components["transformer"].add_transform(
        lambda module: seen.append(weakref.ref(module)) or module
    )
    first = pipe.generate("a fox", seed=0, output_type="latent", **SHAPE)
    gc.collect()
    assert len(seen) == 1 and seen[0]() is None  # released after denoising, and gone
    second = pipe.generate("a fox", seed=0, output_type="latent", **SHAPE)
    assert len(seen) == 2 and pipe.components["transformer"].load_count == 2
    assert torch.equal(first, second)


def test_what_cannot_apply_to_a_gguf_component_is_refused_before_loading(wan_gguf, tmp_path):
    with pytest.raises(LoadError, match="already quantized \\(gguf\\); fp8 storage"):
        WanTextToVideo.from_folder(
            wan_gguf, device="cpu", storage_dtype={"transformer": "fp8"}, progress=False
        )
    with pytest.raises(LoadError, match="already quantized \\(gguf\\), and FSDP2 sharding"):
        WanTextToVideo.from_folder(wan_gguf, device="cpu", shard=("transformer",))
    with pytest.raises(LoadError, match="cannot be placed elsewhere"):
        component_loader(wan_gguf, "transformer", placement=object())
    two = tmp_path / "two"
    shutil.copytree(wan_gguf, two)
    (two / "transformer" / "transformer-Q8_0.gguf").rename(two / "transformer" / "a.gguf")
    shutil.copy(two / "transformer" / "a.gguf", two / "transformer" / "b.gguf")
    with pytest.raises(LoadError, match="component 'transformer'.*holds 2 .gguf files"):
        component_loader(two, "transformer")
    broken = tmp_path / "broken"
    shutil.copytree(wan_gguf, broken)
    (broken / "transformer" / "transformer-Q8_0.gguf").write_bytes(b"not gguf")
    loader = component_loader(broken, "transformer")
    with pytest.raises(LoadError, match="component 'transformer'.*not a readable GGUF file"):
        loader.spec  # noqa: B018


def test_without_the_gguf_package_the_error_says_so(wan_gguf, monkeypatch):
    from ondeck.loading import quantized

    monkeypatch.setattr(quantized, "package_installed", lambda method: False)
    with pytest.raises(LoadError) as error:
        WanTextToVideo.from_folder(wan_gguf, device="cpu", progress=False)
    text = str(error.value)
    assert "\n" not in text
    assert "component 'transformer'" in text and "'gguf' quantization" in text
    assert "its package is not installed (pip install gguf)" in text


def test_diffusers_integration_loads_the_gguf_transformer_on_demand(wan_gguf):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    import ondeck.diffusers

    pipe = ondeck.diffusers.from_pretrained(wan_gguf, device="cpu", torch_dtype=torch.float32)
    seen = []
    pipe.transformer.add_transform(lambda module: seen.append(module) or module)
    output = pipe(
        "a fox", output_type="latent", generator=torch.Generator().manual_seed(0), **SHAPE
    )
    assert output.frames.dim() == 5
    assert len(seen) == 1
    assert any(isinstance(p, GGUFParameter) for p in seen[0].parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gguf_transformer_loads_onto_cuda_quantized_and_computes_as_on_the_cpu(wan_gguf):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    modules = {}
    for device in ("cpu", "cuda"):
        loader = component_loader(wan_gguf, "transformer", device=device, dtype=torch.float32)
        modules[device] = loader()
        assert loader.spec.nbytes == sum(
            t.numel() * t.element_size()
            for t in [*modules[device].parameters(), *modules[device].buffers()]
        )
    quantized = [p for p in modules["cuda"].parameters() if isinstance(p, GGUFParameter)]
    assert quantized and all(p.device.type == "cuda" for p in quantized)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
    )
    with torch.no_grad():
        on_cpu = modules["cpu"](**inputs).sample
        on_cuda = modules["cuda"](**{k: v.cuda() for k, v in inputs.items()}).sample.cpu()
    assert torch.allclose(on_cpu, on_cuda, rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def wan_quanto(wan_wide, tmp_path_factory) -> Path:
    """The wide folder with its transformer quantized to int8 by quanto through diffusers
    and saved by its ``save_pretrained`` (safetensors, the config naming the method)."""
    pytest.importorskip("optimum.quanto")
    from diffusers import QuantoConfig, WanTransformer3DModel

    path = tmp_path_factory.mktemp("quanto") / "wan"
    shutil.copytree(wan_wide, path)
    directory = path / "transformer"
    with pytest.warns(FutureWarning):  # diffusers deprecates quanto, still supports it
        model = WanTransformer3DModel.from_pretrained(
            wan_wide / "transformer",
            quantization_config=QuantoConfig(weights_dtype="int8"),
            torch_dtype=torch.float32,
        )
    shutil.rmtree(directory)
    model.save_pretrained(directory)
    assert (
        json.loads((directory / "config.json").read_text())["quantization_config"]["quant_method"]
        == "quanto"
    )
    return path


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_quanto_transformer_loads_through_from_pretrained_and_is_released(wan_wide, wan_quanto):
    from optimum.quanto import QLinear

    pipe = WanTextToVideo.from_folder(
        wan_quanto, device="cpu", dtype=torch.float32, policy="release", progress=False
    )
    seen = []
    pipe.components["transformer"].add_transform(
        lambda module: seen.append(weakref.ref(module)) or module
    )
    loader = pipe.loaders["transformer"]
    assert isinstance(loader, QuantizedComponentLoader) and loader.method == "quanto"
    observed = {}

    def inspect(module):
        layers = [m for m in module.modules() if isinstance(m, QLinear)]
        observed["qlinear"] = len(layers)
        observed["int8"] = all(layer.weight._data.dtype == torch.int8 for layer in layers)
        return module

    pipe.components["transformer"].add_transform(inspect)
    latents = pipe.generate("a fox", seed=0, output_type="latent", **SHAPE)
    gc.collect()
    assert seen and seen[0]() is None  # released after denoising, and gone
    assert observed["qlinear"] >= 10 and observed["int8"]
    # The plan counts the int8 bytes the files hold (and their float scales).
    float_pipe, reference = generate(wan_wide, policy="release")
    assert loader.spec.nbytes < 0.6 * float_pipe.loaders["transformer"].spec.nbytes
    # int8 weights with a scale per output row: close to float32's latents, not equal.
    difference = (latents - reference).abs().max().item()
    assert 0 < difference < 0.05 * reference.abs().max().item()
