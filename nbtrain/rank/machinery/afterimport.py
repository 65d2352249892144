"""A library module changed as it is imported on a rank: the rank side's one import hook.

A rank runs notebook code outside a kernel, where a few notebook-only APIs do the wrong
thing (``tqdm.notebook``'s widget bar, IPython's ``display``): :mod:`~nbtrain.rank.machinery.progressbars`
and :mod:`~nbtrain.rank.machinery.rankdisplay` say what they do there instead, through
:func:`when_imported`. The change runs right after the module's own code, before anything
that imports it binds its names; a module already imported is changed at once.

Installed in the launcher, which never imports these libraries itself: the ranks it forks
inherit the hook (a spawned rank installs it itself), and a process that never imports
such a module pays nothing.

Example (a module changed as it is imported, here ``colorsys`` of the standard library):
    >>> import sys
    >>> sys.modules.pop("colorsys", None) and None
    >>> take_back = when_imported("colorsys", lambda module: setattr(module, "changed", True))
    >>> import colorsys
    >>> colorsys.changed
    True
    >>> _forget("colorsys")
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_changes: dict[str, list[Callable[[ModuleType], None]]] = {}  # module name -> its changes, in order


def when_imported(name: str, change: Callable[[ModuleType], None]) -> Callable[[], None]:
    """Run ``change(module)`` when the module ``name`` is imported in this process (now, if it was).

    Returns what takes the change back if the module has not been imported by then (a change
    given twice is kept once)."""
    changes = _changes.setdefault(name, [])
    if change in changes:
        return lambda: None
    changes.append(change)
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    module = sys.modules.get(name)
    if module is not None:
        change(module)
    return lambda: _take_back(name, change)


def _take_back(name: str, change: Callable[[ModuleType], None]) -> None:
    changes = _changes.get(name, [])
    if change in changes:
        changes.remove(change)
    if not changes:
        _forget(name)


def _forget(name: str) -> None:
    """Drop ``name``'s changes, and the hook once none is left (this module's own example)."""
    _changes.pop(name, None)
    if not _changes:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Finder)]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        changes = _changes.get(fullname)
        if not changes:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenChange(spec.loader, changes)
        return spec


class _ThenChange(importlib.abc.Loader):
    """The module's own loader, then its change."""

    def __init__(self, loader: importlib.abc.Loader, changes: list[Callable[[ModuleType], None]]):
        self.loader = loader
        self.changes = changes

    def __getattr__(self, name: str) -> Any:  # get_source and the rest, for tracebacks
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for change in list(self.changes):
            change(module)
