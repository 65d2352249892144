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
(a few words, about a microsecond).

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

NO_STOP = 0
PENDING = -1
RING = 16  # step durations kept per rank, for the grace period (3 x their median)

# The board is 8-byte words: the header (the stop step), then per rank its count of steps
# begun, its next ring slot and RING step durations (doubles). Ranks read and write single
# words through a memoryview: the hooks run on every optimizer step, and this is their cost.
_SLOT_WORDS = 2 + RING


class StepBoard:
    """One run's board; see the module's description."""

    def __init__(self, memory: mmap.mmap, world_size: int) -> None:
        self.memory = memory
        self.world_size = world_size
        self._words = memoryview(memory).cast("q")
        self._seconds = memoryview(memory).cast("d")

    @classmethod
    def create(cls, world_size: int) -> StepBoard:
        """A zeroed board (no steps, no stop), shared with every process forked after this."""
        return cls(mmap.mmap(-1, 8 * (1 + world_size * _SLOT_WORDS)), world_size)

    def close(self) -> None:
        """Unmap the board (each process that has it mapped closes its own)."""
        self._words.release()
        self._seconds.release()
        self.memory.close()

    # -- the header: where to stop ------------------------------------------------------
    def stop_step(self) -> int:
        """NO_STOP, PENDING, or the step after which every rank stops."""
        return int(self._words[0])

    def request_stop(self) -> None:
        """Start choosing a stop step (ranks that begin a step meanwhile wait for it)."""
        self._words[0] = PENDING

    def choose_stop(self) -> int:
        """Pick and publish the stop step: the highest step any rank has begun (0: none began one)."""
        step = max(self.counts(), default=0)
        self._words[0] = step if step > 0 else NO_STOP
        return step

    def publish_stop(self, step: int) -> None:
        """Publish a step chosen elsewhere (a cluster's kernel, over every node's highest step).

        Only while ``PENDING``: this node's ranks are then at most one step past its own counts, which the
        chooser saw, so none is past ``step``.
        """
        self._words[0] = step if step > 0 else NO_STOP

    # -- the ranks' slots -----------------------------------------------------------------
    def _slot(self, rank: int) -> int:
        return 1 + rank * _SLOT_WORDS

    def count(self, rank: int) -> int:
        """How many optimizer steps ``rank`` has begun."""
        return int(self._words[self._slot(rank)])

    def counts(self) -> list[int]:
        """Each rank's count of steps begun, in rank order."""
        return [self.count(rank) for rank in range(self.world_size)]

    def begin_step(self, rank: int, last_seconds: float | None = None) -> int:
        """Count one more step begun by ``rank``; its new count.

        ``last_seconds``: how long the iteration before it took (its data, forward, backward
        and step), one of the last RING kept for :meth:`median_step_seconds`. One call per
        step: the hooks run on every step.
        """
        index = 1 + rank * _SLOT_WORDS  # _slot(rank), without the call: this runs on every step
        words = self._words
        count = words[index] + 1
        words[index] = count
        if last_seconds is not None:
            ring = words[index + 1]
            self._seconds[index + 2 + ring % RING] = last_seconds
            words[index + 1] = ring + 1
        return int(count)

    def undo_step(self, rank: int) -> None:
        """The step just counted will not run (the rank stops before it)."""
        self._words[self._slot(rank)] -= 1

    def median_step_seconds(self) -> float | None:
        """The median of the ranks' recent step durations (None before any was recorded)."""
        durations = []
        for rank in range(self.world_size):
            index = self._slot(rank)
            kept = min(RING, int(self._words[index + 1]))
            durations += self._seconds[index + 2 : index + 2 + kept].tolist()
        return statistics.median(durations) if durations else None


def grace_seconds(minimum: float, median_step: float | None) -> float:
    """How long every rank gets to reach the stop step: ``max(minimum, 3 x the median step)``.

    >>> grace_seconds(2.0, 0.1), grace_seconds(2.0, 1.5), grace_seconds(2.0, None)
    (2.0, 4.5, 2.0)
    """
    return max(minimum, 3 * median_step) if median_step is not None else minimum
