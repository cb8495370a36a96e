"""Running the command line in the test process, and what a run leaves behind."""

from __future__ import annotations

from pathlib import Path

from ondeck.cli import main

# Small enough that a whole `generate` on the tiny preset takes a second or two.
FAST = ["--device", "cpu", "--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
# The same for an image pipeline of the breadth families (tiny Flux and SD3).
IMAGE_ARGS = ["--device", "cpu", "--steps", "2", "--height", "8", "--width", "8"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``ondeck ARGV``."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def listing(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}
