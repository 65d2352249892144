"""What data-parallel training leaves different from one process by its nature, named in the cell's summary.

A cell trained on several ranks leaves the kernel as one process would have on the union of
the ranks' batches, except where data parallelism itself differs (docs/semantics.md,
"Inherent differences"). Two of those are decided by a model's layers, and a notebook user
comparing with a run in the kernel should hear of them: BatchNorm normalises by each rank's
own batch (unless ``--sync-batchnorm``), and each rank draws its own dropout masks.
:func:`model_notes` names them for the models a cell trained, once per cell.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Dropout(0.1))
    >>> for sentence in model_notes([("net", net)], world_size=2):
    ...     print(sentence.split(";")[0])
    net: each rank normalised its BatchNorm layers by its own batch, where one process normalises by the whole batch
    net: each rank drew its own dropout masks
    >>> model_notes([("net", net)], world_size=1)
    []
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nbtrain.rank.auto import syncbn

_BATCHNORM = (
    "{names}: each rank normalised its BatchNorm layers by its own batch, where one process normalises by the "
    "whole batch; the running statistics are rank 0's. --sync-batchnorm normalises over every rank's batch "
    "(docs/semantics.md)"
)
_DROPOUT = (
    "{names}: each rank drew its own dropout masks; the weights match one process's in distribution, not value "
    "for value (docs/semantics.md)"
)


def model_notes(models: Iterable[tuple[str, Any]], world_size: int) -> list[str]:
    """One sentence per inherent difference the trained ``models`` (name, module) show over ``world_size`` ranks."""
    if world_size < 2:
        return []
    unsynced = [name for name, model in models if _has_layer(model, _unsynced_batchnorm)]
    dropping = [name for name, model in models if _has_layer(model, _drops)]
    notes = []
    if unsynced:
        notes.append(_BATCHNORM.format(names=", ".join(unsynced)))
    if dropping:
        notes.append(_DROPOUT.format(names=", ".join(dropping)))
    return notes


def _has_layer(model: Any, test: Any) -> bool:
    modules = getattr(model, "modules", None)
    return callable(modules) and any(test(layer) for layer in modules())


def _unsynced_batchnorm(layer: Any) -> bool:
    # deferred: start-up time (torch)
    import torch

    synced = (torch.nn.SyncBatchNorm, syncbn.sync_class())  # torch's, and CPU ranks' own
    return isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(layer, synced)


def _drops(layer: Any) -> bool:
    # deferred: start-up time (torch)
    import torch

    return isinstance(layer, torch.nn.modules.dropout._DropoutNd) and float(layer.p) > 0.0
