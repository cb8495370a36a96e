"""Small Wan-architecture model folders with seeded random weights.

They exercise the real loading path (diffusers format on disk, safetensors, the
same classes as Wan 2.1) without any download. Their output is noise.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .output import OutputError, current_umask, write_json

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
    path: str | os.PathLike,
    *,
    preset: str = "tiny",
    seed: int = 0,
    max_shard_size: str = "5GB",
    vivid: bool = True,
) -> Path:
    """Write a Wan 2.1 text-to-video folder in diffusers format with random weights.

    Small random weights decode to values near zero: a flat grey video, the same for
    any latents. ``vivid`` (the default) gives the VAE decoder unit-gain weights and
    scales its output layer so that its output spans the pixel range: the video shows
    seeded coloured noise that follows the latents, so two runs that differ anywhere
    before the decode give different frames.
    """
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
        if vivid:
            _spread_decoder_output(vae, generator)

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
    (path / MARKER).write_text(json.dumps({"preset": preset, "seed": seed, "vivid": vivid}))
    return path


# Standard deviation of the decoded pixels, in the VAE's [-1, 1] range: most pixels
# land well inside it, some saturate, and neighbouring ones differ visibly.
VIVID_PIXEL_STD = 0.5


def _spread_decoder_output(vae: Any, generator: Any) -> None:
    """Make the VAE decoder carry its input's structure out to the pixels (seeded).

    With small random weights and biases, the biases swamp what comes in: every latent
    decodes to about the same flat colour. Here the decoder's convolutions get unit-gain
    random weights and no biases, so the seeded latent noise survives as coloured,
    spatially correlated blotches, and the last convolution is scaled so that latents
    like the pipeline's decode to pixels with standard deviation ``VIVID_PIXEL_STD``.
    """
    import math

    import torch

    for module in [vae.post_quant_conv, *vae.decoder.modules()]:
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
            fan_in = module.weight[0].numel()
            module.weight.copy_(
                torch.randn(module.weight.shape, generator=generator) / math.sqrt(fan_in)
            )
            if module.bias is not None:
                module.bias.zero_()
    config = vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    # The pipeline decodes latents * std + mean; untrained denoising leaves its noise.
    latents = torch.randn((1, config.z_dim, 2, 8, 8), generator=generator) * std + mean
    measured = float(vae.decode(latents, return_dict=False)[0].std())
    vae.decoder.conv_out.weight.mul_(VIVID_PIXEL_STD / max(measured, 1e-12))


# Part of the folder's name and of its marker: a change to what the embedded default
# holds bumps it, and caches built before the change are rebuilt. 2: vivid output.
EMBEDDED_VERSION = 2

# What a complete embedded default holds, besides the marker written last.
_REQUIRED = (
    "model_index.json",
    "tokenizer",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "transformer/config.json",
    "vae/config.json",
)


def embedded_default(
    cache_dir: str | os.PathLike | None = None,
    *,
    preset: str = "default",
    say: Any = None,
) -> tuple[Path, bool]:
    """The embedded default folder, built on first use. Returns (path, built_now).

    Concurrent first runs build it once: the builder holds a lock file beside the
    folder, builds into a temporary folder in the same place and renames it into
    place; the others wait and use its result. A folder that is incomplete (a marker
    written last is missing, or a file is) or from an older version is rebuilt, and
    ``say`` (a print-like callable) is told why in one line.
    """
    root = Path(cache_dir or default_cache_dir())
    name = "wan-embedded-default" if preset == "default" else f"wan-embedded-{preset}"
    folder = root / name
    if _problem(folder) is None:
        return folder, False
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{name}.lock", "a+b")  # held across the build
    except OSError as error:
        raise OutputError(
            f"cannot write the embedded default under {root} ({error.strerror or error}); "
            "set ONDECK_CACHE to a writable folder, or give a model folder"
        ) from error
    with lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        problem = _problem(folder)
        if problem is None:  # another process built it while this one waited
            return folder, False
        if folder.exists() and say is not None:
            say(f"ondeck: the embedded default in {folder} {problem}; rebuilding it")
        _remove_leftovers(root, name)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root))
            staging.chmod(0o777 & ~current_umask(staging.parent))  # mkdtemp's folder is private
        except OSError as error:
            raise OutputError(
                f"cannot write the embedded default under {root} ({error.strerror or error}); "
                "set ONDECK_CACHE to a writable folder, or give a model folder"
            ) from error
        try:
            build_wan_folder(staging, preset=preset, seed=0, vivid=True)
            _write_marker(staging, preset)
            if folder.exists():
                # A folder cannot be renamed onto a non-empty one: move the old one aside.
                aside = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".old", dir=root))
                os.replace(folder, aside / name)
            os.replace(staging, folder)
        except OSError as error:  # a full disk, say: nothing half-built stays behind
            raise OutputError(
                f"could not build the embedded default under {root} "
                f"({error.strerror or error}); set ONDECK_CACHE to another folder, or give a "
                "model folder"
            ) from error
        finally:
            _remove_leftovers(root, name)
    return folder, True


def _problem(folder: Path) -> str | None:
    """Why ``folder`` is not a usable embedded default, or None when it is."""
    if not folder.is_dir():
        return "does not exist"
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return f"is incomplete (no {MARKER}; an interrupted build?)"
    if not isinstance(marker, dict) or marker.get("version") != EMBEDDED_VERSION:
        return "is from an older ondeck"
    for required in _REQUIRED:
        if not (folder / required).exists():
            return f"is incomplete ({required} is missing)"
    for component in ("text_encoder", "transformer", "vae"):
        if not any((folder / component).glob("*.safetensors")):
            return f"is incomplete (no weights in {component}/)"
    return _damage(folder, marker.get("files"))


def _damage(folder: Path, files: Any) -> str | None:
    """Which file the build wrote differs now (its size, or a JSON file or safetensors
    header that no longer parses): a damaged cache is rebuilt, not loaded into an error
    every run."""
    if not isinstance(files, dict) or not files:
        return "is from an older ondeck"  # built before its files were listed
    for relative, size in files.items():
        path = folder / str(relative)
        try:
            if path.stat().st_size != size:
                return f"is damaged ({relative} has changed size)"
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                _check_header(path, size)
        except (OSError, ValueError, TypeError):
            return f"is damaged ({relative} is missing or unreadable)"
    return None


def _check_header(path: Path, size: int) -> None:
    """A safetensors file's header is JSON that ends inside the file (ValueError if not):
    bytes overwritten at its start leave the size as it was."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if not 0 < length <= size - 8:
            raise ValueError(f"a header of {length} bytes")
        if not isinstance(json.loads(file.read(length)), dict):
            raise ValueError("a header that is not a JSON object")


def _write_marker(folder: Path, preset: str) -> None:
    """The marker, written last and atomically: its presence means the rest is there,
    and it lists every file the build wrote with its size."""
    files = {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MARKER
    }
    document = {"preset": preset, "seed": 0, "vivid": True, "version": EMBEDDED_VERSION}
    write_json(folder / MARKER, {**document, "files": files})


def _remove_leftovers(root: Path, name: str) -> None:
    """Staging and set-aside folders of this or an interrupted build (lock held)."""
    import shutil

    for leftover in root.glob(f".{name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(root / f"{name}.partial", ignore_errors=True)  # older ondeck's staging
