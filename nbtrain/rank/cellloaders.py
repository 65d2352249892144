"""Loaders the cell makes itself, sharded as the kernel's are when the model they train is averaged.

Auto mode prepares what the kernel had before the cell; but a training cell very often
makes its own loader first (``loader = DataLoader(train_ds, batch_size=32, shuffle=True)``,
then the loop), or calls a notebook function that does. Left alone, every rank would read
all of it: DDP averages the same gradients on every rank, the one-device result at several
times the work. So while an auto-mode cell of several ranks runs
(:func:`shard_loaders_made`), each ``DataLoader`` the user's code makes is remembered, and
each of its passes is read as a prepared loader's (:mod:`~nbtrain.rank.loaders`): with
gradients, this rank's share; without, the whole. ``len(loader)`` follows the same rule, so
a schedule sized in the cell from it (``total_steps=epochs * len(loader)``) ends where the
rank's passes end.

It is sharded only while what it trains is averaged: a model auto mode prepared trains
and no optimizer made in the cell steps a model whose gradients nothing averages (a model
made in the cell, unprepared, trains one copy per rank; that copy reads all of the data,
and :mod:`~nbtrain.rank.madehere` names it). Loaders made by libraries (a trainer's own)
are theirs to distribute.

Importing this module does not import torch.

Example (outside a run nothing was made, so nothing is named):
    >>> made_loader_names({})
    {}
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from nbtrain.rank import loaders, madehere, preparations, wrapping

_made: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # loader the user made -> where
_prepared: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # -> its rebuild (itself: unshardable)
# Set while a rebuild reads: its evaluation passes iterate the user's loader itself.
_reading = {"on": False}
_installed = {"on": False}


def shard_loaders_made() -> None:
    """From now on in this rank, shard the training passes of DataLoaders the user's code makes (once)."""
    if _installed["on"]:
        return
    from torch.utils.data import DataLoader

    own_init, own_iter, own_len = DataLoader.__init__, DataLoader.__iter__, DataLoader.__len__

    @functools.wraps(own_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        own_init(self, *args, **kwargs)
        where = madehere.user_code_at(sys._getframe(1)) if type(self) is DataLoader else None
        if where is not None:
            _made[self] = where

    @functools.wraps(own_iter)
    def iterate(self: Any) -> Any:
        rebuild = _rebuild_to_read(self)
        return own_iter(self) if rebuild is None else _read(iter, rebuild)

    @functools.wraps(own_len)
    def length(self: Any) -> int:
        rebuild = _rebuild_to_read(self)
        return own_len(self) if rebuild is None else int(_read(len, rebuild))

    # A rank runs one cell: nothing else sees these.
    DataLoader.__init__ = init  # type: ignore[method-assign]
    DataLoader.__iter__ = iterate  # type: ignore[method-assign]
    DataLoader.__len__ = length  # type: ignore[method-assign]
    _installed["on"] = True


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
        notes = preparations.cell_registry().notes
        said = len(notes)
        rebuild = loaders.prepare_loader(loader)
        for i in range(said, len(notes)):  # "a DataLoader over Stream was not sharded: ..." says where it was made
            notes[i] = notes[i].replace(" was not sharded", f" made in {_made[loader]} was not sharded", 1)
        _prepared[loader] = rebuild
    return None if rebuild is loader else rebuild


def _averaged_training() -> bool:
    """Whether the cell trains an averaged model: one auto mode prepared that trains, and no
    optimizer made in the cell steps a model whose gradients nothing averages."""
    nn = preparations.torch_module().nn
    registry = preparations.cell_registry()
    prepared = [p for _, p in registry.prepared.values() if isinstance(p, nn.Module) and wrapping.trains(p)]
    return bool(prepared) and not madehere.unaveraged_made()


def made_loader_names(cell_globals: Mapping[str, Any]) -> dict[str, Any]:
    """Name -> rebuild for each loader the cell made and sharded, for the summary.

    A global names it; one made in a function the cell called is named by where it was
    made (``the DataLoader made in fit() (<file>, line 3)``), the last one made there.
    """
    names: dict[str, Any] = {}
    by_id = {id(v): n for n, v in cell_globals.items() if not n.startswith("_")}
    for loader, rebuild in list(_prepared.items()):
        if rebuild is loader:
            continue
        name = by_id.get(id(loader)) or f"the DataLoader made in {_made.get(loader, 'the cell')}"
        names[name] = rebuild
    return names
