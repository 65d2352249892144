"""Models a cell made and trained itself, which auto mode did not prepare: named in the summary.

Auto mode prepares what the kernel had before the cell. A model built during the cell and
stepped by an optimizer trains one copy per rank, its gradients never averaged, and a loader
built there gives each rank all of its data: the one-device result at several times the work,
with no error. Built at the top level of the cell they are globals, and
:func:`made_here_notes` names them with the line that prepares them. Built in a function the
cell calls (a k-fold loop's ``run_training(fold)``) they have no name the cell sees: so while
an auto-mode cell of several ranks runs (:func:`record_optimizers_made`), each optimizer made
records where (the user's function and line) and each DDP wrapper made marks its parameters
averaged; an optimizer whose first step finds its parameters averaged by nothing (not
prepared, not wrapped, not sharded) is named at the end by where it was made.

Importing this module does not import torch.

Example (outside a cell nothing was made):
    >>> made_here_notes({}, [])
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
from collections.abc import Iterable, Mapping
from typing import Any

from nbtrain.rank import api, preparations, wrapping

_made: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # optimizer not stepped yet -> where made
_every_made: weakref.WeakSet[Any] = weakref.WeakSet()  # every optimizer made in the cell, stepped or not
# (where it was made, its class) of each optimizer made in the cell whose first step found its
# parameters averaged by nothing: noted then, as such an optimizer is often gone by the cell's end.
_unaveraged: list[tuple[str, str]] = []
_averaged: set[int] = set()  # ids of parameters a DDP wrapper made in this process averages
_recording = {"on": False}
_LIBRARY_FILES = re.compile(r"[/\\](site|dist)-packages[/\\]|^<frozen ")
# nbtrain's own files and the standard library's: no user's code.
_HOMES = (
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ""),
    os.path.join(sysconfig.get_paths()["stdlib"], ""),
)


def record_optimizers_made() -> None:
    """Record, from now on in this rank, the optimizers made and stepped and the parameters DDP averages (once)."""
    if _recording["on"]:
        return
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    own_init, own_ddp_init = torch.optim.Optimizer.__init__, DistributedDataParallel.__init__

    @functools.wraps(own_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        own_init(self, *args, **kwargs)
        _made[self] = _where(sys._getframe(1))
        _every_made.add(self)

    @functools.wraps(own_ddp_init)
    def ddp_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        own_ddp_init(self, module, *args, **kwargs)
        _averaged.update(id(p) for p in module.parameters())

    # A rank runs one cell: nothing else sees these.
    torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]
    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]
    register_optimizer_step_pre_hook(_before_step)
    _recording["on"] = True


def _before_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    where = _made.pop(optimizer, None)  # its first step: later steps find nothing here
    if where is not None and _averages_nothing(optimizer):
        _unaveraged.append((where, type(optimizer).__name__))


def _averages_nothing(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps parameters that nothing averages: not prepared, no DDP, not sharded."""
    if preparations.cell_registry().prepared_for(optimizer) is not None:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return bool(params) and not any(id(p) in _averaged or _sharded(p) for p in params)


def unaveraged_made() -> bool:
    """Whether an optimizer made during this cell steps a model whose gradients nothing averages.

    A loader made in the cell is then not sharded (:mod:`~nbtrain.rank.cellloaders`): each
    rank trains its own copy of that model, so it reads all of the data, as in one process.
    """
    return any(_averages_nothing(optimizer) for optimizer in list(_every_made))


def user_code_at(frame: types.FrameType | None) -> str | None:
    """Where ``frame`` runs, as :func:`made_here_notes` says it, if it is the user's code (else None:
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


def made_here_notes(cell_globals: Mapping[str, Any], bound: Iterable[str]) -> list[str]:
    """The notes for models the cell made and trained itself, unprepared: by their names, else by where."""
    if "torch" not in sys.modules:
        return []
    named = _globals_note(cell_globals, bound)
    if named is not None:
        return [named]
    return _made_elsewhere_notes()


def _made_elsewhere_notes() -> list[str]:
    """One note per place where optimizers were made during the cell and stepped unaveraged parameters."""
    places: dict[str, list[str]] = {}
    for where, kind in _unaveraged:
        places.setdefault(where, []).append(kind)
    return [_elsewhere_note(where, kinds) for where, kinds in places.items()]


def _sharded(param: Any) -> bool:
    """A parameter sharded over the ranks (FSDP2's DTensor, FSDP1's FlatParameter): averaged its own way."""
    return type(param).__name__ in ("DTensor", "FlatParameter")


def _elsewhere_note(where: str, kinds: list[str]) -> str:
    named = ", ".join(sorted(set(kinds)))
    what = f"{len(kinds)} optimizers ({named})" if len(kinds) > 1 else f"an optimizer ({named})"
    ranks = api.world_size()
    return (
        f"{what} made {'in ' + where if where else 'during the cell'} stepped a model auto mode did not prepare "
        "(it prepares what the kernel had before the cell): each rank trained its own copy on all of the data "
        f"(gradients not averaged, a loader made there not sharded), the one-device result at {ranks} times the work. "
        "Prepare them where they are made: `model, optimizer, train_loader = nbtrain.prepare(model, optimizer, "
        "train_loader)` right after making them (in the kernel it only moves the model to nbtrain.device()), "
        "or make them in a cell before this one."
    )


def _globals_note(cell_globals: Mapping[str, Any], bound: Iterable[str]) -> str | None:
    """The note for models the cell made and trained itself, unprepared (None: there are none).

    Auto mode prepares what the kernel had before the cell; a model built in the cell and
    stepped by an optimizer trains one copy per rank, its gradients never averaged, and a
    loader built there gives each rank all of its data. The result is the one-device
    result, with nothing gained: the user is told, and how to fix it.
    """
    torch = preparations.torch_module()
    from torch.utils.data import DataLoader

    registry = preparations.cell_registry()
    made = {n: cell_globals[n] for n in bound if n in cell_globals and registry.prepared_for(cell_globals[n]) is None}
    optimizers_ = {n: v for n, v in made.items() if isinstance(v, torch.optim.Optimizer)}
    stepped = {id(p) for opt in optimizers_.values() for group in opt.param_groups for p in group["params"]}
    models = {
        n: v
        for n, v in made.items()
        if isinstance(v, torch.nn.Module)
        and not wrapping.is_wrapped(v)
        and any(id(p) in stepped for p in v.parameters())
    }
    inside = {id(sub) for model in models.values() for sub in model.modules() if sub is not model}
    models = {n: v for n, v in models.items() if id(v) not in inside}
    if not models:
        return None
    params = {id(p) for model in models.values() for p in model.parameters()}
    opts = [n for n, o in optimizers_.items() if any(id(p) in params for g in o.param_groups for p in g["params"])]
    loaders_ = [n for n, v in made.items() if isinstance(v, DataLoader)]
    names = [*models, *opts, *loaders_]
    them = "it" if len(models) == 1 else "them"
    read = f", and read all of {_listed(loaders_)}" if loaders_ else ""
    return (
        f"{_listed(list(models))} {'was' if len(models) == 1 else 'were'} made in this cell, so auto mode did not "
        f"prepare {them} (it prepares what the kernel had before the cell): each rank trained its own copy, "
        f"gradients not averaged{read}. Make {them} in an earlier cell, or prepare {them} in this one: "
        f"`{', '.join(names)} = nbtrain.prepare({', '.join(names)})`."
    )


def _listed(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
