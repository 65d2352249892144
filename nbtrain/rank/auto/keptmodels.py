"""Models the cell makes and trains itself: kept one model over the ranks, as DDP would keep it.

Auto mode prepares what the kernel had before the cell. A k-fold loop's
``run_training(fold)`` makes its model, optimizer and loader itself, as does a training cell
that starts with ``model = Net()``: no DDP wraps that model, and each rank would train its
own copy. So while an auto-mode cell of several ranks runs, an optimizer made in the cell
whose parameters nothing averages (:mod:`~nbtrain.rank.auto.madeoptimizers` tells) is kept here from its
first step on (:func:`keep_averaged`): rank 0's parameters and buffers are broadcast then
(the ranks may have made the model differently), and its gradients are averaged as each
backward ends (:mod:`~nbtrain.rank.auto.backwardend`: one all-reduce,
:func:`nbtrain.rank.auto.bypass.average_gradients`, as DDP's backward averages; before that
first step too, :func:`average_before_kept`) and rank 0's buffers broadcast
(BatchNorm's running statistics, as DDP's forward does), so every rank
steps the same model with the same gradients, and holds the whole batch's between a backward
and its step (a cell raising there brings them back), as one process. What no backward wrote
(gradients set by hand) is averaged before the step. Under a ``GradScaler`` every rank so
unscales the averaged gradients and skips the same steps, and ``clip_grad_norm_`` clips them,
as under DDP.
A step given a closure (LBFGS) makes its gradients inside the step: they are averaged as the
closure returns, and the loss it returns is the ranks' mean, so every rank's step decides
alike. A loader made in the cell for such a model is sharded
(:mod:`~nbtrain.rank.auto.madeloaders`). The averaging is not overlapped with the backward, as
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.auto import backwardend, bypass, ledger, samedata


@dataclass(frozen=True)
class _Kept:
    """The buffers of the models an optimizer steps (its parameters are read at each step:
    ``add_param_group`` may add some, unfreezing a backbone), and how to name them."""

    buffers: tuple[Any, ...]
    modules: tuple[Any, ...]  # weak references to the models
    where: str  # where the optimizer was made
    sparse: frozenset[int] | None  # ids of sparse-gradient parameters (None: a parameter outside the models)
    owner: backwardend.Averager  # averages as each backward writing into its gradients ends


_kept: weakref.WeakKeyDictionary[Any, _Kept] = weakref.WeakKeyDictionary()
# (where the optimizer was made, weak references to the models found holding its parameters), for
# the summary: a k-fold loop's models are gone by the cell's end, and their memory with them.
_said: list[tuple[str, tuple[Any, ...]]] = []
# Averaged since a backward last wrote into their gradients (as it ended, or as they were unscaled or
# clipped): a read or the step adds nothing.
_early: weakref.WeakSet[Any] = weakref.WeakSet()
# "first_step": madeoptimizers's first_step; "unstepped": the optimizers made in the cell that have not stepped yet
_sources: dict[str, Callable[..., Any]] = {}
# Kept, and their first gradients not yet compared over the ranks (the same on every rank: the same batch).
_unchecked: weakref.WeakSet[Any] = weakref.WeakSet()
# Not kept yet, its first gradients compared over the ranks as they were averaged (average_before_kept).
_compared_first: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def keep_averaged(optimizer: Any, where: str, frame: types.FrameType | None) -> None:
    """Keep ``optimizer``'s model one over the ranks from now on: rank 0's weights now, gradients averaged.

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
    sparse = bypass.sparse_parameters(list(modules)) if all(id(p) in inside for p in stepped) else None
    stack = ledger.cell_registry().patches
    at_end = backwardend.averager(functools.partial(_at_backward_end, weakref.ref(optimizer)), stack)
    _kept[optimizer] = _Kept(buffers, refs, where, sparse, at_end)
    _said.append((where, refs))
    compared = _compared_first.pop(optimizer, None)  # its backwards before this step were averaged
    if compared is None:
        _unchecked.add(optimizer)
    else:
        samedata.note_first_gradients(tuple(modules), _unnamed(where), compared)
    backwardend.watch_backwards(params.values(), at_end)


def average_before_kept(optimizer: Any) -> None:
    """Average the gradients of an optimizer made in the cell whose parameters nothing averages, not
    stepped yet, as a backward writing them ends (:mod:`~nbtrain.rank.auto.madeoptimizers` watches its
    backwards until its first step keeps it): as once it is kept, the ranks hold the whole batch's."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer not in _compared_first:  # its first gradients, each rank's own: the same mean the same batch
        _compared_first[optimizer] = samedata.compare_first_gradients([p.grad for p in params])
    bypass.average_gradients(params)
    _early.add(optimizer)


def _at_backward_end(reference: weakref.ref[Any]) -> None:
    """A backward wrote into a kept model's gradients: average them now, as DDP's backward would."""
    optimizer = reference()
    kept = _kept.get(optimizer) if optimizer is not None else None
    if kept is not None:
        _average(optimizer, kept)
        _early.add(optimizer)


def kept(optimizer: Any) -> bool:
    """Whether ``optimizer``'s model is kept one over the ranks here."""
    return optimizer in _kept


