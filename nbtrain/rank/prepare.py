"""``nbtrain.prepare``: make a model, optimizer and data loader ready for the run's strategy.

On a rank, ``prepare`` does what a torchrun script does by hand:

- a ``Module`` moves to the rank's device and is wrapped for the strategy: a
  :class:`~torch.nn.parallel.DistributedDataParallel` (``ddp_*``) that still reads through
  to the model's own attributes and methods, or sharded in place with FSDP2's
  ``fully_shard`` (``fsdp``). A module with no trainable parameters is moved, not wrapped,
  and so is every module of a run with one rank (nothing to average): the model trains as
  it is, its loader keeps its own order, and on a GPU its inputs and batches move there.
- an ``Optimizer`` is bound to the prepared parameters (with FSDP2 the parameters become
  DTensors, so its param_groups are rebuilt in the same order, state included).
- a ``DataLoader`` is rebuilt on a ``DistributedSampler`` that keeps its batch size,
  shuffle, drop_last, collate_fn and workers. Each pass decides, when iteration starts,
  what it is: with gradients enabled it is a training pass (this rank's share, with
  ``set_epoch`` on every training pass); with gradients disabled (``torch.no_grad()``,
  ``torch.inference_mode()``) it is an evaluation pass, and every rank reads the whole
  dataset in the loader's own order, so a metric computed the single-device way is the
  true one on every rank. ``evaluation="shard"`` shards evaluation passes too (faster;
  reduce the metric with :func:`nbtrain.all_reduce`).

Outside a run (in the kernel) every rank-specific step is skipped: a module only moves to
:func:`nbtrain.device`, the rest comes back unchanged, so the same code runs anywhere.

Importing this module does not import torch: ``import nbtrain`` must stay light.

Example:
    >>> import torch, nbtrain
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model, opt = nbtrain.prepare(model, opt)   # outside a run: moved to nbtrain.device()
    >>> nbtrain.prepare(model) is model             # preparing twice changes nothing
    True
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from nbtrain.rank import api

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel as _DDPBase
    from torch.utils.data import DataLoader

    _LoaderBase = DataLoader[Any]
else:
    # torch is imported when the first model or loader is prepared; the mixins below are
    # put in front of its classes then (transparent_ddp_class, _prepared_loader_class).
    _DDPBase = _LoaderBase = object

# What ``prepare`` wraps a model in when the caller did not say: the magic sets it from
# --strategy; nbtrain.launch passes it in the environment.
WRAPPER_VARIABLE = "NBTRAIN_MODEL_WRAPPER"
WRAPPERS = ("ddp", "ddp_find_unused", "ddp_sharded", "fsdp", "fsdp_offload", "dp", "none")
# The second searches every step for unused parameters; the third shards optimizer state.
DDP_WRAPPERS = ("ddp", "ddp_find_unused", "ddp_sharded")
# fsdp_offload keeps the shards (and the optimizer's step) in host memory: FSDP2's CPUOffloadPolicy.
FSDP_WRAPPERS = ("fsdp", "fsdp_offload")
# With one rank there is nothing to average: these train the model as it is (no wrapper,
# no all-reduce, the same gradients). fsdp_offload stays sharded: its point is host memory.
ONE_RANK_UNWRAPPED = (*DDP_WRAPPERS, "fsdp")
DP_DEVICES_VARIABLE = "NBTRAIN_DP_DEVICES"  # dp: DataParallel's device_ids (nbtrain.config sets it)
UNUSED_NAMES_SHOWN = 8

class _Registry:
    """What this rank prepared: original <-> prepared, and FSDP's parameter swaps."""

    def __init__(self) -> None:
        self.wrapper: str | None = None
        self.prepared: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, prepared)
        self.originals: dict[int, tuple[Any, Any]] = {}  # id(prepared) -> (prepared, original)
        self.param_swaps: dict[int, tuple[Any, Any]] = {}  # id(old param) -> (old, new DTensor param)
        self.param_owner: dict[int, Any] = {}  # id(new parameter) -> the sharded root module
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.notes: list[str] = []
        self.loader_names: dict[str, Any] = {}  # auto mode's loaders: kernel name -> prepared loader
        self.first_iterated: list[Any] = []  # prepared loaders, in the order of their first pass
        self.loss_scaling: Any = None  # precision.LossScaling under 16-mixed on CUDA

    def remember(self, original: Any, prepared: Any) -> None:
        self.prepared[id(original)] = (original, prepared)
        self.originals[id(prepared)] = (prepared, original)

    def prepared_for(self, obj: Any) -> Any | None:
        entry = self.prepared.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        entry = self.originals.get(id(obj))
        if entry is not None and entry[0] is obj:
            return obj
        return None


_registry = _Registry()
_lock = threading.Lock()


