"""benchmarks/README.md is the index of benchmarks/: it names every script there and in
experiments/, and no more than ten scripts stand outside experiments/."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
INDEX = (BENCHMARKS / "README.md").read_text()


def scripts(folder: Path) -> list[Path]:
    """The runnable scripts of ``folder``: the files with a ``__main__`` block."""
    return sorted(p for p in folder.glob("*.py") if '__name__ == "__main__"' in p.read_text())


def test_every_script_and_module_is_named_in_the_index():
    named = [
        str(path.relative_to(BENCHMARKS))
        for path in [*BENCHMARKS.glob("*.py"), *(BENCHMARKS / "experiments").glob("*.py")]
    ]
    missing = sorted(name for name in named if f"`{name}`" not in INDEX)
    assert not missing, f"not in benchmarks/README.md: {missing}"


def test_at_most_ten_scripts_outside_experiments():
    main = scripts(BENCHMARKS)
    assert len(main) <= 10, [path.name for path in main]


def test_every_file_the_index_names_exists():
    named = {part for part in INDEX.split("`")[1::2] if part.endswith(".py")}
    assert named and all((BENCHMARKS / name).exists() for name in named), sorted(
        name for name in named if not (BENCHMARKS / name).exists()
    )