def watch_steps(
    first_step: Callable[[Any, types.FrameType | None], None],
    unstepped: Callable[[], list[Any]],
    cell_globals: dict[str, Any],
) -> None:
    """Average kept models' gradients where they are read before the step, as a GradScaler unscales
    them and as ``clip_grad_norm_`` (or ``clip_grad_value_``) clips them: called as the cell starts,
    after the patch table's ``made in the cell`` is installed.

    ``first_step(optimizer, frame)`` (:func:`nbtrain.rank.auto.madeoptimizers.first_step`) decides, at an
    optimizer's first step, whether it is kept: unscaling and clipping come before the step
    itself. ``unstepped()`` lists the optimizers made in the cell that have not stepped yet.
    ``cell_globals``' own references to torch's clipping functions (``from torch.nn.utils
    import clip_grad_norm_`` in the kernel) are pointed at the averaging ones.
    """
    _sources.update(first_step=first_step, unstepped=unstepped)
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        averaging = getattr(clip_grad, name)
        own = getattr(averaging, "__wrapped__", averaging)
        cell_globals.update({n: averaging for n, v in list(cell_globals.items()) if v is own})


def averaging_unscale(own_unscale: Any) -> Any:
    """``GradScaler.unscale_`` in an auto-mode cell (the patch table's): a kept model's gradients,
    and a wrapped model's that bypassed its wrapper, are averaged first, so every rank finds the
    same infinities."""

    @functools.wraps(own_unscale)
    def unscale_(self: Any, optimizer: Any) -> Any:
        _sources["first_step"](optimizer, sys._getframe(1))  # a first step under the scaler starts here
        _average_early(optimizer)
        bypass.average_before_read(optimizer=optimizer)  # a wrapped model the loop called through a holder
        return own_unscale(self, optimizer)

    return unscale_


@functools.cache
def averaging_clip(own: Any) -> Any:
    """``own`` (torch's clip_grad_norm_ or clip_grad_value_) reading averaged gradients: a kept model's,
    and a wrapped model's whose forward the loop bypassed (the patch table's; one per function,
    wherever torch names it)."""
    torch = ledger.torch_module()

    @functools.wraps(own)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        for optimizer in {id(o): o for o in [*_sources["unstepped"](), *_kept.keys()]}.values():
            if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
                _sources["first_step"](optimizer, sys._getframe(1))  # clipping before the first step
                _average_early(optimizer)
        bypass.average_before_read(params)  # a wrapped model the loop called through a holder (held["net"](x))
        return own(params, *args, **kwargs)

    return clip


def _average_early(optimizer: Any) -> None:
    """Average a kept model's gradients before its step reads them (its step then adds nothing), unless
    they are averaged already (as the backward that wrote them ended): averaging again would take
    another all-reduce, and over 3 ranks or more change the last bits.
    """
    kept = _kept.get(optimizer)
    if kept is not None and optimizer not in _early:
        _average(optimizer, kept)
        _early.add(optimizer)


def average_kept(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The step hook's (:mod:`~nbtrain.rank.auto.stephooks`): average a kept model's gradients before
    its step; a closure's (its step makes them) as it returns. Returns changed (args, kwargs) or None."""
    kept = _kept.get(optimizer) if _kept else None  # a weak dictionary's lookup costs a reference made
    if kept is None:
        return None
    early = optimizer in _early  # averaged already: as the backward ended, a scaler unscaled them or clipping read them
    _early.discard(optimizer)
    # torch hands the hooks the step's arguments with the optimizer first: (optimizer, closure)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None:  # LBFGS, or any step(closure): the gradients are made inside the step
        averaged = functools.partial(_averaged_closure, closure, optimizer, kept)
        if len(args) > 1:
            return (args[0], averaged, *args[2:]), kwargs
        return args, {**kwargs, "closure": averaged}
    if not early:
        _average(optimizer, kept)
    return None


def _averaged_closure(closure: Any, optimizer: Any, kept: _Kept) -> Any:
    """The closure's loss, its gradients averaged and the loss the ranks' mean: every rank's step
    (LBFGS's line search and its stopping rule among it) then decides alike."""
    torch = ledger.torch_module()
    loss = closure()
    if optimizer not in _early:  # its backward averaged them as it ended (or a clip inside it)
        _average(optimizer, kept)
    _early.discard(optimizer)  # nothing is left for later
    if loss is None:
        return None
    value = torch.as_tensor(loss.detach() if isinstance(loss, torch.Tensor) else loss, device=api.device())
    mean = value.to(torch.float64 if value.device.type != "mps" else torch.float32).clone()
    torch.distributed.all_reduce(mean)
    mean /= api.world_size()
    return mean.to(value.dtype) if isinstance(loss, torch.Tensor) else float(mean)


def _average(optimizer: Any, kept: _Kept) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer in _unchecked:  # its first gradients: the same on every rank means the same batch
        _unchecked.discard(optimizer)
        models = tuple(m for m in (ref() for ref in kept.modules) if m is not None)
        compared = samedata.compare_first_gradients([p.grad for p in params])
        samedata.note_first_gradients(models, _unnamed(kept.where), compared)
    bypass.average_gradients(params, sparse=kept.sparse)
    backwardend.watch_backwards(params, kept.owner)  # a parameter unfrozen since
    if kept.buffers:
        _broadcast(kept.buffers)


def _broadcast(tensors: tuple[Any, ...]) -> None:
    """Rank 0's values of ``tensors`` on every rank: one broadcast per device and dtype."""
    torch = ledger.torch_module()
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


def kept_models() -> list[Any]:
    """The models the cell made that train (a loader's pass asks whether they evaluate): those kept
    one over the ranks, and those whose optimizer has not stepped yet (a score taken in eval mode
    before training), found in the caller's names."""
    kept = [m for _, modules in _said for m in (ref() for ref in modules) if m is not None]
    unstepped = _sources.get("unstepped")
    pending = unstepped() if unstepped is not None else []
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
