"""The launcher's run lifecycle: the phases a run passes through, which may follow which, and why it ends.

A run is in exactly one :class:`RunPhase` at a time; :data:`TRANSITIONS` is the one table of
the moves allowed, and :class:`Lifecycle` makes them (each logged at debug level; a move the
table does not allow raises, naming both states). How the run will end and why (its outcome,
the note on a stop that could not keep the state, whether a stop at a step gave up, and on
which ranks) is the state's data, an :class:`Ending` that the move into a stop carries: no
flag is read beside the state. Pure: no processes, no sockets, no clock of its own (the
launcher passes the time in). The kernel's cluster relay (nbtrain.cluster.engine) follows a run
over the nodes with the same machine (RUNNING, STOPPING_AT_STEP, TERMINATING), and the kernel and
the nodes name a stop's notes from here (:data:`HARD_STOP`, :data:`SECOND_STOP`, :func:`hard_stop`,
:func:`names_late`).

::

    RUNNING ──► STOPPING_AT_STEP        (a stop that keeps the state: the ranks go on to a step)
       │              │
       ├──────────────┴──► OFFERING ──► WAITING_FOR_NODES ──► RELEASED ──► DRAINING ──► ENDED
       │  every rank done  (rank 0's     (a cluster node:      (told to                ▲
       │                    result)       every node done)      leave)                 │
       │                                                                               │
       ├──► DUMPING_STACKS / STOPPING_OUTSIDE ──► TERMINATING ──► KILLED ──────────────┘
       │    (a stop, a timeout)                   (SIGTERM)       (SIGKILL)
       │                                               ▲
       └──► AWAITING_RANK_ZERO ────────────────────────┘
            (another rank raised first: rank 0's own error awaited a moment)

A state may skip the ones after it (a run with no offer goes from RUNNING to RELEASED), and
every state before DUMPING_STACKS may go straight to TERMINATING (a failure); the exact moves
are the rows of :data:`TRANSITIONS`.

>>> life = Lifecycle(7, now=0.0)
>>> life.move(RunPhase.DUMPING_STACKS, now=1.0, outcome="timed out")
>>> life.state, life.since, life.ending.outcome
(<RunPhase.DUMPING_STACKS: 'dumping stacks'>, 1.0, 'timed out')
>>> life.move(RunPhase.ENDED, now=2.0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
nbtrain.launch_server.lifecycle.IllegalTransition: run 7 cannot go from DUMPING_STACKS to ENDED: ...
"""

from __future__ import annotations

import dataclasses
import enum
import logging

logger = logging.getLogger(__name__)


class RunPhase(enum.Enum):
    """Where a run of the launcher is: which of its ranks may still work, and what it waits for."""

    RUNNING = "running"  # its ranks run the cell
    STOPPING_AT_STEP = "stopping at a step"  # asked to stop: the ranks go on to a common optimizer step
    OFFERING = "offering its result"  # every rank done; rank 0's result offered to the kernel
    WAITING_FOR_NODES = "waiting for the other nodes"  # a cluster node's ranks wait for every node's
    RELEASED = "released"  # every rank told to leave; their exits awaited
    STOPPING_OUTSIDE = "stopped from the browser"  # the server extension signals the ranks itself
    # A rank other than 0 raised first, with its state at the raise: rank 0, still at work, may be
    # raising the same error at the same line; its own failure is awaited a moment (launched.awaits_rank_zero)
    AWAITING_RANK_ZERO = "awaiting rank 0's error"
    DUMPING_STACKS = "dumping stacks"  # each live rank writes its stack before it is stopped
    TERMINATING = "terminating"  # SIGTERM sent to every rank's group; SIGKILL after a grace
    KILLED = "killed"  # SIGKILL sent to every rank left
    DRAINING = "draining"  # every rank gone (or held for a post-mortem); its last output read
    ENDED = "ended"  # RunEnded sent


_S = RunPhase

# The one place that says what a run may do next. A state missing from a row's set is a bug
# of the launcher, not a user's mistake: Lifecycle.move raises.
TRANSITIONS: dict[RunPhase, frozenset[RunPhase]] = {
    _S.RUNNING: frozenset({
        _S.STOPPING_AT_STEP, _S.OFFERING, _S.WAITING_FOR_NODES, _S.RELEASED,
        _S.STOPPING_OUTSIDE, _S.DUMPING_STACKS, _S.AWAITING_RANK_ZERO, _S.TERMINATING,
    }),
    _S.AWAITING_RANK_ZERO: frozenset({_S.TERMINATING}),
    _S.STOPPING_AT_STEP: frozenset({_S.OFFERING, _S.WAITING_FOR_NODES, _S.RELEASED, _S.DUMPING_STACKS, _S.TERMINATING}),
    _S.OFFERING: frozenset(
        {_S.WAITING_FOR_NODES, _S.RELEASED, _S.STOPPING_OUTSIDE, _S.DUMPING_STACKS, _S.TERMINATING, _S.DRAINING}
    ),
    _S.WAITING_FOR_NODES: frozenset({_S.RELEASED, _S.STOPPING_OUTSIDE, _S.TERMINATING, _S.DRAINING}),
    _S.RELEASED: frozenset({_S.STOPPING_OUTSIDE, _S.TERMINATING, _S.DRAINING}),
    _S.STOPPING_OUTSIDE: frozenset({_S.TERMINATING}),
    _S.DUMPING_STACKS: frozenset({_S.TERMINATING}),
    _S.TERMINATING: frozenset({_S.KILLED, _S.DRAINING}),
    _S.KILLED: frozenset({_S.DRAINING}),
    _S.DRAINING: frozenset({_S.ENDED}),
    _S.ENDED: frozenset(),
}

