"""The weights users bring, written in the tests from a tiny Wan pipeline: its transformer
as one file in the original repository's key names, in float8, fp8_scaled and GGUF, and
LoRAs in diffusers' and in a trainer's key layout. Each fixture also gives the reference:
plain diffusers over a folder holding the weights the file stands for."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from references import in_fresh_tensors
from safetensors.torch import load_file, save_file
from streaming.conftest import budget_keeping, build_six_block_folder

FP8 = torch.float8_e4m3fn
SHAPE = dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16)

# diffusers' Wan names -> the original repository's (Wan-Video/Wan2.1), written by hand:
# the inverse of what diffusers' convert_wan_transformer_to_diffusers does.
_TO_ORIGINAL = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"\.norm2\.", ".norm3."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
]


def original_name(key: str) -> str:
    for pattern, replacement in _TO_ORIGINAL:
        key = re.sub(pattern, replacement, key)
    return "model.diffusion_model." + key


def frames(pipe, prompt: str = "a fox") -> np.ndarray:
    """The run's latents, as the transformer left them: the tiny VAE's decoded frames
    hardly depend on its input (a zeroed transformer moves them by under 1e-7), so a
    comparison of frames could not tell two transformers apart."""
    generator = torch.Generator().manual_seed(7)
    out = pipe(prompt, negative_prompt="blurry", generator=generator, output_type="latent", **SHAPE)
    return out.frames.float().numpy()


def transformer_file(folder: Path) -> Path:
    (path,) = (folder / "transformer").glob("*.safetensors")
    return path


def with_transformer(base: Path, destination: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A copy of ``base`` whose transformer holds ``weights`` (diffusers' names)."""
    shutil.copytree(base, destination)
    for old in (destination / "transformer").glob("*.safetensors"):
        old.unlink()
    save_file(weights, str(destination / "transformer" / "diffusion_pytorch_model.safetensors"))
    return destination


def reference_frames(folder: Path, loras=(), prompt="a fox", transformer_2=False) -> np.ndarray:
    """Plain diffusers over ``folder``, its weights in fresh tensors (tests/references.py)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
    for index, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"lora_{index}")
        if transformer_2:
            pipe.load_lora_weights(
                str(path), adapter_name=f"lora_{index}", load_into_transformer_2=True
            )
    if loras:
        pipe.set_adapters([f"lora_{i}" for i in range(len(loras))], [s for _, s in loras])
    pipe.set_progress_bar_config(disable=True)
    return frames(in_fresh_tensors(pipe), prompt)


def load(base: Path, policy: str = "release", **options):
    """ondeck over ``base``; ``policy="streaming"``: a budget that keeps two of the six
    blocks resident and streams the rest."""
    import ondeck.diffusers
    from ondeck.policy import BudgetPolicy
    from ondeck.streaming import StreamOptions

    if policy == "streaming":
        budget = budget_keeping(stored_blocks(load(base, "release", **options)), 2)
        streaming = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)
        policy = BudgetPolicy(budget, streaming=streaming)
    pipe = ondeck.diffusers.from_pretrained(
        base, dtype=torch.float32, device="cpu", policy=policy, progress=False, **options
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stored_blocks(pipe):
    """The transformer's block sizes as it loads (in float8, when stored so)."""
    from ondeck.streaming import describe_blocks, find_blocks

    template = object.__getattribute__(pipe.transformer, "_ondeck_loader").template
    return describe_blocks(template, find_blocks(template.module))[0]


def streamed_passes(pipe) -> int:
    stats = pipe.ondeck.policy.streaming.stats().get("transformer") or {}
    return stats.get("passes", 0)


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    """A tiny Wan 2.1 pipeline folder with a six-block transformer (enough to stream)."""
    return build_six_block_folder(tmp_path_factory.mktemp("weights") / "base")


@pytest.fixture(scope="session")
def weights(base) -> dict[str, torch.Tensor]:
    """The transformer's tensors in diffusers' names."""
    return load_file(str(transformer_file(base)))


@pytest.fixture(scope="session")
def original_file(weights, tmp_path_factory) -> Path:
    """The transformer as one file in the original repository's key names (the ComfyUI
    ``model.diffusion_model.`` prefix included)."""
    path = tmp_path_factory.mktemp("files") / "wan2.1_t2v_tiny.safetensors"
    save_file({original_name(key): tensor for key, tensor in weights.items()}, str(path))
    return path


def _is_stored(key: str, tensor: torch.Tensor) -> bool:
    """The tensors fp8 checkpoints keep in float8: the matrices of the blocks' layers."""
    return key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2


