"""More diffusers families at the smallest sizes that run, for the breadth tests.

Each builder makes a family's components in code (shapes after diffusers' own fast
pipeline tests, tokenizers that need no files), saves the genuine pipeline with
diffusers' ``save_pretrained`` and names a call that runs in well under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tiny_pipelines import FAMILIES, Family, _byt5, _clip_tokenizer, _image_vae, _t5_encoder

_VOCAB = 400  # covers the ByT5 tokenizer's 384 ids


def _image(size: int):
    from PIL import Image

    return Image.new("RGB", (size, size), (90, 140, 200))


def _clip_text(*, projection: bool, hidden: int = 32, positions: int = 77, seed: int = 3):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        projection_dim=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        max_position_embeddings=positions,
        hidden_act="gelu",
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _gemma2(hidden: int, head_dim: int):
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(4)
    config = Gemma2Config(
        vocab_size=_VOCAB,
        hidden_size=hidden,
        head_dim=head_dim,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        attn_implementation="eager",
    )
    return Gemma2Model(config).eval()


def _wan_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(2)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()  # fmt: skip


def _wan_like(cls: type, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    sizes = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    return cls(**{**sizes, **overrides}).eval()


# -- video ------------------------------------------------------------------------------


def build_wan_i2v(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from diffusers import WanTransformer3DModel as Transformer
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(5)
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, intermediate_size=16, patch_size=1,
        )
    ).eval()  # fmt: skip
    WanImageToVideoPipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
        image_encoder=image_encoder,
        transformer=_wan_like(Transformer, in_channels=36, image_dim=4),
    ).save_pretrained(path)


def build_wan_vace(path: Path) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        WanVACEPipeline,
        WanVACETransformer3DModel,
    )

    WanVACEPipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=_wan_like(
            WanVACETransformer3DModel, num_layers=3, vace_layers=[0, 2], vace_in_channels=96
        ),
    ).save_pretrained(path)


def build_wan22(path: Path) -> None:
    """Wan 2.2 A14B's layout: two transformers, split at a boundary timestep."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    WanPipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        vae=_wan_vae(),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
        transformer=_wan_like(WanTransformer3DModel, seed=0),
        transformer_2=_wan_like(WanTransformer3DModel, seed=1),
        boundary_ratio=0.875,
    ).save_pretrained(path)


def build_skyreels_v2(path: Path) -> None:
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    SkyReelsV2Pipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        transformer=_wan_like(SkyReelsV2Transformer3DModel),
        vae=_wan_vae(),
        scheduler=UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True),
    ).save_pretrained(path)


def build_hunyuan_video(path: Path) -> None:
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=1,
        patch_size_t=1, guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4,
    )  # fmt: skip
    torch.manual_seed(1)
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=_VOCAB, hidden_size=16, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        )
    ).eval()  # fmt: skip
    HunyuanVideoPipeline(
        text_encoder=llama,
        tokenizer=_byt5(),
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=_clip_text(projection=False, hidden=8),
        tokenizer_2=_clip_tokenizer(),
    ).save_pretrained(path)


def build_mochi(path: Path) -> None:
    from diffusers import (
        AutoencoderKLMochi,
        FlowMatchEulerDiscreteScheduler,
        MochiPipeline,
        MochiTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        pooled_projection_dim=16, in_channels=12, qk_norm="rms_norm", text_embed_dim=32,
        time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16,
    )  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLMochi(
        latent_channels=12, out_channels=3,
        encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
    )  # fmt: skip
    MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae.eval(),
        text_encoder=_t5_encoder(),
        tokenizer=_byt5(),
        transformer=transformer.eval(),
    ).save_pretrained(path)


