"""A Hub repo id wherever a folder is accepted, resolved through huggingface_hub's cache.

The tests lay a tiny model out as huggingface_hub caches it and run offline: nothing
here touches the network.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

import ondeck
import ondeck.diffusers
from ondeck.folder_pipelines import pipeline_for_folder
from ondeck.hub import ALLOW_PATTERNS, looks_like_repo_id, resolve_model

from .helpers import FAST, error_lines, run

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tiny_model, tmp_path, monkeypatch):
    """A Hugging Face cache holding ``owner/tiny-wan``, offline."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--owner--tiny-wan"
    shutil.copytree(tiny_model, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / REVISION


def test_a_cached_repo_id_resolves_to_its_snapshot(hub_cache):
    assert resolve_model("owner/tiny-wan") == hub_cache


def test_a_folder_wins_over_a_repo_id_of_the_same_name(hub_cache, tmp_path, monkeypatch):
    (tmp_path / "owner" / "tiny-wan").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("owner/tiny-wan") == Path("owner/tiny-wan")


@pytest.mark.parametrize(
    ("text", "repo_id"),
    [
        ("Wan-AI/Wan2.1-T2V-14B-Diffusers", True),
        ("owner/name", True),
        ("./owner/name", False),
        ("/abs/path", False),
        ("one/two/three", False),
        ("../name", False),
        ("owner/..", False),
        ("plainfolder", False),
    ],
)
def test_what_looks_like_a_repo_id(text, repo_id):
    assert looks_like_repo_id(text) is repo_id


def test_not_cached_and_offline_says_what_to_run(hub_cache):
    with pytest.raises(ondeck.LoadError) as caught:
        resolve_model("owner/missing")
    assert str(caught.value) == (
        "owner/missing is not a folder and not in the Hugging Face cache, and HF_HUB_OFFLINE "
        "is set; fetch it with `hf download owner/missing` (or pass a local folder)"
    )


def test_a_path_that_is_no_repo_id_is_left_to_the_folder_checks(tmp_path):
    assert resolve_model(tmp_path / "nowhere") == tmp_path / "nowhere"


def test_not_cached_and_online_downloads_safetensors_only(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = []

    def fake_snapshot_download(repo_id, **options):
        calls.append((repo_id, options))
        if options.get("local_files_only"):
            raise LocalEntryNotFoundError("not in the cache")
        return str(hub_cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("owner/elsewhere") == hub_cache
    assert [options.get("local_files_only", False) for _, options in calls] == [True, False]
    download = calls[1][1]
    assert download["allow_patterns"] == ALLOW_PATTERNS
    assert "*.safetensors" in ALLOW_PATTERNS and not any("bin" in p for p in ALLOW_PATTERNS)
    assert not any(p.endswith((".py", ".pth", ".ckpt")) for p in ALLOW_PATTERNS)


def test_a_failed_download_is_one_line_saying_what_to_run(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def unreachable(repo_id, **options):
        if options.get("local_files_only"):
            raise LocalEntryNotFoundError("not in the cache")
        raise ConnectionError("Name or service not known\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ondeck.LoadError) as caught:
        resolve_model("owner/elsewhere")
    assert str(caught.value) == (
        "owner/elsewhere is not a folder, and downloading it from the Hugging Face Hub failed "
        "(ConnectionError: Name or service not known); fetch it with `hf download "
        "owner/elsewhere` (or pass a local folder)"
    )


def test_inspect_plan_and_generate_take_a_repo_id(hub_cache, capsys, tmp_path):
    code, out, err = run(capsys, "inspect", "owner/tiny-wan")
    assert code == 0, err
    assert out.startswith(f"{hub_cache}: WanPipeline")
    code, out, err = run(capsys, "plan", "owner/tiny-wan", "--device", "cpu")
    assert code == 0, err
    assert "transformer" in out
    code, _, err = run(capsys, "generate", "owner/tiny-wan", *FAST, "--output", tmp_path / "o")
    assert code == 0, err
    assert (tmp_path / "o" / "video.mp4").stat().st_size > 0


def test_the_cli_on_an_uncached_repo_offline_is_one_line(hub_cache, capsys, tmp_path):
    code, _, err = run(capsys, "generate", "owner/missing", *FAST, "--output", tmp_path / "o")
    assert code == 1
    assert error_lines(err) == [
        "ondeck: error: LoadError: owner/missing is not a folder and not in the Hugging Face "
        "cache, and HF_HUB_OFFLINE is set; fetch it with `hf download owner/missing` (or pass "
        "a local folder)"
    ]


def test_python_entry_points_take_a_repo_id(hub_cache):
    assert ondeck.plan("owner/tiny-wan", device="cpu").component_bytes["transformer"] > 0
    pipe = pipeline_for_folder("owner/tiny-wan", device="cpu")
    assert pipe.model_path == hub_cache
    diffusers_pipe = ondeck.diffusers.from_pretrained("owner/tiny-wan", device="cpu")
    assert type(diffusers_pipe).__name__ == "WanPipeline"
    assert diffusers_pipe.ondeck.plan().component_bytes["transformer"] > 0
