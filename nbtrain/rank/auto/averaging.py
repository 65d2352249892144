"""The one gradient averager: when and how auto mode averages the gradients DDP does not.

DDP averages a wrapped model's gradients in the backward of its own forward. Every other
set of parameters auto mode keeps one over the ranks is a :class:`Target` here, one record
each, registered by the module that finds it:

- ``wrapped``: a DDP model whose forward a step bypassed (the loop called its parts or
  methods, ``model["head"](x)``, which the read-through wrapper lets through): :func:`wrapped`,
  called as :mod:`~nbtrain.rank.auto.wrapping` wraps it; its forwards are counted there.
- ``unfrozen``: a model auto mode left unwrapped because nothing in it was trainable, once
  the cell unfreezes part of it (:func:`unfrozen`).
- ``unstepped``: an optimizer made in the cell whose parameters nothing averages, before its
  first step (:mod:`~nbtrain.rank.auto.celloptimizers`), and ``kept``: the same from its first
  step on, rank 0's weights broadcast then (:mod:`~nbtrain.rank.auto.keptmodels`).

**The rule.** A target's trainable gradients are averaged (one all-reduce per device and
dtype, :func:`average_gradients`) at the first of, between two steps of its optimizer:

1. the end of each backward that wrote any of them (autograd's final callback, as DDP's
   reducer averages): under accumulation each micro-batch's, so a cell raising between a
   backward and its step holds the whole batch's, as one process does;
2. a read before the step: clipping (``clip_grad_norm_``, ``clip_grad_value_``), a
   GradScaler's ``unscale_`` (so one process's clipping, and every rank finds the same
   infinities);
3. the step of an optimizer holding them (what no backward wrote: gradients set by hand);
   a step given a closure (LBFGS) as the closure returns, its loss then the ranks' mean.

An average marks the target averaged until the next step, so a read or the step adds no
second all-reduce. A ``wrapped`` target whose DDP forward ran since the last step is DDP's:
skipped, and at that step its backward hooks go (they cost per backward) until a step finds
it bypassed again. Averaging is linear: each backward's average summed is the sum's average.

Each watched parameter has a post-accumulate-grad hook: it fires where autograd writes a
``.grad`` (``loss.backward()``, ``scaler.scale(loss).backward()``, twice with
``retain_graph``), not for ``torch.autograd.grad``. The first in a backward queues one
callback at its end; it averages each target that backward touched, once, in the order the
targets were made: the same order on every rank, each average being a collective. The state
lives in the records and the cell's registry, none on the user's objects.

Importing this module does not import torch.

Example (a backward writing into a watched parameter averages its target once, at its end):
    >>> import torch
    >>> w, seen = torch.nn.Parameter(torch.ones(2)), []
    >>> target = Target("kept", lambda: [w], average=lambda params: seen.append(w.grad.tolist()))
    >>> watch_backwards(target)
    >>> (w * 3).sum().backward()
    >>> grads = torch.autograd.grad((w * 2).sum(), [w])  # no .grad written: nothing
    >>> unwatch_backwards(target)
    >>> seen, target.averaged
    ([[3.0, 3.0]], True)
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.auto import ledger, stephooks

_orders = itertools.count()
_requires_grad = operator.attrgetter("requires_grad")


def _always(_target: Target) -> bool:
    return True


@dataclass(eq=False)
class Target:
    """Parameters averaged here, and their averaging's state (not a frozen record: backwards and steps
    change it).

    ``params()``: the parameters that may train (those requiring grad now are averaged);
    ``owner``: the optimizer whose steps are this target's (None: any optimizer holding one of
    its parameters); ``mine()``: whether it is still nbtrain's to average (a wrapped model's
    DDP forward ran: DDP's); ``average(params)``: how (by default :func:`average_gradients`
    over all ranks; a kept model's also broadcasts its buffers).
    """

    kind: str  # "wrapped" | "unfrozen" | "unstepped" | "kept"
    params: Callable[[], list[Any]]
    owner: weakref.ref[Any] | None = None
    mine: Callable[[Target], bool] = _always
    average: Callable[[list[Any]], None] | None = None
    averaged: bool = False  # since the last step: a read or the step adds nothing
    order: int = field(default_factory=lambda: next(_orders))  # backwards average their targets in this order
    hooks: ExitStack = field(default_factory=ExitStack)
    watched: set[int] = field(default_factory=set)  # ids of the parameters hooked
    forwards: int = 0  # wrapped: its DDP forwards with gradients so far
    forwards_at_any_step: int = 0  # ... at the last step of any optimizer
    forwards_at_step: dict[int, int] = field(default_factory=dict)  # ... at each optimizer's last step, by id
    label: str = ""  # wrapped: its model's class, for the note said once (``said``)
    said: bool = False


def track(target: Target) -> Target:
    """Average ``target`` by the rule from now until the cell ends (its hooks go then)."""
    registry = ledger.cell_registry()
    registry.targets.append(target)
    registry.targets_changed += 1
    registry.patches.callback(unwatch_backwards, target)
    stephooks.for_prepared_models()  # the step averages what no backward did
    return target


def untrack(target: Target) -> None:
    """Stop averaging ``target`` (an optimizer's first step decided what it is)."""
    unwatch_backwards(target)
    targets = ledger.cell_registry().targets
    if target in targets:
        targets.remove(target)
        ledger.cell_registry().targets_changed += 1


def watch_backwards(target: Target, params: list[Any] | None = None) -> None:
    """Average ``target`` at the end of each backward writing into ``params`` (default: its own) that
    require grad now; calling again adds those that came to (a backbone unfrozen)."""
    for param in target.params() if params is None else params:
        if param.requires_grad and id(param) not in target.watched:
            target.watched.add(id(param))
            target.hooks.callback(param.register_post_accumulate_grad_hook(functools.partial(_touch, target)).remove)


def unwatch_backwards(target: Target) -> None:
    """Stop ``target``'s backward hooks (until :func:`watch_backwards` is called again)."""
    target.hooks.close()
    target.watched.clear()


_touched: dict[int, Target] = {}  # order -> target: touched by the running backward
_queued: dict[str, int | None] = {"task": None}  # the backward whose end is queued


def _touch(target: Target, _param: Any) -> None:
    _touched[target.order] = target
    torch = ledger.torch_module()
    task = torch._C._current_graph_task_id()
    if _queued["task"] != task:
        _queued["task"] = task
        torch.autograd.Variable._execution_engine.queue_callback(_at_backward_end)


def _at_backward_end() -> None:
    """Rule 1: the backward ended; each target it touched averages, in the order they were made."""
    _queued["task"] = None
    touched = [_touched[order] for order in sorted(_touched)]
    _touched.clear()
    with ledger.torch_module().no_grad():
        for target in touched:
            if target.mine(target):
                _average(target)


def _average(target: Target) -> None:
    """Average ``target``'s trainable gradients now, and watch its backwards from now on."""
    params = list(itertools.compress(ps := target.params(), map(_requires_grad, ps)))
    target.averaged = True
    if not params:
        return
    if target.average is not None:
        target.average(params)
    else:
        average_gradients(params)
    watch_backwards(target, params)  # a parameter unfrozen since


def before_read(params: list[Any] | None = None, optimizer: Any = None) -> None:
    """Rule 2: average what the cell is about to read (clipping ``params``, unscaling ``optimizer``'s)."""
    pending = [t for t in ledger.cell_registry().targets if not t.averaged and t.mine(t)]
    if not pending:  # the usual case: the backward's end averaged them
        return
    if optimizer is not None:
        chosen = [t for t in _targets_of(optimizer) if t in pending]
    else:
        ids = {id(p) for p in params or ()}
        chosen = [t for t in pending if t.owner is None and any(id(p) in ids for p in t.params())]
        chosen += [t for t in pending if t.owner is not None and _holds(t.owner(), ids)]
    for target in chosen:
        _average(target)


def _holds(optimizer: Any, ids: set[int]) -> bool:
    return optimizer is not None and any(id(p) in ids for group in optimizer.param_groups for p in group["params"])


_depth = {"steps": 0}  # an optimizer's step inside another's (ZeroRedundancyOptimizer's) is left alone


def at_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Rule 3, the step hook's (:mod:`~nbtrain.rank.auto.stephooks`): average what nothing did before
    ``optimizer``'s step; a closure's as it returns. Returns changed (args, kwargs) or None."""
    _depth["steps"] += 1
    if _depth["steps"] > 1 or not ledger.cell_registry().targets:
        return None
    changed, closure = None, args[1] if len(args) > 1 else kwargs.get("closure")
    for target in _targets_of(optimizer):
        if target.kind == "wrapped":
            if _wrapped_forward_ran(target, optimizer):
                continue
            _say_bypassed(target)
        if closure is not None and target.owner is not None:  # its gradients are made inside the step
            target.averaged = False
            averaged = functools.partial(_averaged_closure, closure, target)
            keyword = (args, {**kwargs, "closure": averaged})
            changed = ((args[0], averaged, *args[2:]), kwargs) if len(args) > 1 else keyword
            continue
        if not target.averaged:
            _average(target)
        target.averaged = False
    return changed


def leave_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """The step hook's, after the step: the step ended."""
    _depth["steps"] = max(0, _depth["steps"] - 1)


def _wrapped_forward_ran(target: Target, optimizer: Any) -> bool:
    """Whether a wrapped model's DDP forward ran since ``optimizer``'s last step (DDP averaged; per
    optimizer: two may step one model's parts); then its backward hooks go until one is bypassed."""
    forwards = target.forwards
    ran = forwards != target.forwards_at_step.get(id(optimizer), 0)
    target.forwards_at_any_step, target.forwards_at_step[id(optimizer)] = forwards, forwards
    if ran:
        unwatch_backwards(target)
        target.averaged = False
    return ran


def _averaged_closure(closure: Any, target: Target) -> Any:
    """The closure's loss, its gradients averaged and the loss the ranks' mean: every rank's step
    (LBFGS's line search and its stopping rule among it) then decides alike."""
    torch = ledger.torch_module()
    loss = closure()
    if not target.averaged:  # its backward averaged them as it ended (or a clip inside it)
        _average(target)
    target.averaged = False  # nothing is left for later
    if loss is None:
        return None
    value = torch.as_tensor(loss.detach() if isinstance(loss, torch.Tensor) else loss, device=api.device())
    mean = value.to(torch.float64 if value.device.type != "mps" else torch.float32).clone()
    torch.distributed.all_reduce(mean)
    mean /= api.world_size()
    return mean.to(value.dtype) if isinstance(loss, torch.Tensor) else float(mean)


def _targets_of(optimizer: Any) -> list[Target]:
    """The targets ``optimizer``'s steps are for: its own, and those holding a parameter it steps
    (worked out again when targets were added)."""
    registry = ledger.cell_registry()
    cached = registry.step_targets.get(id(optimizer))
    if cached is None or cached[0] is not optimizer or cached[1] != registry.targets_changed:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        found = [
            t
            for t in registry.targets
            if (t.owner is not None and t.owner() is optimizer)
            or (t.owner is None and any(id(p) in held for p in t.params()))
        ]
        cached = registry.step_targets[id(optimizer)] = (optimizer, registry.targets_changed, found)
    targets: list[Target] = cached[2]
    return targets


def wrapped(ddp: Any) -> None:
    """Average ``ddp``'s gradients wherever a step bypassed its forward (called as it is wrapped)."""
    module, group = ddp.module, ddp.process_group
    target = Target(
        "wrapped",
        lambda: list(module.parameters()),
        mine=_bypassed_since_step,
        average=lambda params: average_gradients(params, group, sparse_parameters([module])),
        label=type(module).__name__,
    )
    ledger.cell_registry().wrappers[id(ddp)] = target
    # Watched until a step finds its forward ran (DDP averaged), and again once one finds it bypassed.
    watch_backwards(track(target))


def forward_ran(ddp: Any) -> int:
    """A wrapped model's DDP forward with gradients ran (DDP averages this step's): how many so far."""
    target: Target | None = ledger.cell_registry().wrappers.get(id(ddp))
    if target is None:  # wrapped under an earlier cell's registry: DDP averages, nothing of ours is left
        return 0
    target.forwards += 1
    return target.forwards


def _bypassed_since_step(target: Target) -> bool:
    return target.forwards == target.forwards_at_any_step


def _say_bypassed(target: Target) -> None:
    if not target.said:
        target.said = True
        ledger.cell_registry().notes.append(
            f"the {target.label} model's forward was not called in a training step (its parts "
            "or methods were called instead, e.g. model['head'](x) or model.encode(x)), so DDP did not "
            "average its gradients: nbtrain averaged them as each backward ended, one all-reduce after the "
            "backward, as DDP would have (calling the model itself lets DDP overlap it with the backward)."
        )


def unfrozen(module: Any) -> None:
    """Average ``module``'s gradients once the cell unfreezes it (called as it is left unwrapped: nothing
    in it required grad then, and DDP wraps no such model).

    Its forwards with gradients look for parameters the cell unfroze: the first after the
    unfreezing watches them; while all of it is frozen, a forward with gradients and a step
    each cost one read of each parameter's ``requires_grad``.
    """
    params = list(module.parameters())
    target = track(Target("unfrozen", lambda: params))
    hook = module.register_forward_pre_hook(functools.partial(_watch_when_unfrozen, target))
    ledger.cell_registry().patches.callback(hook.remove)


def _watch_when_unfrozen(target: Target, _module: Any, _inputs: Any) -> None:
    if ledger.torch_module().is_grad_enabled():
        watch_backwards(target)


def sparse_parameters(modules: list[Any]) -> frozenset[int]:
    """The ids of the parameters of ``modules`` whose gradients are sparse (``Embedding(sparse=True)``'s)."""
    nn = ledger.torch_module().nn
    sparse = (nn.Embedding, nn.EmbeddingBag)
    return frozenset(id(m.weight) for root in modules for m in root.modules() if isinstance(m, sparse) and m.sparse)


def average_gradients(params: list[Any], group: Any = None, sparse: frozenset[int] | None = None) -> None:
    """Average the gradients of ``params`` over the ranks of ``group`` (None: all), as DDP would.

    Every rank must call it with the same parameters in the same order: it is a collective.
    ``sparse``: the ids of those whose gradients are sparse (:func:`sparse_parameters`), None
    where that is not known. With none sparse, one all-reduce per device and dtype carries the
    gradients and which of them exist on any rank; otherwise which exist, and which are sparse,
    is agreed on first.
    """
    if sparse is not None and not sparse:
        _average_dense(params, group)
        return
    torch = ledger.torch_module()
    # 0: no gradient on any rank, 1: a dense one, 2: a sparse one (an Embedding's with sparse=True)
    kinds = torch.tensor([_kind(p.grad) for p in params], dtype=torch.int32, device=api.device())
    torch.distributed.all_reduce(kinds, op=torch.distributed.ReduceOp.MAX, group=group)
    chosen = list(zip(params, kinds.tolist(), strict=True))
    _average_dense([p for p, kind in chosen if kind == 1], group)
    for p in (p for p, kind in chosen if kind == 2):
        if p.grad is None:  # this rank's batch did not reach it: no rows
            p.grad = torch.zeros_like(p).to_sparse(1)
        torch.distributed.all_reduce(p.grad, group=group)  # gloo's sparse all-reduce (nccl has none, as for DDP)
        p.grad.div_(api.world_size())


def _kind(grad: Any) -> int:
    return 0 if grad is None else 2 if grad.is_sparse else 1


def _average_dense(params: list[Any], group: Any) -> None:
    """One all-reduce per device and dtype, of these parameters' gradients flattened (zeros where
    missing) and, after them, how many ranks had each one: one that none had stays None."""
    torch = ledger.torch_module()
    # deferred: start-up time (torch)
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    kinds: dict[tuple[Any, Any], list[Any]] = {}
    for p in params:
        kinds.setdefault((p.device, p.dtype), []).append(p)
    for (device, dtype), same in kinds.items():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in same]
        had = torch.tensor([p.grad is not None for p in same], dtype=dtype, device=device)
        flat = _flatten_dense_tensors([*grads, had])
        torch.distributed.all_reduce(flat, group=group)
        counts = flat[-len(same) :].tolist()
        flat.div_(api.world_size())
        for p, averaged, count in zip(same, _unflatten_dense_tensors(flat, [*grads, had]), counts, strict=False):
            if count == 0:
                continue
            if p.grad is None:
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)


