"""Notebook progress bars on a rank: ``tqdm.notebook``'s bars print as text there.

A notebook's ``from tqdm.notebook import tqdm`` draws an ipywidgets bar, which needs a
kernel to send it to the frontend. A rank has no kernel: its widget's text stood at 0%
for the whole loop, printed once. Here, when a rank imports ``tqdm.notebook``, its bar
class becomes tqdm's text bar (what ``tqdm.auto`` picks outside a notebook), which the cell
shows as each rank's line; ``tnrange``/``trange`` use it too. The class keeps its name and
module, so a cell that binds ``tqdm`` gives the kernel back its own notebook class.

Example (outside a rank nothing is changed):
    >>> import sys
    >>> _installed, any(isinstance(finder, _TextBars) for finder in sys.meta_path)
    (False, False)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_MODULE = "tqdm.notebook"


_installed = False  # in this process, or the launcher it was forked from


def print_as_text() -> None:
    """In this process (a rank, or the launcher ranks are forked from), tqdm.notebook is imported with a text bar."""
    global _installed
    if not _installed:
        sys.meta_path.insert(0, _TextBars())
        _installed = True


class _TextBars(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenTextBars(spec.loader)
        return spec


class _ThenTextBars(importlib.abc.Loader):
    """The module's own loader, then its bar class replaced."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source and the rest, for tracebacks
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        bar = _text_bar()
        vars(module).update(tqdm_notebook=bar, tqdm=bar)


def _text_bar() -> type:
    std: Any = importlib.import_module("tqdm.std")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("display", None)  # the notebook bar's own argument: show it now or later
        std.tqdm.__init__(self, *args, **kwargs)

    # Pickled by reference as the notebook class: the kernel's is what it gets back.
    return type("tqdm_notebook", (std.tqdm,), {"__init__": __init__, "__module__": _MODULE})
