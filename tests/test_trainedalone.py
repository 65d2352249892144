"""Ranks that each trained alone are told so in the summary (nbtrain.rank.machinery.trainedalone).

The decision and its sentence directly; then the real path: a real kernel, 2 CPU ranks, cells that
train with and without averaging their gradients, in auto mode and ``--no-auto``.
"""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel
from nbtrain.kernel.cellrun import LastRun
from nbtrain.kernel.display import owntext
from nbtrain.rank.machinery import trainedalone
from nbtrain.rank.machinery.trainedalone import Counts

pytestmark = pytest.mark.timeout(300)

ALONE = "Each of the 2 ranks trained alone: rank 0 took 16 optimizer steps and joined no collective"
NAMED = "trained alone"


def test_a_rank_trained_alone_only_with_several_ranks_steps_taken_and_no_collective_known_to_be_none():
    assert trainedalone.trained_alone(world_size=2, steps=16, collectives=0)
    assert not trainedalone.trained_alone(2, 16, 1)  # DDP's all-reduce, a hand all-reduce: it averaged
    assert not trainedalone.trained_alone(2, 0, 0)  # trained nothing: nothing to say
    assert not trainedalone.trained_alone(1, 16, 0)  # one rank is alone by choice
    assert not trainedalone.trained_alone(2, None, 0)  # no step board (ddp_spawn): cannot tell
    assert not trainedalone.trained_alone(2, 16, None)  # a count that cannot be read: cannot tell


def test_the_collectives_joined_are_unknown_where_a_group_could_hide_some():
    start = Counts({"0": 3}, made=1)
    assert trainedalone.joined(start, Counts({"0": 3}, 1)) == 0
    assert trainedalone.joined(start, Counts({"0": 9, "1": 4}, 2)) == 10  # a group made in the cell counts whole
    assert trainedalone.joined(start, Counts({"1": 4}, 2)) is None  # the default group gone
    assert trainedalone.joined(start, Counts({"0": 3}, 2)) is None  # a group made and destroyed in the cell
    assert trainedalone.joined(None, Counts({"0": 3}, 1)) is None  # no process group at the start


def test_the_summary_says_each_rank_trained_alone_first_with_why_and_what_to_do():
    record = LastRun(state="finished", world_size=2, strategy="ddp_notebook", accelerator="cpu", seconds=1.0)
    assert NAMED not in owntext.summary(record)
    record.steps_alone = 16
    assert owntext.summary(record).startswith(
        f"nbtrain: 2 ranks (cpu, ddp_notebook) finished in 1.0 s. {ALONE}, so no gradient was averaged over the "
        "ranks: 2 independent trainings ran, and the kernel got rank 0's. To train one model over the ranks, let "
        "auto mode wrap it (a cell without --no-auto), wrap it in DistributedDataParallel, or give the framework "
        "the cell's 2 ranks (Lightning's Trainer or Fabric with devices=2, not 1)."
    )


# -- the real path --------------------------------------------------------------------------

MODEL = "torch.manual_seed(0)\n{net} = nn.Linear(8, 1)\n{opt} = torch.optim.SGD({net}.parameters(), lr=0.05)\n"


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


def test_a_no_auto_cell_training_a_kernel_model_without_ddp_is_told_each_rank_trained_alone(kernel):
    """16 steps each on the whole loader, no collective: two trainings. Its loss averaged with
    nbtrain.all_reduce is a metric, not a gradient: it does not hide that."""
    kernel.run_ok(MODEL.format(net="net1", opt="opt1"))
    out = kernel.run_ok(
        "%%distributed --devices 2 --no-auto\n"
        "import nbtrain\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(net1(x), y)\n"
        "    opt1.zero_grad(); loss.backward(); opt1.step()\n"
        "mean_loss = nbtrain.all_reduce(loss.item(), op='mean')\n"
    )
    assert ALONE in out.stdout, out.text


def test_a_no_auto_cell_wrapping_its_model_in_ddp_is_told_nothing(kernel):
    kernel.run_ok(MODEL.format(net="net2", opt="opt2"))
    out = kernel.run_ok(
        "%%distributed --devices 2 --no-auto\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(net2)\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(ddp(x), y)\n"
        "    opt2.zero_grad(); loss.backward(); opt2.step()\n"
        "del ddp\n"
    )
    assert "finished in" in out.stdout and NAMED not in out.text, out.text


def test_an_auto_mode_cell_training_a_kernel_model_is_told_nothing(kernel):
    kernel.run_ok(MODEL.format(net="net3", opt="opt3"))
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(net3(x), y)\n"
        "    opt3.zero_grad(); loss.backward(); opt3.step()\n"
    )
    assert "finished in" in out.stdout and NAMED not in out.text, out.text


def test_a_cell_averaging_each_gradient_by_hand_is_told_nothing(kernel):
    kernel.run_ok(MODEL.format(net="net4", opt="opt4"))
    out = kernel.run_ok(
        "%%distributed --devices 2 --no-auto\n"
        "import torch.distributed as dist\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(net4(x), y)\n"
        "    opt4.zero_grad(); loss.backward()\n"
        "    for p in net4.parameters():\n"
        "        dist.all_reduce(p.grad); p.grad /= dist.get_world_size()\n"
        "    opt4.step()\n"
    )
    assert "finished in" in out.stdout and NAMED not in out.text, out.text


def test_a_cell_that_trains_nothing_is_told_nothing(kernel):
    kernel.run_ok(MODEL.format(net="net5", opt="opt5"))
    out = kernel.run_ok(
        "%%distributed --devices 2 --no-auto\n"
        "with torch.no_grad():\n"
        "    error = loss_fn(net5(X), Y).item()\n"
    )
    assert "finished in" in out.stdout and NAMED not in out.text, out.text
