"""The step board: a page of shared memory where ranks count optimizer steps and learn where to stop.

The launcher maps one board per run before it forks the ranks (an anonymous shared mapping,
so every forked rank writes into the very page the launcher reads). Each rank has a slot:
how many optimizer steps it has begun, and the durations of its last few steps. The board's
header holds the stop step: ``NO_STOP``, ``PENDING`` while the launcher is choosing it, or
the step every rank stops after.

Choosing a step without a lock: the launcher writes ``PENDING`` first and reads the ranks'
counts a tick later; a rank counts a step before it reads the header. A rank whose count the
launcher did not see has therefore seen ``PENDING`` (it waits for the step), so no rank is
ever past the step chosen, and none is asked to go back.

Standard library only: the launcher reads it without torch, the ranks write it per step
(two ``struct`` calls, a few microseconds).

Example:
    >>> board = StepBoard.create(2)
    >>> board.begin_step(0), board.begin_step(1), board.begin_step(1)
    (1, 1, 2)
    >>> board.request_stop(); board.stop_step()
    -1
    >>> board.choose_stop(), board.stop_step()
    (2, 2)
"""

from __future__ import annotations

import mmap
import statistics
import struct

NO_STOP = 0
PENDING = -1
RING = 16  # step durations kept per rank, for the grace period (3 x their median)
_HEADER = struct.Struct("q")
_COUNT = struct.Struct("qq")  # steps begun, next ring slot
_DURATION = struct.Struct("d")
_SLOT = _COUNT.size + RING * _DURATION.size


class StepBoard:
    """One run's board; see the module's description."""

    def __init__(self, memory: mmap.mmap, world_size: int) -> None:
        self.memory = memory
        self.world_size = world_size

    @classmethod
    def create(cls, world_size: int) -> StepBoard:
        """A zeroed board (no steps, no stop), shared with every process forked after this."""
        return cls(mmap.mmap(-1, _HEADER.size + world_size * _SLOT), world_size)

    def close(self) -> None:
        """Unmap the board (each process that has it mapped closes its own)."""
        self.memory.close()

    # -- the header: where to stop ------------------------------------------------------
    def stop_step(self) -> int:
        """NO_STOP, PENDING, or the step after which every rank stops."""
        return int(_HEADER.unpack_from(self.memory, 0)[0])

    def request_stop(self) -> None:
        """Start choosing a stop step (ranks that begin a step meanwhile wait for it)."""
        _HEADER.pack_into(self.memory, 0, PENDING)

    def choose_stop(self) -> int:
        """Pick and publish the stop step: the highest step any rank has begun (0: none began one)."""
        step = max(self.counts(), default=0)
        _HEADER.pack_into(self.memory, 0, step if step > 0 else NO_STOP)
        return step

    def publish_stop(self, step: int) -> None:
        """Publish a step chosen elsewhere (a cluster's kernel, over every node's highest step).

        Only while ``PENDING``: this node's ranks are then at most one step past its own counts, which the
        chooser saw, so none is past ``step``.
        """
        _HEADER.pack_into(self.memory, 0, step if step > 0 else NO_STOP)

    def cancel(self) -> None:
        """No stop after all: ranks that wait for a stop step go on."""
        _HEADER.pack_into(self.memory, 0, NO_STOP)

    # -- the ranks' slots -----------------------------------------------------------------
    def _offset(self, rank: int) -> int:
        return _HEADER.size + rank * _SLOT

    def count(self, rank: int) -> int:
        """How many optimizer steps ``rank`` has begun."""
        return int(_COUNT.unpack_from(self.memory, self._offset(rank))[0])

    def counts(self) -> list[int]:
        """Each rank's count of steps begun, in rank order."""
        return [self.count(rank) for rank in range(self.world_size)]

    def begin_step(self, rank: int) -> int:
        """Count one more step begun by ``rank``; its new count."""
        offset = self._offset(rank)
        count, slot = _COUNT.unpack_from(self.memory, offset)
        _COUNT.pack_into(self.memory, offset, count + 1, slot)
        return int(count + 1)

    def undo_step(self, rank: int) -> None:
        """The step just counted will not run (the rank stops before it)."""
        offset = self._offset(rank)
        count, slot = _COUNT.unpack_from(self.memory, offset)
        _COUNT.pack_into(self.memory, offset, count - 1, slot)

    def record_duration(self, rank: int, seconds: float) -> None:
        """Keep how long one of ``rank``'s steps took (the last RING of them are kept)."""
        offset = self._offset(rank)
        count, slot = _COUNT.unpack_from(self.memory, offset)
        _DURATION.pack_into(self.memory, offset + _COUNT.size + (slot % RING) * _DURATION.size, seconds)
        _COUNT.pack_into(self.memory, offset, count, slot + 1)

    def median_step_seconds(self) -> float | None:
        """The median of the ranks' recent step durations (None before any was recorded)."""
        durations = []
        for rank in range(self.world_size):
            offset = self._offset(rank)
            slots = min(RING, int(_COUNT.unpack_from(self.memory, offset)[1]))
            base = offset + _COUNT.size
            durations += [_DURATION.unpack_from(self.memory, base + i * _DURATION.size)[0] for i in range(slots)]
        return statistics.median(durations) if durations else None


def grace_seconds(minimum: float, median_step: float | None) -> float:
    """How long every rank gets to reach the stop step: ``max(minimum, 3 x the median step)``.

    >>> grace_seconds(2.0, 0.1), grace_seconds(2.0, 1.5), grace_seconds(2.0, None)
    (2.0, 4.5, 2.0)
    """
    return max(minimum, 3 * median_step) if median_step is not None else minimum
