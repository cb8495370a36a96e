"""A folder missing a part diffusers loads itself (the scheduler) is refused when the
pipeline is made, naming the component and its folder: diffusers' own error names the
model's folder and a file, and reads as a fault of the program."""

from __future__ import annotations

import shutil

import pytest

import ondeck.diffusers
from ondeck.errors import LoadError


@pytest.fixture
def flux_copy(folders, tmp_path):
    copy = tmp_path / "flux"
    shutil.copytree(folders["flux"], copy)
    return copy


def test_a_missing_scheduler_folder_is_named(flux_copy):
    shutil.rmtree(flux_copy / "scheduler")
    with pytest.raises(
        LoadError, match=r"component 'scheduler': folder .*flux/scheduler is missing"
    ):
        ondeck.diffusers.from_pretrained(flux_copy, device="cpu", progress=False)


def test_a_scheduler_folder_without_its_config_is_named(flux_copy):
    (flux_copy / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(
        LoadError, match=r"component 'scheduler': .*scheduler/scheduler_config.json is missing"
    ):
        ondeck.diffusers.from_pretrained(flux_copy, device="cpu", progress=False)


def test_a_model_index_without_its_class_says_so(flux_copy):
    import json

    index = flux_copy / "model_index.json"
    document = json.loads(index.read_text())
    del document["_class_name"]
    index.write_text(json.dumps(document))
    with pytest.raises(LoadError, match=r"model_index.json has no _class_name"):
        ondeck.diffusers.from_pretrained(flux_copy, device="cpu", progress=False)