def float8_file(weights, base, root: Path, dtype: torch.dtype = FP8):
    """(the original-key file with the blocks' matrices in ``dtype``, the folder of the
    weights it stands for: those float8 values in float32)."""
    stored, exact = {}, {}
    for key, tensor in weights.items():
        if _is_stored(key, tensor):
            stored[key] = tensor.to(dtype)
            exact[key] = stored[key].to(torch.float32)
        else:
            stored[key] = exact[key] = tensor
    path = root / f"wan_fp8_{str(dtype).removeprefix('torch.float8_')}.safetensors"
    save_file({original_name(key): tensor for key, tensor in stored.items()}, str(path))
    return path, with_transformer(base, root / "reference", exact)


@pytest.fixture(scope="session")
def float8(weights, base, tmp_path_factory):
    """The float8_e4m3fn file and its reference folder (:func:`float8_file`)."""
    return float8_file(weights, base, tmp_path_factory.mktemp("float8"))


def fp8_scaled_file(weights, base, root: Path, suffix: str = ".scale_weight"):
    """(an fp8_scaled file: each stored matrix divided by a float32 scale, in float8, with
    the scale beside it: ComfyUI's ``scale_weight`` under the ``scaled_fp8`` marker, or
    the newer per-layer ``weight_scale`` without one; the folder of the weights it stands
    for: ``weight.to(float32) * scale``)."""
    stored, exact = {}, {}
    if suffix == ".scale_weight":
        stored["scaled_fp8"] = torch.empty(0, dtype=FP8)
    for key, tensor in weights.items():
        name = original_name(key)
        if _is_stored(key, tensor):
            scale = (tensor.abs().max() / torch.finfo(FP8).max).to(torch.float32)
            stored[name] = (tensor / scale).to(FP8)
            stored[name.removesuffix(".weight") + suffix] = scale.reshape(())
            exact[key] = stored[name].to(torch.float32) * scale
        else:
            stored[name] = exact[key] = tensor
    path = root / f"wan_fp8_scaled{suffix.replace('.', '_')}.safetensors"
    save_file(stored, str(path))
    return path, with_transformer(base, root / "reference", exact)


@pytest.fixture(scope="session")
def fp8_scaled(weights, base, tmp_path_factory):
    """The ``scale_weight`` fp8_scaled file and its reference folder (:func:`fp8_scaled_file`)."""
    return fp8_scaled_file(weights, base, tmp_path_factory.mktemp("fp8-scaled"))


def lora_state(weights: dict[str, torch.Tensor], rank: int = 4, seed: int = 5):
    """LoRA matrices for every attention and feed-forward layer of the blocks (all a
    musubi-tuner LoRA names): ``{diffusers layer
    name: (down, up)}``, large enough to change the output visibly."""
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for key, tensor in weights.items():
        if re.search(r"\.(attn[12]\.to_(q|k|v|out\.0)|ffn\.net\.(0\.proj|2))\.weight$", key):
            out_features, in_features = tensor.shape
            down = torch.randn(rank, in_features, generator=generator) * 0.3
            up = torch.randn(out_features, rank, generator=generator) * 0.3
            layers[key.removesuffix(".weight")] = (down, up)
    return layers


@pytest.fixture(scope="session")
def lora_files(weights, tmp_path_factory):
    """The same LoRA in diffusers' layout and in musubi-tuner's (kohya-style names over the
    original Wan keys, with alpha): ``{"diffusers": path, "musubi": path}``."""
    root = tmp_path_factory.mktemp("lora")
    layers = lora_state(weights)
    rank = 4
    diffusers_layout = {}
    musubi_layout = {}
    for layer, (down, up) in layers.items():
        diffusers_layout[f"transformer.{layer}.lora_A.weight"] = down
        diffusers_layout[f"transformer.{layer}.lora_B.weight"] = up
        original = original_name(f"{layer}.weight").removesuffix(".weight")
        kohya = "lora_unet_" + original.removeprefix("model.diffusion_model.")
        kohya = kohya.replace(".", "_")
        musubi_layout[f"{kohya}.lora_down.weight"] = down
        musubi_layout[f"{kohya}.lora_up.weight"] = up
        musubi_layout[f"{kohya}.alpha"] = torch.tensor(float(rank))
    paths = {
        "diffusers": root / "lora_diffusers.safetensors",
        "musubi": root / "lora_musubi.safetensors",
    }
    save_file(diffusers_layout, str(paths["diffusers"]))
    save_file(musubi_layout, str(paths["musubi"]))
    return paths


@pytest.fixture(scope="session")
def reference(base) -> np.ndarray:
    return reference_frames(base)


__all__ = [
    "budget_keeping",
    "frames",
    "load",
    "original_name",
    "reference_frames",
    "streamed_passes",
    "with_transformer",
]


