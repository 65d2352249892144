"""What the launcher knows of each run (``LauncherRun``) and each rank it started (``RankProcess``).

Mutable records owned by the launcher's loop (nbtrain.launch_server.server); a run's phase
and how it ends are its ``lifecycle`` (nbtrain.launch_server.lifecycle), not flags. Nothing here starts or
signals a process.

A failed run's state: a cell that raised keeps what it had done, as one process would (the
rank's ``cell.run_cell`` builds its ``CellResult`` from its own objects, with no collective,
and the runtime sends it with the ``RankFailed``). The launcher keeps the state of the lowest
rank that raised the run's error itself, the same exception at the same line
(:func:`failed_state`; another rank's error is then a consequence, and a rank that died without
raising leaves none), and ``RunEnded`` carries it. Whose report comes first is a race: when a
rank other than 0 sends the first failure while rank 0 is still at work, the run waits in
``AWAITING_RANK_ZERO`` (:func:`awaits_rank_zero`) until rank 0 failed or exited, or
``server.RANK_ZERO_GRACE_SECONDS`` passed; a lower rank's same raise meanwhile takes over as
the cause (:func:`takes_over`): the error names it, it is the rank held for ``%nbtrain_debug``,
and its state comes back, so a cell whose every rank raised brings rank 0's.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from dataclasses import dataclass, field

from nbtrain.launch_server import stopatstep
from nbtrain.launch_server.lifecycle import Ending, Lifecycle, RunPhase
from nbtrain.launch_server.rankpipes import RankOutput, RunLog
from nbtrain.messages import events
from nbtrain.messages.events import RankDone, RankExited, RankFailed, RankNotStarted, StartRun
from nbtrain.system import stepboard


@dataclass
class RankProcess:
    """A rank the launcher started: its descriptors, what it reported, and its stack dump."""

    spec: events.RankSpec
    pid: int
    pidfd: int
    channel: socket.socket
    pipes: dict[int, str]  # read fd -> "stdout" | "stderr"
    output: RankOutput
    done: bool = False
    failed: bool = False
    exited: bool = False
    members: set[int] = field(default_factory=set)  # pids seen in its process group
    stack_fd: int | None = None  # read end of the pipe its faulthandler dumps to
    stack: bytes = b""
    stack_asked: bool = False
    stack_seen_at: float = 0.0  # when the last bytes of its dump arrived
    held: bool = False  # the failed run's root cause, kept alive for a post-mortem
    held_until: float | None = None  # released then, unless a post-mortem is open
    cuda_bytes: int | None = None  # what it last reported holding on its GPU
    release_reason: str = "its debugger ended"  # what HeldReleased says when it is gone
    step_board: stepboard.StepBoard | None = None  # a standby rank's: the run that takes it stops on it


@dataclass
class UnevenWatch:
    """A run's watch for ranks left waiting by one that finished (nbtrain.launch_server.uneven)."""

    first_done_at: float | None = None
    steps_then: tuple[int, ...] = ()  # each rank's optimizer steps begun, at the last look (or the first done)
    next_look: float = 0.0
    asked_at: float | None = None  # stacks asked for, not read yet
    said: bool = False


@dataclass
class StallWatch:
    """A run's watch for a stall: no rank moving while some wait on the others (nbtrain.launch_server.stalls)."""

    seconds: float | None = 30.0  # the run's stall window (None: no watch)
    activity: tuple[int, ...] = ()  # each rank's steps and collectives begun, when they last changed
    moved_at: float | None = None
    next_look: float = 0.0
    asked_at: float | None = None  # stacks asked for, not read yet
    shown: str = ""  # what the kernel's notice says now ("": none shown)