def configure(wrapper: str | None) -> None:
    """Start a fresh registry for one cell and set the strategy's model wrapper."""
    global _registry
    if wrapper is not None and wrapper not in WRAPPERS:
        raise ValueError(f"unknown model wrapper {wrapper!r}; expected one of {WRAPPERS}")
    _registry = _Registry()
    _registry.wrapper = wrapper


def know_optimizers(objects: Iterable[Any]) -> None:
    """Optimizers to re-bind when a module they train is sharded, even if never prepared."""
    torch = _torch()
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            _registry.optimizers.add(obj)


EVALUATION_CHOICES = ("whole", "shard")
# Set on a loader by ``prepare(loader, evaluation=...)`` where nothing is rebuilt (in the
# kernel): it travels with the loader, so auto mode on the ranks honours it.
EVALUATION_MARK = "_nbtrain_evaluation"


def notes() -> list[str]:
    """Things prepare chose not to do, each one sentence (e.g. a loader it could not shard)."""
    return list(_registry.notes)


def prepare(*objs: Any, evaluation: str | None = None, **wrapper_options: Any) -> Any:
    """Prepare models, optimizers and data loaders for this rank; return them in order.

    Pass everything at once: modules are prepared first, then the optimizers are bound to
    their (possibly new) parameters, then loaders are sharded. One object in, one object
    out; several in, a tuple out. Anything else passes through unchanged, and an object
    already prepared comes back as it is, so calling ``prepare`` twice is harmless.

    A loader's training passes (iterated with gradients enabled) read this rank's share.
    ``evaluation`` says what its passes without gradients read: ``"whole"`` (the default:
    every rank reads the whole dataset, so metrics come out right unchanged) or
    ``"shard"`` (each rank reads its share, as in training: faster, and the metric must be
    reduced across ranks with :func:`nbtrain.all_reduce`). Outside a run (in the kernel)
    the loader comes back unchanged but remembers the choice, so a later
    ``%%distributed`` cell's auto mode honours it.

    ``wrapper_options`` go to the model wrapper: DistributedDataParallel's keyword
    arguments with ``ddp_*``, ``fully_shard``'s with ``fsdp``. DDP gets
    ``find_unused_parameters=False`` (no extra search of the autograd graph every step)
    unless the strategy is ``ddp_find_unused_parameters_true`` or the caller passes
    ``find_unused_parameters=True``; a model whose first backward leaves a trainable
    parameter without a gradient then fails at once with
    :class:`~nbtrain.errors.UnusedParametersError`, naming the parameters and the fix.

    Example, in a ``%%distributed`` cell or a function run by ``nbtrain.launch``::

        model, opt, loader = nbtrain.prepare(model, opt, loader)
        for x, y in loader:                       # this rank's share of the data
            loss = loss_fn(model(x), y)           # model is DDP-wrapped; model.fc still works
            opt.zero_grad(); loss.backward(); opt.step()
    """
    if not objs:
        raise TypeError("prepare() needs something to prepare, e.g. nbtrain.prepare(model, optimizer, loader).")
    _check_evaluation(evaluation)
    torch = _torch()
    from torch.utils.data import DataLoader

    out = list(objs)
    with _lock:
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.nn.Module):
                out[i] = prepare_module(obj, **wrapper_options)
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = prepare_optimizer(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, DataLoader):
                out[i] = prepare_loader(obj, evaluation)
    return out[0] if len(objs) == 1 else tuple(out)


def _check_evaluation(evaluation: str | None) -> None:
    if evaluation is not None and evaluation not in EVALUATION_CHOICES:
        raise ValueError(
            f"prepare(evaluation={evaluation!r}): a loader's passes without gradients read either "
            "'whole' (every rank reads the whole dataset: metrics come out right unchanged; the default) "
            "or 'shard' (each rank reads its share: faster; reduce metrics with nbtrain.all_reduce)."
        )


# -- modules -------------------------------------------------------------------------------


def model_wrapper() -> str:
    """"ddp", "ddp_find_unused", "fsdp" or "none": what a module is wrapped in on this rank."""
    if _registry.wrapper is not None:
        return _registry.wrapper
    requested = os.environ.get(WRAPPER_VARIABLE)
    if requested in WRAPPERS:
        return requested
    return "ddp" if api.world_size() > 1 else "none"


def prepare_module(module: Any, **wrapper_options: Any) -> Any:
    """The module moved to this rank's device and wrapped for the strategy (see prepare)."""
    existing = _registry.prepared_for(module)
    if existing is not None:
        return existing
    if is_wrapped(module):  # the user wrapped it already (torchrun-style code)
        return module
    _move_module(module, api.device())
    wrapper = model_wrapper() if _in_process_group() else "none"
    trainable = any(p.requires_grad for p in module.parameters())
    _apply_precision_and_sync(module, wrapper)  # --sync-batchnorm as asked: over one rank, a plain BatchNorm's cost
    if one_rank():
        wrapper = "none"
        if trainable and api.device().type != "cpu":
            module.register_forward_pre_hook(_inputs_to_device, with_kwargs=True)
    if wrapper in DDP_WRAPPERS and trainable:
        wrapper_options = {"find_unused_parameters": wrapper == "ddp_find_unused", **wrapper_options}
        prepared = _wrap_ddp(module, wrapper_options)
    elif wrapper in FSDP_WRAPPERS and trainable:
        prepared = _shard(module, wrapper_options, offload=wrapper == "fsdp_offload")
    elif wrapper == "dp" and trainable:
        prepared = _wrap_dp(module, wrapper_options)
    else:
        prepared = module
    _registry.remember(module, prepared)
    return prepared


