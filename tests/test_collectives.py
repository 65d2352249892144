"""The collective ledger (nbtrain.rank.machinery.collectives): mismatched collectives end the cell with one
error naming each rank's call, before gloo aborts a process; a death of its own quotes each rank's last
collective. Real kernels (2 and 3 CPU ranks); the ledger's rule itself on a board of this process.
"""

from __future__ import annotations

import re

import pytest
import torch

from kernel_helpers import nbtrain_kernel
from nbtrain.errors import CollectiveMismatchError
from nbtrain.rank.machinery import collectives
from nbtrain.system import stepboard

pytestmark = pytest.mark.timeout(300)

SETUP = "import nbtrain, time, torch, torch.distributed as dist"


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_different_operations_at_the_same_call_end_the_cell_with_each_ranks_call(kernel):
    cell = """%%distributed --devices 3 --accelerator cpu
x = torch.ones(4)
for i in range(2):
    dist.all_reduce(x)
if nbtrain.rank() == 1:
    dist.broadcast(x, src=0)
else:
    dist.all_reduce(x)
"""
    out = kernel.run(cell)
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    text = "\n".join(out.error["traceback"])
    assert "CollectiveMismatchError: The ranks called different collectives as their 3rd call of the default " in text
    for rank, call, line in ((0, "all_reduce", 8), (1, "broadcast", 6), (2, "all_reduce", 8)):
        assert re.search(rf"rank {rank} {call} of 4 float32 elements \(Cell In\[\d+\], line {line}\)", text), text
    assert "Look for a collective under an `if` on the rank" in text


def test_different_sizes_end_the_cell_before_gloo_aborts_a_rank(kernel):
    cell = """%%distributed --devices 2 --accelerator cpu
for i in range(7):
    dist.all_reduce(torch.ones(2))
dist.all_reduce(torch.ones(4 + nbtrain.rank()))
"""
    out = kernel.run(cell)
    assert out.error is not None, out.text
    text = "\n".join(out.error["traceback"])
    assert "killed by signal" not in text, text
    assert "as their 8th call of the default group" in text, text
    calls = r"rank 0 all_reduce of 4 float32 elements \(Cell In\[\d+\], line 4\); rank 1 all_reduce of 5 float32"
    assert re.search(calls, text), text


def test_a_rank_that_skips_one_collective_is_caught_at_its_next(kernel):
    cell = """%%distributed --devices 2 --accelerator cpu
x = torch.ones(3)
for i in range(4):
    if not (nbtrain.rank() == 1 and i == 2):
        dist.all_reduce(x)
dist.barrier()
"""
    out = kernel.run(cell)
    assert out.error is not None, out.text
    text = "\n".join(out.error["traceback"])
    calls = r"as their 4th call of the default group: rank 0 all_reduce of 3 float32 elements \(Cell In\[\d+\], "
    assert re.search(calls + r"line 5\); rank 1 barrier \(Cell In\[\d+\], line 6\)", text), text


def test_a_rank_that_a_collective_library_aborts_is_named_with_each_ranks_last_collective(kernel):
    # Past the ledger (torch's process group called directly), gloo meets 4 elements on one rank and 5 on
    # the other, and aborts a process: the error quotes what the ledger last saw of each rank.
    cell = """%%distributed --devices 2 --accelerator cpu
dist.all_reduce(torch.ones(2))
group = dist.distributed_c10d._get_default_group()
group.allreduce([torch.ones(4 + nbtrain.rank())]).wait()
"""
    out = kernel.run(cell)
    assert out.error is not None, out.text
    text = "\n".join(out.error["traceback"])
    assert re.search(r"rank \d was killed by signal 6 \(SIGABRT\)", text), text
    assert "Each rank's last collective: rank 0: all_reduce of 2 float32 elements, its 1st collective, returned" in text
    assert "rank 1: all_reduce of 2 float32 elements, its 1st collective, returned" in text


def all_reduce(tensor, op=None, group=None, async_op=False):
    return "joined"


@pytest.fixture
def board():
    board = stepboard.StepBoard.create(2)
    collectives.attach_ledger(board, 1)  # this process is rank 1
    yield board
    collectives.attach_ledger(None, 0)


def test_a_call_is_written_with_its_group_number_size_and_the_users_line(board):
    ledgered = collectives.ledgered(all_reduce)
    assert ledgered(torch.zeros(3, dtype=torch.float64)) == "joined"
    entry = board.collective(1)
    assert (entry.calls, entry.group, entry.group_call) == (1, 0, 1)
    assert entry.describe() == "all_reduce of 3 float64 elements"
    assert entry.line > 0 and entry.since == 0.0  # returned


def test_the_last_rank_to_arrive_at_a_call_of_another_size_raises_before_it_joins(board, monkeypatch):
    monkeypatch.setattr(collectives, "ARRIVAL_SECONDS", 0.0)
    board.enter_collective(0, (0, 1, 0, 4, 1, 0, 8))  # rank 0 waits in its 1st: 4 float32 elements
    with pytest.raises(CollectiveMismatchError, match=r"as their 1st call of the default group: rank 0 all_reduce of 4 "
                                                      r"float32 elements \(line 8\); rank 1 all_reduce of 5 float32"):
        collectives.ledgered(all_reduce)(torch.zeros(5))
    assert board.collective(1).since == 0.0  # it never joined


def test_uneven_all_gather_sizes_are_allowed_and_another_call_number_is_not_compared(board):
    board.enter_collective(0, (0, 1, stepboard.OPERATIONS.index("all_gather"), 4, 1, 0, 8))

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        return "joined"

    assert collectives.ledgered(all_gather)([], torch.zeros(5)) == "joined"  # uneven: torch allows it
    board.enter_collective(0, (0, 9, 0, 4, 1, 0, 8))  # rank 0 is further on: not this call
    assert collectives.ledgered(all_reduce)(torch.zeros(5)) == "joined"


def test_every_collective_the_patch_table_wraps_has_a_name_on_the_board():
    from nbtrain import patches

    wrapped = {p.attribute for p in patches.TABLE if p.group == "collectives" and p.attribute != "forward"}
    assert wrapped == set(stepboard.COLLECTIVES) == set(stepboard.OPERATIONS) - {"DDP's gradient all-reduce"}


def test_a_ddp_made_by_hand_counts_its_syncing_forwards_on_the_ledger(kernel):
    # --no-auto: the cell's own DDP (as torchrun code makes it); a forward under no_sync() counts nothing.
    cell = """%%distributed --devices 2 --accelerator cpu --no-auto
from nbtrain.rank.machinery import collectives
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
before = collectives._ledger.board.collective(collectives._ledger.slot).calls
for i in range(3):
    ddp(torch.ones(2, 4)).sum().backward()
with ddp.no_sync():
    ddp(torch.ones(2, 4)).sum().backward()
with torch.no_grad():
    ddp(torch.ones(2, 4))
counted = collectives._ledger.board.collective(collectives._ledger.slot).calls - before
"""
    kernel.run_ok(cell)
    assert kernel.value("counted") == 3
