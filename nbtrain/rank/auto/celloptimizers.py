"""Optimizers a cell made itself, which auto mode did not prepare: where, and what averages their model.

Auto mode prepares what the kernel had before the cell. A model built during the cell and
stepped by an optimizer made there (a training cell that starts with ``model = Net()``, a
k-fold loop's ``run_training(fold)``) would train one copy per rank, its gradients never
averaged: the one-device result at several times the work, with no error. So while an
auto-mode cell of several ranks runs (the patch table's ``made in the cell``), each optimizer made
records where (the user's function and line) and each DDP wrapper made marks its parameters
averaged. At an optimizer's first step (:func:`first_step`), one whose parameters nothing
averages (not prepared, not wrapped, not sharded) is kept one over the ranks from then on
(:mod:`~nbtrain.rank.auto.keptmodels`), and named in the summary by where it was made. Until
then, such an optimizer's gradients are averaged by :mod:`~nbtrain.rank.auto.averaging`'s rule
too, so a raise before its first step finds the whole batch's, as one process.

Importing this module does not import torch.

Example (outside a cell nothing was made):
    >>> made_optimizers()
    []
"""

from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig
import types
import weakref
from typing import Any

from nbtrain.rank.auto import averaging, keptmodels, ledger

_made: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # optimizer not stepped yet -> where made
_every_made: weakref.WeakSet[Any] = weakref.WeakSet()  # every optimizer made in the cell, stepped or not
_averaged: set[int] = set()  # ids of parameters a DDP wrapper made in this process averages
# optimizer not stepped yet whose parameters nothing averages -> its averaging target until its first step
_unstepped: weakref.WeakKeyDictionary[Any, averaging.Target] = weakref.WeakKeyDictionary()
_LIBRARY_FILES = re.compile(r"[/\\](site|dist)-packages[/\\]|^<frozen ")
# nbtrain's own files and the standard library's: no user's code.
_HOMES = (
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ""),
    os.path.join(sysconfig.get_paths()["stdlib"], ""),
)


def recording_optimizers(own_init: Any) -> Any:
    """``Optimizer.__init__`` while an auto-mode cell runs (the patch table's): records where each is made."""

    @functools.wraps(own_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        own_init(self, *args, **kwargs)
        _made[self] = where_made(sys._getframe(1))
        _every_made.add(self)
        if _averages_nothing(self):
            _watch_before_first_step(self)

    return init


def recording_averaged(own_ddp_init: Any) -> Any:
    """``DistributedDataParallel.__init__`` while an auto-mode cell runs (the patch table's): marks
    the parameters it averages."""

    @functools.wraps(own_ddp_init)
    def ddp_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        own_ddp_init(self, module, *args, **kwargs)
        _averaged.update(id(p) for p in module.parameters())

    return ddp_init


def _watch_before_first_step(optimizer: Any) -> None:
    """Average the gradients of ``optimizer``'s parameters by the one rule until its first step (then it
    is kept, or not): a cell raising between its first backward and step holds the whole batch's."""
    mine = functools.partial(_still_unstepped, weakref.ref(optimizer))
    target = _unstepped[optimizer] = keptmodels.unstepped(optimizer, mine)
    averaging.watch_backwards(averaging.track(target))


def _still_unstepped(reference: weakref.ref[Any], _target: Any) -> bool:
    optimizer = reference()
    return optimizer is not None and optimizer in _made and _averages_nothing(optimizer)


def at_first_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """The step hook's (:mod:`~nbtrain.rank.auto.stephooks`): an optimizer's first step decides whether it is kept."""
    if _made or _unstepped:  # else every optimizer the cell made has stepped: nothing to look up (a few us)
        first_step(optimizer, sys._getframe(2))  # past the dispatcher: where the step was called


def first_step(optimizer: Any, frame: types.FrameType | None) -> None:
    """At an optimizer's first step (later calls do nothing): one made in the cell whose parameters
    nothing averages is kept one over the ranks (:mod:`~nbtrain.rank.auto.keptmodels`). ``frame``: where
    the step was called."""
    where = _made.pop(optimizer, None)
    watching = _unstepped.pop(optimizer, None)
    if watching is not None:
        averaging.untrack(watching)
    if where is not None and _averages_nothing(optimizer):
        keptmodels.keep_averaged(optimizer, where, frame, averaged=watching is not None and watching.averaged)


def _averages_nothing(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps parameters that nothing averages: not prepared, no DDP, not sharded."""
    if ledger.cell_registry().prepared_for(optimizer) is not None:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return bool(params) and not any(id(p) in _averaged or _sharded(p) for p in params)


def made_optimizers() -> list[Any]:
    """The optimizers the cell made of its own (still alive): their models' gradients are averaged,
    by DDP or :mod:`~nbtrain.rank.auto.keptmodels`, so a loader made in the cell is sharded."""
    registry = ledger.cell_registry()
    return [o for o in list(_every_made) if registry.prepared_for(o) is None]


def unstepped_optimizers() -> list[Any]:
    """The optimizers made in the cell that have not stepped yet (still alive)."""
    return list(_made.keys())


def _sharded(param: Any) -> bool:
    """A parameter sharded over the ranks (FSDP2's DTensor, FSDP1's FlatParameter): averaged its own way."""
    return type(param).__name__ in ("DTensor", "FlatParameter")


def where_made(frame: types.FrameType | None) -> str:
    """The user's code that led here: ``run_training() (<its file>, line 6)``, or the cell's ``<file>, line 6``."""
    while frame is not None and _library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return ""
    code = frame.f_code
    place = f"{code.co_filename}, line {frame.f_lineno}"
    return place if code.co_name == "<module>" else f"{code.co_name}() ({place})"


def _library(filename: str) -> bool:
    return bool(_LIBRARY_FILES.search(filename)) or filename.startswith(_HOMES)
