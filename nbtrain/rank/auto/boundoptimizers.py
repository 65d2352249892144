"""Optimizers bound to the prepared parameters, their state following them.

With FSDP2 the parameters become DTensors, so an optimizer's param_groups are rebuilt in
the same order, state included; under ``ddp_sharded`` it becomes a
``ZeroRedundancyOptimizer`` holding this rank's part of the state. See :func:`nbtrain.prepare`.

Example (outside a run an optimizer comes back as it is):
    >>> import torch
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    >>> prepare_optimizer(opt) is opt
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.auto import ledger


def know_optimizers(objects: Iterable[Any]) -> None:
    """Optimizers to re-bind when a module they train is sharded, even if never prepared."""
    torch = ledger.torch_module()
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            ledger.cell_registry().optimizers.add(obj)


def prepare_optimizer(optimizer: Any) -> Any:
    """The optimizer, bound to the prepared parameters; its state follows them.

    Under ``ddp_sharded`` it is a ``ZeroRedundancyOptimizer`` of the same class and
    settings, holding this rank's partition of the state only.
    """
    sharded = ledger.model_wrapper() == "ddp_sharded" and ledger.in_process_group()
    if sharded and api.world_size() > 1 and not _is_zero(optimizer):
        return _shard_optimizer_state(optimizer)
    ledger.cell_registry().optimizers.add(optimizer)
    rebind_optimizer(optimizer)
    _move_optimizer_state(optimizer)
    ledger.cell_registry().remember(optimizer, optimizer)
    return optimizer


def _is_zero(optimizer: Any) -> bool:
    # deferred: start-up time (torch)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _shard_optimizer_state(optimizer: Any) -> Any:
    """A ZeroRedundancyOptimizer over ``optimizer``'s parameters, groups and state."""
    # deferred: start-up time (torch)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = optimizer.param_groups
    # Only the optimizer's own settings go to its constructor; what others keep in a group (an LR
    # scheduler's initial_lr) is copied in after.
    defaults = {k: v for k, v in groups[0].items() if k != "params" and k in optimizer.defaults}
    sharded = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=type(optimizer), **defaults)
    for group in groups[1:]:
        sharded.add_param_group(dict(group))
    # The very group dicts of the optimizer the cell's LR scheduler holds: its changes reach every
    # shard (ZeroRedundancyOptimizer copies them into its local optimizer at each step).
    sharded.param_groups = groups
    if optimizer.state:  # state made in the kernel (a second cell): every rank keeps its part
        sharded.load_state_dict(optimizer.state_dict())
    ledger.cell_registry().remember(optimizer, sharded)
    return sharded


def rebind_optimizer(optimizer: Any) -> None:
    """Point ``optimizer`` at the parameters FSDP2 swapped in, its state resharded onto them."""
    swaps = {key: new for key, (old, new) in ledger.cell_registry().param_swaps.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(id(p) in swaps for p in params):
        return
    owner = next((ledger.cell_registry().param_owner[id(swaps[id(p)])] for p in params if id(p) in swaps), None)
    had_state = bool(optimizer.state)
    full = optimizer.state_dict() if had_state else None
    for group in optimizer.param_groups:  # in place: LBFGS._params is the first group's list
        group["params"][:] = [swaps.get(id(p), p) for p in group["params"]]
    optimizer.state.clear()
    if full is not None and owner is not None:
        _load_full_optimizer_state(owner, optimizer, full)


def _load_full_optimizer_state(module: Any, optimizer: Any, full: dict[str, Any]) -> None:
    """Shard a full (index-keyed) optimizer state onto FSDP2 parameters."""
    # deferred: start-up time (torch)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in module.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if any(name is None for name in order):
        ledger.cell_registry().notes.append(
            f"the state of {type(optimizer).__name__} was reset: it trains parameters of more than one sharded model."
        )
        return
    by_name = rekeyed(full, order.__getitem__)
    set_optimizer_state_dict(module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def rekeyed(state: Any, key: Any) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with each parameter's key (an index, a name) made ``key(old)``.

    >>> rekeyed({"state": {0: "m"}, "param_groups": [{"lr": 0.1, "params": [0]}]}, ["weight"].__getitem__)
    {'state': {'weight': 'm'}, 'param_groups': [{'lr': 0.1, 'params': ['weight']}]}
    """
    return {
        "state": {key(old): value for old, value in state["state"].items()},
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [key(old) for old in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def _move_optimizer_state(optimizer: Any) -> None:
    # Optimizer state made in the kernel sits where the parameters were; after the model
    # moved, load_state_dict casts it to each parameter's device.
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state.get(p, {}).values():
                if getattr(value, "device", p.device) != p.device and getattr(value, "dim", lambda: 1)() > 0:
                    optimizer.load_state_dict(optimizer.state_dict())
                    return
