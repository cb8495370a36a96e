"""The ``ondeck`` command sets what its own process needs; ``main`` called in-process
leaves the caller's environment alone."""

from __future__ import annotations

import os

from ondeck import cli


def test_the_command_turns_on_expandable_segments(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(cli, "main", lambda: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    assert cli.console() == "expandable_segments:True"


def test_a_users_allocator_setting_is_kept(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setattr(cli, "main", lambda: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    assert cli.console() == "max_split_size_mb:128"


def test_main_in_process_leaves_the_environment_alone(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("ONDECK_CACHE", str(tmp_path))
    cli.main(["profiles"])
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
