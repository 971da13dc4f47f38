"""Every relative link in README.md and docs/*.md names a file that exists, and the
README's map reaches every docs page (a reader who starts at the README finds them all)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Code is not prose: `f(x)[0](y)` inside backticks or a fenced block is no link.
_FENCED = re.compile(r"^```.*?^```", flags=re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def local_targets(page: Path) -> list[str]:
    """The link targets of a markdown page that point into the repository."""
    text = _INLINE_CODE.sub("", _FENCED.sub("", page.read_text()))
    targets = [m.group(1) for m in _LINK.finditer(text)]
    return [t for t in targets if not _EXTERNAL.match(t) and not t.startswith("#")]


def broken_links(page: Path) -> list[str]:
    """Targets whose file (the part before any #anchor) does not exist beside the page."""
    return [t for t in local_targets(page)
            if not (page.parent / t.split("#", 1)[0]).exists()]


def test_every_relative_link_resolves() -> None:
    broken = {p.relative_to(ROOT).as_posix(): b for p in PAGES if (b := broken_links(p))}
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.split("#", 1)[0]).resolve() for t in local_targets(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README's map does not link: {missing}"


def test_a_broken_link_is_reported_and_code_is_not_a_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("x\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [gone](missing.md) ![pic](gone.svg) [web](https://x.org)\n"
                    "`a[0](b)` [top](#anchor)\n```\nc[1](d)\n```\n")
    assert broken_links(page) == ["missing.md", "gone.svg"]
