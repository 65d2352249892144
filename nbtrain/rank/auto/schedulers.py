"""A ``ReduceLROnPlateau`` on auto mode's ranks steps on the ranks' mean metric, so their learning rates agree.

Single-device code steps ``ReduceLROnPlateau`` on a number it computed itself, often the
epoch's mean training loss. On the ranks each one computed it from its own share of the
data, so they passed different numbers: one rank cut its learning rate while another did
not, DDP went on averaging their gradients, each applied them at its own rate, and the
weights drifted apart with no error. In an auto-mode run of several ranks (code written
for one device, which never asks which rank it is on, so every rank steps its schedulers
at the same points), :func:`agreed_step` (the patch table's) makes ``step(metrics)`` gather the
number from every rank first (one collective of one number per call, usually once an
epoch). Where they differ, every rank steps on their mean, which is what the number
would have been over the whole data with equal shares, and the summary says so once;
where they agree (an evaluation pass every rank read whole), it steps on it unchanged.

Example (outside a run nothing is gathered: the number passes as it is):
    >>> agreed(0.25)
    0.25
"""

from __future__ import annotations

import functools
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.auto import ledger
from nbtrain.rank.machinery import trainedalone

NOTE = (
    "ReduceLROnPlateau.step got a different number on each rank (each computed it from its share of the "
    "data): every rank stepped on their mean, so all keep the same learning rate."
)


def agreed_step(own: Any) -> Any:
    """``ReduceLROnPlateau.step`` in an auto-mode cell of several ranks (the patch table's): steps on
    the ranks' agreed number."""

    @functools.wraps(own)
    def step(self: Any, metrics: Any, *args: Any, **kwargs: Any) -> Any:
        return own(self, agreed(metrics), *args, **kwargs)

    return step


def agreed(metric: Any) -> Any:
    """``metric`` if every rank passed the same number, else their mean (a float); outside a run, ``metric``."""
    if api.world_size() < 2 or not ledger.in_process_group():
        return metric
    numbers = _gathered(float(metric))
    if all(number == numbers[0] for number in numbers):
        return metric
    registry = ledger.cell_registry()
    if NOTE not in registry.notes:
        registry.notes.append(NOTE)
    return sum(numbers) / len(numbers)  # the same sum, in rank order, on every rank


def _gathered(number: float) -> list[float]:
    """``number`` from every rank, in rank order (nccl gathers device tensors only)."""
    # deferred: start-up time (torch)
    import torch
    import torch.distributed as dist

    home = api.device() if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([number], dtype=torch.float64, device=home)
    every = [torch.empty_like(mine) for _ in range(api.world_size())]
    with trainedalone.not_gradients():  # a metric, not a gradient
        dist.all_gather(every, mine)
    return [float(t.item()) for t in every]
