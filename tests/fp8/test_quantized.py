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


def with_quantization_config(folder: Path, destination: Path, name: str, settings) -> Path:
    """A copy of ``folder`` whose component ``name`` has ``settings`` as its config's
    ``quantization_config``."""
    shutil.copytree(folder, destination)
    config_path = destination / name / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = settings
    config_path.write_text(json.dumps(config))
    return destination


def test_a_quant_method_in_upper_case_loads_as_gguf(wan_gguf, tmp_path):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    folder = with_quantization_config(
        wan_gguf, tmp_path / "upper", "transformer", {"quant_method": "GGUF"}
    )
    loader = component_loader(folder, "transformer", dtype=torch.float32)

    assert isinstance(loader, QuantizedComponentLoader) and loader.method == "gguf"
    assert any(isinstance(p, GGUFParameter) for p in loader().parameters())


def test_a_gguf_config_without_a_compute_dtype_computes_in_float32(wan_gguf, tmp_path):
    folder = with_quantization_config(
        wan_gguf, tmp_path / "no-dtype", "transformer", {"quant_method": "gguf"}
    )
    loader = component_loader(folder, "transformer")
    module = loader()

    assert loader.dtype == torch.float32
    assert module.blocks[0].attn1.to_q.compute_dtype == torch.float32
    assert {p.dtype for p in module.parameters() if p.is_floating_point()} == {torch.float32}


def test_a_gguf_config_on_a_model_without_single_file_loading_is_refused_naming_it(
    wan_fp32, tmp_path
):
    """A transformers text encoder whose folder's config asks for gguf: refused when its
    loader is made, not an AttributeError at its first load."""
    folder = with_quantization_config(
        wan_fp32, tmp_path / "te-gguf", "text_encoder", {"quant_method": "gguf"}
    )
    with pytest.raises(
        LoadError,
        match=r"component 'text_encoder': gguf weights load through diffusers' single-file "
        r"loading, which transformers\.UMT5EncoderModel does not have",
    ):
        component_loader(folder, "text_encoder")


@pytest.mark.parametrize(("dtype", "bytes_per_element"), [(torch.float16, 2), (torch.float32, 6)])
def test_a_gguf_layers_cast_copy_is_counted_only_where_it_computes_in_another_dtype(
    wan_gguf, dtype, bytes_per_element
):
    """A Q8_0 weight dequantizes to float16 (2 bytes an element): computing in float16
    makes no second copy, computing in float32 casts it (4 bytes an element more)."""
    loader = component_loader(wan_gguf, "transformer", dtype=dtype)
    path = next((wan_gguf / "transformer").glob("*.gguf"))
    quantized = [t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name == "Q8_0"]
    largest = max(int(t.n_elements) for t in quantized)

    assert loader.upcast_bytes == largest * bytes_per_element


def test_a_gguf_load_whose_file_cannot_be_read_raises_that_error_unwrapped(wan_gguf, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(wan_gguf, folder)
    (folder / "transformer" / "transformer-Q8_0.gguf").write_bytes(b"not gguf")
    loader = component_loader(folder, "transformer")

    with pytest.raises(LoadError) as caught:
        loader()
    message = str(caught.value)
    assert message.startswith("component 'transformer': ") and "not a readable GGUF" in message
    assert "failed with LoadError" not in message


def test_a_failed_copy_into_the_host_cache_leaves_no_reservation(wan_gguf, monkeypatch):
    """The copy of the file's bytes into the cache fails (one buffer too short): the
    reservation goes, and the next load fills the cache."""
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    reserve = HostCache.reserve

    def one_buffer_short(self, key, infos, **options):
        buffers = reserve(self, key, infos, **options)
        name = next(iter(buffers))
        return {**buffers, name: buffers[name][:-1]}

    monkeypatch.setattr(HostCache, "reserve", one_buffer_short)
    loader = component_loader(wan_gguf, "transformer", dtype=torch.float32, host_cache=cache)
    with pytest.raises(LoadError, match="RuntimeError"):
        loader()
    assert cache.held_bytes == 0

    monkeypatch.setattr(HostCache, "reserve", reserve)
    loader()
    assert [key for key in cache.keys() if key[0] == "gguf"]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_quanto_component_keeps_no_host_cache(wan_quanto, monkeypatch):
    """Its weights come from its files every load, so a host cache given to it would
    only be counted by the host plan (its budget taken from the room for streaming)."""
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    loader = component_loader(wan_quanto, "transformer", host_cache=cache)

    assert loader.method == "quanto" and loader.host_cache is None


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds: a quantized tensor's own (quanto's int8 data and
    scales), not its numel at the element size of the dtype it dequantizes to."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_quanto_component_in_bf16_is_sized_with_its_float32_modules_in_float32(
    wan_wide, tmp_path
):
    """diffusers keeps the Wan transformer's norms and time embedder in float32 whatever
    the dtype: the plan counts them at 4 bytes an element, as they load. (The embedders'
    layers are left unquantized: quanto would store the time embedder's in int8.)"""
    pytest.importorskip("optimum.quanto")
    from diffusers import QuantoConfig, WanTransformer3DModel

    folder = tmp_path / "wan"
    shutil.copytree(wan_wide, folder)
    quantization = QuantoConfig(
        weights_dtype="int8", modules_to_not_convert=["linear_1", "linear_2"]
    )
    model = WanTransformer3DModel.from_pretrained(
        wan_wide / "transformer", quantization_config=quantization, torch_dtype=torch.float32
    )
    shutil.rmtree(folder / "transformer")
    model.save_pretrained(folder / "transformer")
    loader = component_loader(folder, "transformer", dtype=torch.bfloat16)
    module = loader()

    assert module.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert any(t.dtype == torch.float32 for t in module.blocks[0].norm2.parameters())
    assert loader.spec.nbytes == sum(map(stored_bytes, [*module.parameters(), *module.buffers()]))
