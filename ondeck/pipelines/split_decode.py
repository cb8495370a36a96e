"""The Wan VAE's decode split across ranks: each decodes a slab of every frame.

Under context parallelism the ranks share the transformer's work; the decode after it
would otherwise run on one rank while the others wait. Here every rank decodes one
slab of the latent frame (its share along the longer side, plus a margin on each side)
and the slabs' own parts are gathered into the whole video on every rank.

Why the result is the whole-frame decode's: everything in the decoder but its attention
is local. Convolutions see a few pixels around each output, the norm is per pixel, the
upsampling is nearest-neighbour, and the causal caches are per pixel too. A slab's
margin (``decoder_margin``: every spatial convolution after the attention counted, in
latent pixels) keeps the zero padding at a slab's cut edges from reaching its own part.
The attention is over a whole frame at latent size, so it runs whole: each rank gathers
the slabs' own parts before it, attends over the full frame, and keeps its slab's rows
(margins included, now exact). Only rounding differs, as convolutions over a narrower
input may sum in another order: within ``parallel.BF16_FRAME_TOLERANCE`` on the GPU.

Every rank must decode the same latents at the same point: the attention's gather and
the output's are collective.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["Slab", "decoder_margin", "plan_slab", "split_decode"]

# A split is worth its margins only when every rank's slab is at most this share of a
# frame; small frames (or many ranks) decode whole on every rank.
MAX_SLAB_SHARE = 0.85


@dataclasses.dataclass(frozen=True)
class Slab:
    """One rank's part of a latent frame along ``dim`` (-1 width, -2 height)."""

    dim: int
    length: int  # the frame's latent pixels along dim
    own_start: int  # this rank's own part, [own_start, own_start + own_count)
    own_count: int
    start: int  # the slab decoded, own part and margins, [start, stop)
    stop: int
    per_rank: int  # the largest own part: the gathers' padded size

    @property
    def share(self) -> float:
        """The part of a frame's decode this slab makes: its span over the frame's, along
        the split side (all but the attention is per pixel, and the attention's whole
        frame at latent size is small beside the upsampled activations)."""
        return (self.stop - self.start) / self.length


def decoder_margin(vae: Any) -> int | None:
    """Latent pixels a decoded pixel depends on beyond its own, after the attention;
    None for a decoder this module does not know (no split then).

    Counts every spatial convolution from the last attention block on, each at the scale
    it runs at (``nn.Upsample`` doubles it): an upper bound, since residual shortcuts are
    counted as if in series.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock

    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        return None
    modules = list(decoder.modules())
    attentions = [i for i, module in enumerate(modules) if isinstance(module, WanAttentionBlock)]
    if not attentions:
        return None
    margin = 0.0
    scale = 1.0
    inside_attention = set(id(m) for m in modules[attentions[-1]].modules())
    for module in modules[attentions[-1] + 1 :]:
        if id(module) in inside_attention:
            continue
        if isinstance(module, torch.nn.Upsample):
            factor = module.scale_factor
            factor = max(factor) if isinstance(factor, tuple) else factor
            scale *= float(factor or 1)
        elif isinstance(module, torch.nn.modules.conv._ConvNd):
            reach = max((k - 1) // 2 for k in module.kernel_size[-2:])
            margin += reach / scale
    # The nearest-neighbour upsampling may reach one source pixel further.
    return math.ceil(margin) + 1


def plan_slab(height: int, width: int, rank: int, world_size: int, margin: int) -> Slab | None:
    """``rank``'s slab of a ``height`` x ``width`` latent frame, or None when splitting
    would not save enough (a slab larger than ``MAX_SLAB_SHARE`` of the frame)."""
    dim, length = (-1, width) if width >= height else (-2, height)
    per_rank = math.ceil(length / world_size)
    own_start = min(rank * per_rank, length)
    own_count = min(per_rank, length - own_start)
    if own_count <= 0 or length - per_rank * (world_size - 1) <= 0:
        return None  # a rank would own nothing
    # The widest slab is an inner rank's: its own part and a margin on either side.
    widest = (
        min(length, per_rank + 2 * margin) if world_size > 2 else min(length, per_rank + margin)
    )
    if widest / length > MAX_SLAB_SHARE:
        return None
    start = max(0, own_start - margin)
    stop = min(length, own_start + own_count + margin)
    return Slab(dim, length, own_start, own_count, start, stop, per_rank)


def _gather_along(part: torch.Tensor, dim: int, slab: Slab, scale: int, group: Any) -> torch.Tensor:
    """Every rank's ``part`` (its own part along ``dim``, ``scale`` pixels per latent
    pixel), joined in rank order, on every rank."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    padded_size = slab.per_rank * scale
    pad = padded_size - part.shape[dim]
    if pad:
        shape = list(part.shape)
        shape[dim] = pad
        part = torch.cat([part, part.new_zeros(shape)], dim=dim)
    part = part.contiguous()
    parts = [torch.empty_like(part) for _ in range(world_size)]
    dist.all_gather(parts, part, group=group)
    whole = torch.cat(parts, dim=dim)
    return whole.narrow(dim, 0, slab.length * scale)


class _WholeAttention:
    """Replaces a decoder attention block's forward for a split decode: gather the
    slabs' own parts, attend over the whole frame, keep this rank's slab."""

    def __init__(self, block: torch.nn.Module, slab: Slab, group: Any):
        # A forward set on the block itself (a hook's wrapper) is kept and called.
        self.replaced = block.__dict__.get("forward")
        self.forward = self.replaced or block.forward
        self.block = block
        self.slab = slab
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        slab = self.slab
        if x.shape[slab.dim] != slab.stop - slab.start:
            raise RuntimeError(
                f"split VAE decode: the attention saw {x.shape[slab.dim]} pixels along the "
                f"split side, the slab has {slab.stop - slab.start}; this decoder's "
                "attention is not at latent size"
            )
        own = x.narrow(slab.dim, slab.own_start - slab.start, slab.own_count)
        whole = _gather_along(own, slab.dim, slab, 1, self.group)
        attended = self.forward(whole)
        return attended.narrow(slab.dim, slab.start, slab.stop - slab.start)


def split_decode(vae: Any, latents: torch.Tensor, slab: Slab, group: Any = None) -> torch.Tensor:
    """The decode of ``latents`` (batch, channels, frames, height, width), done as this
    rank's share of a split; the whole video on every rank. Collective."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock

    blocks = [m for m in vae.decoder.modules() if isinstance(m, WanAttentionBlock)]
    replacements = [_WholeAttention(block, slab, group) for block in blocks]
    for replacement in replacements:
        replacement.block.forward = replacement
    try:
        part = latents.narrow(slab.dim, slab.start, slab.stop - slab.start)
        video = vae.decode(part, return_dict=False)[0]
    finally:
        for replacement in replacements:
            if replacement.replaced is None:
                del replacement.block.forward  # the class's forward again
            else:
                replacement.block.forward = replacement.replaced
    scale, rest = divmod(video.shape[slab.dim], slab.stop - slab.start)
    if rest:
        raise RuntimeError(
            f"split VAE decode: {slab.stop - slab.start} latent pixels decoded to "
            f"{video.shape[slab.dim]}, not a whole multiple"
        )
    own = video.narrow(slab.dim, (slab.own_start - slab.start) * scale, slab.own_count * scale)
    return _gather_along(own, slab.dim, slab, scale, group)
