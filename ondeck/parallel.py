"""Context parallelism: every rank computes its slice of the transformer's sequence.

The engine is diffusers' own: ``ContextParallelConfig``, the transformer's ``_cp_plan``
(which inputs to split along the sequence, which output to gather) and the Ulysses
all-to-all in its attention dispatch. ondeck builds the config and its device mesh
once per process, re-attaches diffusers' hooks to every module a load builds (a
release drops them with the module, the next load gets them again), and refuses a
set-up that cannot work before any weight is read: no ``torchrun``, a degree other
than the world size, ranks on different kinds of GPU, a transformer without a plan, a
head count or a sequence the degree does not divide.

Why not ``ModelMixin.enable_parallelism``: it picks the device as ``rank %
torch.accelerator.device_count()``, which divides by zero on a host without an
accelerator (so the plumbing could not be tested on CPU processes), and it warns that
it is experimental on every call, that is on every reload. ``attach`` does the same
three things for context parallelism, with diffusers' functions: checks that the
attention backend supports it, gives each attention processor the config, and applies
the plan's hooks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import distributed
from .errors import OndeckError
from .memory import format_bytes

__all__ = [
    "BF16_FRAME_TOLERANCE",
    "ContextParallel",
    "ContextParallelError",
    "check_matching_devices",
    "compare_frames",
    "describe_device",
    "describe_split",
    "exchange_bytes_per_call",
    "resolve_parallel",
    "sequence_split",
    "split_sequences",
]

ATTENTION_KINDS = ("ulysses", "ring")

# Frames (values in [0, 1]) from a context-parallel bf16 run against one GPU's: the
# ranks' matrix products run on fewer rows, which may round differently in bf16. Float32
# on CPU processes gives the same frames bit for bit (tests/distributed).
BF16_FRAME_TOLERANCE = {"max_abs_diff": 0.1, "mean_abs_diff": 0.01}


class ContextParallelError(OndeckError):
    """A context-parallel set-up that cannot run; raised before anything loads."""


@dataclasses.dataclass
class ContextParallel:
    """Context parallelism over ``degree`` ranks (every rank of the launch).

    ``attention``: ``"ulysses"`` (all-to-all of heads; works with diffusers' native
    attention, on CPU processes too) or ``"ring"`` (key/value chunks passed around;
    needs an attention backend that returns log-sum-exp, such as ``flash`` or
    ``_native_cudnn``). Pass one as ``parallel=`` to ``WanTextToVideo.from_folder`` or
    ``ondeck.diffusers.from_pretrained``; ``parallel="context"`` means every rank, Ulysses.
    """

    degree: int
    attention: str = "ulysses"
    # Set by ``start``: diffusers' ParallelConfig, set up for this rank's device.
    config: Any = dataclasses.field(default=None, repr=False, compare=False)
    device: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 2:
            raise ContextParallelError(
                f"context parallelism: degree must be a whole number of ranks, at least 2, "
                f"got {self.degree!r}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ContextParallelError(
                f"context parallelism: attention must be one of {ATTENTION_KINDS}, "
                f"got {self.attention!r}"
            )

    # -- set-up -------------------------------------------------------------------------

    def join(self) -> ContextParallel:
        """Join the ``torchrun`` launch and check its size; before resolving the device,
        since joining selects this rank's GPU."""
        if not distributed.is_active() and not distributed.launched_with_torchrun():
            raise ContextParallelError(
                f"context parallelism over {self.degree} ranks needs one process per GPU: "
                f"launch with `torchrun --nproc-per-node {self.degree} -m ondeck generate "
                f"MODEL_DIR --context-parallel {self.degree}`, or initialise "
                "torch.distributed first"
            )
        distributed.init()
        world_size = distributed.world_size()
        if world_size != self.degree:
            raise ContextParallelError(
                f"context parallelism over {self.degree} ranks, but the launch has "
                f"{world_size} process(es): start it with --nproc-per-node {self.degree}"
            )
        return self

    def start(self, device: Any) -> ContextParallel:
        """Check the ranks' devices and build the config; collective, main thread only.

        Every rank must call it at the same point: it compares the ranks' devices and
        builds the mesh, both collective.
        """
        import torch

        if self.config is not None:
            return self
        self.join()
        device = torch.device(device)
        check_matching_devices(distributed.gather_all(describe_device(device)))
        self._check_backend_before_loading()
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

        ring, ulysses = (self.degree, 1) if self.attention == "ring" else (1, self.degree)
        mesh = distributed.context_mesh(device, ring=ring, ulysses=ulysses)
        cp_config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=mesh)
        config = ParallelConfig(context_parallel_config=cp_config)
        config.setup(distributed.rank(), self.degree, device, mesh=mesh)
        self.config = config
        self.device = device
        return self

    def _check_backend_before_loading(self) -> None:
        """Ring attention needs log-sum-exp, which diffusers' native attention lacks."""
        if self.attention != "ring":
            return
        backend = _active_backend_name()
        if backend == "native":
            raise ContextParallelError(
                "context parallelism: ring attention needs an attention backend that "
                "returns log-sum-exp (flash, _native_cudnn, ...), and diffusers' active "
                "backend is 'native'; use attention='ulysses' or set "
                "DIFFUSERS_ATTN_BACKEND"
            )

    # -- checks before loading ----------------------------------------------------------

    def check_model(self, name: str, cls: type | None, config: Any) -> None:
        """The component's class has a plan and (Ulysses) a head count the degree divides.

        Reads the class and config only, so nothing loads.
        """
        class_name = getattr(cls, "__name__", repr(cls))
        if cls is None or getattr(cls, "_cp_plan", None) is None:
            raise ContextParallelError(
                f"component '{name}' ({class_name}): diffusers gives this model no "
                "context-parallel plan (_cp_plan); run it without --context-parallel"
            )
        heads = _config_value(config, "num_attention_heads")
        if self.attention == "ulysses" and heads is not None and int(heads) % self.degree:
            raise ContextParallelError(
                f"component '{name}' ({class_name}): {heads} attention heads do not split "
                f"over {self.degree} ranks (Ulysses gives each rank heads / ranks); use a "
                f"degree that divides {heads}"
            )

    def check_sequence(self, name: str, tokens: int, shape: str = "") -> None:
        """The transformer's sequence (``tokens`` long) splits evenly over the ranks."""
        if tokens % self.degree:
            at = f" at {shape}" if shape else ""
            raise ContextParallelError(
                f"component '{name}': its sequence of {tokens} tokens{at} does not split "
                f"evenly over {self.degree} ranks; choose a shape whose token count "
                f"{self.degree} divides"
            )

    # -- every load ---------------------------------------------------------------------

    def attach(self, module: Any) -> Any:
        """Apply the plan's hooks to a freshly built module; a transform after every load.

        Returns the module; the hooks live on it and go with it on release.
        """
        from diffusers.hooks.context_parallel import apply_context_parallel
        from diffusers.models.attention import AttentionModuleMixin
        from diffusers.models.attention_processor import Attention, MochiAttention

        if self.config is None:
            raise ContextParallelError("context parallelism was not started (call start())")
        if getattr(module, "_parallel_config", None) is not None:
            raise ContextParallelError(
                f"{type(module).__name__} already has parallelism applied; ondeck applies "
                "it after every load, so do not call enable_parallelism yourself"
            )
        processors = []
        for submodule in module.modules():
            if isinstance(submodule, (Attention, MochiAttention, AttentionModuleMixin)):
                processor = getattr(submodule, "processor", None)
                if processor is not None and hasattr(processor, "_parallel_config"):
                    processors.append(processor)
        if not processors:
            raise ContextParallelError(
                f"{type(module).__name__}: no attention processor takes a parallel config"
            )
        _check_backend_supports_context_parallel(processors[0])
        for processor in processors:
            processor._parallel_config = self.config
        self._guard_splits(module, module._cp_plan)
        apply_context_parallel(module, self.config.context_parallel_config, module._cp_plan)
        # As enable_parallelism records it: diffusers then refuses a second application.
        module._parallel_config = self.config
        return module

    def _guard_splits(self, module: Any, plan: dict[str, Any]) -> None:
        """Forward pre-hooks that refuse, in one line, a sequence the degree does not
        divide, before diffusers' bare ``assert`` (which ``python -O`` skips) is reached.

        On the model: its latent grid in patches, where ``hidden_states`` is a video
        (5-D, 3-D patch) or image (4-D, 2-D patch) grid. On each module whose inputs the
        plan splits: those inputs' lengths. Where the sequence is known before loading
        (the Wan stages, the CLI), :meth:`check_sequence` has refused it already.
        """
        from diffusers.hooks.context_parallel import _get_submodule_by_name
        from diffusers.models._modeling_parallel import ContextParallelInput

        name = type(module).__name__
        patch = _config_value(getattr(module, "config", None), "patch_size")
        module.register_forward_pre_hook(
            self._grid_check(name, patch), with_kwargs=True, prepend=True
        )
        for module_id, entry in plan.items():
            if not isinstance(entry, dict):
                continue
            splits = {
                key: spec
                for key, spec in entry.items()
                if isinstance(key, str)
                and isinstance(spec, ContextParallelInput)
                and not spec.split_output
            }
            if not splits:
                continue
            targets = _get_submodule_by_name(module, module_id)
            label = f"{name}.{module_id}" if module_id else name
            for target in targets if isinstance(targets, list) else [targets]:
                target.register_forward_pre_hook(
                    self._input_check(label, target, splits), with_kwargs=True, prepend=True
                )

    def _grid_check(self, label: str, patch: Any):
        def check(target: Any, args: tuple, kwargs: dict) -> None:
            latents = kwargs.get("hidden_states", args[0] if args else None)
            if latents is None or not hasattr(latents, "dim") or patch is None:
                return
            sizes = patch if isinstance(patch, (list, tuple)) else (patch, patch)
            grid = tuple(latents.shape[2:])
            if len(grid) != len(sizes):
                return
            tokens = 1
            for length, size in zip(grid, sizes, strict=True):
                tokens *= length // int(size)
            if tokens % self.degree:
                raise ContextParallelError(
                    f"{label}: a latent grid of {list(grid)} is {tokens} patches, which do "
                    f"not split evenly over {self.degree} ranks; choose a shape whose token "
                    f"count {self.degree} divides"
                )

        return check

    def _input_check(self, label: str, target: Any, splits: dict[str, Any]):
        import inspect

        signature = inspect.signature(type(target).forward)

        def check(target: Any, args: tuple, kwargs: dict) -> None:
            try:
                bound = signature.bind_partial(target, *args, **kwargs).arguments
            except TypeError:
                return  # diffusers reports a call it cannot map itself
            for key, spec in splits.items():
                value = bound.get(key)
                if value is None or not hasattr(value, "dim"):
                    continue
                if spec.expected_dims is not None and value.dim() != spec.expected_dims:
                    continue  # diffusers leaves such an input whole
                if value.shape[spec.split_dim] % self.degree:
                    raise ContextParallelError(
                        f"{label}: input '{key}' has a sequence of "
                        f"{value.shape[spec.split_dim]}, which does not split evenly over "
                        f"{self.degree} ranks; choose a shape whose token count "
                        f"{self.degree} divides"
                    )

        return check

    # -- what the plan and the report say -----------------------------------------------

    def summary(self) -> dict[str, Any]:
        return {"degree": self.degree, "attention": self.attention}


