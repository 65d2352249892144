"""Ranks left waiting for a rank that finished: seen by the launcher, told to the kernel once, the run going on.

A rank that ends its cell while the others still step (a ``break`` or an ``if`` on the
rank that only some take) leaves them in their next collective, DDP's gradient all-reduce
in a backward or an ``all_reduce``, waiting for it: it will never join, so they wait until
the run's timeout, or for ever. From the notebook that looks like a slow run.
:data:`UNEVEN_SECONDS` after the first rank finished, the launcher asks the others for
their stacks (faulthandler, as before a stop; the run goes on). A rank whose stack waits
on its peers, with no optimizer step begun since the last look, is stuck: the
kernel gets :class:`~nbtrain.messages.events.RanksWaiting`, with where it waits. A rank busy on its
own (the usual uneven end: one rank still evaluating or saving) is looked at again later.
"""

from __future__ import annotations

from nbtrain.launch_server import stackdumps
from nbtrain.launch_server.launched import LauncherRun, RankProcess
from nbtrain.launch_server.lifecycle import RunPhase
from nbtrain.messages import events, stacktext
from nbtrain.system import processes

UNEVEN_SECONDS = 10.0  # after the first rank finished, the others' stacks are looked at (then as often)


def on_done(run: LauncherRun, now: float) -> None:
    """A rank of ``run`` finished its cell: the first one starts the watch."""
    watch = run.uneven
    if watch.first_done_at is None:
        watch.first_done_at = now
        watch.next_look = now + UNEVEN_SECONDS
        watch.steps_then = _steps(run)


def look(run: LauncherRun, now: float) -> events.RanksWaiting | None:
    """From the launcher's tick: ask the unfinished ranks for their stacks when due; once they
    are in, the event to send if some wait for a finished rank (else None, and a later look)."""
    watch = run.uneven
    if watch.said or watch.first_done_at is None or run.state is not RunPhase.RUNNING or run.debugging:
        return None
    busy = [rank for rank in run.ranks if not rank.done and not rank.exited]
    if not busy:
        return None
    if watch.asked_at is None:
        if now >= watch.next_look:
            watch.asked_at = now
            answering = [rank for rank in busy if _ask(rank)]  # asks every one
            watch.said = not answering  # none can answer: nothing to tell
        return None
    if now - watch.asked_at <= stackdumps.STACK_WAIT_SECONDS and not stackdumps.dumps_in(run, now):
        return None
    stuck = [rank for rank in busy if rank.stack and stacktext.waits_on_peers(stackdumps.frames_of(rank))]
    dumps = tuple((rank.spec.rank, rank.stack.decode("utf-8", "replace")) for rank in stuck)
    for rank in busy:
        rank.stack, rank.stack_asked = b"", False
    watch.asked_at, watch.next_look = None, now + UNEVEN_SECONDS
    steps, watch.steps_then = watch.steps_then, _steps(run)
    if not stuck or watch.steps_then != steps:  # a step since the last look: not stuck (yet)
        return None
    watch.said = True
    finished = tuple(rank.spec.rank for rank in run.ranks if rank.done)
    counts = _collectives(run)
    return events.RanksWaiting(run.run_id, finished, now - watch.first_done_at, dumps, counts)


def _collectives(run: LauncherRun) -> tuple[tuple[int, int], ...]:
    """(rank, collectives it began) by each rank's ledger on the board: who skipped one."""
    board = run.board
    if board is None:
        return ()
    return tuple((rank.spec.rank, board.collective(slot).calls) for slot, rank in enumerate(run.ranks))


def _ask(rank: RankProcess) -> bool:
    rank.stack = b""
    rank.stack_asked = processes.request_stack(rank.pid)
    return rank.stack_asked


def _steps(run: LauncherRun) -> tuple[int, ...]:
    return tuple(run.board.counts()) if run.board is not None else ()
