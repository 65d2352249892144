"""Ranks that each trained alone: optimizer steps with no collective, told in the cell's summary.

A run of several ranks trains one model only where the ranks average their gradients, and
every way of averaging is a collective: DDP's reducer (in C++, during the backward), FSDP's
reduce-scatter, auto mode's own all-reduce, a cell's ``dist.all_reduce(p.grad)``. A cell that
trains without one (a ``--no-auto`` cell's model never wrapped in DDP; a framework set up for
one device, Lightning's ``Trainer(devices=1)``, Fabric, an ``Accelerator()`` that sees a
world of one) runs N independent trainings with no error, and the kernel gets rank 0's.

The rule, for any mode and any framework: torch's gloo and NCCL backends number every
collective of a process group (the sequence number, those DDP's reducer makes included).
:func:`watched` reads the sum over every group this rank belongs to as the cell starts and as
it ends; the difference, less nbtrain's own collectives that average no gradient
(:func:`not_gradients`: auto mode's comparison of first batches, its plateau schedulers'
agreement, ``nbtrain.all_reduce`` of a number), is what the cell joined. Rank 0, whose result
the kernel takes, reports its optimizer steps of a cell in which it joined none
(:func:`steps_alone`): a collective of the default group has every rank in it, so rank 0
joining none means no rank averaged with it.

No false alarm: any collective the cell joined counts as averaging (a metric's all-reduce
cannot be told from a gradient's without watching every step); a count that cannot be read
(a backend without sequence numbers, a group gone or made and gone during the cell), or a
rank with no step board (``ddp_spawn``), says nothing. A cell that took no optimizer step is
told nothing. Cost: two reads of the counts per cell, about 10 µs each, and two around each of nbtrain's own
collectives above (beside the collective's own 100 µs or more on gloo); nothing per step.

Importing this module does not import torch.

Example (the decision)::

    >>> trained_alone(world_size=2, steps=24, collectives=0)
    True
    >>> trained_alone(2, 24, 3), trained_alone(2, 0, 0), trained_alone(1, 24, 0), trained_alone(2, 24, None)
    (False, False, False, False)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from nbtrain.rank.machinery import stepcheck


def trained_alone(world_size: int, steps: int | None, collectives: int | None) -> bool:
    """Whether a rank of a run of ``world_size`` that took ``steps`` optimizer steps in a cell and joined
    ``collectives`` other than nbtrain's own trained alone (None: not known, so nothing is said)."""
    return world_size > 1 and bool(steps) and collectives == 0


@dataclass(frozen=True)
class Counts:
    """A rank's sequence numbers of its process groups at one moment, and the number of groups made so far."""

    groups: dict[str, int]  # group name -> its collectives so far (every backend of the group)
    made: int  # torch's count of the groups made in this process


def counts() -> Counts | None:
    """This rank's :class:`Counts` now (None: no process group, or a backend that does not number its collectives).

    >>> counts() is None  # outside a run: no process group
    True
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.distributed_c10d._world
    try:
        groups = {
            name: sum(pg._get_backend(device)._get_sequence_number_for_group() for device in pg._device_types)
            for pg, name in list(world.pg_names.items())
        }
    except (RuntimeError, NotImplementedError, AttributeError, KeyError):  # a backend that numbers none (mpi, fake)
        return None
    return Counts(groups, world.group_count)


def joined(start: Counts | None, end: Counts | None) -> int | None:
    """The collectives between ``start`` and ``end``, or None where a group could hide some: one that was
    there at the start and is gone, or one made and destroyed in between.

    >>> joined(Counts({"0": 3}, 1), Counts({"0": 8, "1": 2}, 2)), joined(Counts({"0": 3}, 1), Counts({"0": 3}, 2))
    (7, None)
    """
    if start is None or end is None or not start.groups.keys() <= end.groups.keys():
        return None
    new = end.groups.keys() - start.groups.keys()
    if end.made - start.made > len(new):
        return None
    return sum(end.groups.values()) - sum(start.groups.values())


class _WatchedCell:
    """The cell now running on this rank: its counts and steps at the start, nbtrain's own collectives since."""

    def __init__(self) -> None:
        self.start = counts()
        self.steps = stepcheck.steps_begun()
        self.own = 0

    def steps_alone(self, world_size: int) -> int:
        """The steps taken since the start if no collective but nbtrain's own was; else 0."""
        steps = stepcheck.steps_begun()
        taken = None if steps is None or self.steps is None else steps - self.steps
        collectives = joined(self.start, counts())
        if collectives is not None:
            collectives -= self.own
        return taken if taken is not None and trained_alone(world_size, taken, collectives) else 0


_cell: _WatchedCell | None = None  # the cell now running, while watched
_last_alone = 0  # what the last cell watched found: steps_alone()


@contextlib.contextmanager
def watched(world_size: int) -> Iterator[None]:
    """Around the cell's own code (after auto mode prepared it, before its results are gathered): whether
    this rank took optimizer steps and joined no collective, for :func:`steps_alone`.

    >>> with watched(world_size=2):
    ...     pass  # outside a run no step is counted: nothing to say
    >>> steps_alone()
    0
    """
    global _cell, _last_alone
    _last_alone = 0
    cell = _cell = _WatchedCell()
    try:
        yield
    finally:
        _cell = None
    # Reached only where the cell's code did not raise: a failed cell's summary is about its error.
    _last_alone = cell.steps_alone(world_size)


def steps_alone() -> int:
    """The optimizer steps this rank took in the last cell :func:`watched` if it joined no collective and did
    not raise; else 0."""
    return _last_alone


@contextlib.contextmanager
def not_gradients() -> Iterator[None]:
    """Around a collective nbtrain makes itself that averages no gradient: not counted as the cell's.

    >>> with not_gradients():
    ...     pass  # auto mode's all-gather of a plateau scheduler's metric, say
    """
    cell = _cell
    if cell is None:  # outside a watched cell (a function run): nothing to count
        yield
        return
    before = counts()
    try:
        yield
    finally:
        own = joined(before, counts())
        cell.own += own or 0
