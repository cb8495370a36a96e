"""Model folders made to hurt: configs that contradict their weights, names that leave
the folder, files that are not files, JSON of the wrong kind.

Each case must end in one ``LoadError`` that names the file at fault (and, for a config
that disagrees with its weights, both files), before any weight is read and without
building anything at the size a hostile config asks for. ``plan`` and ``inspect`` read
no weights, so they are driven through their Python entry points (``ondeck.plan`` and
``ModelFolder.spec``); nothing is written anywhere by any of these cases.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from safetensors.torch import load_file
from torch.nn.modules import module as nn_module

import ondeck
import ondeck.diffusers
from ondeck.loading import ModelFolder, read_header
from ondeck.loading.skeleton import build_skeleton

from .helpers import MiB, edit_json, linked_folder_without, settled_rss, shard, wan, weights_file

TRANSFORMER_CONFIG = Path("transformer") / "config.json"


def set_config(folder: Path, component: str, **values) -> Path:
    path = folder / component / "config.json"
    edit_json(path, lambda config: config.update(values))
    return path


@pytest.fixture
def registration_fuse():
    """Stops any module construction in this test after 100,000 registered tensors.

    Only a safety net, so that the unguarded code fails this test instead of building
    a billion layers; the guard under test stops far earlier.
    """
    count = [0]

    def fuse(module, name, tensor):
        count[0] += 1
        if count[0] > 100_000:
            raise RuntimeError("test fuse: construction ran away")

    handles = [
        nn_module.register_module_parameter_registration_hook(fuse),
        nn_module.register_module_buffer_registration_hook(fuse),
    ]
    yield count
    for handle in handles:
        handle.remove()


def assert_names_config_and_weights(message: str, folder: Path, component: str) -> None:
    assert str(folder / component / "config.json") in message, message
    assert str(weights_file(folder / component)) in message, message
    assert f"component '{component}'" in message, message


# -- configs that contradict their weights ------------------------------------------------


def test_a_layer_count_the_weights_do_not_hold_stops_the_build(tiny_folder, registration_fuse):
    set_config(tiny_folder, "transformer", num_layers=10**9)
    with pytest.raises(ondeck.LoadError, match="disagree") as excinfo:
        ModelFolder.open(tiny_folder).spec("transformer")
    assert_names_config_and_weights(str(excinfo.value), tiny_folder, "transformer")
    # Stopped after a few blocks: the files hold 69 tensors.
    assert registration_fuse[0] < 1_000


def test_a_width_the_weights_do_not_hold_is_refused_by_plan(tiny_folder):
    set_config(tiny_folder, "transformer", ffn_dim=10**6)
    before = settled_rss()
    with pytest.raises(ondeck.LoadError, match="disagree") as excinfo:
        ondeck.plan(tiny_folder, device="cpu")
    assert_names_config_and_weights(str(excinfo.value), tiny_folder, "transformer")
    assert settled_rss() - before < 64 * MiB


def test_a_config_off_by_one_is_refused_when_the_pipeline_is_built(tiny_folder):
    """Before: planned and built fine, and failed only when the transformer loaded."""
    set_config(tiny_folder, "transformer", ffn_dim=49)
    with pytest.raises(ondeck.LoadError, match=r"has shape \[48, 24\], the model expects") as e:
        wan(tiny_folder)
    assert_names_config_and_weights(str(e.value), tiny_folder, "transformer")


def test_a_huge_rope_table_is_refused_before_it_is_computed(tiny_folder):
    set_config(tiny_folder, "transformer", rope_max_seq_len=3_000_000)
    before = settled_rss()
    with pytest.raises(ondeck.LoadError, match="disagree") as excinfo:
        ondeck.plan(tiny_folder, device="cpu")
    assert_names_config_and_weights(str(excinfo.value), tiny_folder, "transformer")
    # The table would take 288 MB; nothing of it was made.
    assert settled_rss() - before < 64 * MiB


def test_computed_tables_that_dwarf_the_weights_are_refused(default_template, tmp_path):
    """Large enough weights that the build guard lets the tables through; the check after
    the meta build still refuses 150 MB of rope tables for 138 MiB of weights."""
    folder = linked_folder_without(default_template, tmp_path / "wan", "transformer")
    (folder / "transformer" / "config.json").write_text(
        (default_template / "transformer" / "config.json").read_text()
    )
    weights = weights_file(default_template / "transformer")
    (folder / "transformer" / weights.name).symlink_to(weights)
    set_config(folder, "transformer", rope_max_seq_len=300_000)
    before = settled_rss()
    with pytest.raises(ondeck.LoadError, match="tables the model computes for itself") as e:
        ModelFolder.open(folder).spec("transformer", dtype=torch.float32)
    assert "rope.freqs_cos" in str(e.value)
    assert str(folder / "transformer" / "config.json") in str(e.value)
    assert settled_rss() - before < 64 * MiB


def test_a_weight_file_that_is_a_fifo_is_refused_not_waited_on(tiny_folder):
    weights = weights_file(tiny_folder / "vae")
    weights.unlink()
    os.mkfifo(weights)
    # The test holds the write end with a few bytes in the pipe, so that code opening and
    # reading the FIFO gets an answer instead of waiting for a writer forever.
    writer = os.open(weights, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(writer, b"\x08" + b"\x00" * 15)
        folder = ModelFolder.open(tiny_folder)
        with pytest.raises(ondeck.LoadError, match=r"not a regular file \(a FIFO\)") as excinfo:
            folder.spec("vae")
        assert str(weights) in str(excinfo.value)
        with pytest.raises(ondeck.LoadError, match=r"not a regular file \(a FIFO\)"):
            ondeck.plan(tiny_folder, device="cpu")
    finally:
        os.close(writer)


def test_a_tokenizer_file_that_is_a_fifo_is_refused_not_waited_on(tiny_folder):
    config = tiny_folder / "tokenizer" / "tokenizer_config.json"
    config.unlink()
    os.mkfifo(config)
    writer = os.open(config, os.O_RDWR | os.O_NONBLOCK)
    os.write(writer, b"{}")
    # A safety valve, not a timing: code that reads the FIFO to its end would wait for
    # ever; closing the write end after a while gives it its end, so it fails the test.
    released = threading.Event()

    def release() -> None:
        os.close(writer)
        released.set()

    valve = threading.Timer(10, release)
    valve.start()
    try:
        with pytest.raises(ondeck.LoadError, match=r"not a regular file \(a FIFO\)") as excinfo:
            wan(tiny_folder)
        assert str(config) in str(excinfo.value)
        assert "component 'tokenizer'" in str(excinfo.value)
    finally:
        valve.cancel()
        valve.join()
        if not released.is_set():
            os.close(writer)


# -- JSON of the wrong kind ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"[]", r"holds a JSON list, not an object"),
        (b'{"_class_name": "WanPipeline\xff"}', r"not valid JSON \('utf-8' codec"),
        (b"[" * 100_000, r"not valid JSON \(maximum recursion depth"),
    ],
    ids=["list", "not-utf-8", "nested-too-deep"],
)
def test_a_bad_model_index_is_one_load_error_for_plan(tiny_folder, content, problem):
    (tiny_folder / "model_index.json").write_bytes(content)
    with pytest.raises(ondeck.LoadError, match=problem) as excinfo:
        ondeck.plan(tiny_folder, device="cpu")
    assert str(tiny_folder / "model_index.json") in str(excinfo.value)


def test_a_config_that_is_a_list_says_so(tiny_folder):
    """Before: "We couldn't connect to 'https://huggingface.co'"."""
    (tiny_folder / TRANSFORMER_CONFIG).write_text("[]")
    with pytest.raises(ondeck.LoadError, match="holds a JSON list, not an object") as excinfo:
        ModelFolder.open(tiny_folder).spec("transformer")
    assert str(tiny_folder / TRANSFORMER_CONFIG) in str(excinfo.value)
    assert "huggingface.co" not in str(excinfo.value)


# -- names that leave the folder ----------------------------------------------------------


def outside_vae(folder: Path) -> Path:
    """A VAE folder beside the model folder, where a hostile name could point."""
    outside = folder.parent / "outside"
    (folder / "vae").rename(outside)
    return outside


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_a_component_name_that_leaves_the_folder_is_refused(tiny_folder, kind):
    outside = outside_vae(tiny_folder)
    name = "../outside" if kind == "relative" else str(outside)
    edit_json(tiny_folder / "model_index.json", lambda index: index.update({name: index["vae"]}))
    with pytest.raises(ondeck.LoadError, match="not a plain folder name") as excinfo:
        ModelFolder.open(tiny_folder)
    assert repr(name) in str(excinfo.value)
    assert str(tiny_folder / "model_index.json") in str(excinfo.value)


def test_the_diffusers_path_loads_nothing_from_outside_the_folder(tiny_folder):
    outside_vae(tiny_folder)
    edit_json(
        tiny_folder / "model_index.json", lambda index: index.update({"../outside": index["vae"]})
    )
    with pytest.raises(ondeck.LoadError, match="not a plain folder name"):
        ondeck.diffusers.from_pretrained(tiny_folder, device="cpu", progress=False)


def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(tiny_folder):
    """Before: a KeyError."""
    first, second = shard(tiny_folder / "transformer", parts=2)
    (tiny_folder / "elsewhere").mkdir()
    second.rename(tiny_folder / "elsewhere" / second.name)
    index = tiny_folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    outside_name = f"../elsewhere/{second.name}"
    edit_json(
        index,
        lambda document: document["weight_map"].update(
            {k: outside_name for k, v in document["weight_map"].items() if v == second.name}
        ),
    )
    with pytest.raises(ondeck.LoadError, match="not a plain file name") as excinfo:
        ModelFolder.open(tiny_folder).spec("transformer")
    assert str(index) in str(excinfo.value)
    assert repr(outside_name) in str(excinfo.value)


# -- missing and pickled weights, custom pipelines ------------------------------------------


def test_a_missing_vae_file_fails_when_the_wan_pipeline_is_built(tiny_folder):
    """Before: found only when the decode stage loaded the VAE, after the whole denoise."""
    weights_file(tiny_folder / "vae").unlink()
    with pytest.raises(ondeck.LoadError, match="no safetensors weights there") as excinfo:
        wan(tiny_folder)
    assert str(tiny_folder / "vae") in str(excinfo.value)
    assert "component 'vae'" in str(excinfo.value)


def test_a_missing_vae_file_fails_when_the_diffusers_pipeline_is_built(tiny_folder):
    weights_file(tiny_folder / "vae").unlink()
    with pytest.raises(ondeck.LoadError, match="no safetensors weights there") as excinfo:
        ondeck.diffusers.from_pretrained(tiny_folder, device="cpu", progress=False)
    assert "component 'vae'" in str(excinfo.value)


def test_pickle_only_weights_on_the_diffusers_path_are_one_load_error(tiny_folder):
    """Before: an OSError from diffusers."""
    weights = weights_file(tiny_folder / "vae")
    torch.save(load_file(str(weights)), tiny_folder / "vae" / "diffusion_pytorch_model.bin")
    weights.unlink()
    with pytest.raises(ondeck.LoadError, match="only pickle weights") as excinfo:
        ondeck.diffusers.from_pretrained(tiny_folder, device="cpu", progress=False)
    message = str(excinfo.value)
    assert "component 'vae'" in message and "diffusion_pytorch_model.bin" in message
    assert "safetensors" in message


def test_a_custom_pipeline_class_is_one_load_error(tiny_folder):
    """Before: a TypeError (diffusers names custom pipelines as [file, class])."""
    edit_json(
        tiny_folder / "model_index.json",
        lambda index: index.update({"_class_name": ["my_pipeline", "MyPipeline"]}),
    )
    with pytest.raises(ondeck.LoadError, match="names a custom pipeline") as excinfo:
        ondeck.plan(tiny_folder, device="cpu")
    assert str(tiny_folder / "model_index.json") in str(excinfo.value)


def test_custom_pipeline_code_is_not_run(tiny_folder, tmp_path):
    marker = tmp_path / "ran"
    (tiny_folder / "pipeline.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from diffusers import WanPipeline\n"
        "class MyPipeline(WanPipeline):\n    pass\n"
    )
    with pytest.raises(ondeck.LoadError, match="custom_pipeline"):
        ondeck.diffusers.from_pretrained(
            tiny_folder, device="cpu", progress=False, custom_pipeline=str(tiny_folder)
        )
    assert not marker.exists()


def test_the_untouched_folder_still_plans_and_inspects(tiny_folder):
    """The checks above refuse hostile folders, not the embedded model itself."""
    folder = ModelFolder.open(tiny_folder)
    for name in ("text_encoder", "transformer", "vae"):
        assert folder.spec(name).nbytes == folder.file_bytes(name) + (
            # The rope tables: computed, not stored.
            4 * 2 * 32 * 12 if name == "transformer" else 0
        )
    assert ondeck.plan(tiny_folder, device="cpu").peak_bytes > 0
    assert json.loads((tiny_folder / "model_index.json").read_text())["_class_name"]


class ReadsItsTensors(ModelMixin, ConfigMixin):
    """A constructor that reads values of tensors it makes, so it cannot run on meta."""

    @register_to_config
    def __init__(self, num_layers: int = 2, width: int = 4):
        super().__init__()
        self.scales = torch.linspace(0.5, 1.0, 2).tolist()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(num_layers))


def test_a_constructor_that_cannot_run_on_meta_is_still_bounded(tmp_path, registration_fuse):
    directory = tmp_path / "toy"
    ReadsItsTensors().save_pretrained(directory)
    header = read_header(weights_file(directory))
    built = build_skeleton(
        ReadsItsTensors, directory, torch.float32, tensors=header.tensors, component="toy"
    )
    assert sorted(name for slot in built.slots for name in slot.names) == sorted(header.tensors)

    edit_json(directory / "config.json", lambda config: config.update(num_layers=10**9))
    with pytest.raises(ondeck.LoadError, match="disagree") as excinfo:
        build_skeleton(
            ReadsItsTensors, directory, torch.float32, tensors=header.tensors, component="toy"
        )
    assert str(directory / "config.json") in str(excinfo.value)
    assert registration_fuse[0] < 1_000
