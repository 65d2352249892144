"""What the launcher knows of a run (nbtrain.launch_server.launched): the questions its loop asks.

Records and their readings only; a run's lifecycle through a real launcher is in
tests/test_launch_server_server.py, its table in tests/test_lifecycle.py.
"""

from __future__ import annotations

import signal
from typing import Any

from nbtrain.launch_server import stopatstep
from nbtrain.launch_server.launched import (
    LauncherRun,
    RankProcess,
    awaits_rank_zero,
    failed_state,
    kept_step,
    our_signal,
    stop_began,
    takes_over,
    took_a_step,
)
from nbtrain.launch_server.lifecycle import Lifecycle, RunPhase
from nbtrain.launch_server.rankpipes import RankOutput
from nbtrain.messages import events
from nbtrain.messages.events import RankFailed
from nbtrain.system import stepboard


def new_run(**fields: Any) -> LauncherRun:
    return LauncherRun(5, [], None, Lifecycle(5, now=0.0), **fields)


def test_a_run_answers_its_phase_from_its_lifecycle_and_moves_only_as_the_table_allows():
    run = new_run()
    assert run.state is RunPhase.RUNNING and not stop_began(run)
    run.move(RunPhase.DUMPING_STACKS)
    assert run.state is RunPhase.DUMPING_STACKS and stop_began(run)
    run.move(RunPhase.TERMINATING)
    assert run.lifecycle.history == [RunPhase.RUNNING, RunPhase.DUMPING_STACKS, RunPhase.TERMINATING]


def test_sigterm_is_always_ours_and_sigkill_once_the_launcher_or_the_sidebar_sent_it():
    run = new_run()
    assert our_signal(run, signal.SIGTERM) and not our_signal(run, signal.SIGKILL) and not our_signal(run, None)
    run.move(RunPhase.TERMINATING)
    assert not our_signal(run, signal.SIGKILL)  # still in the grace: a SIGKILL now is someone else's
    run.move(RunPhase.KILLED)
    assert our_signal(run, signal.SIGKILL) and not our_signal(run, signal.SIGSEGV)
    outside = new_run()
    outside.move(RunPhase.STOPPING_OUTSIDE)  # the server extension SIGKILLs after its own grace
    assert our_signal(outside, signal.SIGKILL)


def test_a_step_counts_only_on_a_board_and_with_on_stop_keep():
    board = stepboard.StepBoard.create(2)
    try:
        run = new_run(board=board)
        assert not took_a_step(run)
        board.begin_step(1)
        assert took_a_step(run) and not took_a_step(new_run(board=board, on_stop="discard"))
        assert not took_a_step(new_run())  # spawned ranks: no board
    finally:
        board.close()


def test_the_step_kept_is_the_graceful_stops_unless_it_gave_up_or_the_run_finished():
    def kept(**ending: Any) -> int | None:  # what a run that learned ``ending`` keeps
        run = new_run(graceful=stopatstep.GracefulStop(events.STOPPED, 0.0, step=12))
        run.lifecycle.learn(**ending)
        return kept_step(run)

    assert kept(outcome=events.STOPPED) == 12
    assert kept(outcome=events.FINISHED) is None
    assert kept_step(new_run()) is None
    assert kept(outcome=events.STOPPED, gave_up=True) is None


def _ranks(world: int) -> list[RankProcess]:
    """Records of ``world`` ranks (no process: only what the launcher's loop reads of them)."""
    return [
        RankProcess(events.RankSpec(n, n, world, "cpu", None), 0, -1, None, {}, RankOutput(n, None))  # type: ignore[arg-type]
        for n in range(world)
    ]


def _run_of(world: int, **fields: Any) -> LauncherRun:
    return LauncherRun(5, _ranks(world), None, Lifecycle(5, now=0.0), **fields)


def _raised(rank: int, line: int = 8, state: bytes | None = b"state") -> RankFailed:
    return RankFailed(5, rank, "RuntimeError", "boom", f'File "<cell>", line {line}', state=state)


def test_another_ranks_raise_with_a_state_awaits_rank_0_while_rank_0_is_at_work():
    run = _run_of(2)
    run.failure, run.failed_states = _raised(1), {1: (_raised(1), None)}
    assert awaits_rank_zero(run)
    for gone in ("exited", "done", "failed"):  # rank 0 can no longer raise: nothing to wait for
        other = _run_of(2, failure=run.failure, failed_states=run.failed_states)
        setattr(other.ranks[0], gone, True)
        assert not awaits_rank_zero(other), gone
    without = _run_of(2, failure=_raised(1, state=None))  # a state_note only (fsdp): no state
    without.failed_states = {1: (_raised(1, state=None), None)}
    assert not awaits_rank_zero(without)
    zero = _run_of(2, failure=_raised(0), failed_states={0: (_raised(0), None)})
    assert not awaits_rank_zero(zero)  # rank 0's own raise came first
    exited = events.RankExited(5, 1, exit_code=None, signal_number=9, reported=False)
    assert not awaits_rank_zero(_run_of(2, failure=exited))


def test_a_lower_ranks_same_raise_awaited_takes_over_and_its_state_comes_back():
    run = _run_of(3)
    run.failure, run.failed_states = _raised(2), {2: (_raised(2), None)}
    run.failed_states[0] = (_raised(0), None)
    assert not takes_over(run, _raised(0))  # still RUNNING: no grace began, the first failure stays
    run.move(RunPhase.AWAITING_RANK_ZERO)
    assert takes_over(run, _raised(0))
    run.failed_states[1] = (_raised(1, line=3), None)
    assert not takes_over(run, _raised(1, line=3))  # raised elsewhere: a consequence of the cause
    run.failure = _raised(0)
    assert not takes_over(run, _raised(1)) and failed_state(run) == (0, "")
