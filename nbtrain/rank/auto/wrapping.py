"""Modules made ready for the strategy: moved to the rank's device and wrapped or sharded.

DDP (``ddp_*``) and DataParallel (``dp``) wrappers that read through to the model's own
attributes and methods, FSDP2's ``fully_shard`` in place (``fsdp``, ``fsdp_offload``), the
check that DDP's first backward reached every trainable parameter, DDP following the
parameters that require grad when a cell freezes or unfreezes some after the wrap, and the
launch's ``--precision`` and ``--sync-batchnorm`` applied before wrapping. See :func:`nbtrain.prepare`.

Example (outside a run a module is only moved to ``nbtrain.device()``):
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> prepare_module(model) is model, is_wrapped(model), original_of(model) is model
    (True, False, True)
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import operator
import sys
from typing import TYPE_CHECKING, Any

from nbtrain.errors import UnusedParametersError
from nbtrain.rank import api
from nbtrain.rank.auto import averaging, boundoptimizers, ledger, samedata
from nbtrain.rank.machinery import settings

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel as _DDPBase
else:
    # torch is imported when the first model is prepared; the mixin below is put in front
    # of its class then (transparent_ddp_class).
    _DDPBase = object


def prepare_module(module: Any, **wrapper_options: Any) -> Any:
    """The module moved to this rank's device and wrapped for the strategy (see prepare)."""
    existing = ledger.cell_registry().prepared_for(module)
    if existing is not None:
        return existing
    wrapper = ledger.model_wrapper() if ledger.in_process_group() else "none"
    if _notebooks_data_parallel(module, wrapper):
        return _data_parallel_set_aside(module, wrapper_options)
    if is_wrapped(module):  # the user wrapped it already (torchrun-style code)
        return module
    _move_module(module, api.device())
    trainable = trains(module)
    _apply_precision_and_sync(module, wrapper)  # --sync-batchnorm as asked: over one rank, a plain BatchNorm's cost
    if ledger.one_rank():
        if trainable and wrapper in ledger.DDP_WRAPPERS:
            module.__class__ = one_rank_class(type(module), plain_module=_has_own_module(module))
        wrapper = "none"
        if trainable and api.device().type != "cpu":
            hook = functools.partial(_inputs_to_device, api.device())  # the rank's device, made once
            module.register_forward_pre_hook(hook, with_kwargs=True)
    if wrapper in ledger.DDP_WRAPPERS and trainable:
        wrapper_options = {"find_unused_parameters": wrapper == "ddp_find_unused", **wrapper_options}
        prepared = _wrap_ddp(module, wrapper_options)
    elif wrapper in ledger.FSDP_WRAPPERS and trainable:
        prepared = _shard(module, wrapper_options, offload=wrapper == "fsdp_offload")
    elif wrapper == "dp" and trainable:
        prepared = _wrap_dp(module, wrapper_options)
    else:
        prepared = module
        if wrapper in ledger.DDP_WRAPPERS and _all_frozen(module):  # the cell may unfreeze it part-way
            averaging.unfrozen(module)
    ledger.cell_registry().remember(module, prepared)
    return prepared


def _notebooks_data_parallel(module: Any, wrapper: str) -> bool:
    """A DataParallel the notebook made, on a rank whose strategy runs one process per device."""
    # deferred: start-up time (torch)
    from torch.nn.parallel import DataParallel

    return (
        isinstance(module, DataParallel)
        and "_nbtrain_ready" not in vars(module)
        and wrapper in (*ledger.DDP_WRAPPERS, *ledger.FSDP_WRAPPERS)
    )