def one_rank() -> bool:
    """True on the only rank of a DDP-family (or fsdp) run: the model trains as it is, unwrapped."""
    return _in_process_group() and api.world_size() == 1 and model_wrapper() in ONE_RANK_UNWRAPPED


def _inputs_to_device(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What DDP did for a one-rank run's model too: inputs made on the CPU move to the rank's GPU.

    A forward pre-hook; inputs already there cost one device comparison each.
    """
    device = api.device()
    if all(getattr(a, "device", device) == device for a in args) and not kwargs:
        return None
    return _to_device(args, device), _to_device(kwargs, device)


def _apply_precision_and_sync(module: Any, wrapper: str) -> None:
    """The launch's --sync-batchnorm and --precision, applied before the model is wrapped."""
    from nbtrain.rank import precision, syncbn

    device = api.device()
    if wrapper != "none" and os.environ.get(syncbn.SYNC_VARIABLE) == "1":
        syncbn.convert(module, device.type)
    chosen = precision.current()
    precision.apply(module, chosen, device)
    if chosen == "16-mixed" and device.type == "cuda" and _registry.loss_scaling is None:
        _registry.loss_scaling = precision.LossScaling("cuda")
        _registry.loss_scaling.install()


def is_wrapped(module: Any) -> bool:
    """True for DDP, DataParallel and FSDP1 wrappers and modules FSDP2 already sharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, (DistributedDataParallel, DataParallel, FSDPModule)):
        return True
    return type(module).__name__ == "FullyShardedDataParallel"


def original_of(obj: Any) -> Any:
    """The object the user had before prepare or a DDP wrapper: a wrapper's ``.module``.

    A prepared DataLoader maps back to the loader it was built from. Anything else is
    returned as is. Safe to call before torch is imported.
    """
    entry = _registry.originals.get(id(obj))
    if entry is not None and entry[0] is obj:
        return entry[1]
    if "torch" not in sys.modules:
        return obj
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    seen = 0
    while isinstance(obj, (DistributedDataParallel, DataParallel)) and seen < 8:
        obj, seen = obj.module, seen + 1
    if type(obj).__name__ == "FullyShardedDataParallel" and hasattr(obj, "module"):
        obj = obj.module
    return obj


def _move_module(module: Any, device: Any) -> None:
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device != device for t in tensors):
        module.to(device)


def _wrap_ddp(module: Any, options: dict[str, Any]) -> Any:
    device = api.device()
    kwargs = dict(options)
    if device.type == "cuda" and "device_ids" not in kwargs:
        kwargs["device_ids"] = [device.index if device.index is not None else _torch().cuda.current_device()]
    return transparent_ddp_class()(module, **kwargs)


def _wrap_dp(module: Any, options: dict[str, Any]) -> Any:
    """DataParallel over the launch's GPUs; this rank's own GPU (the first) holds the model and outputs."""
    kwargs = dict(options)
    if "device_ids" not in kwargs:
        chosen = os.environ.get(DP_DEVICES_VARIABLE, "")
        kwargs["device_ids"] = [int(index) for index in chosen.split(",") if index] or None
    return transparent_dp_class()(module, **kwargs)


class _ReadThrough:
    """A wrapper (DDP, DataParallel) that reads through to the model it wraps.

    ``wrapped.fc``, ``wrapped.num_classes`` and the model's own methods keep working (an
    attribute the wrapper lacks falls back to ``self.module``), the wrapper's own methods
    stay reachable, and ``state_dict``/``load_state_dict`` use the model's keys (no
    ``module.`` prefix), so a state saved in a cell loads into the kernel's model.
    Setting an attribute the model has and the wrapper lacks sets it on the model.
    """

    module: Any

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # a mixin: nn.Module, after it, has one
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if (
            self.__dict__.get("_nbtrain_ready")
            and inner is not None
            and not name.startswith("_")
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and hasattr(inner, name)
        ):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


_transparent_dp: type | None = None


def transparent_dp_class() -> type:
    """A DataParallel subclass that reads through to the wrapped model (see :class:`_ReadThrough`)."""
    global _transparent_dp
    if _transparent_dp is None:
        from torch.nn.parallel import DataParallel

        class TransparentDP(_ReadThrough, DataParallel[Any]):
            def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
                super().__init__(module, *args, **kwargs)
                object.__setattr__(self, "_nbtrain_ready", True)

        TransparentDP.__name__ = "DataParallel"
        TransparentDP.__qualname__ = "DataParallel"
        _transparent_dp = TransparentDP
    return _transparent_dp


_transparent_ddp: type | None = None


class _ReadsThrough(_ReadThrough, _DDPBase):
    """What :func:`transparent_ddp_class` adds to DistributedDataParallel (a mixin put in front of it):
    reading through to the model (:class:`_ReadThrough`) and the check of the first backward."""

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        # Without DDP's own search, the first backward that syncs checks every trainable
        # parameter got a gradient (see _check_first_backward).
        object.__setattr__(self, "_nbtrain_check_unused", not self.find_unused_parameters)
        object.__setattr__(self, "_nbtrain_ready", True)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.__dict__["_nbtrain_check_unused"] and self.require_backward_grad_sync and _torch().is_grad_enabled():
            object.__setattr__(self, "_nbtrain_check_unused", False)
            _check_first_backward(self.module)
        return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]  # DDP's is unannotated


def transparent_ddp_class() -> type:
    """A DistributedDataParallel subclass that reads through to the wrapped model (see :class:`_ReadThrough`).

    DDP's own methods (``no_sync``, ``join``) stay reachable; the first backward that
    syncs checks that every trainable parameter got a gradient.
    """
    global _transparent_ddp
    if _transparent_ddp is None:
        from torch.nn.parallel import DistributedDataParallel

        class TransparentDDP(_ReadsThrough, DistributedDataParallel):
            pass

        TransparentDDP.__name__ = "DistributedDataParallel"
        TransparentDDP.__qualname__ = "DistributedDataParallel"
        _transparent_ddp = TransparentDDP
    return _transparent_ddp


def _check_first_backward(module: Any) -> None:
    """Raise UnusedParametersError at the end of the next backward if it left a trainable parameter out.

    DistributedDataParallel with ``find_unused_parameters=False`` all-reduces a bucket of
    gradients once every parameter in it has one. A parameter the loss does not depend on
    never gets one: its bucket is never averaged (the ranks' weights drift apart) and the
    next forward fails with a message that names parameter indices. Hooks on each parameter
    record which ones the backward reached; the first of them queues a check that the
    autograd engine runs when the backward ends, so the error comes on the first step,
    before the optimizer steps with unaveraged gradients. The hooks go after that one backward.
    """
    from nbtrain.errors import UnusedParametersError

    trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    reached: set[int] = set()
    handles: list[Any] = []

    def check() -> None:
        for handle in handles:
            handle.remove()
        missing = [name for name, p in trainable if id(p) not in reached]
        if missing:
            raise UnusedParametersError(type(module).__name__, missing, len(trainable))

    def seen(param: Any) -> None:
        if not reached:
            _torch().autograd.Variable._execution_engine.queue_callback(check)
        reached.add(id(param))

    handles.extend(p.register_post_accumulate_grad_hook(seen) for _, p in trainable)


def _shard(module: Any, options: dict[str, Any], offload: bool = False) -> Any:
    """Shard ``module`` in place with FSDP2: each block of a ModuleList/Sequential, then the root.

    ``offload`` keeps the shards in host memory (CPUOffloadPolicy): FSDP2 copies a block's
    weights to the device for its forward and backward, and the optimizer steps on the CPU.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device = api.device()
    before = dict(module.named_parameters())
    kwargs = dict(options)
    kwargs.setdefault("mesh", init_device_mesh(device.type, (api.world_size(),)))
    if offload:
        # Pinned host memory makes the copies to a GPU asynchronous; without a GPU torch
        # cannot pin (it refuses), and there is nothing to copy to.
        kwargs.setdefault("offload_policy", CPUOffloadPolicy(pin_memory=device.type == "cuda"))
    for block in _shard_blocks(module):
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    after = dict(module.named_parameters())
    for name, old in before.items():
        new = after.get(name)
        if new is not None and new is not old:
            # Keep the old parameter alive: its id is the key optimizers are matched by.
            _registry.param_swaps[id(old)] = (old, new)
            _registry.param_owner[id(new)] = module
    for optimizer in list(_registry.optimizers):
        _rebind_optimizer(optimizer)
    return module


def _shard_blocks(module: Any) -> list[Any]:
    """Children of ModuleList/Sequential containers that have parameters, if none share any.

    Sharding per block lets FSDP2 gather one block's weights at a time; tied weights
    across blocks cannot be sharded separately, so then only the root is sharded.
    """
    import torch

    blocks: list[Any] = []
    for sub in module.modules():
        if isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential)):
            blocks.extend(child for child in sub.children() if any(True for _ in child.parameters()))
    seen: set[int] = set()
    for block in blocks:
        ids = {id(p) for p in block.parameters()}
        if ids & seen:
            return []
        seen |= ids
    return [b for b in blocks if b is not module]


