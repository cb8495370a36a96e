"""Wan 2.1 text-to-video on ondeck stages.

Text encoder, transformer and VAE are deferred: each loads when its stage first
touches it and (under ``release``) is freed after its last stage, so the three
are never resident together. For the same folder, seed and inputs the frames
match ``diffusers.WanPipeline``.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..arguments import check_generate_arguments, warn_if_cut
from ..distributed import device_mesh, init
from ..lazy import is_lazy
from ..loader import Loader
from ..loading import (
    FolderLoader,
    HostCache,
    LoadOptions,
    ModelFolder,
    component_loader,
    fp8,
    load_auxiliary,
)
from ..loading.options import DeviceChoice, StorageChoice
from ..loading.quantized import quantization_method
from ..loading.sharded import ShardedComponentLoader, check_shard
from ..memory import device_name, resolve_device
from ..parallel import ContextParallel, resolve_parallel
from ..policy import Policy
from ..recency import LeastRecentlyUsed
from ..stages import Pipeline, Stage
from ..tiles import decode_tiles
from ..token_room import CountsTokens, TokenRoom, feed_forward_width, token_bytes
from .wan_decode import Decode, host_frames

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Decode", "WanTextToVideo", "PromptCache", "WanGeometry", "decode_tiles", "host_frames"]


def clean_prompt(text: str) -> str:
    """The same normalisation diffusers applies before tokenising a Wan prompt."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class PromptCache(LeastRecentlyUsed):
    """Encoded prompts by (text, max length, encoder identity, device): one entry per
    text, so a negative prompt kept across runs with new prompts is encoded once.

    A repeated prompt is answered here and never touches (or reloads) the encoder.
    """

    def __init__(self, max_entries: int = 32):
        super().__init__(max_entries)