def _data_parallel_set_aside(dp: Any, wrapper_options: dict[str, Any]) -> Any:
    """What stands for the notebook's ``nn.DataParallel(model)`` on a rank (see :func:`prepare_module`).

    Code written for several GPUs in one process wraps its model so; on a rank, which has
    one device, DataParallel would split each batch over GPUs other ranks use, and train
    one copy per rank unaveraged. Its model is prepared instead: under DDP the rank uses
    the DDP wrapper, which keeps the DataParallel's state-dict keys (``module.`` first) and
    pickles as it; on one rank or under fsdp the DataParallel stays, driving the rank's
    device alone. Either way the DataParallel, holding the trained model, goes back.
    """
    prepared = prepare_module(dp.module, **wrapper_options)
    registry = ledger.cell_registry()
    if prepared is dp.module:  # one rank, or sharded in place
        _drive_one_device(dp, api.device())
        registry.remember(dp, dp)
        return dp
    object.__setattr__(prepared, "_nbtrain_stands_for", dp)  # not a submodule: DDP is built
    registry.remember(dp, prepared)
    return prepared


def _drive_one_device(dp: Any, device: Any) -> None:
    """``dp`` runs its model on this rank's device alone: no scatter over others' GPUs, no copies."""
    if device.type != "cuda":
        dp.device_ids = []  # DataParallel then calls its module as it is
        return
    index = device.index if device.index is not None else ledger.torch_module().cuda.current_device()
    dp.device_ids, dp.output_device, dp.src_device_obj = [index], index, device


def trains(module: Any) -> bool:
    """Whether gradients train ``module``: it has a trainable parameter and is not an averaged copy.

    torch's ``AveragedModel`` (EMA, SWA) holds a copy whose parameters ``update_parameters``
    averages from the model; no optimizer steps them, so there is nothing to all-reduce.
    """
    swa_utils = sys.modules.get("torch.optim.swa_utils")
    if swa_utils is not None and isinstance(module, swa_utils.AveragedModel):
        return False
    return any(p.requires_grad for p in module.parameters())


def _all_frozen(module: Any) -> bool:
    """A model with parameters, none trainable now (a frozen backbone), that is no averaged copy."""
    swa_utils = sys.modules.get("torch.optim.swa_utils")
    averaged = swa_utils is not None and isinstance(module, swa_utils.AveragedModel)
    return not averaged and any(True for _ in module.parameters()) and not trains(module)


_one_rank_classes: dict[tuple[type, bool], type] = {}


def one_rank_class(cls: type, *, plain_module: bool = False) -> type:
    """``cls`` plus what code written for a DDP-wrapped model calls on it: ``no_sync()`` and ``module``.

    A one-rank run trains the model unwrapped, yet the same cell runs on two ranks, where
    the model is DDP's: ``with model.no_sync():`` (gradient accumulation) and
    ``model.module.state_dict()`` must work on one rank too. Here ``no_sync`` has nothing to
    skip and ``module`` is the model itself (unless the model has an attribute of that name:
    ``plain_module``). The class keeps ``cls``'s names, and pickles (``torch.save``,
    ``copy.deepcopy``, the way back to the kernel) as ``cls``: nothing but the rank sees it.

    >>> import copy, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> model.__class__ = one_rank_class(torch.nn.Linear)
    >>> model.module is model, type(model).__name__, type(copy.deepcopy(model)) is torch.nn.Linear
    (True, 'Linear', True)
    """
    key = (cls, plain_module)
    if key not in _one_rank_classes:
        members: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if not hasattr(cls, "no_sync"):
            members["no_sync"] = _no_sync
        if not plain_module and not hasattr(cls, "module"):
            members["module"] = property(_itself)
        made = type(cls.__name__, (cls,), members)
        made.__reduce_ex__ = functools.partialmethod(_reduce_as, made, cls)  # type: ignore[assignment]
        _one_rank_classes[key] = made
    return _one_rank_classes[key]


def _has_own_module(module: Any) -> bool:
    return "module" in vars(module) or "module" in vars(module).get("_modules", {})


def _no_sync(self: Any) -> Any:
    """DDP's ``no_sync``: one rank never synchronises gradients, so there is nothing to skip."""
    return contextlib.nullcontext()


def _itself(self: Any) -> Any:
    return self


