"""The step board (nbtrain.system.stepboard): forked processes count steps into the page the parent reads.

The board is made before the fork, as the launcher makes it before it forks the ranks; each
child here is a real forked process writing its own slot, and the parent reads what they wrote.
"""

from __future__ import annotations

import os
import time

import pytest

from nbtrain.system import stepboard
from nbtrain.system.stepboard import NO_STOP, PENDING, RING, StepBoard

CHILD_SECONDS = 10.0


def _fork(work) -> int:
    """Run ``work()`` in a forked child that exits at once after it (0 on success, 1 on an error)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return pid


def _wait(pids: list[int]) -> list[int]:
    """The children's exit codes, waiting at most CHILD_SECONDS for them."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + CHILD_SECONDS
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids):
            assert time.monotonic() < deadline, f"children {set(pids) - set(codes)} still running"
            time.sleep(0.01)
    return [codes[pid] for pid in pids]


@pytest.fixture
def board():
    made = StepBoard.create(3)
    yield made
    made.close()


def test_forked_ranks_count_into_the_page_the_parent_reads(board):
    def steps(rank: int, count: int):
        return lambda: [board.begin_step(rank) for _ in range(count)]

    assert _wait([_fork(steps(0, 5)), _fork(steps(1, 7)), _fork(steps(2, 2))]) == [0, 0, 0]
    assert board.counts() == [5, 7, 2] and board.count(1) == 7
    assert board.stop_step() == NO_STOP


def test_a_rank_that_begins_a_step_while_the_stop_is_chosen_sees_pending_and_is_counted(board):
    board.begin_step(0)
    board.request_stop()
    seen = os.pipe()

    def rank_one():
        board.begin_step(1)
        board.begin_step(1)
        os.write(seen[1], str(board.stop_step()).encode())

    assert _wait([_fork(rank_one)]) == [0]
    os.close(seen[1])
    assert int(os.read(seen[0], 32)) == PENDING  # it waits for the step: none is past it
    os.close(seen[0])
    assert board.choose_stop() == 2 and board.stop_step() == 2


def test_no_step_begun_means_no_stop_step(board):
    board.request_stop()
    assert board.choose_stop() == 0 and board.stop_step() == NO_STOP


def test_a_rank_that_stops_here_does_not_count_the_step_it_stopped_before(board):
    board.begin_step(2)
    board.begin_step(2)
    board.stop_here(2)
    assert board.counts() == [0, 0, 1]
    assert [board.stopped(rank) for rank in range(3)] == [False, False, True]


def test_the_median_step_is_over_each_ranks_last_ring_of_durations(board):
    assert board.median_step_seconds() is None
    for seconds in [100.0] * 4 + [1.0] * RING:  # the four slow ones are overwritten
        board.begin_step(0, seconds)

    def rank_two():
        for _ in range(3):
            board.begin_step(2, 2.0)

    assert _wait([_fork(rank_two)]) == [0]
    assert board.median_step_seconds() == 1.0
    assert stepboard.grace_seconds(2.0, board.median_step_seconds()) == 3.0
