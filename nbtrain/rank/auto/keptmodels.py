"""Models the cell makes and trains itself: kept one model over the ranks, as DDP would keep it.

Auto mode prepares what the kernel had before the cell. A k-fold loop's
``run_training(fold)`` makes its model, optimizer and loader itself, as does a training cell
that starts with ``model = Net()``: no DDP wraps that model, and each rank would train its
own copy. So while an auto-mode cell of several ranks runs, an optimizer made in the cell
whose parameters nothing averages (:mod:`~nbtrain.rank.auto.celloptimizers` tells) is kept here from its
first step on (:func:`keep_averaged`): rank 0's parameters and buffers are broadcast then
(the ranks may have made the model differently), and from then on (before it too:
:func:`unstepped`) it is a target of :mod:`~nbtrain.rank.auto.averaging`, whose one rule
averages its gradients as each backward ends, as DDP's backward does, and broadcasts rank 0's
buffers with them (BatchNorm's running statistics, as DDP's forward does): every rank steps
the same model with the same gradients, and holds the whole batch's between a backward and
its step, as one process. A loader made in the cell for such a model is sharded
(:mod:`~nbtrain.rank.auto.cellloaders`). The averaging is not overlapped with the backward, as
DDP's is: ``nbtrain.prepare`` on the model where it is made gets that.

Importing this module does not import torch.

Example (outside a run nothing is kept):
    >>> kept_summary({})
    []
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbtrain.rank.auto import averaging, ledger, samedata


@dataclass(frozen=True)
class _Kept:
    """A kept optimizer's models' buffers and how to name them (its parameters are read at each
    average: ``add_param_group`` may add some, unfreezing a backbone)."""

    buffers: tuple[Any, ...]
    modules: tuple[Any, ...]  # weak references to the models
    where: str  # where the optimizer was made
    sparse: frozenset[int] | None  # ids of sparse-gradient parameters (None: a parameter outside the models)


# (where the optimizer was made, weak references to the models found holding its parameters), for
# the summary: a k-fold loop's models are gone by the cell's end, and their memory with them.
_said: list[tuple[str, tuple[Any, ...]]] = []
# Not kept yet, its first gradients compared over the ranks as they were averaged (average_before_kept).
_compared_first: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def keep_averaged(optimizer: Any, where: str, frame: types.FrameType | None, averaged: bool) -> None:
    """Keep ``optimizer``'s model one over the ranks from now on: rank 0's weights now, gradients averaged
    by :mod:`~nbtrain.rank.auto.averaging`'s rule (``averaged``: since the last backward already).

    ``frame`` is where the step was called: the models holding the parameters are looked
    for there and in its callers (their locals, and one attribute in: ``self.model``).
    """
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    modules = tuple(_holders(stepped, frame))
    # All of the models' weights, a frozen backbone's too (add_param_group may unfreeze it later).
    params = {id(p): p for p in [*stepped, *(p for m in modules for p in m.parameters())]}
    buffers = tuple({id(b): b for m in modules for b in m.buffers()}.values())
    _broadcast((*params.values(), *buffers))
    refs = tuple(weakref.ref(m) for m in modules)
    inside = {id(p) for m in modules for p in m.parameters()}
    sparse = averaging.sparse_parameters(list(modules)) if all(id(p) in inside for p in stepped) else None
    kept = _Kept(buffers, refs, where, sparse)
    _said.append((where, refs))
    compared = _compared_first.pop(optimizer, None)  # its backwards before this step were averaged
    if compared is not None:
        samedata.note_first_gradients(tuple(modules), _unnamed(where), compared)
    first = [compared is None]  # its first gradients not yet compared over the ranks
    average = functools.partial(_average, kept, first)
    target = averaging.Target("kept", functools.partial(_params, optimizer), weakref.ref(optimizer), average=average)
    target.averaged = averaged
    averaging.watch_backwards(averaging.track(target), list(params.values()))


def unstepped(optimizer: Any, mine: Any) -> averaging.Target:
    """What averages an optimizer made in the cell whose parameters nothing averages, not stepped yet
    (:mod:`~nbtrain.rank.auto.celloptimizers` tracks it until its first step keeps it, or not), while
    ``mine(target)``: as once it is kept, the ranks hold the whole batch's."""
    average = functools.partial(_average_before_kept, weakref.ref(optimizer))
    return averaging.Target("unstepped", functools.partial(_params, optimizer), weakref.ref(optimizer), mine, average)


