"""Every relative link in the repository's Markdown pages (README.md, docs/, BENCHMARKS.md,
RELIABILITY.md, benchmarks/README.md) leads to a file that exists, and every anchor to a
heading of that file; every page of docs/ is linked from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [
    ROOT / "README.md",
    *DOCS,
    *sorted(p for p in ROOT.glob("*.md") if p.name != "README.md"),
    ROOT / "benchmarks" / "README.md",
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if match := re.match(r"#{1,6}\s+(.*)", line):
            base = anchor(match.group(1))
            seen = counts.get(base, 0)
            counts[base] = seen + 1
            found.add(base if seen == 0 else f"{base}-{seen}")
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_the_pages_exist():
    assert all(page.exists() for page in PAGES) and len(DOCS) > 1


def test_every_docs_page_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {(readme.parent / target.partition("#")[0]).resolve() for target in links(readme)}
    unlinked = [str(page.relative_to(ROOT)) for page in DOCS if page.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_text, _, fragment = target.partition("#")
        path = (page.parent / path_text).resolve() if path_text else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchors_follow_github():
    assert anchor("The default on every card: `auto`, no flags") == (
        "the-default-on-every-card-auto-no-flags"
    )
    assert anchor("fp8 storage, bf16 compute") == "fp8-storage-bf16-compute"
