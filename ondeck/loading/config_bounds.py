"""Bounds on the config values that size an allocation, checked before anything is built.

A model's config is held to its weights (``skeleton``); the parts without weights are
held here: a scheduler's ``num_train_timesteps`` sizes its tables, a tokenizer's
``model_max_length`` the padded ids and its ``extra_ids`` the special tokens it makes, an
image processor's sizes the resized input, a model's ``sample_size`` the default output.
Each bound is far past any real value; a value past it is a damaged or hostile folder,
refused with one line naming the file and the key. Every config is checked whatever its
size (the folder's reader bounds that), and ``tokenizer.json`` is searched whole. A
pipeline named in a component's slot is refused: diffusers would load it whole, past
every guard.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import LoadError

__all__ = ["MAX_JSON_BYTES", "check_component_configs"]

# model_index.json, configs and shard indexes are kilobytes; read no more than this of one.
MAX_JSON_BYTES = 100_000_000
# Real schedulers count 1,000 training steps; each step costs a few float64 tables.
MAX_SCHEDULER_NUMBER = 100_000
# Real tokenizers stop at a few hundred thousand tokens; transformers' "no limit"
# sentinel (int(1e30)) is above LARGE and means "do not pad to it".
MAX_TOKENS = 1 << 24
TOKENIZER_NO_LIMIT = 1e20
# T5's tokenizers make 100 (ByT5's 125) "<extra_id_N>" special tokens; each one is a
# string, a token object and entries in the tokenizer's tables.
MAX_EXTRA_IDS = 1 << 16
# Qwen2-VL's max_pixels is 12.8M; pixel counts and sides stay below this.
MAX_PROCESSOR_NUMBER = 1 << 26
# An autoencoder's sample_size counts pixels (1024 for SD3's and Flux's VAEs); every
# other model's counts latents, which a pipeline multiplies by its VAE's scale for its
# default output (SD3's 128 makes 1024 pixels, PixArt-Sigma 2K's 256 makes 2048), as it
# does sample_height, sample_width and sample_frames (CogVideoX's 60, 90 and 49).
MAX_SAMPLE_SIZE = 16_384
MAX_LATENT_SAMPLE_SIZE = 1_024
LATENT_SAMPLE_KEYS = ("sample_size", "sample_height", "sample_width", "sample_frames")


def check_component_configs(
    directory: Path, component: str, library: str, class_name: str, read_json: Callable
) -> None:
    """Refuse a config of ``component`` (in ``directory``) that asks for an implausible
    allocation; ``read_json(path, component=...)`` reads one the folder's way."""
    if class_name.endswith("Pipeline") or (directory / "model_index.json").is_file():
        if class_name.endswith("Pipeline"):
            what = (
                f"{directory.parent / 'model_index.json'} names a pipeline ({library}.{class_name})"
            )
        else:
            what = f"{directory} holds a pipeline (a model_index.json)"
        raise LoadError(
            f"component '{component}': {what} in a component's place; ondeck runs one "
            "pipeline per folder, with models, schedulers and tokenizers as its parts",
            component=component,
            path=str(directory),
        )
    pixels = class_name.startswith(("Autoencoder", "VQModel"))
    checks = {
        "scheduler_config.json": _scheduler,
        "tokenizer_config.json": _tokenizer,
        "preprocessor_config.json": _processor,
        "processor_config.json": _processor,
        "config.json": _autoencoder if pixels else _model,
    }
    for name, check in checks.items():
        path = directory / name
        if path.is_file():
            for problem in check(read_json(path, component=component)):
                raise _refused(component, path, problem)
    head = directory / "tokenizer.json"
    if head.is_file():
        for problem in _tokenizer_file(head):
            raise _refused(component, head, problem)


def _refused(component: str, path: Path, problem: str) -> LoadError:
    return LoadError(
        f"component '{component}': {path}: {problem}; the folder is damaged or not what it claims",
        component=component,
        path=str(path),
    )


def _numbers(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """Every number in a JSON value, with its key path; lists report their length too."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        yield f"{key} (its length)", len(value)
        for index, item in enumerate(value[:MAX_SCHEDULER_NUMBER]):
            yield from _numbers(item, f"{key}[{index}]")


def _over(document: dict, limit: int, what: str, keys: tuple[str, ...] | None = None):
    for key, value in _numbers(document):
        if keys is not None and key.split(".")[-1].split("[")[0] not in keys:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            yield f"{key} is {value}, not a finite number"
        elif abs(value) > limit:
            yield f"{key} is {value:g}, more than {limit} ({what})"


def _scheduler(document: dict) -> Iterator[str]:
    yield from _over(document, MAX_SCHEDULER_NUMBER, "a scheduler's steps size its tables")


_TOKENIZER_LENGTHS = ("model_max_length", "max_length", "max_len")


def _tokenizer(document: dict) -> Iterator[str]:
    for key in _TOKENIZER_LENGTHS:
        value = document.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or (MAX_TOKENS < value < TOKENIZER_NO_LIMIT) or value < 0:
            yield f"{key} is {value:g}: tokens are padded to it; at most {MAX_TOKENS:,}"
    yield from _over(document, MAX_EXTRA_IDS, "each makes a special token", keys=("extra_ids",))
    others = {key: value for key, value in document.items() if key not in _TOKENIZER_LENGTHS}
    yield from _over(others, MAX_TOKENS, "a tokenizer's numbers count tokens")


def _processor(document: dict) -> Iterator[str]:
    yield from _over(document, MAX_PROCESSOR_NUMBER, "an input image is resized to it")


def _autoencoder(document: dict) -> Iterator[str]:
    yield from _over(
        document, MAX_SAMPLE_SIZE, "the default output is made at it", keys=("sample_size",)
    )


def _model(document: dict) -> Iterator[str]:
    yield from _over(
        document,
        MAX_LATENT_SAMPLE_SIZE,
        "in latents; the pipeline's default output is made at it times the VAE's scale",
        keys=LATENT_SAMPLE_KEYS,
    )


_PADDING = re.compile(rb'"padding"\s*:\s*\{\s*"strategy"\s*:\s*\{\s*"Fixed"\s*:\s*(\d+)')
_TRUNCATION = re.compile(rb'"truncation"\s*:\s*\{[^{}]*?"max_length"\s*:\s*(\d+)')


def _tokenizer_file(path: Path) -> Iterator[str]:
    from .safetensors_format import open_regular_file

    # JSON keys come in any order: the padding may follow megabytes of vocabulary.
    try:
        with open_regular_file(path) as file:
            text = file.read(MAX_JSON_BYTES)
    except OSError:
        return  # the tokenizer library reports an unreadable file itself
    for pattern, what in ((_PADDING, "padding length"), (_TRUNCATION, "truncation max_length")):
        found = pattern.search(text)
        if found and int(found.group(1)) > MAX_TOKENS:
            yield f"its {what} is {int(found.group(1)):,}; at most {MAX_TOKENS:,}"