# The states whose ranks may still be at work: a timeout, a stop or a failure can still begin.
ACTIVE = frozenset({_S.RUNNING, _S.STOPPING_AT_STEP})
# Every rank done, the run not yet stopping: what a rank's unexpected exit turns into a stop.
DONE = frozenset({_S.OFFERING, _S.WAITING_FOR_NODES, _S.RELEASED})
# A stop (with or without stack dumps) may begin from these.
STOPPABLE = ACTIVE | DONE
# Once every rank has exited, the run drains its output from these.
CAN_DRAIN = frozenset(state for state, after in TRANSITIONS.items() if _S.DRAINING in after)


class IllegalTransition(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow: a bug of the launcher, named with both states."""


@dataclasses.dataclass(frozen=True)
class Ending:
    """How a run will end and why: the data of its state, replaced whole by the move that changes it.

    >>> Ending(outcome="stopped", note=hard_stop("rank 1", "step 9", 2.0), gave_up=True, late=(1,))
    Ending(outcome='stopped', note='stopped hard (rank 1 did not reach step 9 within 2.0 s)', gave_up=True, late=(1,))
    """

    outcome: str | None = None  # what RunEnded will say (events.FINISHED, ...): None until it is known
    note: str = ""  # why a stop could not keep the state (RunEnded.stop_note)
    gave_up: bool = False  # a stop at a step became a hard one: a rank came late, or a second stop was asked
    late: tuple[int, ...] = ()  # the ranks it gave up on (their stack dumps then name who waited for whom)


# A stop's notes, as every side writes and reads them (the launcher, the kernel and its cluster relay, the
# nodes). Every note of a stop that could not keep the state begins alike: the kernel's error leads with it.
HARD_STOP = "stopped hard"
SECOND_STOP = f"{HARD_STOP} at once (asked to stop a second time)"


def hard_stop(who: str, missed: str, seconds: float) -> str:
    """The note of a stop at a step given up on: who did not reach what in time.

    >>> names_late(hard_stop("rank 1", "step 9", 2.0)), names_late(SECOND_STOP)
    (True, False)
    """
    return f"{HARD_STOP} ({who} did not reach {missed} within {seconds:.1f} s)"


def names_late(note: str) -> bool:
    """Whether ``note`` names a rank that came late (the cause), not a stop asked twice (its consequence)."""
    return "did not reach" in note


def allowed(before: RunPhase, after: RunPhase) -> bool:
    """Whether a run in ``before`` may go to ``after``.

    >>> allowed(RunPhase.RUNNING, RunPhase.OFFERING), allowed(RunPhase.ENDED, RunPhase.RUNNING)
    (True, False)
    """
    return after in TRANSITIONS[before]


class Lifecycle:
    """One run's state, since when it holds, every state the run has been in, and how it will end.

    >>> life = Lifecycle(3, now=10.0)
    >>> life.move(RunPhase.TERMINATING, now=11.0, outcome="stopped", gave_up=True)
    >>> life.has_been(RunPhase.TERMINATING), life.has_been(RunPhase.KILLED), life.state.name, life.ending.gave_up
    (True, False, 'TERMINATING', True)
    """

    def __init__(self, run_id: int, now: float) -> None:
        self.run_id = run_id
        self.state = RunPhase.RUNNING
        self.since = now  # when the run entered its state (a grace or a deadline counts from it)
        self.history: list[RunPhase] = [RunPhase.RUNNING]
        self.ending = Ending()

    def move(self, to: RunPhase, now: float, **ending: object) -> None:
        """Go to ``to`` at ``now``, with ``ending``'s fields changed; raises :class:`IllegalTransition`
        if the table does not allow it (nothing changes then)."""
        if not allowed(self.state, to):
            allowed_next = ", ".join(sorted(state.name for state in TRANSITIONS[self.state])) or "none"
            raise IllegalTransition(
                f"run {self.run_id} cannot go from {self.state.name} to {to.name}: "
                f"from {self.state.name} it may only go to {allowed_next}; this is a bug of nbtrain's launcher "
                "(nbtrain.launch_server.lifecycle.TRANSITIONS), please report it with the run's output"
            )
        logger.debug("run %d: %s -> %s", self.run_id, self.state.name, to.name)
        self.learn(**ending)
        self.state, self.since = to, now
        self.history.append(to)

    def learn(self, **ending: object) -> None:
        """Change ``ending``'s fields in the state the run is in: what it learned before its next move
        (the outcome of ranks all done, why a stop at a step cannot begin)."""
        self.ending = dataclasses.replace(self.ending, **ending)  # type: ignore[arg-type]

    def has_been(self, state: RunPhase) -> bool:
        """Whether the run is, or once was, in ``state`` (a stop began, SIGKILL was sent)."""
        return state in self.history
