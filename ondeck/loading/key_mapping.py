"""Checkpoint keys as the model's library names them when it loads them itself.

diffusers renames keys of old checkpoints while loading (``_fix_state_dict_keys_on_load``:
deprecated attention block names); ondeck calls that same method on the header dict.

transformers renames keys while loading (transformers 5's conversion mapping: Qwen2.5-VL's
``model.*`` becomes ``model.language_model.*``; 4.x's ``_checkpoint_conversion_mapping``).
ondeck fills the module's tensors from the files directly, so it asks the library for the
same renames, by calling its own functions, and matches tensors under the names the model
has. A key the library would also reshape or merge (a converter, not a rename) cannot be
streamed to its final address; that is a ``LoadError`` naming the component and pattern.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import LoadError

__all__ = ["library_names"]


def library_names(module: Any, tensors: dict[str, Any], component: str) -> dict[str, Any]:
    """``tensors`` keyed by the names the model's library loads them under."""
    fix_keys = _diffusers_key_fixer(module)
    if fix_keys is not None:
        return fix_keys(tensors)
    renames = _transformers_renamer(module)
    if renames is None:
        return tensors
    renamed: dict[str, Any] = {}
    for key, info in tensors.items():
        new_key = renames(key, component)
        # Two checkpoint keys renamed onto one name: keep the checkpoint's own names and
        # let matching report what is wrong, rather than drop a tensor silently.
        if new_key in renamed:
            return tensors
        renamed[new_key] = info
    return renamed


def _diffusers_key_fixer(module: Any):
    """diffusers' ``_fix_state_dict_keys_on_load``: the renames its ``from_pretrained``
    applies to a checkpoint (attention blocks saved before the ``to_q``/``to_k``/``to_v``/
    ``to_out.0`` names). It renames entries of the dict it is given and looks at nothing
    but their keys, so it is handed the file's tensor headers instead of tensors."""
    try:
        from diffusers import ModelMixin
    except ImportError:
        return None
    if not isinstance(module, ModelMixin) or not hasattr(module, "_fix_state_dict_keys_on_load"):
        return None

    def fix(tensors: dict[str, Any]) -> dict[str, Any]:
        renamed = dict(tensors)
        module._fix_state_dict_keys_on_load(renamed)
        return renamed

    return fix


def _transformers_renamer(module: Any):
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(module, PreTrainedModel):
        return None
    try:  # transformers 5: the ordered weight transforms of the model and its sub-models
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return _legacy_renamer(module)
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return None

    def rename(key: str, component: str) -> str:
        new_key, converter = rename_source_key(key, renamings, converters)
        if converter is not None:
            raise LoadError(
                f"component '{component}': checkpoint tensor '{key}' is converted by "
                f"transformers while loading (pattern {converter!r}), not just renamed; "
                "ondeck cannot stream it into place",
                component=component,
            )
        return new_key

    return rename


def _legacy_renamer(module: Any):
    """transformers 4.x: ``_checkpoint_conversion_mapping``, the first matching pattern."""
    mapping = getattr(module, "_checkpoint_conversion_mapping", None) or {}
    if not mapping:
        return None

    def rename(key: str, component: str) -> str:
        for pattern, replacement in mapping.items():
            new_key, count = re.subn(pattern, replacement, key)
            if count:
                return new_key
        return key

    return rename