_sources: dict[str, Callable[..., Any]] = {}  # "first_step", "unstepped": celloptimizers', for the reads below


def watch_steps(
    first_step: Callable[[Any, Any], None],
    unstepped: Callable[[], list[Any]],
    cell_globals: dict[str, Any],
) -> None:
    """Called as the cell starts, after the patch table's ``made in the cell`` is installed: reads before
    a step (unscaling, clipping) decide an optimizer's first step first
    (:func:`nbtrain.rank.auto.celloptimizers.first_step`); ``cell_globals``' own references to
    torch's clipping functions (``from torch.nn.utils import clip_grad_norm_`` in the kernel) are
    pointed at the averaging ones."""
    _sources.update(first_step=first_step, unstepped=unstepped)
    # deferred: start-up time (torch)
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        averaging = getattr(clip_grad, name)
        own = getattr(averaging, "__wrapped__", averaging)
        cell_globals.update({n: averaging for n, v in list(cell_globals.items()) if v is own})


def averaging_unscale(own_unscale: Any) -> Any:
    """``GradScaler.unscale_`` in an auto-mode cell (the patch table's): rule 2, so every rank finds the
    same infinities."""

    @functools.wraps(own_unscale)
    def unscale_(self: Any, optimizer: Any) -> Any:
        _sources["first_step"](optimizer, sys._getframe(1))  # a first step under the scaler starts here
        before_read(optimizer=optimizer)
        return own_unscale(self, optimizer)

    return unscale_


@functools.cache
def averaging_clip(own: Any) -> Any:
    """``own`` (torch's clip_grad_norm_ or clip_grad_value_) reading averaged gradients: rule 2 (the
    patch table's; one per function, wherever torch names it)."""
    torch = ledger.torch_module()

    @functools.wraps(own)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        for optimizer in _sources["unstepped"]():
            if _holds(optimizer, ids):
                _sources["first_step"](optimizer, sys._getframe(1))  # clipping before the first step
        before_read(params)
        return own(params, *args, **kwargs)

    return clip
