"""Every value that sizes an allocation is bounded before anything is built; a weight
file is the file whose header was read; a file's integers are never cast into weights.

Each case damages a copy of the tiny Wan folder and goes through ``ondeck plan`` (or the
pipeline), as a user would; what must come out is one ``LoadError`` naming the file,
with memory that did not grow by what the damaged value asked for.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ondeck
import ondeck.diffusers
from ondeck import profiles as profiles_module
from ondeck.loading import ModelFolder, read_header
from ondeck.loading import model_folder as folder_module

from .helpers import (
    MiB,
    edit_json,
    generate,
    read_raw_header,
    settled_rss,
    wan,
    weights_file,
    write_raw_header,
)


def plan_refuses(folder, *fragments: str) -> str:
    before = settled_rss()
    with pytest.raises(ondeck.LoadError) as caught:
        ondeck.plan(folder, device="cpu")
    grown = settled_rss() - before
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message
    assert grown < 256 * MiB, f"resident set grew {grown / MiB:.0f} MiB"
    return message


# -- configs of the parts without weights ---------------------------------------------------


@pytest.mark.parametrize("value", [2e9, 2_000_000_000, float("nan")])
def test_a_scheduler_asking_for_billions_of_steps_is_refused_before_it_is_built(tiny_folder, value):
    config = tiny_folder / "scheduler" / "scheduler_config.json"
    edit_json(config, lambda c: c.update(num_train_timesteps=value))
    message = plan_refuses(tiny_folder, str(config), "num_train_timesteps is")
    assert message.startswith("component 'scheduler': ")


def test_a_config_of_megabytes_is_checked_all_the_same(tiny_folder):
    # Padded past any size a check might skip: the value is what sizes the tables (2e9
    # exhausted memory in a 5 MB file; 2e6, refused the same way, is cheap if it is not).
    config = tiny_folder / "scheduler" / "scheduler_config.json"
    document = json.loads(config.read_text())
    document["num_train_timesteps"] = 2_000_000
    config.write_text(json.dumps(document)[:-1] + " " * 5_000_000 + "}")
    plan_refuses(tiny_folder, str(config), "num_train_timesteps is 2e+06, more than 100000")


def test_a_scheduler_with_a_huge_list_of_betas_is_refused(tiny_folder):
    config = tiny_folder / "scheduler" / "scheduler_config.json"
    edit_json(config, lambda c: c.update(trained_betas=[0.001] * 200_000))
    plan_refuses(tiny_folder, "trained_betas (its length) is 200000, more than 100000")


@pytest.mark.parametrize("value, refused", [(10**9, True), (int(1e30), False), (512, False)])
def test_a_tokenizer_length_that_would_pad_to_billions_is_refused(tiny_folder, value, refused):
    config = tiny_folder / "tokenizer" / "tokenizer_config.json"
    edit_json(config, lambda c: c.update(model_max_length=value))
    if refused:
        plan_refuses(tiny_folder, str(config), "model_max_length is 1e+09: tokens are padded")
    else:  # transformers' "no limit" sentinel and real lengths plan as before
        assert ondeck.plan(tiny_folder, device="cpu").peak_bytes > 0


@pytest.mark.parametrize(
    "key, value, refused",
    [
        ("extra_ids", 10**8, "extra_ids is 1e+08, more than 65536 (each makes a special token)"),
        ("pad_to_multiple_of", 10**9, "pad_to_multiple_of is 1e+09, more than 16777216"),
        ("extra_ids", 125, None),  # ByT5's own
    ],
)
def test_a_tokenizer_asking_for_millions_of_special_tokens_is_refused(
    tiny_folder, key, value, refused
):
    # extra_ids=10**8 made ByT5's tokenizer build 10**8 "<extra_id_N>" strings.
    config = tiny_folder / "tokenizer" / "tokenizer_config.json"
    edit_json(config, lambda c: c.update({key: value, "extra_special_tokens": None}))
    if refused:
        plan_refuses(tiny_folder, str(config), refused)
    else:
        assert ondeck.plan(tiny_folder, device="cpu").peak_bytes > 0


@pytest.mark.parametrize("vocabulary_first", [False, True], ids=["padding-first", "padding-last"])
def test_a_tokenizer_file_padding_to_billions_is_refused(tiny_folder, vocabulary_first):
    path = tiny_folder / "tokenizer" / "tokenizer.json"
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": {"strategy": {"Fixed": 1_000_000_000}, "direction": "Right"},
    }
    if vocabulary_first:  # JSON keys come in any order; a vocabulary is megabytes
        vocabulary = {f"token{i}": i for i in range(100_000)}
        document = {"model": {"type": "WordLevel", "vocab": vocabulary}, **document}
    path.write_text(json.dumps(document))
    assert path.stat().st_size > (1 << 20) or not vocabulary_first
    plan_refuses(tiny_folder, str(path), "its padding length is 1,000,000,000")


def test_an_image_processor_resizing_to_a_billion_pixels_is_refused(tiny_folder):
    folder = tiny_folder / "image_processor"
    folder.mkdir()
    (folder / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 10**9}}))
    edit_json(
        tiny_folder / "model_index.json",
        lambda index: index.update(image_processor=["transformers", "CLIPImageProcessor"]),
    )
    plan_refuses(tiny_folder, "size.height is 1e+09, more than")


def test_a_pipeline_in_a_components_place_is_refused(tiny_folder):
    nested = tiny_folder / "refiner"
    shutil.copytree(tiny_folder / "scheduler", nested)
    (nested / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    edit_json(
        tiny_folder / "model_index.json",
        lambda index: index.update(refiner=["diffusers", "WanPipeline"]),
    )
    plan_refuses(tiny_folder, "component 'refiner'", "names a pipeline (diffusers.WanPipeline)")
    with pytest.raises(ondeck.LoadError, match="names a pipeline"):
        ondeck.diffusers.from_pretrained(tiny_folder, device="cpu")


def test_a_pipeline_in_the_folder_of_a_component_is_refused(tiny_folder):
    # model_index.json names a scheduler; its folder holds a whole pipeline.
    shutil.rmtree(tiny_folder / "scheduler")
    shutil.copytree(tiny_folder, tiny_folder / "scheduler")
    plan_refuses(
        tiny_folder, f"{tiny_folder / 'scheduler'} holds a pipeline (a model_index.json) in a"
    )


def test_a_default_size_past_any_model_is_refused(tiny_folder):
    edit_json(tiny_folder / "vae" / "config.json", lambda c: c.update(sample_size=10**7))
    plan_refuses(tiny_folder, "sample_size is 1e+07, more than 16384")


@pytest.mark.parametrize("key", ["sample_size", "sample_height", "sample_frames"])
def test_a_default_size_in_latents_past_any_model_is_refused(tiny_folder, key):
    # A transformer's sample_size counts latents: SD3's default output is it times the
    # VAE's scale, so 16384 there asked for a 131072-pixel image (latents of gigabytes).
    config = tiny_folder / "transformer" / "config.json"
    edit_json(config, lambda c: c.update({key: 16_384}))
    plan_refuses(tiny_folder, str(config), f"{key} is 16384, more than 1024 (in latents;")
    edit_json(config, lambda c: c.update({key: 256}))  # PixArt-Sigma 2K's
    assert ondeck.plan(tiny_folder, device="cpu").peak_bytes > 0


# -- headers ------------------------------------------------------------------------------


def test_a_header_of_more_than_16_mb_is_refused(tiny_folder):
    path = weights_file(tiny_folder / "vae")
    document, data = read_raw_header(path)
    document["__metadata__"] = {"padding": " " * 17_000_000}
    write_raw_header(path, document, data)
    plan_refuses(tiny_folder, str(path), "header length", "is not plausible")


def test_shard_headers_that_add_up_are_refused(tiny_folder, monkeypatch):
    from loading.helpers import shard

    shard(tiny_folder / "transformer", 4)
    per_shard = read_header(sorted((tiny_folder / "transformer").glob("*-of-*"))[0]).data_start
    # Four shards whose headers together pass the limit (the real one is 64 MB).
    monkeypatch.setattr(folder_module, "MAX_COMPONENT_HEADER_BYTES", 3 * per_shard)
    plan_refuses(tiny_folder, "component 'transformer'", "headers add up to more than")


# -- identity ---------------------------------------------------------------------------


def replaced_with_garbage(path) -> None:
    """The same tensors by name and shape, other values, as a new file at the same path."""
    tensors = {name: value * 1e22 for name, value in load_file(path).items()}
    path.unlink()
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_weight_file_replaced_after_the_pipeline_was_built_is_refused(tiny_folder):
    pipe = wan(tiny_folder)
    path = weights_file(tiny_folder / "transformer")
    replaced_with_garbage(path)
    with pytest.raises(ondeck.LoadError) as caught:
        generate(pipe)
    # A new file (its inode, unless the old one is reused at once, and its time differ).
    assert str(caught.value).startswith(
        f"component 'transformer' from {path}: the file changed after its header was read ("
    )
    assert "); it is not read: open the model folder again" in str(caught.value)
    assert not ondeck.is_loaded(pipe.components["transformer"])
    fresh = wan(tiny_folder)  # opened again, the new file is read as it is
    assert fresh.components["transformer"].materialize() is not None


def test_a_file_rewritten_in_place_with_its_old_size_and_time_is_caught_by_its_header(
    tiny_folder,
):
    pipe = wan(tiny_folder)
    path = weights_file(tiny_folder / "vae")
    status = path.stat()
    document, data = read_raw_header(path)
    first = next(k for k in document if k != "__metadata__")
    document[first]["dtype"] = "I32"  # same bytes, another meaning
    with open(path, "r+b") as file:  # the same inode
        text = json.dumps(document, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        (length,) = struct.unpack("<Q", path.read_bytes()[:8])
        assert len(text) <= length
        file.seek(8)
        file.write(text + b" " * (length - len(text)))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert path.stat().st_size == status.st_size and path.stat().st_ino == status.st_ino
    with pytest.raises(ondeck.LoadError, match="its header bytes changed"):
        generate(pipe)
    del data


# -- integers where the model has floats -------------------------------------------------


@pytest.mark.parametrize("kind", ["int32", "bool", "int64"])
def test_integer_or_bool_tensors_for_float_parameters_are_a_load_error(tiny_folder, kind):
    path = weights_file(tiny_folder / "transformer")
    tensors = load_file(path)
    name = "proj_out.weight"
    tensors[name] = tensors[name].to(getattr(torch, kind))
    save_file(tensors, path, metadata={"format": "pt"})
    for build in (lambda: wan(tiny_folder), lambda: ondeck.plan(tiny_folder, device="cpu")):
        with pytest.raises(ondeck.LoadError) as caught:
            build()
        assert str(caught.value).startswith(
            f"component 'transformer' from {path}: tensor '{name}' is stored as {kind}, but "
            "the model's parameter is float32"
        )


# -- activation profiles -----------------------------------------------------------------


def profile_document(entries: dict) -> dict:
    return {"format": profiles_module.FORMAT, "version": profiles_module.VERSION, "models": entries}


def entry(shape: dict, stages: dict) -> tuple[str, dict]:
    return profiles_module._shape_key(shape), {"shape": shape, "stages": stages}


def test_a_profile_entry_with_an_absurd_shape_is_dropped_with_one_warning(tmp_path):
    real = {"height": 32, "width": 32, "frames": 5, "guidance": True, "device": "cpu"}
    absurd = {**real, "height": 10**12}
    key, good = entry(real, {"Denoise": 1000})
    bad_key, bad = entry(absurd, {"Denoise": 10**14})
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(profile_document({"m": {key: good, bad_key: bad}})))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiles = profiles_module.ActivationProfiles(path)
    assert [str(w.message) for w in caught] == [
        f"activation profiles {path}: ignored 1 damaged or implausible entry; measuring again "
        "(`ondeck profiles --clear` deletes the file)"
    ]
    larger = {**real, "height": 64}  # extrapolated from the real entry, not the absurd one
    stages, note = profiles.lookup("m", larger)
    assert stages == {"Denoise": 2000}
    assert "extrapolated from" in note and "height=32" in note


def test_a_profile_file_larger_than_its_limit_is_not_parsed(tmp_path):
    path = tmp_path / "profiles.json"
    with open(path, "wb") as file:
        file.truncate(profiles_module.MAX_PROFILE_FILE_BYTES + 1)
    before = settled_rss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiles = profiles_module.ActivationProfiles(path)
    assert settled_rss() - before < 8 * MiB
    assert profiles.entries() == []
    [warning] = caught
    assert "larger than 16 MB, not read" in str(warning.message)


def test_the_untouched_folder_still_plans_and_runs(tiny_folder, clean_frames):
    ModelFolder.open(tiny_folder)
    assert np.array_equal(generate(wan(tiny_folder)), clean_frames)