def build_allegro(path: Path) -> None:
    from diffusers import (
        AllegroPipeline,
        AllegroTransformer3DModel,
        AutoencoderKLAllegro,
        DDIMScheduler,
    )

    torch.manual_seed(0)
    transformer = AllegroTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        num_layers=1, cross_attention_dim=24, sample_width=8, sample_height=8,
        sample_frames=8, caption_channels=24,
    )  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLAllegro(
        down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
        norm_num_groups=2, temporal_compression_ratio=4,
        # Its tiles, sample_size pixels less a fixed overlap of 120 and 80 apart: 128
        # makes them 8 and 48 apart, and a 128x128 video of 24 frames one whole tile.
        sample_size=128,
    )  # fmt: skip
    AllegroPipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(d_model=24),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=DDIMScheduler(),
    ).save_pretrained(path)


def _allegro_tiling(pipe) -> None:
    # Allegro's VAE decodes in tiles only; the setting is not saved with the model.
    pipe.vae.enable_tiling()


# -- image ------------------------------------------------------------------------------


def build_flux_kontext(path: Path) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxKontextPipeline,
        FluxTransformer2DModel,
    )

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )  # fmt: skip
    FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_image_vae(latent_channels=1),
        text_encoder=_clip_text(projection=False),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_t5_encoder(),
        tokenizer_2=_byt5(),
        transformer=transformer.eval(),
        image_encoder=None,
        feature_extractor=None,
    ).save_pretrained(path)


def _sd_vae(channels: tuple[int, int], groups: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    return AutoencoderKL(
        block_out_channels=list(channels), in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4, norm_num_groups=groups,
    ).eval()  # fmt: skip


def _sd_scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, set_alpha_to_one=False,
    )  # fmt: skip


def _sdxl_parts() -> dict:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(2, 4), layers_per_block=1, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=80, cross_attention_dim=64, norm_num_groups=1,
    )  # fmt: skip
    return dict(
        vae=_sd_vae((4, 8), groups=2),
        text_encoder=_clip_text(projection=False, seed=3),
        text_encoder_2=_clip_text(projection=True, seed=4),
        tokenizer=_clip_tokenizer(),
        tokenizer_2=_clip_tokenizer(),
        unet=unet.eval(),
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            steps_offset=1,
            beta_schedule="scaled_linear",
            timestep_spacing="leading",
        ),  # fmt: skip
        add_watermarker=False,
    )


def build_sdxl(path: Path) -> None:
    from diffusers import StableDiffusionXLPipeline

    StableDiffusionXLPipeline(**_sdxl_parts()).save_pretrained(path)


def build_sdxl_controlnet(path: Path) -> None:
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    parts = _sdxl_parts()
    torch.manual_seed(6)
    controlnet = ControlNetModel.from_unet(
        parts["unet"], conditioning_embedding_out_channels=(16, 32)
    )
    StableDiffusionXLControlNetPipeline(**parts, controlnet=_visible(controlnet)).save_pretrained(
        path
    )


def build_sd3_controlnet(path: Path) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3ControlNetModel,
        SD3Transformer2DModel,
        StableDiffusion3ControlNetPipeline,
    )

    sizes = dict(
        sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4,
    )  # fmt: skip
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**sizes)
    torch.manual_seed(6)
    controlnet = SD3ControlNetModel(**sizes)
    StableDiffusion3ControlNetPipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_image_vae(latent_channels=4),
        text_encoder=_clip_text(projection=True, seed=3),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_clip_text(projection=True, seed=4),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(),
        tokenizer_3=_byt5(),
        controlnet=_visible(controlnet),
    ).save_pretrained(path)


def _sd_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        norm_num_groups=1,
    ).eval()  # fmt: skip


def _controlnet(seed: int):
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    controlnet = ControlNetModel(
        block_out_channels=(4, 8), layers_per_block=1, in_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=32,
        conditioning_embedding_out_channels=(16, 32), norm_num_groups=1,
    )  # fmt: skip
    return _visible(controlnet)


def _visible(controlnet):
    """Freshly built ControlNets add zeros (zero-initialised output layers): weights that
    change the result, so that a ControlNet that is skipped shows."""
    with torch.no_grad():
        for module in controlnet.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                torch.nn.init.normal_(module.weight, std=0.2)
    return controlnet.eval()


