"""Whether a run's memory fits this machine, decided before any process starts.

Pure: it imports no torch and starts nothing. It weighs the objects a run sends to its
ranks (a model built on the meta device is weighed by its shapes) and compares the
estimate with the memory the caller measured (:func:`nbtrain.planning.probe.available_memory`
on the host, NVML's free memory per GPU). A run that cannot fit is refused with the
numbers and what to do; one that comes close gets a one-line warning.

What a run needs, at least:

- on every rank: the model's parameters and buffers, a gradient per trainable parameter,
  and the optimizer's state (what it already holds, or what its kind will allocate:
  Adam keeps two tensors per parameter); under ``fsdp`` each rank holds a slice of these;
- once: every tensor sent to the ranks, written into one shared-memory file they all map;
- per process: what a rank costs before any model (``RANK_OVERHEAD``).

On CUDA the per-rank part is checked against each GPU's free memory and the rest against
the host's.

Example:
    >>> need = Footprint(parameters=4 << 30, gradients=4 << 30, optimizer_state=8 << 30, shared=4 << 30)
    >>> check_memory(need, world_size=2, accelerator="cpu", sharded=False, start_method="fork",
    ...              host_available=24 << 30)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbtrain.errors.ConfigurationError: this run needs about 36.1 GiB of host memory (2 ranks x 16.0 GiB per rank: ...
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nbtrain.errors import ConfigurationError

_GIB = 2**30
_MIB = 2**20

# Private memory of one rank beside its model, rounded up from a 2-rank DDP step on CPU
# (unique set size: 14 MiB forked, 217 MiB spawned): a forked rank shares the launcher's
# imported torch copy-on-write; a spawned one imports its own.
RANK_OVERHEAD = {"fork": 32 * _MIB, "spawn": 256 * _MIB}
CLOSE_FRACTION = 0.8  # above this share of what is available, warn
_MOST_OBJECTS = 200_000  # the walk over the run's objects stops here: an estimate, never a stall
_MOST_DEPTH = 6
_MOST_ITEMS = 10_000  # per list or dict: a list of a million numbers is data, not models

# Tensors per parameter that an optimizer allocates on its first step, by class name.
_STATE_PER_PARAMETER = {
    **dict.fromkeys(("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "SparseAdam"), 2),
    **dict.fromkeys(("ASGD", "Adagrad"), 1),
}
_UNKNOWN_OPTIMIZER_STATE = 2
_NOT_CONTAINERS = (str, bytes, bytearray, int, float, complex, bool, type(None), types.ModuleType, type)


@dataclass(frozen=True)
class Footprint:
    """Bytes of what a run's objects weigh: the per-rank parts, and ``shared`` held once."""

    parameters: int = 0  # parameters and buffers of the models
    gradients: int = 0
    optimizer_state: int = 0
    shared: int = 0  # tensors (parameters included) in the one shared file every rank maps

    def per_rank(self, world_size: int, sharded: bool) -> int:
        """What one rank holds of the models: all of it, or under FSDP a 1/world_size slice."""
        total = self.parameters + self.gradients + self.optimizer_state
        return -(-total // world_size) if sharded else total


def weigh(values: Iterable[Any]) -> Footprint:
    """The :class:`Footprint` of ``values`` and everything they hold (modules, optimizers, tensors).

    Without torch imported nothing can be a tensor, and the answer is all zeros.

    >>> weigh([1, "two", {"three": 3.0}])
    Footprint(parameters=0, gradients=0, optimizer_state=0, shared=0)
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return Footprint()
    walk = _Walk(torch)
    for value in values:
        walk.visit(value, 0)
    return walk.footprint()


def check_memory(
    need: Footprint, *, world_size: int, accelerator: str, sharded: bool, start_method: str,
    host_available: int | None, gpu_free: Mapping[int, int] | None = None,
) -> str | None:
    """Raise ConfigurationError when the run cannot fit; a one-line warning when it comes close.

    ``gpu_free`` maps each GPU the run uses to its free bytes (CUDA only).

    >>> check_memory(Footprint(parameters=1 << 20), world_size=2, accelerator="cpu", sharded=False,
    ...              start_method="fork", host_available=8 << 30) is None
    True
    """
    per_rank = need.per_rank(world_size, sharded)
    on_gpu = accelerator == "cuda"
    host_need = need.shared + world_size * (RANK_OVERHEAD.get(start_method, RANK_OVERHEAD["spawn"]))
    if not on_gpu:
        host_need += world_size * per_rank
    warnings = []
    if host_available is not None:
        warnings.append(_compare(host_need, host_available, "host memory", need, world_size, per_rank, sharded))
    for index, free in sorted((gpu_free or {}).items()) if on_gpu else ():
        warnings.append(_compare(per_rank, free, f"memory on GPU {index}", need, 1, per_rank, sharded))
    return next((warning for warning in warnings if warning), None)


def _compare(
    needed: int, available: int, where: str, need: Footprint, ranks: int, per_rank: int, sharded: bool
) -> str | None:
    if needed <= CLOSE_FRACTION * available:
        return None
    parts = _describe(need, ranks, per_rank, sharded)
    if needed > available:
        raise ConfigurationError(
            f"this run needs about {_gib(needed)} of {where} ({parts}), but only {_gib(available)} is available, "
            "so it was not started. Use fewer devices, a smaller model or batch, --strategy fsdp "
            "(each rank then holds a slice of the model), or free memory first."
        )
    return (
        f"this run needs about {_gib(needed)} of the {_gib(available)} of {where} available ({parts}); "
        "it may run out of memory."
    )


def _describe(need: Footprint, ranks: int, per_rank: int, sharded: bool) -> str:
    named = (("parameters", need.parameters), ("gradients", need.gradients), ("optimizer state", need.optimizer_state))
    state = " + ".join(f"{name} {_gib(nbytes)}" for name, nbytes in named if nbytes) or "no model"
    share = f", a 1/{ranks} slice each" if sharded and ranks > 1 else ""
    text = f"{_gib(per_rank)} per rank: {state}{share}"
    if ranks > 1:
        text = f"{ranks} ranks x {text}"
    return text + (f"; {_gib(need.shared)} shared once" if need.shared >= _MIB else "")


def _gib(nbytes: float) -> str:
    if nbytes >= 100 * _GIB:
        return f"{nbytes / _GIB:,.0f} GiB"
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= _GIB / 10 else f"{nbytes / _MIB:.0f} MiB"


class _Walk:
    """One pass over a run's objects, counting each tensor storage once."""

    def __init__(self, torch: Any):
        self.torch = torch
        self.seen: set[int] = set()
        self.storages: set[Any] = set()
        self.parameters = self.gradients = self.optimizer_state = self.shared = 0
        self.visited = 0

    def footprint(self) -> Footprint:
        return Footprint(self.parameters, self.gradients, self.optimizer_state, self.shared)

    def visit(self, value: Any, depth: int) -> None:
        if depth > _MOST_DEPTH or self.visited >= _MOST_OBJECTS or id(value) in self.seen:
            return
        if isinstance(value, _NOT_CONTAINERS) or callable(value) and not hasattr(value, "parameters"):
            return  # modules, classes and functions hold no run data (a Module is callable too)
        self.seen.add(id(value))
        self.visited += 1
        torch = self.torch
        if isinstance(value, torch.Tensor):
            self.shared += 0 if value.device.type == "meta" else self._new_bytes(value)
        elif isinstance(value, torch.nn.Module):
            self._module(value)
        elif isinstance(value, torch.optim.Optimizer):
            self._optimizer(value)
        else:
            self._contents(value, depth)

    def _contents(self, value: Any, depth: int) -> None:
        if isinstance(value, Mapping):
            items: Iterable[Any] = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = value
        else:
            items = list(getattr(value, "__dict__", {}).values())  # a DataLoader, a Dataset, a user class
        for item in itertools.islice(items, _MOST_ITEMS):
            if not isinstance(item, _NOT_CONTAINERS):  # a list of a million floats is quick to pass
                self.visit(item, depth + 1)

    def _module(self, module: Any) -> None:
        for parameter in module.parameters():
            self._parameter(parameter)
        for buffer in module.buffers():
            nbytes = self._new_bytes(buffer)
            self.parameters += nbytes
            self.shared += 0 if buffer.device.type == "meta" else nbytes

    def _parameter(self, parameter: Any) -> None:
        nbytes = self._new_bytes(parameter)
        if not nbytes:
            return  # seen before (a parameter shared by two models, or one the optimizer lists)
        self.parameters += nbytes
        self.shared += 0 if parameter.device.type == "meta" else nbytes  # meta: nothing to send
        if parameter.requires_grad:
            self.gradients += _size(parameter)

    def _optimizer(self, optimizer: Any) -> None:
        per_parameter = _state_tensors(optimizer)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                self._parameter(parameter)
                held = optimizer.state.get(parameter)
                if held:
                    tensors = [v for v in held.values() if isinstance(v, self.torch.Tensor)]
                    self.optimizer_state += sum(_size(tensor) for tensor in tensors)
                else:
                    self.optimizer_state += per_parameter * _size(parameter)

    def _new_bytes(self, tensor: Any) -> int:
        """Bytes of ``tensor``'s storage the first time it is seen, else 0 (views share one)."""
        if tensor.device.type == "meta":  # no storage: weigh the shape
            key: Any = ("meta", id(tensor))
            nbytes = _size(tensor)
        else:
            try:
                storage = tensor.untyped_storage()
                key, nbytes = (tensor.device.type, storage.data_ptr()), storage.nbytes()
            except Exception:  # noqa: BLE001 - a tensor subclass without storage
                key, nbytes = ("id", id(tensor)), _size(tensor)
        if key in self.storages:
            return 0
        self.storages.add(key)
        return nbytes


def _size(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _state_tensors(optimizer: Any) -> int:
    name = type(optimizer).__name__
    defaults = getattr(optimizer, "defaults", {})
    if name == "SGD":
        return 1 if defaults.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum")) + bool(defaults.get("centered"))
    count = _STATE_PER_PARAMETER.get(name, _UNKNOWN_OPTIMIZER_STATE)
    return count + 1 if defaults.get("amsgrad") else count
