"""The documentation holds together: README.md stays a page, and every relative link in
README.md, CONTRIBUTING.md and docs/*.md reaches a file (and, with an anchor, a heading of
it). Reads text files only: no torch, no Ray."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""A Markdown inline link or image, `[text](target)` or `[text](target "title")`."""
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.DOTALL)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", flags=re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.IGNORECASE)  # http:, https:, mailto:


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped (but '-' and
    '_'), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, a repeated one also with GitHub's -1, -2."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    """The relative link targets of a Markdown text, outside code blocks and code spans."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return [t for t in LINK.findall(prose) if not EXTERNAL.match(t)]


def broken_links(page: Path) -> list[str]:
    """What is wrong with each relative link of ``page``: a file that is not there, or an
    anchor that no heading of its target has."""
    broken = []
    for target in links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            shown = file.relative_to(ROOT) if ROOT in file.parents else file
            broken.append(f"{target}: no file {shown}")
        elif anchor and file.suffix == ".md" and anchor.lower() not in anchors(file):
            broken.append(f"{target}: no heading of {file.name} has the anchor #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_readme_is_a_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}"


def test_the_link_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `x` key, in short (2)\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#the-x-key-in-short-2) [ok](#top) ![img](docs/a.md)\n"
        "[web](https://example.com/x.md) [mail](mailto:a@b.c) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "# Top\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nope) [self](#nowhere)\n"
    )
    assert sorted(t.split(":")[0] for t in broken_links(page)) == [
        "#nowhere", "docs/a.md#nope", "docs/b.md",
    ]  # fmt: skip


def test_slugs_are_githubs():
    assert slug("The `x` key, in short (2)") == "the-x-key-in-short-2"
    assert slug("`mbtune analyze RUN_DIR --export FRAMEWORK`") == (
        "mbtune-analyze-run_dir---export-framework"
    )
    assert slug("1. Trial faults") == "1-trial-faults"
    assert slug("Models: built-in, Hugging Face, or your own") == (
        "models-built-in-hugging-face-or-your-own"
    )
