"""What the launcher knows of a run (nbtrain.launch_server.launched): the questions its loop asks.

Records and their readings only; a run's lifecycle through a real launcher is in
tests/test_launch_server_server.py, its table in tests/test_lifecycle.py.
"""

from __future__ import annotations

import signal
from typing import Any

from nbtrain.launch_server import stopatstep
from nbtrain.launch_server.launched import LauncherRun, kept_step, our_signal, stop_began, took_a_step
from nbtrain.launch_server.lifecycle import Lifecycle, RunPhase
from nbtrain.messages import events
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
    stop = stopatstep.GracefulStop(events.STOPPED, 0.0, step=12)
    assert kept_step(new_run(graceful=stop, outcome=events.STOPPED)) == 12
    assert kept_step(new_run(graceful=stop, outcome=events.FINISHED)) is None
    assert kept_step(new_run()) is None
    stop.gave_up = True
    assert kept_step(new_run(graceful=stop, outcome=events.STOPPED)) is None
