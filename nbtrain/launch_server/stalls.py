"""A stall named while it happens: no rank moving while some wait on the others, told to the kernel, the run going on.

Every rank writes its collectives on the run's board (nbtrain.rank.machinery.collectives) and
counts its optimizer steps there (nbtrain.rank.machinery.stepcheck). The launcher reads the
board at each tick: while any rank begins a collective or a step, the run moves. Once none has
for the run's stall window (``--stall-warning``, 30 s by default), the launcher asks every rank
for its stack (faulthandler, as before a stop; the run goes on). Ranks waiting in a collective
(by their ledger) or on the others (by their stack: a backward's gradient all-reduce, DDP's
forward) make it a stall: the kernel gets :class:`~nbtrain.messages.events.RanksStalled`, with
each rank's last collective and stack, and says which ranks wait, in which call, and where the
others are. Nobody waiting (a long evaluation on every rank) is no stall: looked at again a
window later. The notice is sent again when the picture changes, and cleared the moment any
rank moves: a slow step is not a hang, so the run is never stopped for it.

Ranks that finished the cell while others wait are :mod:`nbtrain.launch_server.uneven`'s.
Per tick this costs a read of two words per rank.
"""

from __future__ import annotations

from nbtrain.launch_server import stackdumps
from nbtrain.launch_server.launched import LauncherRun, RankProcess, StallWatch
from nbtrain.launch_server.lifecycle import RunPhase
from nbtrain.messages import events, stacktext
from nbtrain.system import processes, stepboard


def notice(run: LauncherRun, now: float) -> events.RanksStalled | None:
    """From the launcher's tick: the notice to send now (a stall, its new picture, or its end), else None."""
    watch, board = run.stall, run.board
    if watch.seconds is None or board is None or run.state is not RunPhase.RUNNING:
        return None
    activity = board.activity()
    if activity != watch.activity or watch.moved_at is None:
        return _moved(run, watch, activity, now)
    if not _watched(run):
        return None
    if watch.asked_at is None:
        if now >= watch.next_look:
            watch.asked_at = now
            for rank in _live(run):
                rank.stack = b""
                rank.stack_asked = processes.request_stack(rank.pid)
        return None
    if now - watch.asked_at <= stackdumps.STACK_WAIT_SECONDS and not stackdumps.dumps_in(run, now):
        return None
    watch.asked_at, watch.next_look = None, now + watch.seconds
    stalled = _picture(run, board, now - watch.moved_at)
    key = "" if stalled is None else repr((stalled.calls, _places(stalled)))
    if stalled is None or key == watch.shown:
        return None
    watch.shown = key
    return stalled


def on_end(run: LauncherRun) -> events.RanksStalled | None:
    """As a run ends: the notice's end, if one is shown and every rank finished (they all moved on)."""
    if not run.stall.shown or run.ending.outcome != events.FINISHED:
        return None  # a run stopped while stalled keeps its note: its error says where each rank was
    run.stall.shown = ""
    return events.RanksStalled(run.run_id, 0.0)


def _watched(run: LauncherRun) -> bool:
    """None of the run's ranks finished (those are uneven's) or sits at a pdb prompt."""
    return not run.debugging and not any(rank.done for rank in run.ranks)


def _moved(run: LauncherRun, watch: StallWatch, activity: tuple[int, ...], now: float) -> events.RanksStalled | None:
    watch.activity, watch.moved_at, watch.asked_at = activity, now, None
    watch.next_look = now + (watch.seconds or 0.0)
    if not watch.shown:
        return None
    watch.shown = ""
    return events.RanksStalled(run.run_id, 0.0)  # the notice clears


def _live(run: LauncherRun) -> list[RankProcess]:
    return [rank for rank in run.ranks if not rank.exited]


def _picture(run: LauncherRun, board: stepboard.StepBoard, seconds: float) -> events.RanksStalled | None:
    """The stall's picture, if some rank waits on the others (by its ledger or its stack); else None."""
    calls, dumps, waiting = [], [], False
    for slot, rank in enumerate(run.ranks):
        entry = board.collective(slot) if slot < board.world_size else None
        inside = entry is not None and entry.since > 0
        if entry is not None and entry.calls:
            calls.append((rank.spec.rank, entry.describe(), entry.calls, inside))
        frames = stackdumps.frames_of(rank)
        waiting = waiting or inside or stacktext.waits_on_peers(frames)
        dumps.append((rank.spec.rank, rank.stack.decode("utf-8", "replace")))
        rank.stack, rank.stack_asked = b"", False
    if not waiting:
        return None
    return events.RanksStalled(run.run_id, seconds, tuple(calls), tuple(dumps))


def _places(notice: events.RanksStalled) -> tuple[str, ...]:
    """Where each rank is, as the notice would say (a rank busy in Python moving a line is a new picture)."""
    return tuple(stacktext.RankStack(rank, stacktext.parse_dump(text)).summary(lambda _: None, lambda *_: "")
                 for rank, text in notice.stacks)


def last_calls(run: LauncherRun) -> tuple[str, ...]:
    """Each rank's last collective from its ledger, in words, for a rank's death of its own.

    >>> from nbtrain.launch_server.lifecycle import Lifecycle
    >>> run = LauncherRun(1, [], None, Lifecycle(1, 0.0))
    >>> run.board = stepboard.StepBoard.create(1)
    >>> _ = run.board.enter_collective(0, (0, 8, 0, 4, 1, 0, 8))
    >>> last_calls(run)
    ('rank 0: all_reduce of 4 float32 elements, its 1st collective, waiting in it',)
    """
    board = run.board
    if board is None:
        return ()
    lines = []
    for slot in range(board.world_size):
        entry = board.collective(slot)
        rank = run.ranks[slot].spec.rank if slot < len(run.ranks) else slot
        if entry.calls:
            state = "waiting in it" if entry.since else "returned"
            lines.append(f"rank {rank}: {entry.describe()}, its {stacktext.ordinal(entry.calls)} collective, {state}")
    return tuple(lines)