@dataclass(frozen=True)
class WanGeometry:
    """Scalars the stages need, read from the component configs, never the weights."""

    latent_channels: int
    patch_size: tuple[int, int, int]
    scale_temporal: int
    scale_spatial: int
    z_dim: int
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    # The transformer's rotary positions per axis (``rope_max_seq_len``); None: unbounded.
    max_positions: int | None = None

    @classmethod
    def from_configs(cls, transformer_config: Any, vae_config: Any) -> WanGeometry:
        positions = getattr(transformer_config, "rope_max_seq_len", None)
        return cls(
            latent_channels=int(transformer_config.in_channels),
            patch_size=tuple(transformer_config.patch_size),
            scale_temporal=int(getattr(vae_config, "scale_factor_temporal", None) or 4),
            scale_spatial=int(getattr(vae_config, "scale_factor_spatial", None) or 8),
            z_dim=int(vae_config.z_dim),
            latents_mean=tuple(vae_config.latents_mean),
            latents_std=tuple(vae_config.latents_std),
            max_positions=int(positions) if positions else None,
        )

    def beyond_positions(
        self, height: int | None, width: int | None, frames: int | None
    ) -> list[tuple[str, int, str]]:
        """``(side, value, why)`` for each side given (None: not given) with more patches
        than the transformer has rotary positions: diffusers' forward would fail on it
        with a shape error after every component loaded."""
        if self.max_positions is None:
            return []
        limit = self.max_positions
        time_patch, height_patch, width_patch = self.patch_size
        # A side not given counts as none: zero pixels, one frame.
        along_time, along_height, along_width = self.patches(height or 0, width or 0, frames or 1)
        sides = (
            ("height", height, along_height, limit * height_patch * self.scale_spatial),
            ("width", width, along_width, limit * width_patch * self.scale_spatial),
            ("frames", frames, along_time, (limit * time_patch - 1) * self.scale_temporal + 1),
        )
        return [
            (
                side,
                value,
                f"{patches} patches along it, more than the transformer's {limit} rotary "
                f"positions (its rope_max_seq_len); at most {most}",
            )
            for side, value, patches, most in sides
            if value is not None and patches > limit
        ]

    def snap(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        """Round a requested shape the way diffusers does: frames = 4k+1, sides to patches."""
        if frames % self.scale_temporal != 1:
            frames = frames // self.scale_temporal * self.scale_temporal + 1
        frames = max(frames, 1)
        h_step = self.scale_spatial * self.patch_size[1]
        w_step = self.scale_spatial * self.patch_size[2]
        return height // h_step * h_step, width // w_step * w_step, frames

    def tokens(self, height: int, width: int, frames: int) -> int:
        """The transformer's sequence length for a (snapped) shape: latent patches."""
        along_time, along_height, along_width = self.patches(height, width, frames)
        return along_time * along_height * along_width

    def patches(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        """Latent patches along time, height and width for a (snapped) shape."""
        _, _, latent_frames, latent_height, latent_width = self.latent_shape(
            1, height, width, frames
        )
        time_patch, height_patch, width_patch = self.patch_size
        return (
            latent_frames // time_patch,
            latent_height // height_patch,
            latent_width // width_patch,
        )

    def latent_shape(self, batch: int, height: int, width: int, frames: int) -> tuple[int, ...]:
        return (
            batch,
            self.latent_channels,
            (frames - 1) // self.scale_temporal + 1,
            height // self.scale_spatial,
            width // self.scale_spatial,
        )


class EncodePrompt(Stage):
    """Prompt and negative prompt to embeddings, through the cache."""

    def __init__(self, tokenizer: Any, text_encoder: Any, cache: PromptCache, identity: str):
        super().__init__()
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.cache = cache
        self.identity = identity

    def _keys(self, state: dict) -> dict[str, tuple]:
        """The cache key of each text this run encodes: the prompt, and the negative
        prompt when guidance uses it."""
        texts = {"prompt_embeds": state["prompt"]}
        if state["guidance_scale"] > 1.0:
            texts["negative_prompt_embeds"] = state["negative_prompt"]
        # The encoder's changes since it was built (a transform, a replayed ``to``):
        # what was encoded before one is not what it encodes now.
        changes = self.text_encoder.changes if is_lazy(self.text_encoder) else 0
        scope = (state["max_sequence_length"], self.identity, str(state["device"]), changes)
        return {name: (text, *scope) for name, text in texts.items()}

    def needs_components(self, state: dict) -> bool:
        return any(key not in self.cache for key in self._keys(state).values())

    def forward(self, state: dict) -> dict:
        keys = self._keys(state)
        found = {name: self.cache.get(key) for name, key in keys.items()}
        encoded = {
            name: self._encode(keys[name][0], state)
            for name, embeds in found.items()
            if embeds is None
        }
        for name, embeds in encoded.items():  # moved once all are encoded: one wait
            # Kept in host memory: a cache must not hold device memory the stages need.
            found[name] = embeds.to("cpu", copy=True)
            self.cache.put(keys[name], found[name])
        state["negative_prompt_embeds"] = None
        for name, embeds in found.items():
            # A copy: a caller changing the state's tensor in place leaves the kept one.
            state[name] = embeds.to(state["device"], copy=True)
        return state

    @torch.no_grad()
    def _encode(self, prompt: str, state: dict) -> torch.Tensor:
        length = state["max_sequence_length"]
        text = clean_prompt(prompt)
        warn_if_cut(self.tokenizer, text, length, "the Wan text encoder")
        tokens = self.tokenizer(
            [text],
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = self.text_encoder.device
        mask = tokens.attention_mask
        hidden = self.text_encoder(tokens.input_ids.to(device), mask.to(device)).last_hidden_state
        hidden = hidden.to(dtype=self.text_encoder.dtype, device=state["device"])
        used = int(mask.gt(0).sum())
        embeds = torch.cat([hidden[0, :used], hidden.new_zeros(length - used, hidden.shape[-1])])
        return embeds.unsqueeze(0)


class PrepareLatents(Stage):
    """Initial noise; shapes come from the geometry, so nothing is loaded here."""

    def __init__(self, geometry: WanGeometry):
        super().__init__()
        self.geometry = geometry

    def forward(self, state: dict) -> dict:
        from diffusers.utils.torch_utils import randn_tensor

        shape = self.geometry.latent_shape(1, state["height"], state["width"], state["num_frames"])
        if state.get("latents") is not None:
            state["latents"] = state["latents"].to(device=state["device"], dtype=torch.float32)
        else:
            state["latents"] = randn_tensor(
                shape, generator=state.get("generator"), device=state["device"], dtype=torch.float32
            )
        return state


class Denoise(Stage):
    """Flow-matching denoising with classifier-free guidance."""

    def __init__(self, transformer: Any, scheduler: Any):
        super().__init__()
        self.transformer = transformer
        self.scheduler = scheduler

    @torch.no_grad()
    def forward(self, state: dict) -> dict:
        dtype = self.transformer.dtype
        positive = state["prompt_embeds"].to(dtype)
        negative = state["negative_prompt_embeds"]
        negative = negative.to(dtype) if negative is not None else None
        scheduler = self.scheduler
        scheduler.set_timesteps(state["num_inference_steps"], device=state["device"])
        scheduler.set_begin_index(0)
        latents = state["latents"]
        guidance = state["guidance_scale"]
        progress = state.get("progress")
        for timestep in scheduler.timesteps:
            model_input = latents.to(dtype)
            batch_timestep = timestep.expand(latents.shape[0])
            noise = self.transformer(
                hidden_states=model_input,
                timestep=batch_timestep,
                encoder_hidden_states=positive,
                return_dict=False,
            )[0]
            if negative is not None:
                unconditional = self.transformer(
                    hidden_states=model_input,
                    timestep=batch_timestep,
                    encoder_hidden_states=negative,
                    return_dict=False,
                )[0]
                noise = unconditional + guidance * (noise - unconditional)
            latents = scheduler.step(noise, timestep, latents, return_dict=False)[0]
            if progress is not None:
                progress.update(1)
        state["latents"] = latents
        return state


WAN_MODELS = ("text_encoder", "transformer", "vae")


def _model_loaders(
    folder: ModelFolder,
    load: LoadOptions,
    dtype: torch.dtype | None,
    stored: Mapping[str, torch.dtype],
    shard: tuple[str, ...],
    mesh: DeviceMesh | None,
    parallel: ContextParallel | None,
) -> dict[str, FolderLoader]:
    """The loader of each of Wan's models: sharded over the ranks where asked."""
    loaders: dict[str, FolderLoader] = {}
    for name in WAN_MODELS:
        component_dtype = dtype
        if name == "vae" and dtype is not None:
            component_dtype = torch.float32  # Wan's VAE runs in float32, as in diffusers
        options = load.replace(dtype=component_dtype, storage_dtype=stored.get(name))
        quantized = quantization_method(folder, name) is not None
        if (shard or parallel is not None) and not quantized:
            # Unsharded components load whole on every rank, counting what they read.
            loaders[name] = ShardedComponentLoader(
                folder, name, options, mesh=mesh if name in shard else None
            )
        else:
            loaders[name] = component_loader(folder, name, options)
    return loaders


class WanTextToVideo(CountsTokens, Pipeline):
    """Wan 2.1 text-to-video with its text encoder, transformer and VAE on demand."""

    lazy_components = ("text_encoder", "transformer", "vae")

    def __init__(
        self,
        components: dict[str, Any],
        *,
        identity: str = "wan",
        model_path: Path | None = None,
        loaders: Mapping[str, Loader] | None = None,
        vae_tiling: bool = True,
        parallel: ContextParallel | None = None,
        **pipeline_options: Any,
    ):
        """``pipeline_options`` are :class:`ondeck.Pipeline`'s (``policy``, ``budget``,
        ``device``, ``prefetch``, ``host_memory``)."""
        self.identity = identity
        self.profile_model = identity
        self.prompt_cache = PromptCache()
        self.model_path = model_path
        # The model components' loaders, by name: their counters go into reports.
        self.loaders: dict[str, Loader] = dict(loaders or {})
        # Decode in tiles when whole frames would not fit (see ``Decode``).
        self.vae_tiling = vae_tiling
        # Context parallelism (``ondeck.parallel``), started; None runs on one rank's own.
        self.parallel = parallel
        self.token_room = TokenRoom()  # Denoise's room before it is measured, by tokens
        super().__init__(components, **pipeline_options)
        if self.parallel is not None:
            transformer = self.components["transformer"]
            # A transform, not a call on the proxy: every load builds a fresh module, and
            # the split/gather hooks must be on each one.
            if is_lazy(transformer):
                transformer.add_transform(self.parallel.attach, reads_weights=False)
            else:
                self.parallel.attach(transformer)

    @classmethod
    def from_folder(
        cls,
        path: str | os.PathLike,
        *,
        device: DeviceChoice = None,
        dtype: torch.dtype | None = None,
        policy: str | Policy = "auto",
        budget: int | str | None = None,
        prefetch: bool = True,
        host_cache: HostCache | None = None,
        progress: bool = True,
        shard: tuple[str, ...] | list[str] = (),
        vae_tiling: bool = True,
        libraries: tuple[str, ...] | list[str] = (),
        pipelined: bool | None = None,
        parallel: str | int | ContextParallel | None = None,
        storage_dtype: StorageChoice = None,
        host_memory: int | str | None = None,
    ) -> WanTextToVideo:
        """Build the pipeline over a diffusers-format Wan folder; reads no weights.

        ``shard`` names components to split across the ranks of ``torch.distributed``
        (FSDP2; see ``ondeck.loading.sharded``): each rank then holds and reads only its
        share of their weights. Every rank builds the pipeline and runs it on the same
        inputs. ``vae_tiling`` lets the VAE decode in tiles when whole frames would not
        fit the memory left (see ``Decode``); False always decodes whole frames.
        ``libraries`` names installed packages, beyond diffusers and transformers, whose
        classes model_index.json may name. ``pipelined``: whether a stage may start computing
        while its component's blocks still arrive (``ComponentLoader``'s option; None
        pipelines the large components). ``parallel`` (``"context"``, a degree or an
        ``ondeck.parallel.ContextParallel``) splits the transformer's sequence over the
        ranks (diffusers' context parallelism): each computes its slice, and the frames
        are the same on every rank. Bad set-ups are refused before anything loads.
        ``storage_dtype`` keeps weights in fp8 and
        computes in ``dtype`` (``ondeck.loading.fp8``): one dtype for the text
        encoder and transformer, or a dict by component name. ``host_memory``: the host
        budget (:class:`ondeck.Pipeline`).
        """
        folder = ModelFolder.open(path, libraries=libraries)
        shard = check_shard(folder, shard, WAN_MODELS)
        if shard:
            init()  # before resolving the device: it selects this rank's GPU
        parallel = resolve_parallel(parallel)
        if parallel is not None:
            parallel.join()
        device = resolve_device(device)
        mesh = device_mesh(device) if shard else None
        if parallel is not None:
            spec = folder.spec("transformer")
            parallel.check_model("transformer", spec.cls, spec.config)
            parallel.start(device)
        stored = fp8.storage_by_component(
            storage_dtype, {name: folder.component_class(name) for name in WAN_MODELS}
        )
        if set(stored) & set(shard):
            raise ValueError(f"cannot shard components stored in fp8 ({sorted(stored)})")
        load = LoadOptions(
            device=device, host_cache=host_cache, progress=progress, pipelined=pipelined
        )
        components = _model_loaders(folder, load, dtype, stored, shard, mesh, parallel)
        loaders = dict(components)
        components["tokenizer"] = load_auxiliary(folder, "tokenizer")
        components["scheduler"] = load_auxiliary(folder, "scheduler")
        identity = f"{Path(path).resolve()}:{dtype}"
        if stored:  # prompts encoded from fp8 weights are cached apart
            identity += f":{fp8.describe(stored)}"
        return cls(
            components,
            identity=identity,
            model_path=Path(path),
            loaders=loaders,
            device=device,
            policy=policy,
            budget=budget,
            prefetch=prefetch,
            vae_tiling=vae_tiling,
            parallel=parallel,
            host_memory=host_memory,
        )

    def profile_shape(self, state: dict) -> dict[str, Any]:
        return {
            "height": state["height"],
            "width": state["width"],
            "frames": state["num_frames"],
            "guidance": state["guidance_scale"] > 1.0,
            "device": device_name(self.device),
            # Each rank's activations are its slice's: a different profile per degree.
            **({"context_parallel": self.parallel.degree} if self.parallel is not None else {}),
        }

    def set_plan_shape(
        self, *, height: int | None = None, width: int | None = None, frames: int | None = None
    ) -> None:
        """The shape ``plan()`` looks up activation profiles for (defaults: 480x832, 81)."""
        height, width, frames = self.geometry.snap(height or 480, width or 832, frames or 81)
        state = {"height": height, "width": width, "num_frames": frames, "guidance_scale": 5.0}
        self._profile_shape = self.profile_shape(state)

    def _token_estimates(self) -> dict[str, int | None]:
        """Denoise's transformer, for the run's shape (``CountsTokens``)."""
        shape = self.run_shape
        transformer = self.components["transformer"]
        width = feed_forward_width(getattr(transformer, "config", None))
        if shape is None or width is None:
            return {}
        tokens = self.geometry.tokens(shape["height"], shape["width"], shape["frames"])
        if self.parallel is not None:  # each rank computes its slice
            tokens = -(-tokens // self.parallel.degree)
        dtype = transformer.spec.dtype if is_lazy(transformer) else transformer.dtype
        return {"transformer": token_bytes(tokens, width, dtype)}

    @property
    def geometry(self) -> WanGeometry:
        c = self.components
        return WanGeometry.from_configs(c["transformer"].config, c["vae"].config)

    def create_stages(self) -> list[Stage]:
        c = self.components
        geometry = self.geometry
        return [
            EncodePrompt(c["tokenizer"], c["text_encoder"], self.prompt_cache, self.identity),
            PrepareLatents(geometry),
            Denoise(c["transformer"], c["scheduler"]),
            Decode(c["vae"], geometry, tiling=self.vae_tiling),
        ]

    def generate(
        self,
        prompt: str,
        *,
        negative_prompt: str = "",
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        max_sequence_length: int = 512,
        output_type: str = "np",
        progress: Any = None,
    ) -> Any:
        """Generate one video; returns frames as diffusers would (``np``: B×F×H×W×C).

        An argument the model cannot take (a side not a multiple of its patches, frames
        not 4k+1, a guidance that is not finite) raises ``ValueError`` naming it, the
        same check as the command line's; nothing is rounded.
        """
        check_generate_arguments(
            self,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            max_sequence_length=max_sequence_length,
        )
        if self.parallel is not None:  # before anything loads
            self.parallel.check_sequence(
                "transformer",
                self.geometry.tokens(height, width, num_frames),
                f"{height}x{width}, {num_frames} frames",
            )
        if generator is None and seed is not None:
            generator = torch.Generator("cpu").manual_seed(seed)
        state = {
            "prompt": prompt,
            "negative_prompt": negative_prompt,
            "height": height,
            "width": width,
            "num_frames": num_frames,
            "num_inference_steps": num_inference_steps,
            "guidance_scale": guidance_scale,
            "generator": generator,
            "latents": latents,
            "max_sequence_length": max_sequence_length,
            "output_type": output_type,
            "device": self.device,
            "progress": progress,
        }
        return self(state)["frames"]


def is_wan_folder(model_index: dict) -> bool:
    """A Wan 2.1 text-to-video folder. diffusers' ``save_pretrained`` writes an absent
    component as ``[null, null]``; only a named class is a second transformer (Wan 2.2)."""
    second = model_index.get("transformer_2")
    has_second = isinstance(second, (list, tuple)) and any(part is not None for part in second)
    return model_index.get("_class_name") == "WanPipeline" and not has_second
