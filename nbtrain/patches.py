"""Every change nbtrain makes to code it does not own, declared in one table and undone.

Auto mode lets a notebook's single-device code run on several ranks unchanged, and a few
of the ways it does so replace an attribute of a library: ``torch.save`` writes a whole file
when ranks save one path at once, ``DataLoader.__iter__`` reads a rank's share, a rank's
``builtins.input`` asks the cell. Each such replacement is one :class:`Patch` in
:data:`TABLE`: what it replaces (target and attribute), with what (a factory that is given
the original and returns the replacement, named by its module path so that reading the
table imports nothing), why, and for how long (:class:`Lifetime`). Nothing else in nbtrain
assigns an attribute of a library (``tests/test_structure.py`` looks).

:func:`install` installs the patches of one group onto an :class:`contextlib.ExitStack`, in
the table's order; closing the stack undoes them in reverse. Undo puts the original back
unless something else (the user's own code) replaced the attribute meanwhile: theirs stays.
A patch with ``on_import`` waits for its module to be imported (its library's own code has
run, nothing has bound its names yet), so that a cell that never imports numpy pays
nothing; a module already imported is patched at once.

Standard library only; installing imports what the group's patches name.

Example (a patch of the standard library's ``colorsys``, installed and undone)::

    >>> import colorsys, contextlib
    >>> patch = Patch("example", "colorsys", "rgb_to_hsv", "builtins:repr", Lifetime.CELL, "an example")
    >>> with contextlib.ExitStack() as stack:
    ...     install("example", stack, table=(patch,))
    ...     colorsys.rgb_to_hsv is colorsys.rgb_to_yiq
    False
    >>> colorsys.rgb_to_hsv(0.0, 0.0, 0.0)
    (0.0, 0.0, 0.0)
"""

from __future__ import annotations

import enum
import importlib
import sys
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from types import ModuleType
from typing import Any


class Lifetime(enum.Enum):
    """How long a patch stays: who installs it, and when it is undone."""

    RANK = "a rank's process"  # installed as the rank starts; the process ends with it
    CELL = "one cell"  # installed as a cell starts on a rank, undone as it ends
    LAUNCHER = "the launcher"  # installed by the warm launcher; its forked ranks inherit it
    KERNEL = "the kernel"  # installed by %load_ext nbtrain, undone by %unload_ext nbtrain


@dataclass(frozen=True)
class Patch:
    """One replacement of an attribute nbtrain does not own.

    ``target`` is a module (``"torch.serialization"``) or a class in one
    (``"torch.utils.data:DataLoader"``); ``replacement`` names a factory
    (``"nbtrain.rank.checkpoints:whole_torch_save"``) called with the original attribute
    (``None`` where the target had none of its own) that returns what replaces it.
    """

    group: str  # the patches installed together, by the code that owns the group
    target: str
    attribute: str
    replacement: str
    lifetime: Lifetime
    why: str
    on_import: bool = False  # wait for the target's module to be imported rather than import it

    @property
    def module(self) -> str:
        """The module the target lives in."""
        return self.target.partition(":")[0]


_MISSING = object()  # the target had no attribute of its own (a class's was inherited)


def install(group: str, stack: ExitStack, table: Iterable[Patch] | None = None) -> None:
    """Install every patch of ``group`` in ``table`` (:data:`TABLE`) onto ``stack``, in order."""
    patches = [patch for patch in (TABLE if table is None else table) if patch.group == group]
    if not patches:
        raise ValueError(f"no patch belongs to group {group!r}; the groups are {sorted(groups())}")
    for patch in patches:
        if patch.on_import and patch.module not in sys.modules:
            stack.callback(_when_imported(patch, stack))
        else:
            _apply(patch, importlib.import_module(patch.module), stack)


def groups(table: Iterable[Patch] | None = None) -> set[str]:
    """The groups of ``table`` (:data:`TABLE`)."""
    return {patch.group for patch in (TABLE if table is None else table)}


def _apply(patch: Patch, module: ModuleType, stack: ExitStack) -> None:
    owner = _owner(patch, module)
    original = vars(owner).get(patch.attribute, _MISSING)
    current = getattr(owner, patch.attribute, None)
    replacement = _factory(patch.replacement)(current)
    setattr(owner, patch.attribute, replacement)
    stack.callback(_undo, owner, patch.attribute, original, replacement)


def _owner(patch: Patch, module: ModuleType) -> Any:
    _, _, path = patch.target.partition(":")
    owner: Any = module
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name)
    return owner


