"""Gradients DDP did not average: a wrapped model whose forward the training step never called.

DDP averages gradients in the backward of its own forward, ``model(x)``. A loop that calls
the model's parts or methods instead (``model["head"](x)``, ``model.encode_image(x)``,
which the read-through wrapper lets through to the model) makes gradients DDP never sees:
each rank would step with its own, and the ranks' weights would drift apart without a
word. So a wrapped model whose forward did not run since the last optimizer step gets its
gradients averaged here as each backward writing them ends, as DDP's own backward would
(:mod:`~nbtrain.rank.auto.backwardend`; under gradient accumulation each micro-batch's, so a
cell raising between a backward and its step holds the whole batch's gradients): one
all-reduce saying which parameters have a gradient on any rank (and which a sparse one),
then one of the dense gradients (flat, per device and dtype) and one per sparse gradient
(an ``Embedding(sparse=True)``'s, as DDP reduces them); a model with no sparse gradient needs
only the dense all-reduce, which carries which gradients exist too. The summary says so, once.
Before each (outermost) optimizer step, such a model that the step trains gets what no
backward wrote averaged. A model's backwards are watched (a hook per parameter) until a
step finds its forward ran (then DDP averages, and the hooks go), and again once a step
finds it bypassed.
Gradients are averaged before anything of the cell's reads them: where clipping
(``clip_grad_norm_``, ``clip_grad_value_``) or a GradScaler's ``unscale_`` comes before the
step (:func:`average_before_read`), there, and the step adds nothing; one process clips the
whole batch's gradients, not a rank's share. (Code reading ``.grad`` itself is not watched:
every read of every gradient, torch's own included, would pay for it.) A model auto mode left
unwrapped because nothing in it was trainable (a frozen backbone) is averaged the same way
once the cell unfreezes it (:func:`average_when_unfrozen`), as each backward ends from its first
forward with gradients after the unfreezing.

A forward with gradients enabled counts (under ``no_sync`` too: DDP's own rule then holds).
Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.auto import backwardend, ledger, stephooks

_state = {"depth": 0}  # an optimizer's step inside another's (ZeroRedundancyOptimizer's) is left alone


def average_when_bypassed(ddp: Any) -> None:
    """Average ``ddp``'s gradients wherever a step bypassed its forward (called as it is wrapped)."""
    object.__setattr__(ddp, "_nbtrain_forwards", 0)
    object.__setattr__(ddp, "_nbtrain_forwards_at_step", {})  # id(optimizer) -> forwards at its last step
    object.__setattr__(ddp, "_nbtrain_forwards_at_any_step", 0)  # forwards at the last step of any optimizer
    object.__setattr__(ddp, "_nbtrain_early", False)  # averaged since a backward wrote them (as it ended, or read)
    stack = ledger.cell_registry().patches
    at_end = backwardend.averager(functools.partial(_ddp_at_backward_end, weakref.ref(ddp)), stack)
    object.__setattr__(ddp, "_nbtrain_at_end", at_end)
    # Watched until a step finds its forward ran (DDP averaged), and again once one finds it bypassed.
    backwardend.watch_backwards(ddp.module.parameters(), at_end)
    ledger.cell_registry().ddp_models.append(ddp)
    stephooks.for_prepared_models()  # average_bypassed before each step