def resolve_parallel(parallel: Any) -> ContextParallel | None:
    """``parallel=`` as callers write it: None, ``"context"`` (every rank), a degree, or a
    :class:`ContextParallel`. Not started yet (see :meth:`ContextParallel.start`)."""
    if parallel is None or parallel is False:
        return None
    if isinstance(parallel, ContextParallel):
        return parallel
    if isinstance(parallel, str):
        if parallel != "context":
            raise ContextParallelError(
                f"parallel={parallel!r}: ondeck knows 'context' (context parallelism over "
                "every rank of the launch), a degree, or a ContextParallel"
            )
        if not distributed.is_active() and not distributed.launched_with_torchrun():
            raise ContextParallelError(
                "parallel='context' needs one process per GPU: launch with `torchrun "
                "--nproc-per-node N -m ondeck generate MODEL_DIR --parallel context`"
            )
        world_size = (
            distributed.world_size()
            if distributed.is_active()
            else int(os.environ.get("WORLD_SIZE", "1"))
        )
        if world_size < 2:
            raise ContextParallelError(
                "parallel='context' needs at least 2 processes; this launch has 1"
            )
        return ContextParallel(world_size)
    if isinstance(parallel, int) and not isinstance(parallel, bool):
        return ContextParallel(parallel)
    raise ContextParallelError(
        f"parallel={parallel!r}: expected 'context', a degree or a ContextParallel"
    )


