"""Each rank's stack dump before a stop: asking for it, reading it, knowing when it is all in.

A run that times out or is stopped asks every live rank for a faulthandler dump
(nbtrain.messages.stacktext) and waits until each has gone quiet, at most STACK_WAIT_SECONDS, before
its ranks are signalled: RunEnded then says where each rank was.

Each rank registers faulthandler at start on a spare real-time signal, writing to a pipe only
the launcher reads. The launcher sends the signal only to ranks that registered it (it reads
the rank's ``SigCgt`` mask in /proc; until then the rank ignores the signal, so an early
request is lost rather than fatal). faulthandler dumps from its C signal handler, so a rank
blocked in a C++ collective answers; a Python-level handler would run only when the collective
returned, which in a deadlock is never. A healthy run pays only the registration.
"""

from __future__ import annotations

import os
import selectors
import time

from nbtrain.launch_server import stopatstep
from nbtrain.launch_server.launched import LauncherRun, RankProcess
from nbtrain.messages import events, stacktext
from nbtrain.system import processes

# Before stopping a run that timed out or was stopped, each rank dumps its stack: wait for
# every dump to arrive and go quiet, but never longer than STACK_WAIT_SECONDS in all.
STACK_WAIT_SECONDS = 1.0
STACK_QUIET_SECONDS = 0.05


def request_dumps(run: LauncherRun) -> bool:
    """Signal every live rank for its stack dump; False when none can answer."""
    for rank in run.ranks:
        rank.stack = b""  # what an earlier look (nbtrain.launch_server.uneven) read is not this stop's
        rank.stack_asked = not rank.exited and processes.request_stack(rank.pid)
    return any(rank.stack_asked for rank in run.ranks)


def dumps_in(run: LauncherRun, now: float) -> bool:
    """Whether every rank asked has dumped and gone quiet (or exited)."""
    return all(
        rank.exited or not rank.stack_asked or (rank.stack and now - rank.stack_seen_at > STACK_QUIET_SECONDS)
        for rank in run.ranks
    )


def read_dump(selector: selectors.BaseSelector, rank: RankProcess) -> None:
    """Read what the rank's faulthandler wrote; at EOF, close its pipe."""
    assert rank.stack_fd is not None
    try:
        data = os.read(rank.stack_fd, 65536)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if not data:  # every holder of the write end is gone
        close_dump(selector, rank)
        return
    rank.stack += data
    rank.stack_seen_at = time.monotonic()


def close_dump(selector: selectors.BaseSelector, rank: RankProcess) -> None:
    """Stop reading the rank's dump pipe (it is done, or the rank leaves the run)."""
    if rank.stack_fd is not None:
        selector.unregister(rank.stack_fd)
        os.close(rank.stack_fd)
        rank.stack_fd = None


def frames_of(rank: RankProcess) -> tuple[stacktext.Frame, ...]:
    """The frames of the rank's dump, innermost last."""
    return stacktext.parse_dump(rank.stack.decode("utf-8", "replace"))


def dumps_of(run: LauncherRun) -> tuple[tuple[int, str], ...]:
    """What each rank's dump said, for a run that ended by a timeout or a stop."""
    if run.ending.outcome not in (events.STOPPED, events.TIMED_OUT):
        return ()
    return tuple(
        (rank.spec.rank, rank.stack.decode("utf-8", "replace")) for rank in run.ranks if rank.stack or rank.stack_asked
    )


def laggards(run: LauncherRun) -> str:
    """The note naming the ranks that kept a graceful stop from its step (after the dumps: not those waiting)."""
    if run.graceful is None or run.board is None:
        return run.ending.note
    slots = {rank.spec.rank: index for index, rank in enumerate(run.ranks)}
    waiting = frozenset(r.spec.rank for r in run.ranks if r.stack and stacktext.waits_on_peers(frames_of(r)))
    backward = frozenset(r.spec.rank for r in run.ranks if r.stack and stacktext.in_backward(frames_of(r)))
    return stopatstep.laggards_note(run.graceful, run.board, list(run.ending.late), slots, waiting, backward)
