"""A component from one checkpoint file, the rest of the pipeline from its base folder.

What users download for a transformer is mostly one ``.safetensors`` file in the
original repository's key names. diffusers loads such a file with ``from_single_file``:
its conversion function for the model class (``SINGLE_FILE_LOADABLE_CLASSES``) renames
the keys of the state dict and splits or joins some tensors (Flux's fused ``qkv``, the
swapped halves of a final modulation). ondeck calls that same function, not on tensors,
but on stand-ins built from the header: meta tensors that remember which bytes of which
file tensor they hold (:class:`_Traced`). What comes out says, for every tensor the
model has, which byte ranges of the file fill it and in what order, so the fast reader
reads them straight into place, under every policy, streaming and the host cache
included, and ``plan`` and ``inspect`` still read no weights.

A conversion may only rename, slice contiguous rows, reshape and join along the first
dimension: every tensor then is a list of byte ranges of the file. One that computes
with values (a transpose, a sum) is refused, naming the tensor and the operation.

Checkpoints saved "fp8_scaled" (a float8 ``weight`` with a ``scale_weight`` beside it, and
a ``scaled_fp8`` marker; the newer per-layer ``weight_scale``) keep their float8 weights as
stored; the scales are set aside here, matched to the weights they scale through the same
conversion, and applied per layer for compute (``ondeck.loading.fp8``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import LoadError
from .model_folder import TRUSTED_LIBRARIES, ModelFolder
from .safetensors_format import SafetensorsHeader, TensorInfo, read_header
from .skeleton import some_names

__all__ = [
    "PICKLE_SUFFIXES",
    "SAFETENSORS_SUFFIXES",
    "AssembledTensor",
    "SingleFileFolder",
    "converted_tensors",
    "pickle_note",
    "pieces_of",
    "single_file_kind",
]

# Keys of fp8_scaled checkpoints that are not the model's tensors. ``scaled_fp8`` is the
# format's marker (an empty tensor whose dtype names the float8 dtype); ``scale_input``
# and ``input_scale`` scale activations for float8 matrix products, which a compute in the
# weights' upcast dtype does not use.
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_IGNORED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_MARKERS = ("scaled_fp8",)
# The prefix ComfyUI-style checkpoints give every key of the diffusion model, markers too.
MODEL_PREFIX = "model.diffusion_model."


# A safetensors file's names: Black Forest Labs ship theirs as .sft (flux1-dev.sft).
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")


def single_file_kind(path: str | os.PathLike) -> str:
    """``"safetensors"`` or ``"gguf"``, from the file's name; a LoadError otherwise."""
    name = os.fspath(path).lower()
    if os.path.isdir(path):
        raise LoadError(f"{path} is a folder; a single-file component is one file")
    if name.endswith(SAFETENSORS_SUFFIXES):
        return "safetensors"
    if name.endswith(".gguf"):
        return "gguf"
    raise LoadError(
        f"{path}: a single-file component is a .safetensors (or .sft) or a .gguf file"
        + pickle_note(path),
        path=os.fspath(path),
    )


def pickle_note(path: str | os.PathLike) -> str:
    """Why a pickle checkpoint is not read, for a file named as one; else nothing."""
    if not os.fspath(path).lower().endswith(PICKLE_SUFFIXES):
        return ""
    return " (pickle checkpoints are not read: unpickling can run code)"


@dataclasses.dataclass(frozen=True)
class AssembledTensor(TensorInfo):
    """A model tensor made of byte ranges of file tensors, in order (``pieces``, each a
    flat ``TensorInfo`` of its range). ``start`` and ``end`` span its byte count only."""

    pieces: tuple[TensorInfo, ...] = ()


def pieces_of(info: TensorInfo, destination: torch.Tensor) -> list[tuple[TensorInfo, torch.Tensor]]:
    """What to read into ``destination`` for ``info``: itself, or each piece of an
    assembled tensor with the part of the destination it fills."""
    if not isinstance(info, AssembledTensor):
        return [(info, destination)]
    if not destination.is_contiguous():
        raise LoadError(
            f"tensor '{info.name}' is assembled from {len(info.pieces)} parts of {info.path}, "
            "and its destination is not contiguous",
            path=info.path,
        )
    flat = destination.view(-1)
    parts = []
    offset = 0
    for piece in info.pieces:
        parts.append((piece, flat[offset : offset + piece.numel]))
        offset += piece.numel
    return parts


# -- tracing a conversion -----------------------------------------------------------------

# (file key, first element, end element): a contiguous run of one file tensor's elements.
_Run = tuple[str, int, int]

