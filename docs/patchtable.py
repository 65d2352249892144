"""The patch table of docs/architecture.md, generated from ``nbtrain.patches.TABLE``.

The page holds the table between two marker lines; this script writes what ``TABLE`` gives
between them and leaves the rest of the page as it is. ``tests/test_architecture_page.py``
fails when the page's table is not what ``TABLE`` gives, naming the command that fixes it::

    .venv/bin/python docs/patchtable.py           # rewrite the table in docs/architecture.md
    .venv/bin/python docs/patchtable.py --check   # exit 1 if it is out of date

A script beside the page rather than a module of nbtrain: ``nbtrain/patches.py`` stays the
table and its installer, and an installed nbtrain has no docs/ to write to.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
COMMAND = ".venv/bin/python docs/patchtable.py"
BEGIN = f"<!-- patch table: generated from nbtrain.patches.TABLE by `{COMMAND}`; do not edit by hand -->"
END = "<!-- end patch table -->"

if str(ROOT) not in sys.path:  # run as a script from a checkout: import this checkout's nbtrain
    sys.path.insert(0, str(ROOT))

from nbtrain import patches


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Iterable[patches.Patch] | None = None) -> str:
    """The Markdown table of ``table`` (``patches.TABLE``): one row per patch, in the table's order."""
    rows = [
        "| group | target | attribute | lifetime | replaced by | why |",
        "|---|---|---|---|---|---|",
    ]
    for patch in patches.TABLE if table is None else table:
        why = patch.why + (" (as it is imported)" if patch.on_import else "")
        rows.append(
            f"| {patch.group} | `{patch.target}` | `{patch.attribute}` | {patch.lifetime.value} "
            f"| `{patch.replacement.removeprefix('nbtrain.')}` | {_cell(why)} |"
        )
    return "\n".join(rows)


def with_table(page: str, table: Iterable[patches.Patch] | None = None) -> str:
    """``page`` with what lies between its marker lines replaced by :func:`markdown_table`."""
    before, begin, rest = page.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the page lacks its marker lines: {BEGIN!r} ... {END!r}")
    return f"{before}{BEGIN}\n{markdown_table(table)}\n{END}{after}"


def main(argv: list[str]) -> int:
    """Rewrite the page's table (or, with ``--check``, say whether it is out of date)."""
    text = PAGE.read_text(encoding="utf-8")
    wanted = with_table(text)
    if "--check" in argv:
        if wanted != text:
            print(f"{PAGE.relative_to(ROOT)}: the patch table is out of date; run {COMMAND}")
            return 1
        return 0
    if wanted != text:
        PAGE.write_text(wanted, encoding="utf-8")
        print(f"rewrote the patch table in {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
