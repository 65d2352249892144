"""The launcher's run lifecycle: the phases a run passes through, and which may follow which.

A run is in exactly one :class:`RunPhase` at a time; :data:`TRANSITIONS` is the one table of
the moves allowed, and :class:`Lifecycle` makes them (each logged at debug level; a move the
table does not allow raises, naming both states). Pure: no processes, no sockets, no clock
of its own (the launcher passes the time in).

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
>>> life.move(RunPhase.DUMPING_STACKS, now=1.0)
>>> life.state, life.since
(<RunPhase.DUMPING_STACKS: 'dumping stacks'>, 1.0)
>>> life.move(RunPhase.ENDED, now=2.0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
nbtrain.launch_server.lifecycle.IllegalTransition: run 7 cannot go from DUMPING_STACKS to ENDED: ...
"""

from __future__ import annotations

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
    _S.RUNNING: frozenset(
        {
            _S.STOPPING_AT_STEP,
            _S.OFFERING,
            _S.WAITING_FOR_NODES,
            _S.RELEASED,
            _S.STOPPING_OUTSIDE,
            _S.DUMPING_STACKS,
            _S.AWAITING_RANK_ZERO,
            _S.TERMINATING,
        }
    ),
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


def allowed(before: RunPhase, after: RunPhase) -> bool:
    """Whether a run in ``before`` may go to ``after``.

    >>> allowed(RunPhase.RUNNING, RunPhase.OFFERING), allowed(RunPhase.ENDED, RunPhase.RUNNING)
    (True, False)
    """
    return after in TRANSITIONS[before]


class Lifecycle:
    """One run's state, since when it holds, and every state the run has been in.

    >>> life = Lifecycle(3, now=10.0)
    >>> life.move(RunPhase.TERMINATING, now=11.0)
    >>> life.has_been(RunPhase.TERMINATING), life.has_been(RunPhase.KILLED), life.state.name
    (True, False, 'TERMINATING')
    """

    def __init__(self, run_id: int, now: float) -> None:
        self.run_id = run_id
        self.state = RunPhase.RUNNING
        self.since = now  # when the run entered its state (a grace or a deadline counts from it)
        self.history: list[RunPhase] = [RunPhase.RUNNING]

    def move(self, to: RunPhase, now: float) -> None:
        """Go to ``to`` at ``now``; raises :class:`IllegalTransition` if the table does not allow it."""
        if not allowed(self.state, to):
            allowed_next = ", ".join(sorted(state.name for state in TRANSITIONS[self.state])) or "none"
            raise IllegalTransition(
                f"run {self.run_id} cannot go from {self.state.name} to {to.name}: "
                f"from {self.state.name} it may only go to {allowed_next}; this is a bug of nbtrain's launcher "
                "(nbtrain.launch_server.lifecycle.TRANSITIONS), please report it with the run's output"
            )
        logger.debug("run %d: %s -> %s", self.run_id, self.state.name, to.name)
        self.state, self.since = to, now
        self.history.append(to)

    def has_been(self, state: RunPhase) -> bool:
        """Whether the run is, or once was, in ``state`` (a stop began, SIGKILL was sent)."""
        return state in self.history
