"""A graceful stop as the launcher follows it (nbtrain.launch_server.stopatstep), on a real step board.

The whole path, through a kernel, is in tests/test_graceful_stop.py; the sidebar's in
tests/test_graceful_stop_server.py. The note naming a late rank has examples in its docstring.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nbtrain.launch_server import stopatstep
from nbtrain.system import stepboard


@pytest.fixture
def board() -> Iterator[stepboard.StepBoard]:
    board = stepboard.StepBoard.create(2)
    try:
        yield board
    finally:
        board.close()


def test_the_step_is_chosen_once_a_moment_after_the_ask_as_the_highest_begun(board):
    for _ in range(3):
        board.begin_step(0)
    board.begin_step(1)
    stop = stopatstep.GracefulStop("stopped", asked_at=10.0)
    board.request_stop()
    assert not stop.choose(board, minimum_grace=2.0, now=10.0)  # counts written just before may be unseen
    later = 10.0 + 2 * stopatstep.CHOOSE_AFTER_SECONDS
    assert stop.choose(board, minimum_grace=2.0, now=later)
    assert stop.step == 3 == board.stop_step() and stop.grace >= 2.0
    assert stop.deadline == later + stop.grace
    assert not stop.choose(board, minimum_grace=2.0, now=20.0)  # chosen already


def test_it_is_overdue_past_its_deadline(board):
    board.begin_step(0)
    stop = stopatstep.GracefulStop("timed out", asked_at=0.0)
    assert not stop.overdue(1e9)  # no step chosen: no deadline yet
    stop.choose(board, minimum_grace=1.0, now=1.0)
    assert stop.deadline is not None
    assert not stop.overdue(stop.deadline) and stop.overdue(stop.deadline + 0.1)


def test_why_a_run_cannot_stop_at_a_step_names_the_reason(board):
    assert stopatstep.why_none(board, "discard") == ""  # it asked for a hard stop
    assert stopatstep.why_none(None, "keep").endswith("cannot follow the steps of spawned ranks (ddp_spawn).")
    assert "none had run (a loop without optimizer.step()" in stopatstep.why_none(board, "keep")
    board.begin_step(1)
    assert stopatstep.why_none(board, "keep") == ""