@dataclass
class LauncherRun:
    """What the launcher knows of one run: its ranks, its phase (``lifecycle``) and what it ends with."""

    run_id: int
    ranks: list[RankProcess]
    deadline: float | None
    lifecycle: Lifecycle
    on_cluster: bool = False  # a cluster node's part: done ranks wait for ReleaseRanks (every node done)
    failure: RankFailed | RankExited | RankNotStarted | None = None
    result: bytes | None = None
    result_fd: int | None = None
    offer: RankDone | None = None  # rank 0's result, tensors still in its memory
    last_memory_sample: float = 0.0
    log: RunLog | None = None  # every rank's full output
    last_skipped_report: float = 0.0
    debug_hold: float | None = None  # seconds a failed run's root-cause rank is held
    debugging: set[int] = field(default_factory=set)  # ranks at a pdb prompt: the timeout waits
    paused_at: float = 0.0  # when the first of them stopped
    detail: str = ""  # how a stop came, for RunEnded
    held_text: str | None = None  # its held rank, as the sidebar lists it
    plan: StartRun | None = None  # what standby ranks for the next run are forked for
    board: stepboard.StepBoard | None = None  # the ranks' optimizer steps (forked ranks only)
    on_stop: str = "keep"
    stop_grace: float = 2.0
    graceful: stopatstep.GracefulStop | None = None
    uneven: UnevenWatch = field(default_factory=UnevenWatch)  # ranks left waiting (launch_server.uneven)
    stall: StallWatch = field(default_factory=StallWatch)  # no rank moving (launch_server.stalls)
    # rank -> (its failure, with the cell's state at its raise; that state's tensor file): see failed_state
    failed_states: dict[int, tuple[RankFailed, int | None]] = field(default_factory=dict)

    @property
    def state(self) -> RunPhase:
        """The run's phase now (nbtrain.launch_server.lifecycle)."""
        return self.lifecycle.state

    @property
    def ending(self) -> Ending:
        """How the run will end and why: its state's data (nbtrain.launch_server.lifecycle)."""
        return self.lifecycle.ending

    def move(self, to: RunPhase, **ending: object) -> None:
        """Go to ``to`` now with ``ending``'s fields changed, as the lifecycle's table allows (or raise)."""
        self.lifecycle.move(to, time.monotonic(), **ending)


def kept_step(run: LauncherRun) -> int | None:
    """The step a graceful stop kept (every rank ended its cell there), or None."""
    stop, ending = run.graceful, run.ending
    if stop is None or ending.gave_up or ending.outcome == events.FINISHED or not all(r.done for r in run.ranks):
        return None
    return stop.step


def our_signal(run: LauncherRun, signal_number: int | None) -> bool:
    """Whether a rank died of nbtrain's own stop: SIGTERM, or SIGKILL once the launcher (or,
    for a stop asked in the browser, the server extension) sends it."""
    return signal_number == signal.SIGTERM or (
        signal_number == signal.SIGKILL
        and (run.lifecycle.has_been(RunPhase.KILLED) or run.lifecycle.has_been(RunPhase.STOPPING_OUTSIDE))
    )


def stop_began(run: LauncherRun) -> bool:
    """Whether the launcher began stopping ``run`` (its ranks' exits then count as stopped)."""
    return run.lifecycle.has_been(RunPhase.DUMPING_STACKS) or run.lifecycle.has_been(RunPhase.TERMINATING)


def took_a_step(run: LauncherRun) -> bool:
    """Whether a rank of ``run`` has begun an optimizer step that a stop could keep."""
    return run.board is not None and run.on_stop == "keep" and any(run.board.counts())


