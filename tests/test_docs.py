"""README is the landing page and docs/ holds the rest: every relative link in them resolves.

A link to a file must name one that exists (from the page's own folder), a ``#anchor`` must
name a heading of the page it points to (as GitHub makes anchors from headings), and every
page under docs/ must be reachable from README's "Where to go next". Links inside code
(fenced blocks, inline code) are text, not links, and web addresses are not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The page without its code: fenced blocks and inline code spans cannot hold a link."""
    return _CODE_SPAN.sub("``", _FENCE.sub("", text))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor ``page``'s headings give, a repeated one numbered as GitHub numbers it."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        anchor = _anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The relative link targets of ``page`` (web and mail addresses left out)."""
    targets = _LINK.findall(_prose(page.read_text(encoding="utf-8")))
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


def broken(page: Path) -> list[str]:
    """Each link of ``page`` that names no file, or an anchor that no heading there gives, with why."""
    problems = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.name}: {target}: no such file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            problems.append(f"{page.name}: {target}: no heading gives #{anchor} in {file.name}")
    return problems


def test_every_relative_link_in_readme_and_docs_resolves():
    problems = [problem for page in _pages() for problem in broken(page)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"docs pages README does not link (add them to its 'Where to go next'): {unlinked}"


def test_readme_stays_a_landing_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README has {len(lines)} lines: move the detail to a page under docs/ and link it"
    assert {"## The two commands", "## A first example", "## Where to go next"} <= set(lines)


def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `%%distributed` flags\n\n## Flags\n\n## Flags\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#the-distributed-flags) [ok](other.md#flags-1) [ok](#page)\n"
        "[web](https://example.com/x.md) `[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading) [bad here](#nothing)\n"
    )
    assert anchors(tmp_path / "other.md") == {"other-page", "the-distributed-flags", "flags", "flags-1"}
    assert [problem.split(": ")[1] for problem in broken(page)] == [
        "missing.md", "other.md#no-such-heading", "#nothing"
    ]
