"""Ranks fed the same batches are told they trained on the same data (a real kernel, 2 CPU ranks)."""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


def test_a_loop_that_slices_its_own_batches_is_told_every_rank_trained_on_the_same_data(kernel):
    """A tutorial's first loop slices its tensors itself (``X[i:i + 32]``): auto mode has no
    DataLoader to shard, so every rank trains on every batch. The summary says so and how to
    fix it; the same loop over a DataLoader gets each rank its share and no note."""
    kernel.run_ok("torch.manual_seed(11)\nnet11 = nn.Linear(8, 1)\nopt11 = torch.optim.SGD(net11.parameters(), lr=0.1)")
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for i in range(0, len(X), 32):\n"
        "    loss = loss_fn(net11(X[i:i + 32]), Y[i:i + 32])\n"
        "    opt11.zero_grad(); loss.backward(); opt11.step()\n"
    )
    expected = (
        "nbtrain note: every rank fed `net11` the same first training batch, so the 2 ranks trained it on "
        "the same data: the one-device result at 2 times the work."
    )
    assert expected in out.stderr, out.stderr
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(net11(x), y)\n"
        "    opt11.zero_grad(); loss.backward(); opt11.step()\n"
    )
    assert "same first training batch" not in out.stderr, out.stderr


def test_a_loader_auto_mode_could_not_shard_has_its_own_note_and_no_other(kernel):
    """A custom sampler's loader is read whole by every rank: its note says so; no second note."""
    kernel.run_ok(
        "from torch.utils.data import Sampler\n"
        "class Reversed(Sampler):\n"
        "    def __init__(self, n): self.n = n\n"
        "    def __len__(self): return self.n\n"
        "    def __iter__(self): return iter(range(self.n - 1, -1, -1))\n"
        "backwards = DataLoader(TensorDataset(X, Y), batch_size=32, sampler=Reversed(len(X)))\n"
        "net12 = nn.Linear(8, 1)\nopt12 = torch.optim.SGD(net12.parameters(), lr=0.1)\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in backwards:\n"
        "    loss = loss_fn(net12(x), y)\n"
        "    opt12.zero_grad(); loss.backward(); opt12.step()\n"
    )
    expected = "`backwards`, a DataLoader over TensorDataset was not sharded: its sampler (Reversed) is custom"
    assert expected in out.stderr and "same first training batch" not in out.stderr, out.stderr


def test_a_model_the_cell_makes_and_feeds_the_same_batches_is_told_so_too(kernel):
    """No DDP wraps a model the cell makes; its first gradients, the same on every rank, say the
    ranks fed it the same batch. Over a loader made in the cell each rank reads its share: no note."""
    made = "net13 = nn.Linear(8, 1); opt13 = torch.optim.SGD(net13.parameters(), lr=0.1)\n"
    out = kernel.run_ok(
        "%%distributed --devices 2\n" + made + "for i in range(0, len(X), 32):\n"
        "    loss = loss_fn(net13(X[i:i + 32]), Y[i:i + 32]); opt13.zero_grad(); loss.backward(); opt13.step()\n"
    )
    assert "nbtrain note: every rank fed `net13` the same first training batch" in out.stderr, out.stderr
    out = kernel.run_ok(
        "%%distributed --devices 2\n" + made + "for x, y in DataLoader(TensorDataset(X, Y), batch_size=32):\n"
        "    loss = loss_fn(net13(x), y); opt13.zero_grad(); loss.backward(); opt13.step()\n"
    )
    assert "same first training batch" not in out.stderr, out.stderr