def average_bypassed(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """The step hook's (:mod:`~nbtrain.rank.auto.stephooks`): average a wrapped model's gradients its forward did
    not."""
    _state["depth"] += 1
    registry = ledger.cell_registry()
    if _state["depth"] > 1:  # a step inside another's (ZeroRedundancyOptimizer)
        return
    if registry.frozen_models:
        _average_unfrozen(_frozen_of(optimizer, registry), early_ones=_early_frozen)
    if not registry.ddp_models:
        return
    for ddp in _models_of(optimizer, registry):
        state = ddp.__dict__
        forwards, early = state["_nbtrain_forwards"], state["_nbtrain_early"]
        at_step = state["_nbtrain_forwards_at_step"]
        state["_nbtrain_forwards_at_any_step"], state["_nbtrain_early"] = forwards, False
        if forwards != at_step.get(id(optimizer), 0):  # per optimizer: two may step one model's parts
            at_step[id(optimizer)] = forwards
            if state["_nbtrain_at_end"].watched:  # DDP's forward averages it: no hook on its backwards
                backwardend.unwatch_backwards(state["_nbtrain_at_end"])
            continue
        if not early:  # clipping or unscaling averaged them already: this step adds nothing
            _average(ddp)
        _say_bypassed(ddp, registry)


def _ddp_at_backward_end(reference: weakref.ref[Any]) -> None:
    """A backward wrote into a bypassed wrapper's gradients: average them as it ends, unless its forward
    ran since the last step (DDP averaged them)."""
    ddp = reference()
    if ddp is not None and ddp.__dict__["_nbtrain_forwards"] == ddp.__dict__["_nbtrain_forwards_at_any_step"]:
        _average(ddp)
        ddp.__dict__["_nbtrain_early"] = True


def average_before_read(params: list[Any] | None = None, optimizer: Any = None) -> None:
    """Average a bypassed model's gradients before the cell reads them, as DDP's would be by then.

    Called as ``clip_grad_norm_``/``clip_grad_value_`` reads ``params``' gradients and as a
    GradScaler unscales ``optimizer``'s (:mod:`~nbtrain.rank.auto.keptmodels`' patches): a loop that
    calls the model through what else holds it (``held["net"](x)``, ``ns.model(x)``) bypasses
    DDP, and one process clips the gradients of the whole batch, not a rank's share. A model
    is averaged here when no forward of its wrapper ran since its last step (the step then
    adds nothing); one DDP's forward averaged costs one check.
    """
    registry = ledger.cell_registry()
    if registry.frozen_models:
        _average_unfrozen(_frozen_of(optimizer, registry, params), early_ones=None)
    for ddp in registry.ddp_models:  # a loop, no call per wrapper: it runs at every clip
        state = ddp.__dict__
        if not state["_nbtrain_early"] and state["_nbtrain_forwards"] == state["_nbtrain_forwards_at_any_step"]:
            break
    else:
        return
    pending = [d for d in registry.ddp_models if _pending(d.__dict__)]
    if optimizer is not None:
        chosen = [d for d in _models_of(optimizer, registry) if any(d is p for p in pending)]
    else:
        ids = {id(p) for p in params or ()}
        chosen = [d for d in pending if any(id(p) in ids for p in d.module.parameters())]
    for ddp in chosen:
        _average(ddp)
        ddp.__dict__["_nbtrain_early"] = True
        _say_bypassed(ddp, registry)


def average_when_unfrozen(module: Any) -> None:
    """Average ``module``'s gradients at each step once the cell unfreezes it (called as it is left
    unwrapped: nothing in it required grad then, and DDP wraps no such model).

    A fine-tuning cell that unfreezes a backbone part-way trains it as one process does: its
    parameters that require grad then get their gradients averaged as each backward writing
    them ends (its forwards with gradients look for them: the first after the unfreezing
    watches them), else before each step of an optimizer holding them (or before clipping or
    unscaling reads them), one all-reduce; while all of it is frozen, a forward with gradients
    and a step each cost one read of each parameter's ``requires_grad``.
    """
    registry = ledger.cell_registry()
    registry.frozen_models.append(module)
    stephooks.for_prepared_models()
    watching = module.register_forward_pre_hook(functools.partial(_watch_when_unfrozen, list(module.parameters())))
    registry.patches.callback(watching.remove)


def _watch_when_unfrozen(params: list[Any], _module: Any, _inputs: Any) -> None:
    """A frozen module's forward: those of its parameters the cell unfroze are averaged as backwards end."""
    if params and ledger.torch_module().is_grad_enabled():
        trainable = list(itertools.compress(params, map(_requires_grad, params)))
        if trainable:
            _watch_unfrozen(params, trainable)


_early_frozen: set[int] = set()  # ids of parameters averaged since their step, as clipping or unscaling read them


def _frozen_of(optimizer: Any, registry: Any, params: list[Any] | None = None) -> list[list[Any]]:
    """The parameters of each module left unwrapped as frozen that ``optimizer`` holds any of (worked out
    once), or, with no optimizer, that ``params`` (what clipping reads) hold any of."""
    if optimizer is None:
        ids = {id(p) for p in params or ()}
        modules = [list(m.parameters()) for m in registry.frozen_models]
        return [ps for ps in modules if any(id(p) in ids for p in ps)]
    cached = registry.step_frozen.get(id(optimizer))
    if cached is None or cached[0] is not optimizer:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        modules = [list(m.parameters()) for m in registry.frozen_models]
        chosen = [ps for ps in modules if any(id(p) in held for p in ps)]
        cached = registry.step_frozen[id(optimizer)] = (optimizer, chosen)
    found: list[list[Any]] = cached[1]
    return found


def _average_unfrozen(modules: list[list[Any]], early_ones: set[int] | None) -> None:
    """Average the gradients of the parameters of ``modules`` that require grad now (none: nothing, no
    collective), unless they are averaged already (as a backward ended, or a read). At a step
    (``early_ones``: those averaged since) the marks are cleared; before a read, they are set."""
    for params in modules:
        trainable = list(itertools.compress(params, map(_requires_grad, params)))
        if not trainable:
            continue
        if id(trainable[0]) in _early_frozen:
            if early_ones is not None:
                early_ones.difference_update(id(p) for p in trainable)
            continue
        if early_ones is None:
            _early_frozen.update(id(p) for p in trainable)
        average_gradients(trainable)
        _watch_unfrozen(params, trainable)


# id of a module's first parameter -> (the cell's registry, that parameter, what averages the module as backwards
# end for that cell). Keyed by id: a dictionary keyed by the tensor itself would compare tensors with ==.
_unfrozen_averagers: dict[int, tuple[Any, Any, backwardend.Averager]] = {}


def _watch_unfrozen(params: list[Any], trainable: list[Any]) -> None:
    """Average an unfrozen module's gradients as each backward writing them ends, from now on."""
    registry = ledger.cell_registry()
    registered, first, at_end = _unfrozen_averagers.get(id(params[0]), (None, None, None))
    if registered is not registry or first is not params[0] or at_end is None:
        at_end = backwardend.averager(functools.partial(_unfrozen_at_backward_end, params), registry.patches)
        _unfrozen_averagers[id(params[0])] = (registry, params[0], at_end)
        registry.patches.callback(_unfrozen_averagers.pop, id(params[0]), None)
    backwardend.watch_backwards(trainable, at_end)


def _unfrozen_at_backward_end(params: list[Any]) -> None:
    trainable = list(itertools.compress(params, map(_requires_grad, params)))
    if trainable:
        average_gradients(trainable)
        _early_frozen.update(id(p) for p in trainable)


_requires_grad = operator.attrgetter("requires_grad")


def _pending(state: dict[str, Any]) -> bool:
    """Whether a wrapper's gradients since its last step bypassed its forward and are not averaged yet."""
    return not state["_nbtrain_early"] and state["_nbtrain_forwards"] == state["_nbtrain_forwards_at_any_step"]


def _say_bypassed(ddp: Any, registry: Any) -> None:
    if id(ddp) not in registry.bypassed:
        registry.bypassed.add(id(ddp))
        registry.notes.append(
            f"the {type(ddp.module).__name__} model's forward was not called in a training step (its parts "
            "or methods were called instead, e.g. model['head'](x) or model.encode(x)), so DDP did not "
            "average its gradients: nbtrain averaged them as each backward ended, one all-reduce after the "
            "backward, as DDP would have (calling the model itself lets DDP overlap it with the backward)."
        )


def leave_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """The step hook's: the step ended."""
    _state["depth"] = max(0, _state["depth"] - 1)


def _models_of(optimizer: Any, registry: Any) -> list[Any]:
    """The wrapped models whose parameters ``optimizer`` steps (worked out once per optimizer)."""
    cached = registry.step_models.get(id(optimizer))
    if cached is None or cached[0] is not optimizer:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        models = [d for d in registry.ddp_models if any(id(p) in held for p in d.module.parameters())]
        cached = registry.step_models[id(optimizer)] = (optimizer, models)
    found: list[Any] = cached[1]
    return found


def _average(ddp: Any) -> None:
    """Average the gradients of ``ddp``'s trainable parameters over its process group, as DDP would."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    average_gradients(params, ddp.process_group, sparse_parameters([ddp.module]))
    backwardend.watch_backwards(params, ddp.__dict__["_nbtrain_at_end"])  # from now on


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
