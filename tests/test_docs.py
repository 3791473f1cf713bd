"""The docs: a README a newcomer finishes; every relative link in README.md and docs/ resolves."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_BYTES = 15_000
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def prose(page: Path) -> str:
    """A Markdown page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def relative_links(page: Path) -> list[str]:
    """The page's link targets that are paths or anchors, not URLs."""
    targets = [match[1] for match in LINK.finditer(prose(page))]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercase, no punctuation, hyphens for spaces."""
    headings = re.findall(r"^#+ (.+)$", prose(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size} bytes: move detail into docs/"


def test_there_are_links_to_check():
    assert len(PAGES) > 1 and relative_links(REPO / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    where = page.relative_to(REPO)
    for target in relative_links(page):
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        assert path.exists(), f"{where} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{where} links to {target}: no such heading"
