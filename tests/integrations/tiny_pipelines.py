"""Tiny diffusers pipelines of several families, built in code and saved to folders.

Each family writes a complete diffusers-format folder (model_index.json, configs,
safetensors) with random weights and offline tokenizers, and names the call
arguments that run it in a fraction of a second on a CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_class: str
    build: Callable[[Path], None]
    call: dict[str, Any] = field(default_factory=dict)
    output: str = "frames"
    # Settings a loaded pipeline needs before a call (not saved with the folder).
    prepare: Callable[[Any], None] | None = None

    def pipeline_type(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class)


def _byt5():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def _t5_encoder(d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(1)
    config = T5Config(
        vocab_size=len(_byt5()),
        d_model=d_model,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    return T5EncoderModel(config).eval()


def _clip_tokenizer():
    """A CLIP BPE tokenizer over single letters: no files, no download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        vocab[letter] = len(vocab)
    for letter in "abcdefghijklmnopqrstuvwxyz":
        vocab[f"{letter}</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _clip_encoder(with_projection: bool, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        projection_dim=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        max_position_embeddings=77,
        hidden_act="gelu",
    )
    model = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return model(config).eval()


def _image_vae(latent_channels: int, levels: int = 1):
    """A tiny AutoencoderKL; ``levels`` of it halve the image each (one: no shrinking)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    return AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(4,) * levels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval()


def build_wan(path: Path) -> None:
    from ondeck.embedded import build_wan_folder

    build_wan_folder(path, preset="tiny")


def build_ltx(path: Path) -> None:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=1,
        caption_channels=32,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae.eval(),
        text_encoder=_t5_encoder(),
        tokenizer=_byt5(),
        transformer=transformer.eval(),
    ).save_pretrained(path)


def build_flux(path: Path, vae: Any = None) -> None:
    """A tiny Flux; ``vae`` in place of its VAE (which does not shrink the image)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae if vae is not None else _image_vae(latent_channels=1),
        text_encoder=_clip_encoder(with_projection=False, seed=3),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_t5_encoder(),
        tokenizer_2=_byt5(),
        transformer=transformer.eval(),
        image_encoder=None,
        feature_extractor=None,
    ).save_pretrained(path)


def build_sd3(path: Path) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_image_vae(latent_channels=4),
        text_encoder=_clip_encoder(with_projection=True, seed=3),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_clip_encoder(with_projection=True, seed=4),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(),
        tokenizer_3=_byt5(),
        transformer=transformer.eval(),
    ).save_pretrained(path)


def build_cogvideox(path: Path) -> None:
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=32,
        num_layers=1,
        sample_width=2,
        sample_height=2,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=16,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    CogVideoXPipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=CogVideoXDDIMScheduler(),
    ).save_pretrained(path)


_COMMON = {"prompt": "a fox", "num_inference_steps": 2, "output_type": "np"}

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "wan",
            "WanPipeline",
            build_wan,
            {
                **_COMMON,
                "negative_prompt": "",
                "height": 32,
                "width": 32,
                "num_frames": 5,
                "guidance_scale": 5.0,
                "max_sequence_length": 16,
            },
        ),
        Family(
            "ltx",
            "LTXPipeline",
            build_ltx,
            {
                **_COMMON,
                "negative_prompt": "",
                "height": 32,
                "width": 32,
                "num_frames": 9,
                "guidance_scale": 3.0,
                "max_sequence_length": 16,
            },
        ),
        Family(
            "flux",
            "FluxPipeline",
            build_flux,
            {**_COMMON, "height": 8, "width": 8, "guidance_scale": 5.0, "max_sequence_length": 16},
            output="images",
        ),
        Family(
            "sd3",
            "StableDiffusion3Pipeline",
            build_sd3,
            {
                **_COMMON,
                "negative_prompt": "",
                "height": 32,
                "width": 32,
                "guidance_scale": 5.0,
                "max_sequence_length": 16,
            },
            output="images",
        ),
        Family(
            "cogvideox",
            "CogVideoXPipeline",
            build_cogvideox,
            {
                **_COMMON,
                "negative_prompt": "",
                "height": 16,
                "width": 16,
                "num_frames": 9,
                "guidance_scale": 6.0,
                "max_sequence_length": 16,
            },
        ),
    )
}


def run(pipe: Any, family: Family, seed: int = 0, **overrides: Any) -> Any:
    """One call with a fresh CPU generator; returns the frames or images."""
    if family.prepare is not None:
        family.prepare(pipe)
    arguments = {**family.call, **overrides}
    arguments["generator"] = torch.Generator("cpu").manual_seed(seed)
    with _prompts_cleaned_without_ftfy(pipe):
        return getattr(pipe(**arguments), family.output)


def plain_tiled(family: str, folder: Path, tiles: Any) -> Any:
    """Plain diffusers' call of ``family``, its weights in fresh tensors and its VAE tiled
    at ``tiles`` through the VAE's own ``enable_tiling``."""
    from references import in_fresh_tensors

    from ondeck.integrations.diffusers.decode import spatial_scale, tiling_style

    from .breadth_pipelines import ALL_FAMILIES

    pipe = ALL_FAMILIES[family].pipeline_type().from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    in_fresh_tensors(pipe)
    vae, decode = pipe.vae, pipe.vae.decode
    style = tiling_style(type(vae))
    settings = {name: getattr(vae, name) for name in style.names if hasattr(vae, name)}

    def tiled(*args: Any, **kwargs: Any) -> Any:
        # Tiles for the decode alone, as ondeck sets them: an encode (an edit pipeline's
        # input image) stays whole.
        style.apply(vae, tiles, spatial_scale(vae.config))
        try:
            return decode(*args, **kwargs)
        finally:
            for name, value in settings.items():
                setattr(vae, name, value)

    vae.decode = tiled
    return run(pipe, ALL_FAMILIES[family])


def expected_output(pipe: Any, family: str, folder: Path, reference: Any) -> Any:
    """What an ondeck call of ``family`` must equal: ``reference`` (plain diffusers' call)
    where its VAE decoded whole frames, diffusers' own tiled decode at the same tiles
    where it tiled."""
    decoder = pipe.ondeck.decoders.get("vae")
    if decoder is None or decoder.last_tiles is None:
        return reference
    return plain_tiled(family, folder, decoder.last_tiles)


@contextlib.contextmanager
def _prompts_cleaned_without_ftfy(pipe: Any) -> Iterator[None]:
    """Some pipelines (Wan VACE, SkyReels-V2) clean prompts with ftfy whenever it is
    installed or not; without it, for this call, the text passes through unchanged (for
    plain diffusers and ondeck alike)."""
    module = sys.modules[type(pipe).__module__]
    if not hasattr(module, "basic_clean") or hasattr(module, "ftfy"):
        yield
        return
    with mock.patch.object(module, "ftfy", SimpleNamespace(fix_text=str), create=True):
        yield
