"""A cell trained on several ranks names the differences data parallelism has from one process
by its nature: BatchNorm by each rank's own batch, each rank's own dropout masks (a real kernel,
CPU ranks)."""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

LOOP = """%%distributed {flags}
for x, y in loader:
    loss = loss_fn(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""
BATCHNORM = "nbtrain note: net: each rank normalised its BatchNorm layers by its own batch"
DROPOUT = "nbtrain note: net: each rank drew its own dropout masks"


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


def _model(kernel, *layers: str) -> None:
    kernel.run_ok(
        f"net = nn.Sequential(nn.Linear(8, 4), {', '.join(layers)}, nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.01)"
    )


def test_two_ranks_name_batchnorm_and_dropout_in_the_model_they_trained(kernel):
    _model(kernel, "nn.BatchNorm1d(4)", "nn.Dropout(0.2)")
    out = kernel.run_ok(LOOP.format(flags="--devices 2"))
    assert BATCHNORM in out.stderr and DROPOUT in out.stderr, out.stderr
    assert "--sync-batchnorm normalises over every rank's batch" in out.stderr, out.stderr


def test_sync_batchnorm_or_one_rank_or_a_plain_model_name_nothing(kernel):
    _model(kernel, "nn.BatchNorm1d(4)", "nn.Dropout(0.0)")
    out = kernel.run_ok(LOOP.format(flags="--devices 2 --sync-batchnorm"))
    assert BATCHNORM not in out.stderr and DROPOUT not in out.stderr, out.stderr
    assert "detach()" not in out.stderr, out.stderr  # CPU ranks' synchronised BatchNorm warns of nothing
    _model(kernel, "nn.BatchNorm1d(4)", "nn.Dropout(0.2)")
    out = kernel.run_ok(LOOP.format(flags="--devices 1"))
    assert "nbtrain note: net:" not in out.stderr, out.stderr
    _model(kernel, "nn.ReLU()")
    out = kernel.run_ok(LOOP.format(flags="--devices 2"))
    assert "nbtrain note: net:" not in out.stderr, out.stderr


def test_a_model_made_in_the_cell_is_named_too(kernel):
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "made = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))\n"
        "made_opt = torch.optim.SGD(made.parameters(), lr=0.01)\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(made(x), y)\n"
        "    made_opt.zero_grad(); loss.backward(); made_opt.step()\n"
    )
    assert "nbtrain note: made: each rank normalised its BatchNorm layers by its own batch" in out.stderr, out.stderr