# -- optimizers ----------------------------------------------------------------------------


def prepare_optimizer(optimizer: Any) -> Any:
    """The optimizer, bound to the prepared parameters; its state follows them.

    Under ``ddp_sharded`` it is a ``ZeroRedundancyOptimizer`` of the same class and
    settings, holding this rank's partition of the state only.
    """
    if model_wrapper() == "ddp_sharded" and _in_process_group() and api.world_size() > 1 and not _is_zero(optimizer):
        return _shard_optimizer_state(optimizer)
    _registry.optimizers.add(optimizer)
    _rebind_optimizer(optimizer)
    _move_optimizer_state(optimizer)
    _registry.remember(optimizer, optimizer)
    return optimizer


def prepared_for(obj: Any) -> Any | None:
    """What ``prepare`` made of ``obj`` on this rank (None if it never saw it)."""
    return _registry.prepared_for(obj)


def _is_zero(optimizer: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _shard_optimizer_state(optimizer: Any) -> Any:
    """A ZeroRedundancyOptimizer over ``optimizer``'s parameters, groups and state."""
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
    _registry.remember(optimizer, sharded)
    return sharded


def _rebind_optimizer(optimizer: Any) -> None:
    swaps = {key: new for key, (old, new) in _registry.param_swaps.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(id(p) in swaps for p in params):
        return
    owner = next((_registry.param_owner[id(swaps[id(p)])] for p in params if id(p) in swaps), None)
    had_state = bool(optimizer.state)
    full = optimizer.state_dict() if had_state else None
    for group in optimizer.param_groups:  # in place: LBFGS._params is the first group's list
        group["params"][:] = [swaps.get(id(p), p) for p in group["params"]]
    optimizer.state.clear()
    if full is not None and owner is not None:
        _load_full_optimizer_state(owner, optimizer, full)


def _load_full_optimizer_state(module: Any, optimizer: Any, full: dict[str, Any]) -> None:
    """Shard a full (index-keyed) optimizer state onto FSDP2 parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in module.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if any(name is None for name in order):
        _registry.notes.append(
            f"the state of {type(optimizer).__name__} was reset: it trains parameters of more than one sharded model."
        )
        return
    by_name: dict[str, Any] = {
        "state": {order[i]: value for i, value in full["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
            for g in full["param_groups"]
        ],
    }
    set_optimizer_state_dict(module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _move_optimizer_state(optimizer: Any) -> None:
    # Optimizer state made in the kernel sits where the parameters were; after the model
    # moved, load_state_dict casts it to each parameter's device.
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state.get(p, {}).values():
                if getattr(value, "device", p.device) != p.device and getattr(value, "dim", lambda: 1)() > 0:
                    optimizer.load_state_dict(optimizer.state_dict())
                    return


# -- data loaders --------------------------------------------------------------------------


def prepare_loader(loader: Any, evaluation: str | None = None) -> Any:
    """The loader rebuilt on a DistributedSampler (this rank's share), or as is if it cannot be.

    ``evaluation`` ("whole" or "shard", see :func:`prepare`) is what its passes without
    gradients read; None keeps the loader's earlier choice ("whole" if none).
    """
    existing = _registry.prepared_for(loader)
    if existing is not None:
        if evaluation is not None and existing is not loader:
            setattr(existing, EVALUATION_MARK, evaluation)
        return existing
    if evaluation is not None:
        setattr(loader, EVALUATION_MARK, evaluation)
    if not _in_process_group() or model_wrapper() == "none":
        return loader
    if one_rank():  # the loader's own order; on a GPU its batches move there
        return loader if api.device().type == "cpu" else _one_rank_loader(loader)
    if _already_distributed(loader):
        return loader
    reason, shuffle = _shardable(loader)
    if reason:
        _registry.notes.append(reason)
        return loader
    prepared = _rebuild_loader(loader, shuffle)
    _registry.remember(loader, prepared)
    return prepared


def evaluation_of(loader: Any) -> str:
    """"whole" or "shard": what ``loader``'s passes without gradients read once prepared."""
    return getattr(loader, EVALUATION_MARK, "whole")


def _shardable(loader: Any) -> tuple[str, bool]:
    """("", shuffle) when the loader can be rebuilt on a DistributedSampler, else (why not, _)."""
    from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

    what = f"a DataLoader over {type(loader.dataset).__name__}"
    if isinstance(loader.dataset, IterableDataset):
        return f"{what} was not sharded: an IterableDataset must split its data by nbtrain.rank() itself.", False
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        name = type(loader.batch_sampler).__name__
        return f"{what} was not sharded: its batch_sampler ({name}) is custom, so every rank reads all of it.", False
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return "", False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return "", True
    name = type(sampler).__name__
    return f"{what} was not sharded: its sampler ({name}) is custom, so every rank reads all of it.", False


def batches_per_rank(loader: Any, world_size: int, wrapper: str, *, evaluation: bool = False) -> int | None:
    """``len(loader)`` as each rank will see it once auto mode prepared it, or None if unsure.

    Called in the kernel, before the run, on the kernel's own loader: it takes the same
    decision as :func:`prepare_loader` (``wrapper`` is the strategy's model wrapper) and
    counts a DistributedSampler's share as torch does (padded, or cut with drop_last), so
    every rank gets the same number. ``evaluation=True`` asks about a pass without
    gradients, which reads the whole loader unless it was prepared with
    ``evaluation="shard"``. Nothing is built that draws from an RNG.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(200, 1)), batch_size=16, shuffle=True)
        >>> len(loader), batches_per_rank(loader, 2, "ddp"), batches_per_rank(loader, 2, "none")
        (13, 7, 13)
        >>> batches_per_rank(loader, 2, "ddp", evaluation=True)  # under torch.no_grad(): all of it
        13
    """
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None  # an iterable dataset's length is only a hint
    try:
        unchanged = len(loader)
        if wrapper == "none" or world_size < 2 or _already_distributed(loader) or _shardable(loader)[0]:
            return unchanged  # the rank iterates its copy of this very loader
        if evaluation and evaluation_of(loader) == "whole":
            return unchanged
        share: DistributedSampler[Any] = DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=0, shuffle=False, drop_last=loader.drop_last
        )
        if loader.batch_size is None:
            return len(share)
        return len(BatchSampler(share, loader.batch_size, loader.drop_last))
    except (TypeError, ValueError, AttributeError):  # no len(), or a loader torch would refuse
        return None


def loader_lengths(objects: Mapping[str, Any], world_size: int, wrapper: str) -> tuple[dict[str, int], dict[str, int]]:
    """Batches per rank of each DataLoader among ``objects``: in passes with gradients, and without.

    The second dict is what an evaluation pass reads (the whole loader, unless it was
    prepared with ``evaluation="shard"``); see :func:`batches_per_rank`.
    """
    training: dict[str, int] = {}
    evaluation: dict[str, int] = {}
    for name, obj in objects.items():
        for lengths, without_grad in ((training, False), (evaluation, True)):
            length = batches_per_rank(obj, world_size, wrapper, evaluation=without_grad)
            if length is not None:
                lengths[name] = length
    return training, evaluation


def _already_distributed(loader: Any) -> bool:
    from torch.utils.data import DistributedSampler

    return isinstance(loader.sampler, DistributedSampler) or isinstance(
        getattr(loader.batch_sampler, "sampler", None), DistributedSampler
    )


_loader_class: type | None = None


class _PassAware(_LoaderBase):
    """A DataLoader on a DistributedSampler that tells training passes from evaluation passes.

    Each ``iter()`` (a ``for`` loop's start) reads the thread's grad mode, one cheap
    call: enabled, a training pass reads this rank's share (``set_epoch`` first, so
    every training pass shuffles anew); disabled, an evaluation pass reads the rank's
    copy of the user's own loader, whole and in its own order, unless the loader
    was prepared with ``evaluation="shard"``. ``len()`` follows the same rule, so
    ``len(loader)`` inside ``torch.no_grad()`` counts the batches that pass reads.
    (A mixin: :func:`_prepared_loader_class` puts it in front of torch's DataLoader.)
    """

    _nbtrain_epoch: int  # training passes so far: the next one's set_epoch
    _nbtrain_whole: Any  # what an evaluation pass reads: the rank's copy of the user's loader
    _nbtrain_passes: dict[str, int]  # passes so far: "train", "whole", "shard"
    _nbtrain_one_rank = False  # every pass reads the user's loader, moved to the device

    # Not DataLoader's iterator type: a pass reads the user's own loader, or moves batches.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        kind = self._nbtrain_pass_kind()
        if not any(self._nbtrain_passes.values()):
            _registry.first_iterated.append(self)  # the summary names loaders in this order
        self._nbtrain_passes[kind] += 1
        batches: Iterator[Any]
        if kind == "whole" or self._nbtrain_one_rank:
            batches = iter(self._nbtrain_whole)
        else:
            if kind == "train":
                sampler: Any = self.sampler  # a DistributedSampler (_rebuild_loader)
                sampler.set_epoch(self._nbtrain_epoch)
                self._nbtrain_epoch += 1
            batches = super().__iter__()
        device = api.device()
        if device.type == "cpu":
            return batches
        return (_to_device(batch, device) for batch in batches)

    def __len__(self) -> int:
        if self._nbtrain_one_rank or self._nbtrain_pass_kind() == "whole":
            return len(self._nbtrain_whole)
        return super().__len__()

    def _nbtrain_pass_kind(self) -> str:
        if _torch().is_grad_enabled():
            return "train"
        return "shard" if evaluation_of(self) == "shard" else "whole"


def _prepared_loader_class() -> type:
    """:class:`_PassAware` on torch's DataLoader, named ``DataLoader`` (built once: it imports torch)."""
    global _loader_class
    if _loader_class is None:
        from torch.utils.data import DataLoader

        class PreparedDataLoader(_PassAware, DataLoader[Any]):
            pass

        PreparedDataLoader.__name__ = PreparedDataLoader.__qualname__ = "DataLoader"
        _loader_class = PreparedDataLoader
    return _loader_class


def _rebuild_loader(loader: Any, shuffle: bool) -> Any:
    import torch
    from torch.utils.data import DistributedSampler

    if loader.generator is not None:
        seed = int(loader.generator.initial_seed())
    else:  # every rank draws the same seed: they start from the kernel's RNG state
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=api.world_size(),
        rank=api.rank(),
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
    )
    kwargs = {
        "batch_size": loader.batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
        "in_order": getattr(loader, "in_order", True),
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    cls = _prepared_loader_class()
    accepted = inspect.signature(cls).parameters
    new = cls(loader.dataset, **{k: v for k, v in kwargs.items() if k in accepted})
    new._nbtrain_epoch = 0
    new._nbtrain_whole = loader
    new._nbtrain_passes = {"train": 0, "whole": 0, "shard": 0}
    setattr(new, EVALUATION_MARK, evaluation_of(loader))
    return new


def _one_rank_loader(loader: Any) -> Any:
    """The only rank's loader on a GPU: the user's own loader (its sampler, order and RNG draws)
    whose batches move to the rank's device, as a sharded loader's do."""
    cls = _prepared_loader_class()
    new = cls(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last)
    new._nbtrain_one_rank = True
    new._nbtrain_epoch = 0
    new._nbtrain_whole = loader
    new._nbtrain_passes = {"train": 0, "whole": 0, "shard": 0}
    setattr(new, EVALUATION_MARK, evaluation_of(loader))
    _registry.remember(loader, new)
    return new


def loader_report() -> list[tuple[str, str]]:
    """(name, what its passes read) for each loader auto mode prepared, for the run's summary.

    Example: ``("test_loader", "evaluated whole on every rank (iterated without gradients)")``.
    """
    order = {id(loader): i for i, loader in enumerate(_registry.first_iterated)}
    named = sorted(_registry.loader_names.items(), key=lambda item: order.get(id(item[1]), len(order)))
    return [(name, describe_passes(loader)) for name, loader in named]


def describe_passes(loader: Any) -> str:
    """What a prepared loader's passes so far read, in words."""
    if loader._nbtrain_one_rank:
        return f"its own order, batches moved to {api.device()} (one rank: not sharded)"
    share = f"DistributedSampler, {loader.sampler.num_samples} of {len(loader.dataset)} per rank"
    passes = loader._nbtrain_passes
    parts = []
    if passes["train"]:
        also = " for training" if passes["whole"] or passes["shard"] else ""
        parts.append(f"sharded{also} ({share}{_effective_batch(loader)})")
    if passes["whole"]:
        parts.append("evaluated whole on every rank (iterated without gradients)")
    if passes["shard"]:
        parts.append(f"evaluated sharded ({share}; evaluation='shard')")
    if not parts:
        return f"not iterated (prepared: {share} when iterated with gradients)"
    return " and ".join(parts)




def _effective_batch(loader: Any) -> str:
    """"; effective batch 64 = 32 per rank x 2 ranks": what the learning rate usually follows."""
    batch = loader.batch_size
    world = api.world_size()
    if not batch or world < 2:
        return ""
    return f"; effective batch {batch * world} = {batch} per rank x {world} ranks"


def _to_device(batch: Any, device: Any) -> Any:
    if hasattr(batch, "to") and hasattr(batch, "device"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return type(batch)((k, _to_device(v, device)) for k, v in batch.items())
    return batch


# -- auto mode -----------------------------------------------------------------------------


def auto_prepare(namespace: dict[str, Any], names: Iterable[str]) -> list[tuple[str, str]]:
    """Prepare the Modules, Optimizers and DataLoaders among ``namespace[names]`` in place.

    Each name is rebound to its prepared object (so the cell, and every notebook function
    it calls, uses the wrapped model and the sharded loader). Only root modules are
    wrapped: a module inside another one the cell uses is moved with it. Returns
    (name, what was done) for the run's summary.
    """
    torch = _torch()
    from torch.utils.data import DataLoader

    names = sorted(n for n in names if n in namespace)
    modules = {id(namespace[n]): namespace[n] for n in names if isinstance(namespace[n], torch.nn.Module)}
    inside: set[int] = set()
    for module in modules.values():
        inside.update(id(sub) for sub in module.modules() if sub is not module)
    done: list[tuple[str, str]] = []
    know_optimizers(namespace[n] for n in names)
    for kind in (torch.nn.Module, torch.optim.Optimizer, DataLoader):
        for name in names:
            obj = namespace[name]
            if not isinstance(obj, kind) or (kind is torch.nn.Module and id(obj) in inside):
                continue
            prepared = prepare(obj)
            namespace[name] = prepared
            done.append((name, _describe(obj, prepared)))
            if kind is DataLoader and prepared is not obj:
                _registry.loader_names[name] = prepared
    return done


def auto_prepare_held(
    namespace: Mapping[str, Any], held: Iterable[Any]
) -> tuple[list[tuple[str, str]], list[tuple[Any, Any, Any]]]:
    """Prepare the torch objects held inside the cell's globals (``trainer.model``), in their places.

    ``held`` is :func:`nbtrain.reach.find_held`'s list, made in the kernel. Each prepared
    object replaces the original where it is held, so the cell's ``trainer.run()`` trains
    the wrapped model. Returns (label, what was done) for the summary, a place that could
    not take the prepared object saying ``not prepared (why)``, and (held, original,
    prepared) for each place changed: the cell puts the originals back after it ran.
    """
    from nbtrain import reach

    torch = _torch()
    found = list(resolved(namespace, held))
    roots = [v for v in namespace.values() if isinstance(v, torch.nn.Module)]
    roots += [obj for h, obj in found if h.kind == "module"]
    inside = {id(sub) for root in roots for sub in root.modules() if sub is not root}
    done: list[tuple[str, str]] = []
    placed: list[tuple[Any, Any, Any]] = []
    for kind in ("module", "optimizer", "loader"):
        for h, obj in found:
            if h.kind != kind or (kind == "module" and id(obj) in inside):
                continue
            if h.fixed and kind == "module":
                done.append((h.label, _not_prepared(h.fixed, kind)))
                continue
            prepared = prepare(obj)
            if prepared is not obj:
                try:
                    reach.put(namespace, h, prepared)
                except Exception as error:  # noqa: BLE001 - whatever the holder raises, the summary says it
                    done.append((h.label, _not_prepared(h.fixed or f"its holder refused it: {error}", kind)))
                    continue
                placed.append((h, obj, prepared))
            done.append((h.label, _describe(obj, prepared)))
            if kind == "loader" and prepared is not obj:
                _registry.loader_names[h.label] = prepared
    return done, placed


def resolved(namespace: Mapping[str, Any], held: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """(held, this rank's object) for each place that still holds an object of its kind."""
    from nbtrain import reach

    for h in held:
        try:
            obj = reach.resolve(namespace, h)
        except (LookupError, AttributeError, TypeError):
            continue
        if reach.torch_kind(obj) == h.kind:
            yield h, obj


def _not_prepared(why: str, kind: str) -> str:
    consequence = {
        "module": "each rank trains its own copy, gradients not averaged",
        "loader": "each rank reads all of it",
    }.get(kind, "it stays as it was")
    fix = "hold it in a list or attribute, or call nbtrain.prepare on it in the cell"
    return f"not prepared ({why}; {consequence}): {fix}"


def put_back(namespace: Mapping[str, Any], placed: Iterable[tuple[Any, Any, Any]]) -> None:
    """Put the originals back where :func:`auto_prepare_held` put prepared objects (unless the cell replaced them)."""
    from nbtrain import reach

    for h, original, prepared in placed:
        with contextlib.suppress(Exception):
            if reach.resolve(namespace, h) is prepared:
                reach.put(namespace, h, original)


def _describe(original: Any, prepared: Any) -> str:
    from torch.utils.data import DataLoader

    if prepared is original:
        if type(original).__name__.startswith("FSDP"):
            return "sharded with fully_shard"
        trains = isinstance(original, _torch().nn.Module) and any(p.requires_grad for p in original.parameters())
        if trains and one_rank():
            return f"on {api.device()}, not wrapped (one rank)"
        return "moved" if not _is_optimizer(original) else "bound"
    if isinstance(prepared, DataLoader):
        return "DistributedSampler"
    return type(prepared).__name__


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, _torch().optim.Optimizer)


# -- logging the loss --------------------------------------------------------------------


@contextlib.contextmanager
def loss_logging() -> Iterator[None]:
    """While active, ``scalar.backward()`` logs the scalar as ``loss`` unless the user logs.

    The live view then has a loss curve with no code change. It stops as soon as the cell
    calls ``nbtrain.log`` itself, and does nothing outside a run.
    """
    context = api.current_context()
    if context is None:
        yield
        return
    torch = _torch()
    original = torch.Tensor.backward
    busy = threading.local()

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A tensor subclass re-enters through __torch_function__: log once per call.
        gradient = args[0] if args else kwargs.get("gradient")
        if not getattr(busy, "on", False) and not context.logged and gradient is None and self.numel() == 1:
            was = context.logged
            api.log(loss=getattr(self, "_nbtrain_unscaled", self))  # the true loss under 16-mixed
            context.logged = was  # our own entry does not count as the user's log()
        busy.on = True
        try:
            return original(self, *args, **kwargs)
        finally:
            busy.on = False

    backward.__doc__ = original.__doc__
    backward.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps would set it
    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original


# -- helpers -------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def _in_process_group() -> bool:
    if api.current_context() is None:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