def build_sd_controlnet(path: Path, controlnets: int = 1) -> None:
    """SD 1.5 with one ControlNet, or with ``controlnets`` of them in a
    ``MultiControlNetModel``."""
    from diffusers import MultiControlNetModel, StableDiffusionControlNetPipeline

    if controlnets == 1:
        controlnet = _controlnet(seed=6)
    else:
        controlnet = MultiControlNetModel([_controlnet(seed=6 + i) for i in range(controlnets)])
    StableDiffusionControlNetPipeline(
        vae=_sd_vae((4, 8), groups=2),
        text_encoder=_clip_text(projection=False),
        tokenizer=_clip_tokenizer(),
        unet=_sd_unet(),
        controlnet=controlnet,
        scheduler=_sd_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    ).save_pretrained(path)


def build_pixart_sigma(path: Path) -> None:
    from diffusers import AutoencoderKL, DDIMScheduler, PixArtSigmaPipeline
    from diffusers import PixArtTransformer2DModel as Transformer

    torch.manual_seed(0)
    transformer = Transformer(
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8,
        num_attention_heads=3, caption_channels=32, in_channels=4, cross_attention_dim=24,
        out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(2)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4)
    PixArtSigmaPipeline(
        tokenizer=_byt5(),
        text_encoder=_t5_encoder(),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=DDIMScheduler(),
    ).save_pretrained(path)


def build_sana(path: Path) -> None:
    from diffusers import (
        AutoencoderDC,
        FlowMatchEulerDiscreteScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )

    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2,
        attention_head_dim=4, num_cross_attention_heads=2, cross_attention_head_dim=4,
        cross_attention_dim=8, caption_channels=8, sample_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1],
        downsample_block_type="conv", upsample_block_type="interpolate",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    )  # fmt: skip
    SanaPipeline(
        tokenizer=_byt5(),
        text_encoder=_gemma2(hidden=8, head_dim=16),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    ).save_pretrained(path)


def build_qwenimage(path: Path) -> None:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
        temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": _VOCAB,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={
            "depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
            "out_hidden_size": 16,
        },
        hidden_size=16, vocab_size=_VOCAB, vision_start_token_id=_VOCAB - 3,
        vision_end_token_id=_VOCAB - 2, vision_token_id=_VOCAB - 1,
    )  # fmt: skip
    QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae.eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
        tokenizer=_byt5(),
        transformer=transformer.eval(),
    ).save_pretrained(path)


def build_lumina2(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline
    from diffusers import Lumina2Transformer2DModel as Transformer

    torch.manual_seed(0)
    transformer = Transformer(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=1,
        num_attention_heads=1, num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None,
        norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=[4, 2, 2], cap_feat_dim=8,
    )  # fmt: skip
    Lumina2Pipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_image_vae(latent_channels=4),
        text_encoder=_gemma2(hidden=8, head_dim=4),
        tokenizer=_byt5(),
    ).save_pretrained(path)


def build_auraflow(path: Path) -> None:
    from diffusers import (
        AuraFlowPipeline,
        AuraFlowTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    transformer = AuraFlowTransformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1,
        num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, out_channels=4,
        pos_embed_max_size=64,
    )  # fmt: skip
    torch.manual_seed(1)
    umt5 = UMT5EncoderModel(
        UMT5Config(
            vocab_size=_VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8,
        )
    ).eval()  # fmt: skip
    AuraFlowPipeline(
        tokenizer=_byt5(),
        text_encoder=umt5,
        vae=_sd_vae((4, 8), groups=2),
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    ).save_pretrained(path)


def build_chroma(path: Path) -> None:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32, approximator_layers=1,
        approximator_num_channels=16,
    )  # fmt: skip
    ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_image_vae(latent_channels=1),
        text_encoder=_t5_encoder(),
        tokenizer=_byt5(),
        transformer=transformer.eval(),
        image_encoder=None,
        feature_extractor=None,
    ).save_pretrained(path)


