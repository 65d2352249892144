"""A stop at a step boundary, on a rank: count optimizer steps, and end the cell at the step the launcher chose.

The launcher forks each rank with the run's :class:`nbtrain.system.stepboard.StepBoard` and its
slot (:func:`attach`). A ``%%distributed`` cell's step hooks (:mod:`~nbtrain.rank.auto.stephooks`)
call :func:`check_stop` and :func:`leave_counted_step`: before each outermost step the rank counts it on the
board and looks at the stop step; when the launcher has chosen one and this step would go
past it, the hook raises :class:`StopAtStep` instead, and :func:`nbtrain.rank.cell.run_cell`
ends the cell there as if it had finished: its models, optimizers and schedulers hold the
stop step, and rank 0 sends them back.

The check is at the *next* step's start, not the stop step's end: by then the loop's own
``scheduler.step()`` for the stop step has run, and every rank has gone through the same
collectives (DDP's gradient all-reduce, FSDP's gathers), so none is left waiting in one.
The forward and backward of that next step ran but changed no weight; buffers a forward
updates (BatchNorm's running statistics) include it.

Per step this costs about a microsecond or two: a few words read and written on the shared page.
"""

from __future__ import annotations

import time
from typing import Any

from nbtrain.system import stepboard

PENDING_POLL_SECONDS = 0.002  # while the launcher chooses the step (at most one of its ticks)


class StopAtStep(BaseException):
    """Raised by the step hook where a graceful stop ends the cell (``except Exception`` lets it by)."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class _Counter:
    def __init__(self, board: stepboard.StepBoard, slot: int) -> None:
        self.board = board
        self.slot = slot
        self.depth = 0  # an optimizer's step inside another's (ZeroRedundancyOptimizer's) is not a step
        self.last_begin: float | None = None

    def before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Count the outermost step on the board; raise :class:`StopAtStep` where it would pass the stop step.

        It also records the whole iteration just ended (data, forward, backward and step: from
        one step's start to the next), for the grace period of a stop.
        """
        self.depth += 1
        if self.depth > 1:
            return
        now, last = time.monotonic(), self.last_begin
        self.last_begin = now
        # Counted before the header is read (see stepboard).
        count = self.board.begin_step(self.slot, None if last is None else now - last)
        stop = self.board.stop_step()
        if stop != stepboard.NO_STOP:
            self._stop_if_due(count, stop)

    def _stop_if_due(self, count: int, stop: int) -> None:
        while stop == stepboard.PENDING:
            time.sleep(PENDING_POLL_SECONDS)
            stop = self.board.stop_step()
        if stop != stepboard.NO_STOP and count > stop:
            self.board.stop_here(self.slot)
            self.depth = 0
            raise StopAtStep(stop)

    def after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The step ended: a step inside it no longer is."""
        self.depth = max(0, self.depth - 1)


_counter: _Counter | None = None  # this rank's count on the run's board (None: no board, a spawned rank)


def attach(board: stepboard.StepBoard | None, slot: int) -> None:
    """Called by the launcher in a forked rank: the run's board and this rank's slot on it."""
    global _counter
    _counter = None if board is None else _Counter(board, slot)


def counting() -> bool:
    """Whether this rank counts its steps on a board (a forked rank; a spawned one has none)."""
    return _counter is not None


def steps_begun() -> int | None:
    """This rank's optimizer steps begun in the run, as its board counts them (None: no board).

    >>> steps_begun() is None  # outside a forked rank
    True
    """
    return None if _counter is None else _counter.board.count(_counter.slot)


def check_stop(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step hook's (:mod:`~nbtrain.rank.auto.stephooks`): count the step; raise :class:`StopAtStep` past the
    stop."""
    if _counter is not None:
        _counter.before_step(optimizer, args, kwargs)


def leave_counted_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step hook's: the step ended."""
    if _counter is not None:
        _counter.after_step(optimizer, args, kwargs)