def _reduce_as(obj: Any, made: type, cls: type, protocol: Any) -> Any:
    """``obj``'s reduction with ``made`` (the one-rank class) replaced by ``cls``.

    pickle checks that ``copyreg.__newobj__`` makes an object of ``obj``'s own class, so
    that form becomes ``copyreg._reconstructor``'s (what protocols 0 and 1 use): the
    saved file needs nothing but ``cls`` to load.
    """
    reduced = getattr(cls, "__reduce_ex__")(obj, protocol)  # noqa: B009 - the class under the one-rank class; typeshed reads it as bound
    if not isinstance(reduced, tuple) or len(reduced) < 2 or not reduced[1] or reduced[1][0] is not made:
        return reduced
    if reduced[0] is copyreg.__newobj__ and len(reduced[1]) == 1:  # type: ignore[attr-defined]  # typeshed lacks it
        return (copyreg._reconstructor, (cls, object, None), *reduced[2:])  # type: ignore[attr-defined]
    return (reduced[0], (cls, *reduced[1][1:]), *reduced[2:])


def _inputs_to_device(device: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What DDP did for a one-rank run's model too: inputs made on the CPU move to the rank's GPU.

    A forward pre-hook (``device`` bound); inputs already there cost one device comparison each.
    """
    if not kwargs and all(getattr(a, "device", device) == device for a in args):
        return None
    return ledger.to_device(args, device), ledger.to_device(kwargs, device)


def _apply_precision_and_sync(module: Any, wrapper: str) -> None:
    """The launch's --sync-batchnorm and --precision, applied before the model is wrapped."""
    # deferred: start-up time
    from nbtrain.rank.auto import precision, syncbn

    device = api.device()
    if wrapper != "none" and settings.current().sync_batchnorm:
        syncbn.convert(module, device.type)
    chosen = settings.current().precision
    precision.apply(module, chosen, device)
    if chosen == "16-mixed" and device.type == "cuda" and ledger.cell_registry().loss_scaling is None:
        precision.scale_losses("cuda")


def is_wrapped(module: Any) -> bool:
    """True for DDP, DataParallel and FSDP1 wrappers and modules FSDP2 already sharded."""
    # deferred: start-up time (torch)
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
    registry = ledger.cell_registry()
    entry = registry.originals.get(id(obj))
    if entry is not None and entry[0] is obj:
        return entry[1]
    if "torch" not in sys.modules or registry.is_original(obj):  # the notebook's own DataParallel goes back as one
        return obj
    # deferred: start-up time (torch)
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
        cuda = ledger.torch_module().cuda
        kwargs["device_ids"] = [device.index if device.index is not None else cuda.current_device()]
    return transparent_ddp_class()(module, **kwargs)


def _wrap_dp(module: Any, options: dict[str, Any]) -> Any:
    """DataParallel over the launch's GPUs; this rank's own GPU (the first) holds the model and outputs."""
    kwargs = dict(options)
    if "device_ids" not in kwargs:
        kwargs["device_ids"] = list(settings.current().dp_devices) or None
    return transparent_dp_class()(module, **kwargs)


class _ReadThrough:
    """A wrapper (DDP, DataParallel) that reads through to the model it wraps.

    ``wrapped.fc``, ``wrapped.num_classes`` and the model's own methods keep working (an
    attribute the wrapper lacks falls back to ``self.module``), the wrapper's own methods
    stay reachable, and ``state_dict``/``load_state_dict`` use the model's keys (no
    ``module.`` prefix), so a state saved in a cell loads into the kernel's model.
    Setting a public attribute the wrapper lacks sets it on the model (``model.epoch = 3``, as
    it would be unwrapped).
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
        ):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own state dict (its keys, no ``module.`` prefix; a DataParallel's own keys
        where the wrapper stands for the notebook's DataParallel)."""
        return self._nbtrain_kernels_module().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the model with its own keys (a state saved from the kernel's model fits)."""
        return self._nbtrain_kernels_module().load_state_dict(state_dict, strict=strict, assign=assign)

    def _nbtrain_kernels_module(self) -> Any:
        """The module the kernel had: the model, or the DataParallel around it this wrapper stands for."""
        stands_for = self.__dict__.get("_nbtrain_stands_for")
        return self.module if stands_for is None else stands_for

    # A container model's own operations (``model[0]``, ``model["head"]``, ``len(model)``,
    # ``for block in model``, ``"head" in model``) go through the type, never through
    # __getattr__. __bool__ keeps ``if model:`` true once __len__ exists (a model that is
    # no container has no len(), and says so as it does unwrapped).
    def __getitem__(self, index: Any) -> Any:
        return self.module[index]

    def __len__(self) -> int:
        return len(self.module)

    def __iter__(self) -> Any:
        return iter(self.module)

    def __contains__(self, item: Any) -> bool:
        return item in self.module

    def __bool__(self) -> bool:
        return True

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the model: ``torch.save(model, path)`` saves it and ``copy.deepcopy(model)``
        copies it, as in the kernel (a copy of the wrapper would be a second DDP on the
        process group, and its generated class cannot be pickled by name)."""
        # stdlib's identity: loads anywhere, the memo keeps it shared
        return operator.itemgetter(0), ((self._nbtrain_kernels_module(),),)


@functools.cache
def transparent_dp_class() -> type:
    """A DataParallel subclass that reads through to the wrapped model (see :class:`_ReadThrough`)."""
    # deferred: start-up time (torch)
    from torch.nn.parallel import DataParallel

    class TransparentDP(_ReadThrough, DataParallel[Any]):
        def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(module, *args, **kwargs)
            object.__setattr__(self, "_nbtrain_ready", True)

    TransparentDP.__name__ = TransparentDP.__qualname__ = "DataParallel"
    return TransparentDP


class _ReadsThrough(_ReadThrough, _DDPBase):
    """What :func:`transparent_ddp_class` adds to DistributedDataParallel (a mixin put in front of it):
    reading through to the model (:class:`_ReadThrough`) and the check of the first backward."""

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        # Without DDP's own search, the first backward that syncs checks every trainable
        # parameter got a gradient (see _check_first_backward).
        object.__setattr__(self, "_nbtrain_check_unused", not self.find_unused_parameters)
        object.__setattr__(self, "_nbtrain_trainable", _trainable_flags(self._module_parameters))
        object.__setattr__(self, "_nbtrain_all_frozen", False)
        object.__setattr__(self, "_nbtrain_ready", True)
        averaging.wrapped(self)  # a step that calls the model's parts instead of it still averages

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DDP's forward, after nbtrain's own bookkeeping (:func:`_before_forward`)."""
        __tracebackhide__ = True  # an error in the model's forward reads as in the kernel (rank.machinery.runtime)
        if self._before_forward(inputs, kwargs):  # nothing to average: the model runs as it is
            return self.module(*inputs, **kwargs)
        return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]  # DDP's is unannotated

    def _before_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Replaced by :func:`_before_forward` where the class is made (transparent_ddp_class)."""
        raise NotImplementedError


def _before_forward(ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """nbtrain's part of a prepared DDP's forward; True when the model has nothing left to train (run it unwrapped).

    The trainable set followed, the forward counted, the first inputs compared, the first syncing
    backward's check armed. Never traced by torch.compile
    (:func:`transparent_ddp_class` disables dynamo here): a compiled model's graph is the model's own,
    and this bookkeeping reads process groups and shared memory, which dynamo cannot trace.
    """
    grads = ledger.torch_module().is_grad_enabled()
    if grads:
        if _trainable_flags(ddp._module_parameters) != ddp.__dict__["_nbtrain_trainable"]:
            _follow_trainable(ddp)  # frozen or unfrozen since it was wrapped: train what requires grad
        if ddp.__dict__["_nbtrain_all_frozen"]:
            return True
        if averaging.forward_ran(ddp) == 1:  # DDP averages this step's gradients; do the ranks train on different data?
            samedata.note_first_inputs(ddp, inputs, kwargs)
    syncs = ddp.require_backward_grad_sync and grads
    if ddp.__dict__["_nbtrain_check_unused"] and syncs:
        object.__setattr__(ddp, "_nbtrain_check_unused", False)
        _check_first_backward(ddp.module)
    return False


_requires_grad = operator.attrgetter("requires_grad")


def _trainable_flags(parameters: list[Any]) -> list[bool]:
    """Which of ``parameters`` require grad: one read each, in C (no Python frame per parameter)."""
    return list(map(_requires_grad, parameters))


def _follow_trainable(ddp: Any) -> None:
    """Rebuild ``ddp``'s reducer for the parameters that require grad now, as DDP does when it is unpickled.

    DDP builds its reducer, which waits for every trainable parameter's gradient before it
    averages, from the parameters that required grad when it was made. A cell that freezes
    one after that (``requires_grad_(False)``) would leave the reducer waiting ("Expected to
    have finished reduction"), and one it unfreezes would never be averaged. One process
    trains what requires grad; so, at the first forward with gradients after the set changed
    (every rank changes it at the same line), the reducer is built anew from the model as it
    is: no collective, nothing for the optimizer to rebind (the parameters are the same).
    A model with nothing left to train runs unwrapped until something is unfrozen.
    """
    flags = _trainable_flags(ddp._module_parameters)
    object.__setattr__(ddp, "_nbtrain_trainable", flags)
    object.__setattr__(ddp, "_nbtrain_all_frozen", not any(flags))
    if not any(flags):
        return
    hooks = getattr(ddp, "_accum_grad_hooks", [])  # the compiled-autograd reducer's, one per trainable parameter
    for handle in hooks:
        handle.remove()
    hooks.clear()
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    if getattr(ddp, "_use_python_reducer", False):
        ddp._register_accum_grad_hook()
    object.__setattr__(ddp, "_nbtrain_check_unused", not ddp.find_unused_parameters)  # check the new set's backward


@functools.cache
def transparent_ddp_class() -> type:
    """A DistributedDataParallel subclass that reads through to the wrapped model (see :class:`_ReadThrough`).

    DDP's own methods (``no_sync``, ``join``) stay reachable; the first backward that
    syncs checks that every trainable parameter got a gradient.
    """
    # deferred: start-up time (torch)
    from torch.nn.parallel import DistributedDataParallel

    class TransparentDDP(_ReadsThrough, DistributedDataParallel):
        _before_forward = ledger.torch_module().compiler.disable(_before_forward)

    TransparentDDP.__name__ = TransparentDDP.__qualname__ = "DistributedDataParallel"
    return TransparentDDP


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
            ledger.torch_module().autograd.Variable._execution_engine.queue_callback(check)
        reached.add(id(param))

    handles.extend(p.register_post_accumulate_grad_hook(seen) for _, p in trainable)


def _shard(module: Any, options: dict[str, Any], offload: bool = False) -> Any:
    """Shard ``module`` in place with FSDP2: each block of a ModuleList/Sequential, then the root.

    ``offload`` keeps the shards in host memory (CPUOffloadPolicy): FSDP2 copies a block's
    weights to the device for its forward and backward, and the optimizer steps on the CPU.
    """
    # deferred: start-up time (torch)
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
            ledger.cell_registry().param_swaps[id(old)] = (old, new)
            ledger.cell_registry().param_owner[id(new)] = module
    for optimizer in list(ledger.cell_registry().optimizers):
        boundoptimizers.rebind_optimizer(optimizer)
    return module


def _shard_blocks(module: Any) -> list[Any]:
    """Children of ModuleList/Sequential containers that have parameters, if none share any.

    Sharding per block lets FSDP2 gather one block's weights at a time; tied weights
    across blocks cannot be sharded separately, so then only the root is sharded.
    """
    # deferred: start-up time (torch)
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