_JOINS = {torch.cat, torch.concat, torch.concatenate, torch.stack}
_COPIES = {
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.contiguous,
    torch.Tensor.detach,
    torch.detach,
    torch.Tensor.to,
    torch.Tensor.type,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.cpu,
    torch.Tensor.requires_grad_,
}


class _Traced(torch.Tensor):
    """A meta tensor standing in for file data: ``runs`` lists, in the tensor's flat
    element order, the runs of file tensors it holds; ``refused`` says why it cannot
    (the operation that made it computes with values)."""

    runs: tuple[_Run, ...] | None
    refused: str | None

    @staticmethod
    def __new__(cls, shape, dtype, runs, refused=None):
        with torch._C.DisableTorchFunctionSubclass():
            meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
        traced = torch.Tensor._make_subclass(cls, meta)
        traced.runs = runs
        traced.refused = refused
        return traced

    def __repr__(self) -> str:  # the default repr reads values
        return f"_Traced({list(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stand_ins: dict[int, _Traced] = {}

        def unwrap(value):
            if isinstance(value, _Traced):
                with torch._C.DisableTorchFunctionSubclass():
                    plain = torch.empty(value.shape, dtype=value.dtype, device="meta")
                stand_ins[id(plain)] = value
                return plain
            return value

        plain_args = tree_map(unwrap, args)
        plain_kwargs = tree_map(unwrap, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*plain_args, **plain_kwargs)
        name = getattr(func, "__name__", repr(func))
        if _is_in_place(name):
            for traced in stand_ins.values():
                traced.runs, traced.refused = None, f"{name} (changes it in place)"
            return result
        inputs = [tree_flatten(plain_args)[0], tree_flatten(plain_kwargs)[0]]
        plain_inputs = [value for values in inputs for value in values if id(value) in stand_ins]

        def wrap(value):
            if not isinstance(value, torch.Tensor) or isinstance(value, _Traced):
                return value
            runs, refused = _runs_of(func, name, value, plain_inputs, stand_ins, args, kwargs)
            return _Traced(value.shape, value.dtype, runs, refused)

        if not stand_ins:
            return result
        return tree_map(wrap, result)


_IN_PLACE_OPERATORS = frozenset(
    f"__i{operator}__"
    for operator in ("add sub mul matmul truediv floordiv mod pow and or xor lshift rshift".split())
)


def _is_in_place(name: str) -> bool:
    if name in ("__setitem__", "copy_", "set_") or name in _IN_PLACE_OPERATORS:
        return True
    return name.endswith("_") and not name.startswith("_") and name != "requires_grad_"


def _runs_of(func, name, value, plain_inputs, stand_ins, args, kwargs):
    """The runs ``value`` (a result of ``func``) holds, or None and why not."""
    if func in _JOINS:
        return _joined_runs(func, name, value, plain_inputs, stand_ins, args, kwargs)
    sources = [stand_ins[id(plain)] for plain in plain_inputs]
    refused = next((source.refused for source in sources if source.runs is None), None)
    if refused is not None:
        return None, refused
    if func in _COPIES and len(sources) == 1 and value.numel() == sources[0].numel():
        return sources[0].runs, None
    for plain in plain_inputs:
        if value is plain or getattr(value, "_base", None) is plain:
            if value.numel() == 0:
                return (), None
            if not value.is_contiguous():
                return None, f"{name} (a strided view: its elements are not contiguous bytes)"
            first = value.storage_offset()
            return _slice_runs(stand_ins[id(plain)].runs, first, first + value.numel()), None
    return None, name


def _joined_runs(func, name, value, plain_inputs, stand_ins, args, kwargs):
    parts = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim = dim % value.dim() if value.dim() else 0
    if math.prod(value.shape[:dim]) != 1:
        return None, f"{name} along dim {dim} (its parts interleave)"
    runs: list[_Run] = []
    for part in parts:
        if not isinstance(part, _Traced):
            return None, f"{name} with a tensor that is not the file's"
        if part.runs is None:
            return None, part.refused
        runs.extend(part.runs)
    return tuple(runs), None


def _slice_runs(runs: tuple[_Run, ...], first: int, end: int) -> tuple[_Run, ...]:
    """The runs of flat elements ``[first, end)`` of a tensor made of ``runs``."""
    sliced: list[_Run] = []
    position = 0
    for key, lo, hi in runs:
        length = hi - lo
        start, stop = max(first, position), min(end, position + length)
        if start < stop:
            sliced.append((key, lo + start - position, lo + stop - position))
        position += length
        if position >= end:
            break
    return tuple(sliced)