def split_sequences(parallel: ContextParallel, components: dict[str, Any], device: Any) -> None:
    """Context parallelism for every deferred component with a plan (the transformers).

    Checks them and starts ``parallel`` (collective) before anything loads; each then
    gets the plan's hooks after every load.
    """
    planned = {
        name: proxy
        for name, proxy in components.items()
        if getattr(proxy.spec.cls, "_cp_plan", None) is not None
    }
    if not planned:
        classes = ", ".join(
            f"{name} ({getattr(proxy.spec.cls, '__name__', '?')})"
            for name, proxy in components.items()
        )
        raise ContextParallelError(
            f"context parallelism: diffusers gives none of this pipeline's models a "
            f"context-parallel plan (_cp_plan): {classes}"
        )
    for name, proxy in planned.items():
        parallel.check_model(name, proxy.spec.cls, proxy.spec.config)
    parallel.start(device)
    for proxy in planned.values():
        proxy.add_transform(parallel.attach, reads_weights=False)


def compare_frames(reference: Any, candidate: Any) -> dict[str, Any]:
    """How far ``candidate`` frames are from ``reference``, and whether within
    :data:`BF16_FRAME_TOLERANCE`."""
    import numpy as np

    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.shape != candidate.shape:
        return {"within_tolerance": False, "note": f"shapes {reference.shape} {candidate.shape}"}
    difference = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    found = {
        "max_abs_diff": float(difference.max()) if difference.size else 0.0,
        "mean_abs_diff": float(difference.mean()) if difference.size else 0.0,
    }
    within = all(found[key] <= limit for key, limit in BF16_FRAME_TOLERANCE.items())
    return {
        **found,
        "equal": bool(np.array_equal(reference, candidate)),
        "within_tolerance": within,
    }


