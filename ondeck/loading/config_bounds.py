"""Bounds on the config values that size an allocation, checked before anything is built.

A model's config is held to its weights (``skeleton``); the parts without weights are
held here: a scheduler's ``num_train_timesteps`` sizes its tables, a tokenizer's
``model_max_length`` the padded ids, an image processor's sizes the resized input, a
model's ``sample_size`` the default output. Each bound is far past any real value; a
value past it is a damaged or hostile folder, refused with one line naming the file
and the key. A pipeline named in a component's slot is refused: diffusers would load
it whole, past every guard.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import LoadError

__all__ = ["check_component_configs"]

# Real schedulers count 1,000 training steps; each step costs a few float64 tables.
MAX_SCHEDULER_NUMBER = 100_000
# Real tokenizers stop at a few hundred thousand tokens; transformers' "no limit"
# sentinel (int(1e30)) is above LARGE and means "do not pad to it".
MAX_TOKENS = 1 << 24
TOKENIZER_NO_LIMIT = 1e20
# Qwen2-VL's max_pixels is 12.8M; pixel counts and sides stay below this.
MAX_PROCESSOR_NUMBER = 1 << 26
MAX_SAMPLE_SIZE = 16_384
# Configs are kilobytes; a larger one is left to the reader's own limit.
MAX_CHECKED_BYTES = 4 << 20
# tokenizer.json can be tens of MB; its padding and truncation come first.
TOKENIZER_HEAD_BYTES = 64 << 10


def check_component_configs(
    directory: Path, component: str, library: str, class_name: str, read_json: Callable
) -> None:
    """Refuse a config of ``component`` (in ``directory``) that asks for an implausible
    allocation; ``read_json(path, component=...)`` reads one the folder's way."""
    if class_name.endswith("Pipeline") or (directory / "model_index.json").is_file():
        raise LoadError(
            f"component '{component}': {directory.parent / 'model_index.json'} names a "
            f"pipeline ({library}.{class_name}) in a component's place; ondeck runs one "
            "pipeline per folder, with models, schedulers and tokenizers as its parts",
            component=component,
            path=str(directory),
        )
    checks = {
        "scheduler_config.json": _scheduler,
        "tokenizer_config.json": _tokenizer,
        "preprocessor_config.json": _processor,
        "processor_config.json": _processor,
        "config.json": _model,
    }
    for name, check in checks.items():
        path = directory / name
        if path.is_file() and path.stat().st_size <= MAX_CHECKED_BYTES:
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


def _over(document: dict, limit: float, what: str, keys: tuple[str, ...] | None = None):
    for key, value in _numbers(document):
        if keys is not None and key.split(".")[-1].split("[")[0] not in keys:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            yield f"{key} is {value}, not a finite number"
        elif abs(value) > limit:
            yield f"{key} is {value:g}, more than {limit:g} ({what})"


def _scheduler(document: dict) -> Iterator[str]:
    yield from _over(document, MAX_SCHEDULER_NUMBER, "a scheduler's steps size its tables")


def _tokenizer(document: dict) -> Iterator[str]:
    for key in ("model_max_length", "max_length", "max_len"):
        value = document.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or (MAX_TOKENS < value < TOKENIZER_NO_LIMIT) or value < 0:
            yield f"{key} is {value:g}: tokens are padded to it; at most {MAX_TOKENS:,}"


def _processor(document: dict) -> Iterator[str]:
    yield from _over(document, MAX_PROCESSOR_NUMBER, "an input image is resized to it")


def _model(document: dict) -> Iterator[str]:
    yield from _over(
        document, MAX_SAMPLE_SIZE, "the default output is made at it", keys=("sample_size",)
    )


_PADDING = re.compile(rb'"padding"\s*:\s*\{\s*"strategy"\s*:\s*\{\s*"Fixed"\s*:\s*(\d+)')
_TRUNCATION = re.compile(rb'"truncation"\s*:\s*\{[^{}]*?"max_length"\s*:\s*(\d+)')


def _tokenizer_file(path: Path) -> Iterator[str]:
    from .safetensors_format import open_regular_file

    try:
        with open_regular_file(path) as file:
            head = file.read(TOKENIZER_HEAD_BYTES)
    except OSError:
        return  # the tokenizer library reports an unreadable file itself
    for pattern, what in ((_PADDING, "padding length"), (_TRUNCATION, "truncation max_length")):
        found = pattern.search(head)
        if found and int(found.group(1)) > MAX_TOKENS:
            yield f"its {what} is {int(found.group(1)):,}; at most {MAX_TOKENS:,}"
