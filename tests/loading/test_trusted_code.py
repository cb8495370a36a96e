"""A model folder is data: opening, planning or inspecting it never runs code it ships."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ondeck import LoadError
from ondeck.loading import ModelFolder

from .helpers import copy_folder

# Importing this module writes a file beside it: proof that the folder's code ran.
_PAYLOAD = """
from pathlib import Path
Path(__file__).with_name("RAN").write_text("ran")
class Evil:
    pass
class EvilTokenizer:
    pass
"""


def _set_index_entry(folder: Path, name: str, entry: list) -> None:
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index[name] = entry
    index_path.write_text(json.dumps(index))


@pytest.fixture
def evil_folder(wan_template, tmp_path) -> Path:
    """A Wan folder named ``mymodel`` whose VAE entry names a module inside the folder."""
    folder = copy_folder(wan_template, tmp_path / "mymodel")
    (folder / "__init__.py").write_text("")
    (folder / "vae" / "__init__.py").write_text("")
    (folder / "vae" / "evilmod.py").write_text(_PAYLOAD)
    _set_index_entry(folder, "vae", ["mymodel.vae.evilmod", "Evil"])
    return folder


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.run(
        [sys.executable, "-m", "ondeck", *args],
        cwd=cwd,
        env=env,
        input="y\ny\n",  # were anything to prompt for consent, it would get a yes
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_library_named_by_the_folder_is_refused(evil_folder, monkeypatch):
    monkeypatch.syspath_prepend(str(evil_folder.parent))
    folder = ModelFolder.open(evil_folder)
    with pytest.raises(LoadError, match=r"library 'mymodel\.vae\.evilmod'.*never imports it"):
        folder.component_class("vae")
    assert not (evil_folder / "vae" / "RAN").exists()
    assert "mymodel.vae.evilmod" not in sys.modules


def test_naming_the_folders_own_code_as_a_library_is_refused_too(evil_folder, monkeypatch):
    # `--library mymodel` from the folder's parent: mymodel is the model, not a package.
    monkeypatch.chdir(evil_folder.parent)
    monkeypatch.syspath_prepend(str(evil_folder.parent))
    folder = ModelFolder.open(evil_folder, libraries=["mymodel"])
    with pytest.raises(LoadError, match="not an installed package: ondeck never imports it"):
        folder.component_class("vae")
    assert not (evil_folder / "vae" / "RAN").exists()
    result = _run_cli("plan", "mymodel", "--library", "mymodel", cwd=evil_folder.parent)
    assert result.returncode == 1
    assert not (evil_folder / "vae" / "RAN").exists(), result.stdout + result.stderr


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_the_cli_runs_no_code_from_the_folder(evil_folder, command):
    # Run from the folder's parent: the working directory is on sys.path under `-m`.
    result = _run_cli(command, "mymodel", cwd=evil_folder.parent)
    assert not (evil_folder / "vae" / "RAN").exists(), result.stdout + result.stderr
    assert "mymodel.vae.evilmod" in result.stdout + result.stderr


def test_a_library_the_caller_names_is_imported(wan_template, tmp_path):
    folder_path = copy_folder(wan_template, tmp_path / "wan")
    _set_index_entry(folder_path, "vae", ["torch.nn", "Identity"])
    with pytest.raises(LoadError, match="library 'torch.nn'"):
        ModelFolder.open(folder_path).component_class("vae")
    trusted = ModelFolder.open(folder_path, libraries=["torch"])
    assert trusted.component_class("vae") is torch.nn.Identity


def test_diffusers_pipeline_packages_are_found_by_their_short_name(wan_template, tmp_path):
    folder_path = copy_folder(wan_template, tmp_path / "wan")
    _set_index_entry(folder_path, "vae", ["ltx", "LTXLatentUpsamplerModel"])
    from diffusers.pipelines.ltx import LTXLatentUpsamplerModel

    assert ModelFolder.open(folder_path).component_class("vae") is LTXLatentUpsamplerModel


def test_a_tokenizer_auto_map_is_never_run(wan_template, tmp_path):
    folder = copy_folder(wan_template, tmp_path / "wan")
    tokenizer = folder / "tokenizer"
    (tokenizer / "evil_tokenizer.py").write_text(_PAYLOAD)
    config_path = tokenizer / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]}
    config.pop("tokenizer_class", None)  # nothing but the shipped code would name a class
    config_path.write_text(json.dumps(config))
    _set_index_entry(folder, "tokenizer", ["transformers", "AutoTokenizer"])

    result = _run_cli("plan", str(folder), cwd=tmp_path)
    assert not (tokenizer / "RAN").exists(), result.stdout + result.stderr
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr

    from ondeck.loading import load_auxiliary

    with pytest.raises(LoadError, match="component 'tokenizer'"):
        load_auxiliary(ModelFolder.open(folder), "tokenizer")
    assert not (tokenizer / "RAN").exists()
