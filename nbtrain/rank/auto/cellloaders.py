"""Loaders the cell makes itself, sharded as the kernel's are.

Auto mode prepares what the kernel had before the cell; but a training cell very often
makes its own loader first (``loader = DataLoader(train_ds, batch_size=32, shuffle=True)``,
then the loop), or calls a notebook function that does (a k-fold loop's
``run_training(fold)``). Left alone, every rank would read all of it: the one-device result
at several times the work. So while an auto-mode cell of several ranks runs
(the patch table's ``made in the cell``), each ``DataLoader`` made is remembered, and
each of its passes is read as a prepared loader's (:mod:`~nbtrain.rank.auto.preparedloaders`): with
gradients, this rank's share; without, the whole. ``len(loader)`` follows the same rule, so
a schedule sized in the cell from it (``total_steps=epochs * len(loader)``) ends where the
rank's passes end. That holds once the cell trains an averaged model (one auto mode
prepared, or one an optimizer made in the cell steps, :mod:`~nbtrain.rank.auto.keptmodels`);
before that (statistics over the data at the top of a cell) a pass reads the whole loader.
A library's trainer that makes its loaders inside ``fit`` (skorch's ``NeuralNet``) counts as the
cell's code: a framework that distributes its own loaders makes auto mode step aside for the whole
cell (:mod:`~nbtrain.rank.auto.stepaside`), so none of this runs for it. A loader made here is
held weakly: a fold's loader, and the data it holds, go when the fold is done.

Importing this module does not import torch.

Example (outside a run nothing was made, so nothing is named):
    >>> made_loader_report({})
    []
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from nbtrain.rank.auto import celloptimizers, ledger, preparedloaders, wrapping

_made: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # loader the user made -> where
_prepared: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # -> its rebuild (itself: unshardable)
# Set while a rebuild reads: its evaluation passes iterate the user's loader itself.
_reading = {"on": False}
_gone: dict[str, str] = {}  # where a loader that is gone was made -> what its passes read


def recording_loaders(own_init: Any) -> Any:
    """``DataLoader.__init__`` while an auto-mode cell runs (the patch table's): remembers each loader
    made, and where the user's code made it (or called the library that did)."""
    # deferred: start-up time (torch)
    from torch.utils.data import DataLoader

    @functools.wraps(own_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        own_init(self, *args, **kwargs)
        if type(self) is DataLoader:  # a subclass is a library's own kind of loader: its passes are its own
            _made[self] = celloptimizers.where_made(sys._getframe(1))

    return init


def sharded_iter(own_iter: Any) -> Any:
    """``DataLoader.__iter__`` while an auto-mode cell runs (the patch table's): a pass over a loader
    the cell made reads as a prepared loader's."""
    return _through_rebuild(own_iter, iter)


def sharded_len(own_len: Any) -> Any:
    """``DataLoader.__len__`` while an auto-mode cell runs (the patch table's): as its passes read."""
    return _through_rebuild(own_len, len)


def _through_rebuild(own: Callable[[Any], Any], how: Callable[[Any], Any]) -> Any:
    """``own`` (a DataLoader's method), or ``how`` of the prepared loader a pass over a loader the cell made reads."""

    @functools.wraps(own)
    def through(self: Any) -> Any:
        rebuild = _rebuild_to_read(self)
        return own(self) if rebuild is None else _read(how, rebuild)

    return through


def _read(how: Callable[[Any], Any], rebuild: Any) -> Any:
    """``how(rebuild)``, its reads of the user's loader going to that loader itself."""
    _reading["on"] = True
    try:
        return how(rebuild)
    finally:
        _reading["on"] = False


def _rebuild_to_read(loader: Any) -> Any | None:
    """The prepared loader a pass over ``loader`` reads through, or None: read it as it is."""
    if _reading["on"] or loader not in _made or not _averaged_training():
        return None
    rebuild = _prepared.get(loader)
    if rebuild is None:
        rebuild = _prepared[loader] = _prepare(loader)
    return None if rebuild is loader else rebuild


def _prepare(loader: Any) -> Any:
    """``loader`` prepared as the kernel's are, holding it weakly: a k-fold loop's loader, and the
    data it holds, go when its fold is done (its summary line is written then)."""
    registry = ledger.cell_registry()
    said = len(registry.notes)
    rebuild = preparedloaders.prepare_loader(loader)
    where = _made[loader]
    for i in range(said, len(registry.notes)):  # "a DataLoader over Stream was not sharded: ..." says where
        registry.notes[i] = registry.notes[i].replace(" was not sharded", f" made in {where} was not sharded", 1)
    if rebuild is not loader:
        registry.prepared.pop(id(loader), None)
        registry.originals.pop(id(rebuild), None)
        rebuild._nbtrain_whole = weakref.proxy(loader)
        weakref.finalize(loader, _remember_gone, where, rebuild)
    return rebuild


def _remember_gone(where: str, rebuild: Any) -> None:
    _gone[where] = preparedloaders.describe_passes(rebuild)


def _averaged_training() -> bool:
    """Whether the cell trains averaged models: one auto mode prepared, or one an optimizer made in
    the cell steps (kept one over the ranks, or wrapped in DDP)."""
    if celloptimizers.made_optimizers():
        return True
    nn = ledger.torch_module().nn
    registry = ledger.cell_registry()
    return any(isinstance(p, nn.Module) and wrapping.trains(p) for _, p in registry.prepared.values())


def made_loader_report(cell_globals: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, what its passes read) for each loader the cell made and sharded, for the summary.

    A global names it; one made in a function the cell called (gone by now) is named by
    where it was made (``the DataLoader made in fit() (<file>, line 3)``), the last one
    made there, unless a global names a loader made at that place.
    """
    report: dict[str, str] = {}
    named: set[str] = set()
    by_id = {id(v): n for n, v in cell_globals.items() if not n.startswith("_")}
    for loader, rebuild in list(_prepared.items()):
        if rebuild is not loader:
            name = by_id.get(id(loader))
            if name is not None:
                named.add(_made[loader])
            report[name or _label(_made[loader])] = preparedloaders.describe_passes(rebuild)
    for where, passes in _gone.items():
        if where not in named:
            report.setdefault(_label(where), passes)
    return list(report.items())


def _label(where: str) -> str:
    return f"the DataLoader made in {where}"