def build_hidream(path: Path) -> None:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_channels=[32, 16],
        text_emb_dim=64, num_routed_experts=4, num_activated_experts=2,
        axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
    )  # fmt: skip
    torch.manual_seed(2)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, scaling_factor=0.3611,
                        shift_factor=0.1159)  # fmt: skip
    torch.manual_seed(1)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=_VOCAB, hidden_size=16, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        )
    ).eval()  # fmt: skip
    long_clip = _clip_tokenizer()
    long_clip.model_max_length = 128
    HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae.eval(),
        text_encoder=_clip_text(projection=True, positions=128, seed=3),
        tokenizer=long_clip,
        text_encoder_2=_clip_text(projection=True, positions=128, seed=4),
        tokenizer_2=long_clip,
        text_encoder_3=_t5_encoder(),
        tokenizer_3=_byt5(),
        text_encoder_4=llama,
        tokenizer_4=_byt5(),
        transformer=transformer.eval(),
    ).save_pretrained(path)


def _small_hidream(pipe) -> None:
    # HiDream resizes every request to default_sample_size² latents (128² by default).
    pipe.default_sample_size = 16


def build_kandinsky22_combined(path: Path) -> None:
    from diffusers import (
        DDIMScheduler,
        KandinskyV22CombinedPipeline,
        PriorTransformer,
        UnCLIPScheduler,
        UNet2DConditionModel,
        VQModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(8, 16),
        layers_per_block=1, encoder_hid_dim=32, encoder_hid_dim_type="image_proj",
        cross_attention_dim=32, attention_head_dim=4, resnet_time_scale_shift="scale_shift",
        norm_num_groups=4, class_embed_type=None,
    )  # fmt: skip
    torch.manual_seed(0)
    movq = VQModel(
        block_out_channels=[32, 32], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
        in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
        norm_type="spatial", num_vq_embeddings=12, out_channels=3,
        up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"], vq_embed_dim=4,
    )  # fmt: skip
    torch.manual_seed(0)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=32,
                             num_layers=1)  # fmt: skip
    prior.clip_std = torch.nn.Parameter(torch.ones(prior.clip_std.shape))
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=32, image_size=32, projection_dim=32, intermediate_size=37,
            num_attention_heads=4, num_hidden_layers=2, patch_size=16,
        )
    ).eval()  # fmt: skip
    KandinskyV22CombinedPipeline(
        unet=unet.eval(),
        scheduler=DDIMScheduler(
            beta_schedule="linear",
            beta_start=0.00085,
            beta_end=0.012,
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        ),  # fmt: skip
        movq=movq.eval(),
        prior_prior=prior.eval(),
        prior_image_encoder=image_encoder,
        prior_text_encoder=_clip_text(projection=True),
        prior_tokenizer=_clip_tokenizer(),
        prior_scheduler=UnCLIPScheduler(
            variance_type="fixed_small_log",
            prediction_type="sample",
            num_train_timesteps=1000,
            clip_sample=True,
            clip_sample_range=10.0,
        ),  # fmt: skip
        prior_image_processor=CLIPImageProcessor(crop_size=32, size=32),
    ).save_pretrained(path)


_STEPS = {"prompt": "a fox", "num_inference_steps": 2, "output_type": "np"}
_VIDEO = {**_STEPS, "height": 16, "width": 16, "max_sequence_length": 16}

