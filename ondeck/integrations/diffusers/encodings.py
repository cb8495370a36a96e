"""A text encoder's answers, kept across calls: a prompt (or a negative prompt) a
pipeline encodes again is answered from host memory, without loading the encoder or
streaming its blocks.

An answer is keyed on everything the call was given (tensors by their bytes) and is
forgotten as soon as anything other than a call or a walk of its modules reaches the
component: an attribute, a configuring call, a LoRA, a move. A component with adapters
(LoRA) keeps nothing: their scales change between calls without a trace. What the
pipeline gets back is a fresh copy on the device the encoder answered on, so changing it
in place changes nothing kept.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ...recency import LeastRecentlyUsed

# Inputs larger than this are not hashed (a text encoder's are token ids: kilobytes).
MAX_INPUT_BYTES = 1 << 20
# The host bytes one component's answers may hold.
MAX_CACHED_BYTES = 256 << 20
MAX_ENTRIES = 32

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class _Uncacheable(Exception):
    """An input or output this cache does not know how to key or copy."""


def caches_answers(spec: Any, name: str) -> bool:
    """Whether component ``name`` is an encoder whose calls are worth keeping: a
    transformers model named as an encoder (text and image encoders, whose outputs
    depend on their inputs alone)."""
    module_name = getattr(getattr(spec, "cls", None), "__module__", None) or ""
    return module_name.split(".")[0] == "transformers" and "encoder" in name


class EncodingCache:
    """Answers of one component's calls by their inputs, least recently used first out."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_CACHED_BYTES):
        self._kept = LeastRecentlyUsed(max_entries, max_bytes)
        # Counts the clears: an answer computed across one is from before it, not kept.
        self.generation = 0
        self._lock = threading.Lock()  # a clear and the check before a put: one or the other

    @property
    def hits(self) -> int:
        return self._kept.hits

    @property
    def misses(self) -> int:
        return self._kept.misses

    def __len__(self) -> int:
        return len(self._kept)

    def key(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple | None:
        """The key of a call with these arguments; None when it cannot be kept (an
        argument that is not a tensor, a plain value or a container of them, a large
        tensor, or gradients being recorded)."""
        if torch.is_grad_enabled():
            return None
        try:
            return (
                _key_of(args),
                tuple(sorted((name, _key_of(value)) for name, value in kwargs.items())),
                _autocast_state(),
            )
        except _Uncacheable:
            return None

    def get(self, key: tuple) -> Any | None:
        """A fresh copy of the answer kept for ``key``, on its device; None if none."""
        found = self._kept.get(key)
        return _mapped(found, _HostTensor.restored) if found is not None else None

    def put(self, key: tuple, answer: Any, generation: int) -> None:
        """Keep a host copy of ``answer`` (unless it takes half the bytes or more, or is
        of a kind this cache cannot copy), computed when ``generation`` was current: if
        the cache was cleared since, the answer may be from weights that changed."""
        if generation != self.generation:
            return
        try:
            nbytes = _tensor_bytes(answer)
            if nbytes > self._kept.max_bytes // 2:
                return
            kept = _mapped(answer, _HostTensor)  # the copy to the host takes a while
        except _Uncacheable:
            return
        with self._lock:  # a clear during the copy: the answer may be from before it
            if generation == self.generation:
                self._kept.put(key, kept, nbytes)

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._kept.clear()


def _autocast_state() -> tuple:
    """Autocast on each device type, and to which dtype: it changes what a call returns."""
    return tuple(
        (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        for kind in ("cpu", "cuda")
    )


def _key_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        nbytes = value.numel() * value.element_size()
        if nbytes > MAX_INPUT_BYTES or value.requires_grad:
            raise _Uncacheable
        raw = value.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy()
        digest = hashlib.blake2b(raw.tobytes(), digest_size=16).hexdigest()
        return ("tensor", str(value.dtype), tuple(value.shape), str(value.device), digest)
    if isinstance(value, _PLAIN):
        return (type(value).__name__, repr(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key_of(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _key_of(v)) for k, v in value.items())))
    raise _Uncacheable


def _tensor_bytes(value: Any, seen: set[int] | None = None) -> int:
    """The bytes of the tensors in ``value``, each counted once, as ``_mapped`` copies it."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(item, seen) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item, seen) for item in value)
    return 0


def _mapped(value: Any, copy: Any, copies: dict[int, Any] | None = None) -> Any:
    """``value`` with every tensor (or kept tensor) replaced by ``copy(it)``, once per
    object (T5's last hidden state is also the last of its hidden states); output
    classes (transformers' ``ModelOutput``) keep their class."""
    copies = {} if copies is None else copies
    if isinstance(value, (torch.Tensor, _HostTensor)):
        if id(value) not in copies:
            copies[id(value)] = copy(value)
        return copies[id(value)]
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        items = {
            name: _mapped(item, copy, copies)
            for name, item in value.items()
            if not _is_key_value_cache(item)
        }
        return type(value)(**items) if _is_output(value) else type(value)(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_mapped(item, copy, copies) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(item, copy, copies) for item in value)
    raise _Uncacheable


def _is_key_value_cache(value: Any) -> bool:
    """A decoder's key/value cache (transformers' ``Cache``), which a language model used
    as a text encoder returns beside its hidden states: not kept, and absent from the
    answers given again (it comes after the hidden states an encoder is read for)."""
    return type(value).__module__.startswith("transformers.cache_utils")


def _is_output(value: Mapping) -> bool:
    """A dataclass-like output (transformers' ``ModelOutput``, diffusers' ``BaseOutput``),
    built from keyword arguments rather than from a dict."""
    return hasattr(value, "__dataclass_fields__")


class _HostTensor:
    """A kept tensor: its host copy and the device it goes back to."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor):
        self.device = tensor.device
        self.tensor = tensor.detach().to("cpu", copy=True)

    def restored(self) -> torch.Tensor:
        return self.tensor.to(self.device, copy=True)
