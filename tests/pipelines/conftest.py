from __future__ import annotations

from pathlib import Path

import pytest

from ondeck import embedded

# Wan 2.1's proportions in miniature: the transformer largest, then the text encoder,
# a small VAE, each with repeated blocks where Wan's have them.
SHAPED = {
    "text_encoder": dict(d_model=32, d_kv=8, d_ff=256, num_layers=6, num_heads=4),
    "transformer": dict(
        num_attention_heads=2,
        attention_head_dim=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=256,
        num_layers=12,
        rope_max_seq_len=32,
    ),
    "vae": dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
}


@pytest.fixture(scope="session")
def saved_wan_folder(tmp_path_factory) -> Path:
    """A small Wan folder written by the installed diffusers' ``WanPipeline.save_pretrained``
    (its model_index.json lists ``transformer_2`` as ``[null, null]``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(embedded.PRESETS, "shaped", SHAPED)
        folder = embedded.build_wan_folder(
            tmp_path_factory.mktemp("saved") / "wan", preset="shaped"
        )
    assert '"transformer_2"' in (folder / "model_index.json").read_text()
    return folder