def failed_state(run: LauncherRun) -> tuple[int | None, str]:
    """The rank whose state at its raise a failed run brings back (None: none), and why none.

    The state kept is that of the lowest rank that raised the run's error itself: the same
    exception at the same line (every rank of a deterministic cell raises there). Another
    rank's error then is the first one's consequence (a collective it broke, in the middle of
    a step), and a rank that died without raising leaves no rank with a state at a raise.

    >>> boom = RankFailed(1, 1, "RuntimeError", "boom", 'File "c.py", line 4', state=b"s")
    >>> broken = RankFailed(1, 0, "RuntimeError", "Connection closed by peer", 'File "c.py", line 2', state=b"s")
    >>> run = LauncherRun(1, [], None, Lifecycle(1, 0.0), failure=boom)
    >>> run.failed_states = {0: (broken, None), 1: (boom, None)}
    >>> failed_state(run)
    (1, '')
    >>> run.failed_states[0] = (RankFailed(1, 0, "RuntimeError", "boom", 'File "c.py", line 4', state=b"s"), None)
    >>> failed_state(run)
    (0, '')
    """
    failure = run.failure
    if isinstance(failure, RankExited):
        if not run.failed_states:
            return None, ""
        return None, (
            f"rank {failure.rank} ended without raising an error, so no rank holds a state at a raise "
            "(the others' errors came from its end, in the middle of a step)"
        )
    if not isinstance(failure, RankFailed):
        return None, ""
    same = [rank for rank, (m, _) in run.failed_states.items() if m.state is not None and _same_raise(m, failure)]
    if same:
        return min(same), ""
    own = run.failed_states.get(failure.rank)
    note = own[0].state_note if own is not None else ""
    return None, (f"rank {failure.rank}: {note}" if note else "")


def awaits_rank_zero(run: LauncherRun) -> bool:
    """Whether a failing run waits a moment for rank 0's own error before its ranks are stopped.

    Its cause so far is a raise of a rank other than 0 that sent its state there, and rank 0 is
    still at work (alive, not done, not failed): in a deterministic cell every rank raises at the
    same line, and whose report reaches the launcher first is a race. Rank 0's state is what a
    finished cell brings back, so the one a failed cell brings back should be rank 0's too.
    """
    failure = run.failure
    if not isinstance(failure, RankFailed) or failure.rank == 0 or not _has_state(run, failure.rank):
        return False
    return any(rank.spec.rank == 0 and not (rank.exited or rank.done or rank.failed) for rank in run.ranks)


def takes_over(run: LauncherRun, failure: RankFailed) -> bool:
    """Whether ``failure``, come while the run awaits rank 0, becomes the run's cause: a lower rank
    raised the same error at the same line, with its state (the error named, the rank held for
    ``%nbtrain_debug`` and the state brought back are then all that rank's).

    >>> run = LauncherRun(1, [], None, Lifecycle(1, 0.0))
    >>> run.failure = RankFailed(1, 1, "RuntimeError", "boom", 'File "c.py", line 4')
    >>> run.move(RunPhase.AWAITING_RANK_ZERO)
    >>> zero = RankFailed(1, 0, "RuntimeError", "boom", 'File "c.py", line 4', state=b"s")
    >>> run.failed_states = {0: (zero, None)}
    >>> takes_over(run, zero)
    True
    >>> broken = RankFailed(1, 0, "RuntimeError", "Connection closed by peer", 'File "c.py", line 2', state=b"s")
    >>> run.failed_states = {0: (broken, None)}
    >>> takes_over(run, broken)  # another error: a consequence of rank 1's
    False
    """
    cause = run.failure
    if run.state is not RunPhase.AWAITING_RANK_ZERO or not isinstance(cause, RankFailed):
        return False
    return failure.rank < cause.rank and _has_state(run, failure.rank) and _same_raise(failure, cause)


def _has_state(run: LauncherRun, rank: int) -> bool:
    """Whether ``rank`` sent its state at its raise."""
    sent = run.failed_states.get(rank)
    return sent is not None and sent[0].state is not None


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _same_raise(one: RankFailed, other: RankFailed) -> bool:
    """Whether two ranks raised the same error at the same line (their tracebacks' last frames)."""
    def where(text: str) -> tuple[str, str] | None:
        frames = _FRAME.findall(text)
        return frames[-1] if frames else None

    same_error = (one.exc_type, one.message) == (other.exc_type, other.message)
    return same_error and where(one.traceback) == where(other.traceback)