def _merged(runs: Iterable[_Run]) -> tuple[_Run, ...]:
    """Adjacent runs of one tensor as one (a split put back together reads once)."""
    merged: list[_Run] = []
    for key, lo, hi in runs:
        if merged and merged[-1][0] == key and merged[-1][2] == lo:
            merged[-1] = (key, merged[-1][1], hi)
        else:
            merged.append((key, lo, hi))
    return tuple(merged)


def converted_tensors(
    convert: Any,
    tensors: Mapping[str, TensorInfo],
    *,
    component: str,
    path: str,
    config: Any = None,
) -> dict[str, TensorInfo]:
    """The file's ``tensors`` under the names ``convert(checkpoint=..., config=...)``
    (a diffusers conversion function) gives them, each one a file tensor, a narrower byte
    range of one, or an :class:`AssembledTensor`. Reads no data."""
    checkpoint = {
        key: _Traced(info.shape, info.dtype, ((key, 0, info.numel),))
        for key, info in tensors.items()
    }
    try:
        with torch.device("meta"):
            converted = convert(checkpoint=checkpoint, config=config)
    except LoadError:
        raise
    except Exception as error:
        raise LoadError(
            f"component '{component}' from {path}: diffusers' conversion of its keys failed "
            f"on the header ({type(error).__name__}: {error}); is it a checkpoint of this "
            "model class?",
            component=component,
            path=path,
        ) from error
    result: dict[str, TensorInfo] = {}
    for key, value in converted.items():
        if not isinstance(value, _Traced):
            raise LoadError(
                f"component '{component}' from {path}: the conversion makes tensor '{key}' "
                "from nothing in the file; ondeck cannot read it into place",
                component=component,
                path=path,
            )
        if value.runs is None:
            raise LoadError(
                f"component '{component}' from {path}: the conversion computes tensor "
                f"'{key}' ({value.refused}); ondeck reads tensors that are byte ranges of "
                "the file only",
                component=component,
                path=path,
            )
        result[key] = _info_for(key, value, _merged(value.runs), tensors, component, path)
    return result


def _info_for(key, value, runs, tensors, component, path) -> TensorInfo:
    shape = tuple(value.shape)
    if len(runs) == 1:
        source = tensors[runs[0][0]]
        lo, hi = runs[0][1], runs[0][2]
        if lo == 0 and hi == source.numel:
            return dataclasses.replace(source, shape=shape)
    pieces = tuple(_piece(tensors[name], lo, hi) for name, lo, hi in runs)
    dtypes = {piece.dtype for piece in pieces}
    if len(dtypes) > 1:
        raise LoadError(
            f"component '{component}' from {path}: tensor '{key}' joins file tensors of "
            f"different dtypes ({', '.join(sorted(map(str, dtypes)))})",
            component=component,
            path=path,
        )
    if len(pieces) == 1:
        return dataclasses.replace(pieces[0], shape=shape)
    nbytes = sum(piece.nbytes for piece in pieces)
    return AssembledTensor(
        key, pieces[0].dtype, shape, pieces[0].start, pieces[0].start + nbytes, path, pieces=pieces
    )


def _piece(info: TensorInfo, lo: int, hi: int) -> TensorInfo:
    itemsize = info.dtype.itemsize
    return TensorInfo(
        f"{info.name}[{lo}:{hi}]",
        info.dtype,
        (hi - lo,),
        info.start + lo * itemsize,
        info.start + hi * itemsize,
        info.path,
    )


def conversion_for(cls: type) -> Any:
    """diffusers' single-file conversion function for ``cls``, or None when it has none."""
    try:
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    except ImportError:
        return None
    import diffusers

    for class_name, functions in SINGLE_FILE_LOADABLE_CLASSES.items():
        loadable = getattr(diffusers, class_name, None)
        if isinstance(loadable, type) and issubclass(cls, loadable):
            return functions.get("checkpoint_mapping_fn")
    return None


# -- the folder ---------------------------------------------------------------------------