def _params(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _average_before_kept(reference: weakref.ref[Any], params: list[Any]) -> None:
    optimizer = reference()
    if optimizer is not None and optimizer not in _compared_first:  # its first gradients, each rank's own
        _compared_first[optimizer] = samedata.compare_first_gradients([p.grad for p in params])
    averaging.average_gradients(params)


def _average(kept: _Kept, first: list[bool], params: list[Any]) -> None:
    if first[0]:  # its first gradients: the same on every rank means the same batch
        first[0] = False
        models = tuple(m for m in (ref() for ref in kept.modules) if m is not None)
        compared = samedata.compare_first_gradients([p.grad for p in params])
        samedata.note_first_gradients(models, _unnamed(kept.where), compared)
    averaging.average_gradients(params, sparse=kept.sparse)
    if kept.buffers:
        _broadcast(kept.buffers)


def _broadcast(tensors: tuple[Any, ...]) -> None:
    """Rank 0's values of ``tensors`` on every rank: one broadcast per device and dtype."""
    torch = ledger.torch_module()
    # deferred: start-up time (torch)
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    kinds: dict[tuple[Any, Any], list[Any]] = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for same in kinds.values():
            flat = _flatten_dense_tensors([t.detach() for t in same])
            torch.distributed.broadcast(flat, src=0)
            for t, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                t.copy_(value)


def _holders(params: list[Any], frame: types.FrameType | None) -> list[Any]:
    """The outermost modules holding any of ``params``, found in ``frame``'s and its callers' names."""
    nn = ledger.torch_module().nn
    wanted = {id(p) for p in params}
    found: dict[int, Any] = {}
    while frame is not None:
        for value in _near(frame.f_locals.values()):
            if _is_module(value, nn.Module) and any(id(p) in wanted for p in value.parameters()):
                found[id(value)] = value
        frame = frame.f_back
    inside = {id(sub) for m in found.values() for sub in m.modules() if sub is not m}
    return [m for i, m in found.items() if i not in inside]


def _near(values: Any) -> Any:
    """Each value, and the attributes of those that have some (a trainer's ``self.model``)."""
    for value in list(values):
        yield value
        attributes = _attributes(value)
        if isinstance(attributes, dict) and not isinstance(value, (type, types.ModuleType)):
            yield from list(attributes.values())


def _is_module(value: Any, module_class: type) -> bool:
    try:
        return isinstance(value, module_class)
    except ReferenceError:  # a weak proxy whose object is gone
        return False


def _attributes(value: Any) -> Any:
    try:
        return getattr(value, "__dict__", None)
    except Exception:  # noqa: BLE001 - a dead weak proxy, an object whose attribute lookup fails: none
        return None


def kept_models(pending: list[Any]) -> list[Any]:
    """The models the cell made that train (a loader's pass asks whether they evaluate): those kept
    one over the ranks, and those whose optimizer has not stepped yet (``pending``: a score taken in
    eval mode before training), found in the caller's names."""
    kept = [m for _, modules in _said for m in (ref() for ref in modules) if m is not None]
    if not pending:
        return kept
    stepped = [p for o in pending for group in o.param_groups for p in group["params"]]
    return kept + _holders(stepped, sys._getframe(1))


def kept_summary(cell_globals: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what, how) for the summary: each model kept one over the ranks here, by its global name
    (``trainer.model`` one attribute in), else by where its optimizer was made (once per place: a
    k-fold loop makes one there per fold)."""
    by_id = _names(cell_globals)
    places: dict[str, list[str]] = {}
    for where, modules in _said:
        names = places.setdefault(where, [])
        alive = (ref() for ref in modules)
        names += [by_id[id(m)] for m in alive if m is not None and id(m) in by_id and by_id[id(m)] not in names]
    how = "made in the cell: gradients averaged before each step"
    return [(name, how) for where, names in places.items() for name in names or [_unnamed(where)]]


def _unnamed(where: str) -> str:
    return f"the model of the optimizer made in {where}"


def _names(cell_globals: Mapping[str, Any]) -> dict[int, str]:
    """id -> name of the cell's globals, then of their attributes (``trainer.model``)."""
    names: dict[int, str] = {}
    for name, value in cell_globals.items():
        if not name.startswith("_"):
            names.setdefault(id(value), name)
    for name, value in list(cell_globals.items()):
        attributes = _attributes(value) if not name.startswith("_") else None
        if isinstance(attributes, dict) and not isinstance(value, (type, types.ModuleType)):
            for attribute, inner in attributes.items():
                names.setdefault(id(inner), f"{name}.{attribute}")
    return names
