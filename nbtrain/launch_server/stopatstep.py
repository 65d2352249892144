"""A graceful stop, as the launcher follows it: ask, choose the step, wait for every rank, or give up.

1. Asked (the kernel's StopRun with ``graceful``, or the run's timeout): the board goes to
   ``PENDING`` (:mod:`nbtrain.system.stepboard`), unless no rank has begun an optimizer step yet,
   or the run was started with ``--on-stop discard``, or its ranks have no board (spawned
   ranks): then the stop is the hard one, as it always was.
2. A tick later the launcher chooses the step (the highest any rank has begun) and the grace
   period (at least the run's ``stop_grace``, 3 x the median step otherwise).
3. Every rank ends its cell at that step and reports done: the run ends with rank 0's result
   and ``stopped_at``. A rank that has not reached the step when the grace is over makes it a
   hard stop, and the note names it (one that reached it and is still ending its cell gets
   ``stepboard.ENDING_SECONDS`` more).

On a cluster's node (``across_nodes``) step 2 is the kernel's: the launcher reports its own
ranks' highest step (``StepsBegun``) while they wait, and adopts the step the kernel chose
over every node (``StepChosen``; :mod:`nbtrain.cluster.crossnodestop`); step 3 is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbtrain.launch_server import lifecycle
from nbtrain.messages import events
from nbtrain.system import stepboard

CHOOSE_AFTER_SECONDS = 0.01  # between PENDING and reading the counts: every count written before is seen


@dataclass
class GracefulStop:
    """One run's graceful stop in progress; whether it gave up is the run's (its lifecycle's ``ending``)."""

    state: str  # how the run ends: events.STOPPED or events.TIMED_OUT
    asked_at: float
    step: int | None = None  # chosen a tick after asked_at
    grace: float = 0.0
    deadline: float | None = None
    across_nodes: bool = False  # a cluster's node: the kernel chooses the step over every node
    reported: bool = False  # across_nodes: this node's highest step went to the kernel

    def choose(self, board: stepboard.StepBoard, minimum_grace: float, now: float) -> bool:
        """Choose the step when it is time; True when it was chosen now."""
        if self.step is not None or now - self.asked_at < CHOOSE_AFTER_SECONDS or self.across_nodes:
            return False
        self.step = board.choose_stop()
        self.grace = stepboard.grace_seconds(minimum_grace, board.median_step_seconds())
        self.deadline = now + self.grace
        return True

    def report(
        self, run_id: int, board: stepboard.StepBoard, minimum_grace: float, now: float
    ) -> events.StepsBegun | None:
        """On a cluster's node, once it is time: this node's highest step, for the kernel to choose from.

        >>> board = stepboard.StepBoard.create(1); _ = board.begin_step(0); board.request_stop()
        >>> stop = GracefulStop("stopped", 0.0, across_nodes=True)
        >>> stop.report(7, board, 2.0, 1.0), stop.report(7, board, 2.0, 1.1)
        (StepsBegun(run_id=7, highest=1, grace=2.0, state='stopped'), None)
        """
        if not self.across_nodes or self.reported or now - self.asked_at < CHOOSE_AFTER_SECONDS:
            return None
        self.reported = True
        grace = stepboard.grace_seconds(minimum_grace, board.median_step_seconds())
        return events.StepsBegun(run_id, max(board.counts(), default=0), grace, self.state)

    def adopt(self, board: stepboard.StepBoard, chosen: events.StepChosen, now: float) -> bool:
        """The kernel's step for every node: publish it to this node's ranks; False when it came too late
        (asked of a stop still going to its step only: one given up has left STOPPING_AT_STEP)."""
        if not self.across_nodes or self.step is not None:
            return False
        board.publish_stop(chosen.step)
        self.step, self.grace, self.deadline = chosen.step, chosen.grace, now + chosen.grace
        return True

    def overdue(self, now: float, ending: bool = False) -> bool:
        """Whether the grace is over (the launcher, still in STOPPING_AT_STEP, then stops hard).

        ``ending``: every rank not done has reached the stop step and is ending its cell (its ``finally``
        blocks, gathering and pickling its state): slow on a loaded machine, not stuck, so it has
        stepboard.ENDING_SECONDS more.

        >>> stop = GracefulStop("stopped", 0.0, step=3, grace=2.0, deadline=2.0)
        >>> stop.overdue(2.5), stop.overdue(2.5, ending=True), stop.overdue(2.1 + stepboard.ENDING_SECONDS, ending=True)
        (True, False, True)
        """
        return self.deadline is not None and now > self.deadline + (stepboard.ENDING_SECONDS if ending else 0.0)


def why_none(board: stepboard.StepBoard | None, on_stop: str) -> str:
    """Why a run cannot stop gracefully now ("" when it can)."""
    if on_stop != "keep":
        return ""  # asked for the stop it gets: nothing to explain
    if board is None:
        return (
            "It could not stop at an optimizer step: nbtrain cannot follow the steps of spawned ranks "
            "(ddp_spawn)."
        )
    if max(board.counts(), default=0) == 0:
        return (
            "It could not stop at an optimizer step: none had run (a loop without optimizer.step(), or an "
            "optimizer outside torch.optim, which nbtrain does not see)."
        )
    return ""


def laggards_note(
    stop: GracefulStop,
    board: stepboard.StepBoard,
    not_done: list[int],
    slots: dict[int, int],
    waiting: frozenset[int] = frozenset(),
    in_backward: frozenset[int] = frozenset(),
) -> str:
    """"stopped hard (rank 1 did not reach step 412 within 2.0 s)": who kept the run from stopping at its step.

    ``not_done`` are the ranks that had not ended their cell; ``slots`` maps a rank to its slot on the
    board; ``waiting`` are ranks whose stack showed them waiting for the others (not the cause), and
    ``in_backward`` those of them waiting in a backward pass, the step every rank takes: where every late
    rank waits, one in a collective of its own (outside the step) is the one the others did not join.

    >>> board = stepboard.StepBoard.create(2)
    >>> _ = [board.begin_step(0) for _ in range(3)] + [board.begin_step(1)]
    >>> stop = GracefulStop("stopped", 0.0, step=3, grace=2.0)
    >>> laggards_note(stop, board, [1], {0: 0, 1: 1})
    'stopped hard (rank 1 did not reach step 3 within 2.0 s)'
    >>> early = GracefulStop("stopped", 0.0, step=1, grace=2.0)  # both began it; rank 1 waits for rank 0
    >>> laggards_note(early, board, [0, 1], {0: 0, 1: 1}, waiting=frozenset({1}))
    'stopped hard (rank 0 did not reach the optimizer step after step 1 within 2.0 s)'
    >>> deadlock = GracefulStop("stopped", 0.0, step=3, grace=2.0)  # rank 1 in an all_reduce rank 0 never joins
    >>> _ = board.begin_step(1); _ = board.begin_step(1)
    >>> laggards_note(deadlock, board, [0, 1], {0: 0, 1: 1}, frozenset({0, 1}), in_backward=frozenset({0}))
    'stopped hard (rank 1 did not reach the optimizer step after step 3 within 2.0 s)'
    """
    behind = [rank for rank in not_done if board.count(slots[rank]) < (stop.step or 0)]
    # Every late rank had begun the step: one is stuck after it (a sleep, a loop) and the others wait for it.
    named = (
        behind
        or [rank for rank in not_done if rank not in waiting]
        or [rank for rank in not_done if rank not in in_backward]  # a collective the others did not join
        or not_done
    )
    names = ", ".join(str(rank) for rank in named)
    who = f"rank {names}" if len(named) == 1 else f"ranks {names}"
    # Those behind missed the step; the others had begun it: the cell ends for it where the next
    # optimizer step starts, which never came.
    missed = f"step {stop.step}" if behind else f"the optimizer step after step {stop.step}"
    return lifecycle.hard_stop(who, missed, stop.grace)
