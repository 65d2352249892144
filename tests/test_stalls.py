"""A stall named while it happens (nbtrain.launch_server.stalls), in real kernels: 2 CPU ranks, no --timeout.

The stall window is ``--stall-warning`` (30 s built in); these cells use 2 s, so that a stall is
named within seconds. docs/failures.md shows each notice. The rule itself, on a board of this
process: a run whose ranks move is never named; one where none moves and one waits is, once; a
move clears it.
"""

from __future__ import annotations

import re
import time

import pytest

from kernel_helpers import nbtrain_kernel
from nbtrain.launch_server import stalls
from nbtrain.launch_server.launched import LauncherRun
from nbtrain.launch_server.lifecycle import Lifecycle, RunPhase
from nbtrain.system import stepboard

pytestmark = pytest.mark.timeout(300)

SETUP = "import nbtrain, time, torch, torch.distributed as dist"
WINDOW = 2  # --stall-warning of these cells
NOTED = WINDOW + 10  # a stall is named within the window and a look at the stacks

BUSY = f"""%%distributed --devices 2 --accelerator cpu --stall-warning {WINDOW}
for i in range(3):
    dist.all_reduce(torch.ones(4))
if nbtrain.rank() == 1:
    while True:
        spin = sum(range(1000))
dist.all_reduce(torch.ones(4))
"""




@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_a_busy_rank_is_named_while_the_others_wait_and_the_run_goes_on(kernel):
    msg_id = kernel.start_cell(BUSY)
    try:
        needles = ["no rank has moved", "stalled for"]
        seen = kernel.wait_for_stream(msg_id, needles, timeout=NOTED + 30, displays=True)
    finally:
        kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    # The run went on until the interrupt stopped it.
    assert reply["status"] == "error" and out.error is not None and out.error["ename"] == "RunInterrupted", out.text
    note = seen[seen.index("nbtrain: no rank has moved"):]
    waits = r"Waiting for the others: rank 0 in all_reduce of 4 float32 elements \(its 4th collective\), "
    assert re.search(waits + r"Cell In\[\d+\], line 7", note), note
    missing = r"Not there: rank 1: (at|in sum,) Cell In\[\d+\], line [56] \(its last collective, the 3rd, returned\)"
    assert re.search(missing, note), note
    assert "rank 1 (most recent call last):" in note and "spin = sum(range(1000))" in note, note
    assert "The run goes on (a slow step is not a hang)" in note
    # The live view says so too.
    live = r"stalled for \d+ s: rank 0 waits in all_reduce \(its 4th collective\); rank 1 has not joined"
    assert re.search(live, seen), seen
    assert kernel.run_ok("%%distributed --devices 2 --accelerator cpu\nn = nbtrain.world_size()\n")
    assert kernel.value("n") == 2


def test_a_stall_that_resolves_by_itself_is_named_then_cleared_and_the_run_finishes(kernel):
    cell = f"""%%distributed --devices 2 --accelerator cpu --stall-warning {WINDOW}
t = torch.ones(4)
if nbtrain.rank() == 1:
    time.sleep({WINDOW + 6})
dist.all_reduce(t)
total = t.sum().item()
"""
    msg_id = kernel.start_cell(cell)
    needles = ["no rank has moved", "the ranks moved again"]
    seen = kernel.wait_for_stream(msg_id, needles, timeout=NOTED + 30, displays=True)
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    assert reply["status"] == "ok", out.text
    assert re.search(r"Not there: rank 1: in time.sleep, Cell In\[\d+\], line 4", seen), seen
    assert kernel.value("total") == 8.0
    assert kernel.value("nbtrain.last_run().stall") == ""  # over: nothing left to say


class _Rank:
    """What the watch reads of a rank (RankProcess's fields), with no process behind it."""

    def __init__(self, rank: int) -> None:
        self.spec = type("Spec", (), {"rank": rank})()
        self.pid, self.done, self.exited = -1, False, True  # exited: no stack to ask for
        self.stack, self.stack_asked, self.stack_seen_at = b"", False, 0.0


def _run(board: stepboard.StepBoard) -> LauncherRun:
    run = LauncherRun(7, [_Rank(0), _Rank(1)], None, Lifecycle(7, 0.0))  # type: ignore[list-item]
    run.lifecycle.state = RunPhase.RUNNING
    run.board, run.stall.seconds = board, 2.0
    return run


def test_the_watch_names_a_stall_once_and_clears_it_when_a_rank_moves():
    board = stepboard.StepBoard.create(2)
    run = _run(board)
    assert stalls.notice(run, 0.0) is None  # the first look: the ranks' activity now
    board.enter_collective(0, (0, 4, 0, 4, 1, 0, 7))
    assert stalls.notice(run, 0.1) is None  # rank 0 entered its 4th: a move
    assert stalls.notice(run, 1.0) is None  # within the window
    assert stalls.notice(run, 2.2) is None  # the stacks are asked for (these ranks have none to give)
    stalled = stalls.notice(run, 3.5)  # the wait for them is over: rank 0 waits, by its ledger
    assert stalled is not None and stalled.seconds == pytest.approx(3.4)
    assert stalled.calls == ((0, "all_reduce of 4 float32 elements", 1, True),)
    assert stalls.notice(run, 6.0) is None and stalls.notice(run, 7.5) is None  # the same picture: said once
    board.enter_collective(1, (0, 4, 0, 4, 1, 0, 7))  # rank 1 arrives
    cleared = stalls.notice(run, 7.6)
    assert cleared is not None and cleared.seconds == 0 and cleared.calls == ()


def test_nobody_waiting_is_no_stall():
    board = stepboard.StepBoard.create(2)
    run = _run(board)
    assert stalls.notice(run, 0.0) is None
    assert [stalls.notice(run, t) for t in (2.5, 4.0, 6.5, 8.0)] == [None] * 4  # a long evaluation on both


def test_a_rank_that_finished_leaves_the_run_to_the_uneven_watch():
    board = stepboard.StepBoard.create(2)
    run = _run(board)
    board.enter_collective(0, (0, 1, 0, 4, 1, 0, 7))
    run.ranks[1].done = True
    assert [stalls.notice(run, t) for t in (0.0, 2.5, 4.0)] == [None] * 3


def test_a_background_run_keeps_the_stall_in_last_run_while_it_lasts(kernel):
    kernel.run_ok(BUSY.replace("--accelerator cpu", "--accelerator cpu --background", 1))
    deadline = time.monotonic() + NOTED + 30
    stall = ""
    while "no rank has moved" not in stall:  # each look is a cell the kernel runs beside the run
        assert time.monotonic() < deadline, f"no stall in last_run() within {NOTED + 30} s"
        stall = kernel.value("nbtrain.last_run().stall")
    assert "Waiting for the others: rank 0 in all_reduce of 4 float32 elements (its 4th collective)" in stall, stall
    out = kernel.run("_run = [r for r in nbtrain.runs() if r.state != 'standby'][-1]; _run.stop(); _run.wait(60)")
    assert out.error is not None and out.error["ename"] == "RunStoppedError", out.text