class SingleFileFolder(ModelFolder):
    """A diffusers-format base folder in which some components come from single files.

    ``files`` maps a component name to its ``.safetensors`` file. Configs, tokenizers and
    every other component are the base folder's; a replaced component needs its
    ``config.json`` there (its weights there, if any, are never read). The file's keys are
    taken through diffusers' conversion for the component's class when they are not the
    model's own (:func:`converted_tensors`).
    """

    def __init__(self, base: ModelFolder, files: Mapping[str, str | os.PathLike]):
        extra = [library for library in base.libraries if library not in TRUSTED_LIBRARIES]
        super().__init__(base.path, base.model_index, variant=base.variant, libraries=extra)
        paths = {name: Path(os.fspath(path)).expanduser() for name, path in files.items()}
        # .gguf files load through diffusers' GGUF support (``ondeck.loading.quantized``).
        self.gguf_files = {n: p for n, p in paths.items() if single_file_kind(p) == "gguf"}
        self.files = {n: p for n, p in paths.items() if n not in self.gguf_files}
        self._converted: dict[str, dict[str, TensorInfo]] = {}
        self._scale_keys: dict[str, dict[str, str]] = {}
        self._scales: dict[str, dict[str, torch.Tensor]] = {}
        self._scale_lock = threading.Lock()
        for name, path in paths.items():
            self.library_and_class(name)  # a name the base does not list is refused now
            if not self.is_model(name):
                raise LoadError(
                    f"component '{name}' holds no weights (a scheduler, a tokenizer): a "
                    f"single file cannot stand in for it ({path})",
                    component=name,
                    path=str(path),
                )
            if not path.is_file():
                raise LoadError(
                    f"component '{name}': single file {path} does not exist or is not a file",
                    component=name,
                    path=str(path),
                )

    def __repr__(self) -> str:
        files = {**self.files, **self.gguf_files}
        replaced = ", ".join(f"{name}={path}" for name, path in files.items())
        return f"SingleFileFolder({str(self.path)!r}, {replaced})"

    def _read_headers(self, name: str) -> list[SafetensorsHeader]:
        if name in self.gguf_files:
            return []
        if name not in self.files:
            return super()._read_headers(name)
        return [read_header(self.files[name], component=name)]

    def require_weights(self, name: str) -> list[SafetensorsHeader]:
        return self.headers(name)

    def tensors(self, name: str) -> dict[str, TensorInfo]:
        if name not in self.files:
            return super().tensors(name)
        with self._lock:
            if name not in self._converted:
                self._converted[name] = self._convert(name)
            return self._converted[name]

    def weight_scales(self, name: str) -> dict[str, torch.Tensor]:
        """``{model tensor name: its scale}`` of an fp8_scaled file (empty otherwise), read
        on the first call (a few bytes per layer) and kept."""
        if name not in self.files:
            return {}
        self.tensors(name)
        with self._scale_lock:
            if name not in self._scales:
                self._scales[name] = self._read_scales(name)
            return self._scales[name]

    def has_scales(self, name: str) -> bool:
        if name not in self.files:
            return False
        self.tensors(name)
        return bool(self._scale_keys.get(name))

    def _convert(self, name: str) -> dict[str, TensorInfo]:
        path = str(self.files[name])
        header = self.headers(name)[0]
        weights, scales = _split_scales(header.tensors)
        slots = self._model_slots(name)
        convert = conversion_for(self.component_class(name))
        # A file already in the model's own names is taken as it is (diffusers' rule:
        # convert unless the keys are exactly the model's). A tied weight is the model's
        # under any of its names (T5's ``shared.weight`` for ``encoder.embed_tokens``).
        own_names = {key.removeprefix(MODEL_PREFIX) for key in weights}
        missing = _absent(slots or (), own_names)
        own = not missing
        if missing and len(missing) < len(slots) / 2:  # the model's names, some of them absent
            raise LoadError(
                f"component '{name}' from {path}: its keys are the model's own names, but "
                f"the file lacks {len(missing)} of the model's tensors: "
                f"{some_names(missing, quoted=False)}",
                component=name,
                path=path,
            )
        if own or convert is None:
            if not own:
                cls = self.component_class(name)
                raise LoadError(
                    f"component '{name}' from {path}: its keys are not {cls.__name__}'s, and "
                    f"diffusers has no single-file conversion for {cls.__name__}",
                    component=name,
                    path=path,
                )
            converted = {key.removeprefix(MODEL_PREFIX): info for key, info in weights.items()}
        else:
            converted = converted_tensors(
                convert,
                weights,  # scales follow their weights by file key (``_scale_owners``)
                component=name,
                path=path,
                config=dict(self.config_dict(name)),
            )
            self._check_converted(name, path, converted, slots, weights)
            converted = _only_the_models(name, path, converted, slots)
        self._scale_keys[name] = _scale_owners(converted, scales, header.tensors, name, path)
        return {key: info for key, info in converted.items() if not _is_scale_name(key)}

    def _check_converted(self, name, path, converted, slots, weights) -> None:
        """A file whose converted keys name under half of the model's tensors is another
        model's (another component's file, say): said here, naming the file, rather than
        as the config and the weights disagreeing."""
        if not slots:
            return
        found = len(slots) - len(_absent(slots, converted))
        if found * 2 >= len(slots):
            return
        cls = self.component_class(name).__name__
        raise LoadError(
            f"component '{name}' from {path}: its tensors are not {cls}'s: diffusers' "
            f"conversion finds {found} of the model's {len(slots)} tensors in its "
            f"{len(weights)} keys ({some_names(sorted(weights), 3, quoted=True)}); is it "
            f"another component's or another model's file?",
            component=name,
            path=path,
        )

    def _model_slots(self, name: str) -> list[list[str]] | None:
        """The names of each of the model's tensors (several where weights are tied),
        from a build on the meta device."""
        from .skeleton import build_skeleton

        try:
            skeleton = build_skeleton(
                self.component_class(name),
                self.directory(name),
                torch.float32,
                tensors=None,
                component=name,
                config_path=self.config_path(name),
            )
        except LoadError:
            return None
        return [list(slot.names) for slot in skeleton.slots]

    def _read_scales(self, name: str) -> dict[str, torch.Tensor]:
        from .chunks import ReadJob
        from .reads import read_into

        owners = self._scale_keys.get(name) or {}
        header = self.headers(name)[0].tensors
        jobs, scales = [], {}
        for weight, scale_key in owners.items():
            info = header[scale_key]
            scales[weight] = torch.empty(info.shape, dtype=info.dtype)
            jobs.append(ReadJob(info, scales[weight]))
        if jobs:
            read_into(jobs, progress=False, component=name)
        return scales