def _undo(owner: Any, attribute: str, original: Any, replacement: Any) -> None:
    """Put the original back, unless the attribute is no longer ours (the user's code replaced it)."""
    if vars(owner).get(attribute, _MISSING) is not replacement:
        return
    if original is _MISSING:
        delattr(owner, attribute)
    else:
        setattr(owner, attribute, original)


def _factory(reference: str) -> Callable[[Any], Any]:
    module, _, name = reference.partition(":")
    factory: Callable[[Any], Any] = getattr(importlib.import_module(module), name)
    return factory


def _when_imported(patch: Patch, stack: ExitStack) -> Callable[[], None]:
    """Apply ``patch`` once its module is imported; returns what stops waiting for it."""
    from nbtrain.rank import afterimport  # an import hook, needed only by a patch that waits

    return afterimport.when_imported(patch.module, lambda module: _apply(patch, module, stack))


_TRACKERS = "nbtrain.rank.trackers:"
_ONE_RUN = "a cell of several ranks writes one run, rank 0's; "
# Experiment trackers (nbtrain.rank.trackers): installed for a cell on every rank; each factory
# leaves rank 0's tracker writing (and charting its scalars) and quiets the other ranks'.
TRACKER_PATCHES: tuple[Patch, ...] = (
    Patch(
        "trackers", "torch.utils.tensorboard.writer", "FileWriter", _TRACKERS + "tensorboard_file_writer",
        Lifetime.CELL, _ONE_RUN + "the other ranks' SummaryWriters write no event file", on_import=True,
    ),
    Patch(
        "trackers", "torch.utils.tensorboard.writer:SummaryWriter", "__init__", _TRACKERS + "tensorboard_init",
        Lifetime.CELL, "a writer the cell leaves open is closed (flushed) at its end", on_import=True,
    ),
    Patch(
        "trackers", "torch.utils.tensorboard.writer:SummaryWriter", "add_scalar", _TRACKERS + "tensorboard_add_scalar",
        Lifetime.CELL, "rank 0's scalars are charted in the live view", on_import=True,
    ),
    Patch(
        "trackers", "torch.utils.tensorboard.writer:SummaryWriter", "add_scalars",
        _TRACKERS + "tensorboard_add_scalars", Lifetime.CELL, "rank 0's scalars are charted in the live view",
        on_import=True,
    ),
    Patch(
        "trackers", "wandb", "init", _TRACKERS + "wandb_init", Lifetime.CELL,
        _ONE_RUN + "the other ranks get a disabled run (and no wandb service process)", on_import=True,
    ),
    Patch(
        "trackers", "wandb", "log", _TRACKERS + "wandb_module_log", Lifetime.CELL,
        "wandb.log reaches the run the kernel opened (rank 0's calls, sent to the kernel)", on_import=True,
    ),
    Patch(
        "trackers", "wandb.sdk.wandb_run:Run", "log", _TRACKERS + "wandb_log", Lifetime.CELL,
        "rank 0's scalars are charted in the live view", on_import=True,
    ),
    Patch(
        "trackers", "mlflow.tracking._tracking_service.utils", "_get_store", _TRACKERS + "mlflow_store",
        Lifetime.CELL, _ONE_RUN + "the other ranks track into a throwaway store", on_import=True,
    ),
    Patch(
        "trackers", "mlflow.tracking.client:MlflowClient", "log_metric", _TRACKERS + "mlflow_log_metric",
        Lifetime.CELL, "rank 0's metrics are charted in the live view", on_import=True,
    ),
    Patch(
        "trackers", "mlflow.tracking.client:MlflowClient", "log_batch", _TRACKERS + "mlflow_log_batch",
        Lifetime.CELL, "rank 0's metrics are charted in the live view", on_import=True,
    ),
    Patch(
        "trackers", "trackio", "init", _TRACKERS + "trackio_init", Lifetime.CELL,
        _ONE_RUN + "the other ranks get a run that writes nothing", on_import=True,
    ),
    Patch(
        "trackers", "trackio.run:Run", "log", _TRACKERS + "trackio_log", Lifetime.CELL,
        "rank 0's scalars are charted in the live view", on_import=True,
    ),
)

TABLE: tuple[Patch, ...] = TRACKER_PATCHES
"""Every patch nbtrain installs, in the order each group installs them. docs/architecture.md
shows this table; ``tests/test_structure.py`` checks that nothing else replaces a library's
attribute."""