def describe_device(device: Any) -> str:
    """What must match across ranks: the device type and, on CUDA, the GPU model and its
    memory (a rank on a smaller or slower card would set everyone's pace or run out)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    properties = torch.cuda.get_device_properties(device)
    return f"cuda {properties.name} {properties.total_memory // 2**20} MiB"


def check_matching_devices(descriptions: list[str]) -> None:
    """Every rank runs on the same kind of device; one line naming the odd ones if not."""
    if len(set(descriptions)) <= 1:
        return
    by_rank = ", ".join(f"rank {rank}: {text}" for rank, text in enumerate(descriptions))
    raise ContextParallelError(
        f"context parallelism needs the same device on every rank, got {by_rank}; "
        "set CUDA_VISIBLE_DEVICES to matching GPUs"
    )


def exchange_bytes_per_call(
    *,
    attention: str,
    tokens: int,
    heads: int,
    head_dim: int,
    layers: int,
    degree: int,
    element_bytes: int,
) -> int:
    """Bytes one rank receives from the others per transformer call (self-attention).

    Ulysses: each self-attention moves query, key and value from sequence-split to
    head-split and the output back, four all-to-alls of ``tokens / degree`` rows of
    ``heads * head_dim`` each, of which ``(degree - 1) / degree`` crosses to other ranks.
    Ring: each self-attention gathers the other ranks' keys and values, ``(degree - 1)
    / degree`` of two ``tokens``-row tensors. Cross-attention stays local either way.
    """
    row_bytes = heads * head_dim * element_bytes
    if attention == "ring":
        per_layer = 2 * tokens * row_bytes * (degree - 1) // degree
    else:
        per_layer = 4 * (tokens // degree) * row_bytes * (degree - 1) // degree
    return layers * per_layer


def sequence_split(
    parallel: ContextParallel, *, tokens: int, config: Any, element_bytes: int
) -> dict[str, Any]:
    """What a rank computes and exchanges at one shape, for the plan and the report."""
    heads = int(_config_value(config, "num_attention_heads") or 0)
    head_dim = int(_config_value(config, "attention_head_dim") or 0)
    layers = int(_config_value(config, "num_layers") or 0)
    exchange = exchange_bytes_per_call(
        attention=parallel.attention,
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        layers=layers,
        degree=parallel.degree,
        element_bytes=element_bytes,
    )
    return {
        **parallel.summary(),
        "tokens": tokens,
        "tokens_per_rank": tokens // parallel.degree,
        "exchange_bytes_per_transformer_call": exchange if heads and layers else None,
    }


def describe_split(split: dict[str, Any], component_bytes: dict[str, int | None]) -> str:
    """One line for the plan: the split, the traffic, and each rank's weights."""
    exchange = split.get("exchange_bytes_per_transformer_call")
    traffic = (
        f"; {format_bytes(exchange)} exchanged per rank per transformer call"
        if exchange is not None
        else ""
    )
    weights = ", ".join(
        f"{name} {format_bytes(nbytes)}" for name, nbytes in component_bytes.items() if nbytes
    )
    return (
        f"context parallel over {split['degree']} ranks ({split['attention']}): each rank "
        f"computes {split['tokens_per_rank']} of {split['tokens']} tokens{traffic}; "
        f"weights per rank: {weights}"
    )


def _config_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


def _active_backend_name() -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend, _ = _AttentionBackendRegistry.get_active_backend()
    return getattr(backend, "value", str(backend))


def _check_backend_supports_context_parallel(processor: Any) -> None:
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
    )

    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        backend, _ = _AttentionBackendRegistry.get_active_backend()
    else:
        backend = AttentionBackendName(backend)
    if not _AttentionBackendRegistry._is_context_parallel_available(backend):
        supported = sorted(str(getattr(b, "value", b)) for b in _supported_backends())
        raise ContextParallelError(
            f"attention backend '{backend.value}' does not support context parallelism; "
            f"use one of {supported}"
        )


def _supported_backends() -> Any:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry._supports_context_parallel