def _only_the_models(name: str, path: str, converted: dict, slots) -> dict:
    """What diffusers' conversion left that the model does not have goes, as diffusers'
    own single-file loading leaves it out: the other parts of a checkpoint that holds a
    whole pipeline (its VAE's ``first_stage_model.*``, its text encoders'), said once."""
    if not slots:
        return converted
    # Only under names the model has no part of: ``blocks.40.*`` beside a 40-block config
    # is a config that disagrees with the file, refused as before by the skeleton's check.
    roots = {n.split(".")[0] for slot in slots for n in slot}
    other = {key for key in converted if key.split(".")[0] not in roots}
    if other:
        warnings.warn(
            f"ondeck: component '{name}' from {path}: {len(other)} tensor(s) outside the "
            f"model are left out ({some_names(sorted(other), 3, quoted=True)}): another "
            "component's, in a checkpoint that holds more than this one",
            stacklevel=4,
        )
    return {key: info for key, info in converted.items() if key not in other}


def _absent(slots, names) -> list[str]:
    """The first name of each of the model's tensors (its ``slots``' names, several where
    weights are tied) that ``names`` holds under none of its names."""
    return [slot[0] for slot in slots if not any(n in names for n in slot)]


def _file_key(info: TensorInfo) -> str:
    """The file tensor ``info`` reads from (a piece is named ``key[first:end]``)."""
    return info.name.split("[")[0]


def _is_scale_name(key: str) -> bool:
    return key.endswith(SCALE_SUFFIXES)


def _split_scales(tensors: Mapping[str, TensorInfo]):
    """The file's weights, and its fp8_scaled scales; markers and input scales dropped."""
    weights, scales = {}, {}
    for key, info in tensors.items():
        if key.removeprefix(MODEL_PREFIX) in _MARKERS or key.endswith(_IGNORED_SUFFIXES):
            continue
        (scales if _is_scale_name(key) else weights)[key] = info
    return weights, scales


def _scale_owners(converted, scales, file_tensors, component, path) -> dict[str, str]:
    """``{model weight name: file key of its scale}``. A scale belongs to the file weight
    beside it (``x.scale_weight`` to ``x.weight``), so it follows that weight through the
    conversion: every model tensor read from that file weight is scaled by it."""
    if not scales:
        return {}
    scale_of = {}
    for key, info in scales.items():
        if info.numel != 1:
            raise LoadError(
                f"component '{component}' from {path}: scale '{key}' holds {info.numel} "
                "values; ondeck applies one scale per weight",
                component=component,
                path=path,
            )
        stem = key[: -len(next(s for s in SCALE_SUFFIXES if key.endswith(s)))]
        scale_of[f"{stem}.weight"] = key
    owners: dict[str, str] = {}
    for model_key, info in converted.items():
        if _is_scale_name(model_key):
            continue
        sources = {_file_key(piece) for piece in getattr(info, "pieces", ())} or {_file_key(info)}
        found = {scale_of[source] for source in sources if source in scale_of}
        if len(found) > 1 or (found and len(found) != len(sources)):
            raise LoadError(
                f"component '{component}' from {path}: tensor '{model_key}' joins weights with "
                "different scales",
                component=component,
                path=path,
            )
        if found:
            owners[model_key] = found.pop()
    return owners