@pytest.fixture(scope="session")
def two_experts(base, tmp_path_factory) -> Path:
    """A Wan 2.2-style folder: a second transformer (other weights) for the low-noise
    steps: with two steps (timesteps 1000 and 500) and the switch at 900, each expert
    computes one."""
    import json

    from diffusers import WanTransformer3DModel

    path = tmp_path_factory.mktemp("wan22") / "two-experts"
    shutil.copytree(base, path)
    expert = WanTransformer3DModel.from_pretrained(base / "transformer")
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in expert.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    expert.save_pretrained(path / "transformer_2")
    index = json.loads((path / "model_index.json").read_text())
    index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
    index["boundary_ratio"] = 0.9
    (path / "model_index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(scope="session")
def gguf_base(tmp_path_factory) -> Path:
    """The six-block folder with widths GGUF's 32-value quantization blocks divide."""
    return build_six_block_folder(
        tmp_path_factory.mktemp("weights-gguf") / "base", attention_head_dim=32, ffn_dim=128
    )


@pytest.fixture(scope="session")
def gguf_file(gguf_base, tmp_path_factory):
    """(the transformer as a GGUF file in the original key names, the blocks' matrices
    Q8_0 and everything else F32, written with the ``gguf`` package; the folder of the
    weights it stands for: the Q8_0 values dequantized)."""
    gguf = pytest.importorskip("gguf")

    root = tmp_path_factory.mktemp("gguf")
    weights = load_file(str(transformer_file(gguf_base)))
    path = root / "wan2.1_t2v_tiny-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    exact = {}
    for key, tensor in weights.items():
        name = original_name(key).removeprefix("model.diffusion_model.")
        array = tensor.numpy()
        if _is_stored(key, tensor):
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            restored = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
            exact[key] = torch.from_numpy(restored.reshape(array.shape).copy())
        else:
            writer.add_tensor(name, array)
            exact[key] = tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, with_transformer(gguf_base, root / "reference", exact)


@pytest.fixture(scope="session")
def text_encoder_gguf(base, tmp_path_factory) -> Path:
    """The text encoder (UMT5) as a GGUF file in llama.cpp's names, its matrices Q8_0, as
    city96's umt5-xxl GGUF files are written."""
    gguf = pytest.importorskip("gguf")
    from transformers import UMT5EncoderModel

    encoder = UMT5EncoderModel.from_pretrained(base / "text_encoder")
    config = encoder.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5ENCODER, config.num_layers)
    path = tmp_path_factory.mktemp("gguf-te") / "umt5-tiny-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), arch="t5encoder")
    writer.add_name("umt5")
    writer.add_context_length(512)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_key_length(config.d_kv)
    writer.add_value_length(config.d_kv)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_relative_attn_buckets_count(config.relative_attention_num_buckets)
    writer.add_vocab_size(config.vocab_size)
    for key, tensor in encoder.state_dict().items():
        if key == "encoder.embed_tokens.weight":
            continue  # tied to shared
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        array = tensor.float().numpy()
        if ".blk." in name and array.ndim == 2 and "rel_b" not in name:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _flux_lora_state(model, prefix, ends, seed):
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, layer in model.named_modules():
        if name.endswith(ends):
            a = torch.randn(4, layer.in_features, generator=generator) * 0.5
            b = torch.randn(layer.out_features, 4, generator=generator) * 0.5
            state[f"{prefix}.{name}.lora_A.weight"] = a
            state[f"{prefix}.{name}.lora_B.weight"] = b
    return state


@pytest.fixture(scope="session")
def flux_loras(tmp_path_factory):
    """A tiny Flux folder; LoRA 'both' (text encoder and transformer), 'other' (same
    layers, other values) and 'transformer_only'."""
    from diffusers import FluxPipeline
    from integrations.tiny_pipelines import build_flux
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("flux-check")
    build_flux(root / "flux")
    plain = FluxPipeline.from_pretrained(root / "flux")
    for folder, seed, parts in (
        ("both", 1, ("text_encoder", "transformer")),
        ("other", 2, ("text_encoder", "transformer")),
        ("transformer_only", 3, ("transformer",)),
    ):
        state = {}
        if "text_encoder" in parts:
            state.update(
                _flux_lora_state(plain.text_encoder, "text_encoder", ("q_proj", "v_proj"), seed)
            )
        state.update(
            _flux_lora_state(plain.transformer, "transformer", ("attn.to_q", "attn.to_k"), seed)
        )
        (root / folder).mkdir()
        save_file(state, root / folder / "pytorch_lora_weights.safetensors")
    return root


@pytest.fixture(scope="session")
def wan_lora(tmp_path_factory):
    """A tiny Wan folder and a transformer LoRA (Wan's load_lora_weights reads nothing of
    the deferred transformer, so the recorded call is tried on its meta skeleton)."""
    from diffusers import WanPipeline
    from integrations.tiny_pipelines import build_wan
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("wan-check")
    build_wan(root / "wan")
    plain = WanPipeline.from_pretrained(root / "wan")
    state = _flux_lora_state(plain.transformer, "transformer", ("attn1.to_q", "attn1.to_k"), 1)
    (root / "lora").mkdir()
    save_file(state, root / "lora" / "pytorch_lora_weights.safetensors")
    return root
