"""Small Wan-architecture model folders with seeded random weights.

They exercise the real loading path (diffusers format on disk, safetensors, the
same classes as Wan 2.1) without any download. Their output is noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on one CPU core; used by the test suite.
    "tiny": {
        "text_encoder": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        "transformer": dict(
            num_attention_heads=2,
            attention_head_dim=12,
            text_dim=32,
            freq_dim=32,
            ffn_dim=48,
            num_layers=2,
            rope_max_seq_len=32,
        ),
        "vae": dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    },
    # What `ondeck generate` runs with no model folder: three components of clearly
    # different sizes, so the memory timeline shows each one come and go.
    "default": {
        "text_encoder": dict(d_model=512, d_kv=64, d_ff=1536, num_layers=6, num_heads=8),
        "transformer": dict(
            num_attention_heads=8,
            attention_head_dim=64,
            text_dim=512,
            freq_dim=256,
            ffn_dim=2048,
            num_layers=8,
            rope_max_seq_len=256,
        ),
        "vae": dict(base_dim=32, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    },
}

MARKER = "ondeck-embedded.json"


def default_cache_dir() -> Path:
    root = os.environ.get("ONDECK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ondeck"
    )
    return Path(root)


def build_wan_folder(
    path: str | os.PathLike, *, preset: str = "tiny", seed: int = 0, max_shard_size: str = "5GB"
) -> Path:
    """Write a Wan 2.1 text-to-video folder in diffusers format with random weights."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    sizes = PRESETS[preset]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    tokenizer = ByT5Tokenizer()
    text_config = UMT5Config(
        vocab_size=len(tokenizer),
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        tie_word_embeddings=False,
        **sizes["text_encoder"],
    )
    text_encoder = UMT5EncoderModel(text_config).eval()
    transformer = WanTransformer3DModel(**sizes["transformer"]).eval()
    vae = AutoencoderKLWan(**sizes["vae"]).eval()
    with torch.no_grad():
        for module in (text_encoder, transformer, vae):
            for parameter in module.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
            for norm in module.modules():
                weight = getattr(norm, "weight", None)
                if "Norm" in type(norm).__name__ and isinstance(weight, torch.nn.Parameter):
                    weight.fill_(1.0)

    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    # Saved as users' folders are: by diffusers' own save_pretrained, so model_index.json
    # is what diffusers writes (absent components as [null, null] included).
    from diffusers import WanPipeline

    pipeline = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
    )
    pipeline.save_pretrained(path, max_shard_size=max_shard_size)
    (path / MARKER).write_text(json.dumps({"preset": preset, "seed": seed}))
    return path


def embedded_default(cache_dir: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """The embedded default folder, built on first use. Returns (path, built_now)."""
    folder = Path(cache_dir or default_cache_dir()) / "wan-embedded-default"
    if (folder / MARKER).exists() and (folder / "model_index.json").exists():
        return folder, False
    staging = folder.with_name(folder.name + ".partial")
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    build_wan_folder(staging, preset="default", seed=0)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    staging.rename(folder)
    return folder, True
