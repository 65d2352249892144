"""The step board: a page of shared memory where ranks count optimizer steps and collectives, and learn where to stop.

The launcher maps one board per run before it forks the ranks (an anonymous shared mapping,
so every forked rank writes into the very page the launcher reads). Each rank has a slot:
how many optimizer steps it has begun, and the durations of its last few steps. The board's
header holds the stop step: ``NO_STOP``, ``PENDING`` while the launcher is choosing it, or
the step every rank stops after. A slot also holds the rank's collective ledger: how many
collectives it has begun and the last one (:class:`Collective`), with the time it entered it
while it waits there (nbtrain.rank.machinery.collectives writes it, nbtrain.launch_server.stalls reads it).

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
import time
from dataclasses import dataclass

NO_STOP = 0
PENDING = -1
RING = 16  # step durations kept per rank, for the grace period (3 x their median)
ENDING_SECONDS = 30.0  # past the grace, for ranks that reached the stop step and are ending their cell

# The torch.distributed collectives the ledger wraps (nbtrain.patches' "collectives" rows), and every
# operation by the index the ledger writes; DTYPES[0]: no tensor (a barrier).
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single",  # FSDP2's gathers and reduce-scatters
)
OPERATIONS = (
    *COLLECTIVES,
    "DDP's gradient all-reduce",  # torch's own, in C++: counted as a syncing forward begins it (a numbering of its own)
)
DTYPES = (
    "", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "objects",
)

# The board is 8-byte words: the header (the stop step), then per rank its count of steps
# begun, its next ring slot and RING step durations (doubles), then its ledger (_LEDGER words:
# see Collective; the last is a double), then whether it stopped at the stop step. Ranks read and
# write single words through a memoryview: the hooks run on every optimizer step and every
# collective, and this is their cost.
_LEDGER = 9
_SLOT_WORDS = 2 + RING + _LEDGER + 1
_STOPPED = 2 + RING + _LEDGER  # the slot's last word


@dataclass(frozen=True)
class Collective:
    """A rank's last collective, as its ledger on the board holds it.

    >>> Collective(3, 0, 3, 0, 4, 1, 0, 8, 0.0).describe()
    'all_reduce of 4 float32 elements'
    """

    calls: int  # collectives the rank has begun in the run (every group)
    group: int  # 0: the default group; else a number made of its members' ranks (the same on each)
    group_call: int  # its number among the group's collectives (1: the group's first)
    operation: int  # index in OPERATIONS
    elements: int  # of its tensor (or tensors), or the number of objects
    dtype: int  # index in DTYPES
    file: int  # crc32 of the file name of the user's call
    line: int
    since: float  # time.monotonic() as it entered; 0.0 once it returned

    def describe(self) -> str:
        """``all_reduce of 4 float32 elements``; ``barrier``; ``all_gather_object of 2 objects``."""
        name, dtype = OPERATIONS[self.operation], DTYPES[self.dtype]
        if not dtype:
            return name
        unit = "" if dtype == "objects" else " elements"
        return f"{name} of {self.elements} {dtype}{unit}"


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

    def enter_collective(self, rank: int, entry: tuple[int, int, int, int, int, int, int]) -> int:
        """``rank`` begins a collective: ``entry`` is (group, group_call, operation, elements, dtype, file, line);
        its new count of collectives begun."""
        index = 1 + rank * _SLOT_WORDS + 2 + RING
        words = self._words
        for offset, value in enumerate(entry, start=1):
            words[index + offset] = value
        calls = words[index] + 1
        words[index] = calls
        self._seconds[index + 8] = time.monotonic()  # last: a peer that sees it set sees the entry whole
        return int(calls)

    def differs(self, rank: int, entry: tuple[int, int, int, int, int, int, int], equal: bool) -> bool:
        """Whether a peer of ``rank`` waits in the same call of the same group as ``entry`` (see
        :meth:`enter_collective`) but in another collective: another operation, or (``equal``) other sizes.
        Single words read: every collective's own check."""
        words, seconds = self._words, self._seconds
        group, call, operation, elements, dtype = entry[:5]
        for peer in range(self.world_size):
            index = 1 + peer * _SLOT_WORDS + 2 + RING
            if peer == rank or not seconds[index + 8] or words[index + 1] != group or words[index + 2] != call:
                continue
            if words[index + 3] != operation or (equal and (words[index + 4], words[index + 5]) != (elements, dtype)):
                return True
        return False

    def leave_collective(self, rank: int) -> None:
        """``rank``'s collective returned."""
        self._seconds[1 + rank * _SLOT_WORDS + 2 + RING + 8] = 0.0

    def collective(self, rank: int) -> Collective:
        """``rank``'s last collective (``calls`` 0: none yet), read whole: read again while it changed meanwhile."""
        index = 1 + rank * _SLOT_WORDS + 2 + RING
        while True:
            since = self._seconds[index + 8]
            calls, group, call, operation, elements, dtype, file, line = self._words[index : index + 8].tolist()
            if self._seconds[index + 8] == since and self._words[index] == calls:
                return Collective(calls, group, call, operation, elements, dtype, file, line, since)

    def activity(self) -> tuple[int, ...]:
        """Each rank's steps and collectives begun: when none of it changes, no rank has moved."""
        slots = (self._slot(rank) for rank in range(self.world_size))
        return tuple(self._words[index + offset] for index in slots for offset in (0, 2 + RING))

    def stop_here(self, rank: int) -> None:
        """``rank`` stops before the step it just counted: uncount it, and mark the rank as at the stop step
        (what is left for it is ending its cell, which a stop waits for longer: see :meth:`stopped`)."""
        index = self._slot(rank)
        self._words[index] -= 1
        self._words[index + _STOPPED] = 1

    def stopped(self, rank: int) -> bool:
        """Whether ``rank`` reached the stop step and is ending its cell there.

        >>> board = StepBoard.create(1); _ = board.begin_step(0); board.stopped(0)
        False
        >>> board.stop_here(0); board.count(0), board.stopped(0)
        (0, True)
        """
        return bool(self._words[self._slot(rank) + _STOPPED])

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
