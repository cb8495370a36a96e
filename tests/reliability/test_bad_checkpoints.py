"""Damaged and incomplete model folders, through the same paths a user takes.

Every case must end in one ``LoadError`` that names the file, the component and the
problem, and leave memory as it was: no proxy loaded, nothing in the tracker, no
skeleton or weight tensor alive after ``gc.collect()`` (while the caller still holds
the error), and no growth of the process's resident set over repeated attempts.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ondeck
from ondeck.loading import ComponentLoader, ModelFolder

from .helpers import (
    MiB,
    Watcher,
    assert_nothing_resident,
    edit_header,
    edit_json,
    generate,
    linked_folder_without,
    rewrite_weights,
    settled_rss,
    shard,
    tensor_entries,
    wan,
    weights_file,
)

# A tiny folder's components are a few hundred KB, so this bound is about repeated
# failures not accumulating; the large-component tests below bound a single failure.
RSS_GROWTH_BOUND = 8 * MiB
ATTEMPTS = 3


@dataclass(frozen=True)
class Case:
    id: str
    component: str | None  # the component the message must name (None: folder level)
    damage: Callable[[Path], None]
    problem: str  # regex the message must match
    file: Callable[[Path], Path]  # the file or folder the message must name
    after_build: bool = False  # damage lands after the pipeline read the headers


def transformer_file(folder: Path) -> Path:
    return weights_file(folder / "transformer")


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder)


def rename_class(component: str, class_name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        def edit(index: dict) -> None:
            index[component] = [index[component][0], class_name]

        edit_json(folder / "model_index.json", edit)

    return damage


def header_not_json(folder: Path) -> None:
    path = transformer_file(folder)
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    path.write_bytes(raw[:8] + b"{" + b"x" * (length - 1) + raw[8 + length :])


def implausible_header_length(folder: Path) -> None:
    path = transformer_file(folder)
    raw = path.read_bytes()
    path.write_bytes((2**60).to_bytes(8, "little") + raw[8:])


def truncate(folder: Path) -> None:
    path = transformer_file(folder)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty_file(folder: Path) -> None:
    transformer_file(folder).write_bytes(b"")


def overlap_offsets(document: dict) -> None:
    """Shift the second tensor back so its first element lies inside the first tensor."""
    (_, first), (_, second) = tensor_entries(document)[:2]
    begin, end = second["data_offsets"]
    new_begin = first["data_offsets"][1] - 4
    second["data_offsets"] = [new_begin, new_begin + end - begin]


def reverse_offsets(document: dict) -> None:
    _, entry = tensor_entries(document)[1]
    entry["data_offsets"] = entry["data_offsets"][::-1]


def unknown_dtype(document: dict) -> None:
    _, entry = tensor_entries(document)[0]
    entry["dtype"] = "F12"


def wrong_shape(tensors: dict) -> None:
    weight = tensors["proj_out.weight"]
    tensors["proj_out.weight"] = torch.zeros(weight.shape[0] + 1, weight.shape[1])


def missing_key(tensors: dict) -> None:
    del tensors["proj_out.weight"]


def unexpected_key(tensors: dict) -> None:
    tensors["bogus.weight"] = torch.zeros(3)


def missing_shard(folder: Path) -> None:
    shard(folder / "transformer")[1].unlink()


SECOND_SHARD = "diffusion_pytorch_model-00002-of-00002.safetensors"


def second_shard(folder: Path) -> Path:
    return folder / "transformer" / SECOND_SHARD


def index_misplaces_a_tensor(folder: Path) -> None:
    shard(folder / "transformer")
    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"

    def edit(document: dict) -> None:
        weight_map = document["weight_map"]
        first = next(k for k, v in weight_map.items() if v.endswith("00001-of-00002.safetensors"))
        weight_map[first] = "diffusion_pytorch_model-00002-of-00002.safetensors"

    edit_json(index, edit)


def config_not_json(folder: Path) -> None:
    (folder / "transformer" / "config.json").write_text("{not json")


CASES = [
    Case("missing-folder", None, remove_folder, r"does not exist", lambda f: f),
    Case(
        "missing-model-index",
        None,
        lambda f: (f / "model_index.json").unlink(),
        r"no model_index\.json",
        lambda f: f,
    ),
    Case(
        "model-index-not-json",
        None,
        lambda f: (f / "model_index.json").write_text("{nope"),
        r"not valid JSON",
        lambda f: f / "model_index.json",
    ),
    Case(
        "missing-config",
        "transformer",
        lambda f: (f / "transformer" / "config.json").unlink(),
        r"config\.json is missing",
        lambda f: f / "transformer" / "config.json",
    ),
    Case(
        "config-not-json",
        "transformer",
        config_not_json,
        r"config\.json: not valid JSON",
        lambda f: f / "transformer",
    ),
    Case(
        "class-missing-from-diffusers",
        "transformer",
        rename_class("transformer", "WanTransformer9DModel"),
        r"class WanTransformer9DModel is not in diffusers",
        lambda f: Path("model_index.json"),
    ),
    Case(
        "class-missing-from-transformers",
        "text_encoder",
        rename_class("text_encoder", "UMT9EncoderModel"),
        r"class UMT9EncoderModel is not in transformers",
        lambda f: Path("model_index.json"),
    ),
    Case(
        "library-not-installed",
        "vae",
        lambda f: edit_json(
            f / "model_index.json", lambda i: i.__setitem__("vae", ["nolib_xyz", "Autoencoder"])
        ),
        r"from library 'nolib_xyz'; ondeck imports classes only from diffusers, transformers",
        lambda f: Path("vae"),
    ),
    Case("header-not-json", "transformer", header_not_json, r"not valid JSON", transformer_file),
    Case(
        "header-length-implausible",
        "transformer",
        implausible_header_length,
        r"header length \d+ is not plausible",
        transformer_file,
    ),
    Case(
        "empty-weight-file",
        "transformer",
        empty_file,
        r"file holds 0 bytes, too short",
        transformer_file,
    ),
    Case(
        "offsets-past-end-of-file",
        "transformer",
        truncate,
        r"header says .* of data, file holds .* \(truncated download\?\)",
        transformer_file,
    ),
    Case(
        "overlapping-offsets",
        "transformer",
        lambda f: edit_header(f / "transformer", overlap_offsets),
        r"tensor '.+' overlaps tensor '.+'",
        transformer_file,
    ),
    Case(
        "offsets-end-before-they-begin",
        "transformer",
        lambda f: edit_header(f / "transformer", reverse_offsets),
        r"data_offsets \[\d+, \d+\] end before they begin",
        transformer_file,
    ),
    Case(
        "unknown-dtype",
        "transformer",
        lambda f: edit_header(f / "transformer", unknown_dtype),
        r"unknown dtype 'F12'",
        transformer_file,
    ),
    Case(
        "shape-disagrees-with-model",
        "transformer",
        lambda f: rewrite_weights(f / "transformer", wrong_shape),
        r"tensor 'proj_out\.weight' has shape \[65, 24\], the model expects \[64, 24\]",
        transformer_file,
    ),
    Case(
        "missing-key",
        "transformer",
        lambda f: rewrite_weights(f / "transformer", missing_key),
        r"1 tensor\(s\) the model needs are missing: 'proj_out\.weight'",
        transformer_file,
    ),
    Case(
        "unexpected-key",
        "transformer",
        lambda f: rewrite_weights(f / "transformer", unexpected_key),
        r"1 tensor\(s\) the model does not have: 'bogus\.weight'",
        transformer_file,
    ),
    Case(
        "shard-index-names-missing-shard",
        "transformer",
        missing_shard,
        r"names shard .*00002-of-00002\.safetensors, but .* is missing",
        second_shard,
    ),
    Case(
        "shard-index-misplaces-a-tensor",
        "transformer",
        index_misplaces_a_tensor,
        r"the shard index puts tensor '.+' in .*00002-of-00002\.safetensors, but that file "
        r"does not hold it",
        lambda f: Path(SECOND_SHARD),
    ),
    Case(
        "no-weight-file",
        "vae",
        lambda f: weights_file(f / "vae").unlink(),
        r"no safetensors weights there \(expected diffusion_pytorch_model\.safetensors",
        lambda f: f / "vae",
    ),
    Case(
        "truncated-after-the-pipeline-was-built",
        "transformer",
        truncate,
        r"the file changed after its header was read \(its size changed from \d+ to \d+ "
        r"bytes\); it is not read",
        transformer_file,
        after_build=True,
    ),
]


def assert_names_everything(error: ondeck.LoadError, case: Case, folder: Path) -> None:
    message = str(error)
    assert re.search(case.problem, message), message
    assert str(case.file(folder)) in message, message
    if case.component is not None:
        assert f"component '{case.component}'" in message, message
        assert error.component == case.component


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_checkpoint_fails_cleanly_through_the_pipeline(case, tiny_folder, monkeypatch):
    if not case.after_build:
        case.damage(tiny_folder)
    watcher = Watcher(monkeypatch)
    baseline = None
    built = None
    if case.after_build:
        built = wan(tiny_folder)
        case.damage(tiny_folder)
    for _ in range(ATTEMPTS):
        pipe = built
        with pytest.raises(ondeck.LoadError) as excinfo:
            pipe = pipe or wan(tiny_folder)
            generate(pipe)
        assert_names_everything(excinfo.value, case, tiny_folder)
        if pipe is not None:
            assert_nothing_resident(pipe)
        # Checked while the error and its traceback are still held.
        assert watcher.alive() == []
        del pipe, excinfo
        if baseline is None:
            baseline = settled_rss()
    assert settled_rss() - baseline < RSS_GROWTH_BOUND


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_checkpoint_fails_cleanly_through_the_component_loader(case, tiny_folder, monkeypatch):
    name = case.component or "transformer"
    if not case.after_build:
        case.damage(tiny_folder)
    watcher = Watcher(monkeypatch)
    with pytest.raises(ondeck.LoadError) as excinfo:
        loader = ComponentLoader(tiny_folder, name, dtype=torch.float32, progress=False)
        if case.after_build:
            loader.folder.tensors(name)
            case.damage(tiny_folder)
        loader()
    error = excinfo.value
    assert re.search(case.problem, str(error)), str(error)
    assert str(case.file(tiny_folder)) in str(error)
    # Through the loader the component is always known, folder-level failures included.
    assert f"component '{name}'" in str(error)
    assert watcher.alive() == []


@pytest.mark.parametrize("case", CASES[:3], ids=[case.id for case in CASES[:3]])
def test_bad_folder_fails_cleanly_through_model_folder_open(case, tiny_folder):
    case.damage(tiny_folder)
    with pytest.raises(ondeck.LoadError) as excinfo:
        ModelFolder.open(tiny_folder)
    assert re.search(case.problem, str(excinfo.value))
    assert str(case.file(tiny_folder)) in str(excinfo.value)


def test_a_failed_load_of_a_large_component_gives_its_memory_back(
    default_template, tmp_path, monkeypatch
):
    """The transformer of the default preset (138 MiB) cut to half after its header was
    read: refused on its identity before a byte is read (a read that fails late in the
    file is `test_fault_late_in_a_large_load_gives_the_memory_back`)."""
    folder = linked_folder_without(default_template, tmp_path / "wan", "transformer")
    for entry in (default_template / "transformer").iterdir():
        (folder / "transformer" / entry.name).symlink_to(entry)
    pipe = wan(folder)
    component_bytes = pipe.component_bytes()["transformer"]
    generate(pipe)  # a clean run first: allocator pools and lazy imports settle
    # The download "stopped" half way: same path, first half of the bytes.
    weights = weights_file(folder / "transformer")
    full = weights.resolve()
    weights.unlink()
    with open(full, "rb") as source:
        weights.write_bytes(source.read(full.stat().st_size // 2))
    watcher = Watcher(monkeypatch)
    before = settled_rss()
    for _ in range(2):
        with pytest.raises(ondeck.LoadError, match="changed after its header was read") as excinfo:
            generate(pipe)
        assert_nothing_resident(pipe)
        assert watcher.alive() == []
        del excinfo
    grown = settled_rss() - before
    assert component_bytes > 100 * MiB
    assert grown < 16 * MiB, f"resident set grew {grown / MiB:.1f} MiB"