BREADTH: dict[str, Family] = {
    family.name: family
    for family in (
        Family("wan_i2v", "WanImageToVideoPipeline", build_wan_i2v,
               {**_VIDEO, "image": _image(16), "num_frames": 5, "guidance_scale": 6.0}),
        Family("wan_vace", "WanVACEPipeline", build_wan_vace,
               {**_VIDEO, "num_frames": 5, "guidance_scale": 6.0}),
        Family("wan22", "WanPipeline", build_wan22,
               {**_VIDEO, "num_frames": 5, "guidance_scale": 6.0}),
        Family("skyreels_v2", "SkyReelsV2Pipeline", build_skyreels_v2,
               {**_VIDEO, "num_frames": 5, "guidance_scale": 6.0}),
        Family("hunyuan_video", "HunyuanVideoPipeline", build_hunyuan_video,
               {**_VIDEO, "num_frames": 5, "guidance_scale": 4.5,
                "prompt_template": {"template": "{}", "crop_start": 0}}),
        Family("mochi", "MochiPipeline", build_mochi,
               {**_VIDEO, "num_frames": 7, "guidance_scale": 4.5, "negative_prompt": ""}),
        Family("allegro", "AllegroPipeline", build_allegro,
               # One whole tile (128x128, 24 frames): its tiled decode gives no pixels
               # for a smaller video, whatever the latents.
               {**_VIDEO, "num_frames": 24, "height": 128, "width": 128,
                "guidance_scale": 6.0, "negative_prompt": ""},
               prepare=_allegro_tiling),
        Family("flux_kontext", "FluxKontextPipeline", build_flux_kontext,
               {**_STEPS, "image": _image(32), "height": 8, "width": 8, "max_area": 64,
                "_auto_resize": False, "guidance_scale": 5.0, "max_sequence_length": 16},
               output="images"),
        Family("sdxl", "StableDiffusionXLPipeline", build_sdxl,
               {**_STEPS, "height": 32, "width": 32, "guidance_scale": 5.0}, output="images"),
        Family("sd_controlnet", "StableDiffusionControlNetPipeline", build_sd_controlnet,
               {**_STEPS, "image": _image(32), "height": 32, "width": 32,
                "guidance_scale": 6.0}, output="images"),
        Family("sdxl_controlnet", "StableDiffusionXLControlNetPipeline",
               build_sdxl_controlnet,
               {**_STEPS, "image": _image(32), "height": 32, "width": 32,
                "guidance_scale": 5.0}, output="images"),
        Family("sd3_controlnet", "StableDiffusion3ControlNetPipeline", build_sd3_controlnet,
               {**_STEPS, "control_image": _image(32), "height": 32, "width": 32,
                "guidance_scale": 5.0, "max_sequence_length": 16}, output="images"),
        Family("pixart_sigma", "PixArtSigmaPipeline", build_pixart_sigma,
               {**_STEPS, "guidance_scale": 5.0, "use_resolution_binning": False,
                "max_sequence_length": 16}, output="images"),
        Family("sana", "SanaPipeline", build_sana,
               {**_STEPS, "height": 32, "width": 32, "guidance_scale": 6.0,
                "max_sequence_length": 16, "complex_human_instruction": None,
                "use_resolution_binning": False}, output="images"),
        Family("qwenimage", "QwenImagePipeline", build_qwenimage,
               {**_STEPS, "negative_prompt": "bad", "true_cfg_scale": 2.0, "height": 32,
                "width": 32, "max_sequence_length": 16}, output="images"),
        Family("lumina2", "Lumina2Pipeline", build_lumina2,
               {**_STEPS, "height": 32, "width": 32, "guidance_scale": 5.0,
                "max_sequence_length": 16}, output="images"),
        Family("auraflow", "AuraFlowPipeline", build_auraflow,
               {**_STEPS, "height": 32, "width": 32, "guidance_scale": 5.0,
                "max_sequence_length": 16}, output="images"),
        Family("chroma", "ChromaPipeline", build_chroma,
               {**_STEPS, "negative_prompt": "bad", "height": 8, "width": 8,
                "guidance_scale": 5.0, "max_sequence_length": 16}, output="images"),
        Family("hidream", "HiDreamImagePipeline", build_hidream,
               {**_STEPS, "height": 16, "width": 16, "guidance_scale": 5.0,
                "max_sequence_length": 16}, output="images", prepare=_small_hidream),
        Family("kandinsky22_combined", "KandinskyV22CombinedPipeline",
               build_kandinsky22_combined,
               {**_STEPS, "height": 32, "width": 32, "guidance_scale": 4.0,
                "prior_num_inference_steps": 2}, output="images"),
    )
}  # fmt: skip

ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **BREADTH}
