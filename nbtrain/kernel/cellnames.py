"""Cell naming, in one place: notebook cells registered for tracebacks, and named as IPython names them.

A ``%%distributed`` cell is registered in linecache (and IPython's compiler) under a file
name of its own (:func:`register_source`), so the ranks, which get the kernel's in-memory
linecache entries, show the cell's own lines in a traceback. Back in the kernel, a file
name of a cell reads ``Cell In[N]`` (:func:`cell_namer`, :func:`name_cells`), as IPython
writes it. Which file name belongs to which cell is kept by the compiler, in a way that
differs between IPython generations: :func:`nbtrain.kernel.compat.cell_filenames` reads it.

>>> name = register_source(None, "--devices 2", "x = 1\\n")
>>> name.startswith("<cell-"), linecache.getline(name, 2)
(True, 'x = 1\\n')
>>> cell_namer(None)(name) is None  # no shell: no cell numbers
True
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any

from nbtrain.kernel import compat
from nbtrain.kernel import shell as kernel_shell


def register_source(shell: Any, line: str, cell: str) -> str:
    """Register the cell, as the user wrote it, in linecache; return the filename to compile with.

    The engine ships the kernel's in-memory linecache entries to the ranks, so a rank's
    traceback shows the cell's own lines. IPython's compiler also remembers the cell's
    number for the name, which :func:`cell_namer` uses.
    """
    source = f"{kernel_shell.magic_name()} {line}".rstrip() + "\n" + cell
    # A raw_code of our own gives a name of our own: the kernel's entry for the
    # cell (its transformed form) stays as it is.
    number = kernel_shell.current_cell_number(shell)
    cached = compat.cache_source(shell, source, number, source + "\n# nbtrain %%distributed")
    if cached is not None:
        return cached
    filename = f"<cell-{abs(hash(source))}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return filename


def cell_namer(shell: Any) -> Callable[[str], str | None]:
    """filename -> ``Cell In[N]`` for the cells ``shell`` ran (None for any other file).

    >>> cell_namer(None)("/tmp/ipykernel_1/23.py") is None
    True
    """
    names = compat.cell_filenames(shell)
    return lambda filename: f"Cell In[{names[filename]}]" if filename in names else None


def name_cells(text: str, shell: Any) -> str:
    """``text`` (a debugger's output, say) with each cell's file name written ``Cell In[N]``.

    >>> name_cells("> /tmp/ipykernel_1/23.py(4)", None)  # no shell: nothing to rename
    '> /tmp/ipykernel_1/23.py(4)'
    """
    for filename, number in compat.cell_filenames(shell).items():
        if filename in text:
            text = text.replace(filename, f"Cell In[{number}]")
    return text
