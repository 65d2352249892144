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
then, such an optimizer's gradients are averaged as each backward writing them ends
(:mod:`~nbtrain.rank.auto.backwardend`), so a raise before its first step finds the whole
batch's, as one process.

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

from nbtrain.rank.auto import backwardend, keptmodels, ledger

_made: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # optimizer not stepped yet -> where made
_every_made: weakref.WeakSet[Any] = weakref.WeakSet()  # every optimizer made in the cell, stepped or not
_averaged: set[int] = set()  # ids of parameters a DDP wrapper made in this process averages
# optimizer not stepped yet whose parameters nothing averages -> what averages them as each backward ends
_unstepped_watch: weakref.WeakKeyDictionary[Any, backwardend.Averager] = weakref.WeakKeyDictionary()
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
        _made[self] = _where(sys._getframe(1))
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
    """Average the gradients of ``optimizer``'s parameters as each backward writing them ends, until its
    first step (then kept, :mod:`~nbtrain.rank.auto.keptmodels` watches them, or not): a cell raising
    between its first backward and step holds the whole batch's, as one process."""
    stack = ledger.cell_registry().patches
    by = backwardend.averager(functools.partial(_before_first_step, weakref.ref(optimizer)), stack)
    _unstepped_watch[optimizer] = by
    backwardend.watch_backwards(_params(optimizer), by)


def _before_first_step(reference: weakref.ref[Any]) -> None:
    optimizer = reference()
    if optimizer is not None and optimizer in _made and _averages_nothing(optimizer):
        keptmodels.average_before_kept(optimizer)
        backwardend.watch_backwards(_params(optimizer), _unstepped_watch[optimizer])  # a group added since


def _params(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def at_first_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """The step hook's (:mod:`~nbtrain.rank.auto.stephooks`): an optimizer's first step decides whether it is kept."""
    if _made or _unstepped_watch:  # else every optimizer the cell made has stepped: nothing to look up (a few us)
        first_step(optimizer, sys._getframe(2))  # past the dispatcher: where the step was called


def first_step(optimizer: Any, frame: types.FrameType | None) -> None:
    """At an optimizer's first step (later calls do nothing): one made in the cell whose parameters
    nothing averages is kept one over the ranks (:mod:`~nbtrain.rank.auto.keptmodels`). ``frame``: where
    the step was called."""
    where = _made.pop(optimizer, None)
    watching = _unstepped_watch.pop(optimizer, None)
    if watching is not None:
        backwardend.unwatch_backwards(watching)
    if where is not None and _averages_nothing(optimizer):
        keptmodels.keep_averaged(optimizer, where, frame)


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


def user_code_at(frame: types.FrameType | None) -> str | None:
    """Where ``frame`` runs (``fit() (<file>, line 3)``) if it is the user's code (else None:
    a library's, nbtrain's or the standard library's)."""
    if frame is None or _library(frame.f_code.co_filename):
        return None
    return _where(frame)


def _where(frame: types.FrameType | None) -> str:
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
