"""What ``nbtrain.prepare`` prepared on this rank, and the strategy's model wrapper.

One registry per cell (:func:`configure` starts it): original <-> prepared objects, FSDP's
parameter swaps, the optimizers to re-bind, the notes for the summary. The preparers of
modules (:mod:`~nbtrain.rank.auto.wrapping`), optimizers (:mod:`~nbtrain.rank.auto.boundoptimizers`) and
loaders (:mod:`~nbtrain.rank.auto.preparedloaders`) all read it through :func:`cell_registry`.

Importing this module does not import torch.

Example (outside a run nothing is prepared, and no wrapper is chosen):
    >>> configure()
    >>> model_wrapper(), in_process_group(), notes()
    ('none', False, [])
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterable
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.machinery import settings

# The second searches every step for unused parameters; the third shards optimizer state.
DDP_WRAPPERS = ("ddp", "ddp_find_unused", "ddp_sharded")
# fsdp_offload keeps the shards (and the optimizer's step) in host memory: FSDP2's CPUOffloadPolicy.
FSDP_WRAPPERS = ("fsdp", "fsdp_offload")
# With one rank there is nothing to average: these train the model as it is (no wrapper,
# no all-reduce, the same gradients). fsdp_offload stays sharded: its point is host memory.
ONE_RANK_UNWRAPPED = (*DDP_WRAPPERS, "fsdp")


class _Registry:
    """What this rank prepared: original <-> prepared, and FSDP's parameter swaps."""

    def __init__(self) -> None:
        self.prepared: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, prepared)
        self.originals: dict[int, tuple[Any, Any]] = {}  # id(prepared) -> (prepared, original)
        self.param_swaps: dict[int, tuple[Any, Any]] = {}  # id(old param) -> (old, new DTensor param)
        self.param_owner: dict[int, Any] = {}  # id(new parameter) -> the sharded root module
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.notes: list[str] = []
        self.loader_names: dict[str, Any] = {}  # auto mode's loaders: kernel name -> prepared loader
        self.first_iterated: list[int] = []  # ids of prepared loaders, in the order of their first pass
        self.loss_scaling: Any = None  # precision.LossScaling under 16-mixed on CUDA
        # What auto mode averages itself (nbtrain.rank.auto.averaging): its targets, each optimizer's
        # (it, targets_changed then, its targets), and each DDP wrapper's target by id.
        self.targets: list[Any] = []
        self.targets_changed = 0
        self.step_targets: dict[int, tuple[Any, int, list[Any]]] = {}
        self.wrappers: dict[int, Any] = {}
        # (the model's objects to name it by, else its words, its first inputs' or gradients' extremes, any tensor)
        self.first_inputs: list[tuple[tuple[Any, ...], str, Any, bool]] = []
        self.unsharded: list[int] = []  # ids of loaders auto mode could not shard (each said in a note)
        self.shipped: dict[int, Any] = {}  # id -> the kernel's wrappers (a DataParallel) the cell received
        # The cell's patches (nbtrain.patches) and step hooks, undone in reverse as the cell ends
        # (nbtrain.rank.cell); also those prepare installs during the cell (16-mixed's loss scaling).
        self.patches = contextlib.ExitStack()
        self.steps_hooked = False  # nbtrain.rank.auto.stephooks' pair of step hooks is on self.patches

    def ship(self, objects: Iterable[Any]) -> None:
        """Note the kernel's wrappers among ``objects``: they go back as themselves, not as their model."""
        nn = sys.modules.get("torch.nn")
        if nn is not None:
            self.shipped.update({id(o): o for o in objects if isinstance(o, nn.DataParallel)})

    def is_original(self, obj: Any) -> bool:
        """True for the notebook's own: a wrapper the kernel sent, or an object prepare made something of."""
        return self.shipped.get(id(obj)) is obj or self.prepared.get(id(obj), (None,))[0] is obj

    def remember(self, original: Any, prepared: Any) -> None:
        """``prepared`` is what ``original`` became (the same object when only moved)."""
        self.prepared[id(original)] = (original, prepared)
        self.originals[id(prepared)] = (prepared, original)

    def prepared_for(self, obj: Any) -> Any | None:
        """What ``obj`` became, ``obj`` itself if it is a prepared object, None if never seen."""
        entry = self.prepared.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        entry = self.originals.get(id(obj))
        if entry is not None and entry[0] is obj:
            return obj
        return None


_registry = _Registry()


def cell_registry() -> _Registry:
    """This cell's registry (the one :func:`configure` started last)."""
    return _registry


def configure() -> None:
    """Start a fresh registry for one cell."""
    global _registry
    _registry = _Registry()


def notes() -> list[str]:
    """Things prepare chose not to do, each one sentence (e.g. a loader it could not shard)."""
    return list(_registry.notes)


def model_wrapper() -> str:
    """What a module is wrapped in on this rank (a strategy's ``model_wrapper``: the run's --strategy says).

    A run nbtrain did not plan (a script under torchrun) wraps in DDP over several ranks.
    """
    return settings.current().model_wrapper or ("ddp" if api.world_size() > 1 else "none")


def one_rank() -> bool:
    """True on the only rank of a DDP-family (or fsdp) run: the model trains as it is, unwrapped."""
    return in_process_group() and api.world_size() == 1 and model_wrapper() in ONE_RANK_UNWRAPPED


def prepared_for(obj: Any) -> Any | None:
    """What ``prepare`` made of ``obj`` on this rank (None if it never saw it)."""
    return _registry.prepared_for(obj)


def to_device(batch: Any, device: Any) -> Any:
    """``batch`` (a tensor, or lists, tuples, named tuples and dicts of them) moved to ``device``."""
    if hasattr(batch, "to") and hasattr(batch, "device"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    return batch


def torch_module() -> Any:
    """torch, imported when first asked for (importing nbtrain must not import it)."""
    # deferred: start-up time (torch)
    import torch

    return torch


def in_process_group() -> bool:
    """True on a rank of a run whose process group is up (False in the kernel)."""
    if api.current_context() is None:
        return False
    # deferred: start-up time (torch)
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
