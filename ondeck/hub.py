"""A model named as users type it: a folder, or a Hugging Face Hub repo id."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import LoadError

# What a diffusers-format pipeline needs: configs, tokenizer files and safetensors
# weights. Pickle weights, original-format checkpoints, images and code stay on the Hub.
ALLOW_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.safetensors"]

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def looks_like_repo_id(source: str | os.PathLike) -> bool:
    text = os.fspath(source)
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and not text.endswith(".")


def model_label(source: str | os.PathLike) -> str:
    """What a model is called in plans and titles: a folder's name, or a repo id as typed
    (its cached snapshot's folder is a commit hash)."""
    text = os.fspath(source).rstrip("/") or os.fspath(source)
    if not Path(text).expanduser().is_dir() and looks_like_repo_id(text):
        return text
    return Path(text).expanduser().name or text


def resolve_model(source: str | os.PathLike) -> Path:
    """The local folder for ``source``: itself when it is a folder, else a Hub snapshot.

    A repo id (``owner/name``) that is not an existing folder is looked up in
    huggingface_hub's cache first; if it is not there it is downloaded (safetensors
    weights only, with huggingface_hub's progress bar) unless ``HF_HUB_OFFLINE`` is
    set. Offline or failing, a ``LoadError`` says what to run to fetch it. Anything
    else is returned as a path, for the folder checks to report.
    """
    path = Path(os.fspath(source)).expanduser()
    if path.is_dir() or not looks_like_repo_id(source):
        return path
    repo_id = os.fspath(source)
    from huggingface_hub import snapshot_download

    # Read at call time: huggingface_hub reads these once, when it is first imported.
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    fetch = f"fetch it with `hf download {repo_id}` (or pass a local folder)"
    try:
        return Path(
            snapshot_download(
                repo_id, cache_dir=cache_dir, local_files_only=True, allow_patterns=ALLOW_PATTERNS
            )
        )
    except Exception as error:  # not cached; huggingface_hub's error types vary by version
        if not _is_missing_locally(error):
            raise LoadError(
                f"{repo_id}: reading it from the Hugging Face cache failed "
                f"({type(error).__name__}: {_first_line(error)}); {fetch}",
                path=repo_id,
            ) from error
    if _offline():
        raise LoadError(
            f"{repo_id} is not a folder and not in the Hugging Face cache, and HF_HUB_OFFLINE "
            f"is set; {fetch}",
            path=repo_id,
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS))
    except Exception as error:  # network, authentication, missing repo: one line each
        raise LoadError(
            f"{repo_id} is not a folder, and downloading it from the Hugging Face Hub failed "
            f"({type(error).__name__}: {_first_line(error)}); {fetch}",
            path=repo_id,
        ) from error


def _is_missing_locally(error: Exception) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError

    return isinstance(error, (LocalEntryNotFoundError, FileNotFoundError))


def _offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
