"""A ReduceLROnPlateau in auto mode steps on the ranks' agreed number (a real kernel, 2 CPU ranks)."""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


def test_a_plateau_schedule_stepped_on_each_ranks_own_loss_keeps_one_learning_rate(kernel):
    """``scheduler.step(epoch_loss)`` with the epoch's mean training loss: each rank's is of
    its share, and a rank that cut its rate alone would drift from the others. Every rank
    steps on the mean, says so once; a number every rank agrees on steps as it is."""
    kernel.run_ok(
        "import nbtrain, torch.distributed as dist\n"
        "torch.manual_seed(0)\n"
        "noise9 = DataLoader(TensorDataset(X, torch.randn(256, 1)), batch_size=16, shuffle=True)\n"
        "net9 = nn.Linear(8, 1)\n"
        "opt9 = torch.optim.SGD(net9.parameters(), lr=0.4)\n"
        "plateau9 = torch.optim.lr_scheduler.ReduceLROnPlateau(opt9, patience=0, factor=0.5)\n"
    )
    agree = (
        "mine = torch.tensor([opt9.param_groups[0]['lr'], *net9.weight.detach().flatten()])\n"
        "every = [torch.zeros_like(mine) for _ in range(2)]\n"
        "dist.all_gather(every, mine)\n"
        "agreed9 = torch.equal(every[0], every[1])\n"
        "lr9 = opt9.param_groups[0]['lr']\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for epoch in range(6):\n"
        "    total = 0.0\n"
        "    for x, y in noise9:\n"
        "        loss = loss_fn(net9(x), y)\n"
        "        opt9.zero_grad(); loss.backward(); opt9.step(); total += loss.item()\n"
        "    plateau9.step(total / len(noise9))\n" + agree
    )
    assert "ReduceLROnPlateau.step got a different number on each rank" in out.stderr, out.stderr
    assert kernel.value("agreed9"), out.stdout
    assert kernel.value("lr9") < 0.4  # the mean plateaued: the rate was cut
    assert kernel.value("opt9.param_groups[0]['lr'] == lr9 and plateau9.num_bad_epochs <= 1")
    out = kernel.run_ok("%%distributed --devices 2\nfor epoch in range(3):\n    plateau9.step(1.0)\n" + agree)
    assert "ReduceLROnPlateau" not in out.stderr, out.stderr
    assert kernel.value("agreed9")
