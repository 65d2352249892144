"""A loader the cell makes itself is sharded as the kernel's are (a real kernel, 2 CPU ranks).

Training cells often make their loader first and loop over it. Once the cell trains an
averaged model (the kernel's, prepared, or one it made, kept one over the ranks), each rank
reads its share in passes with gradients and the whole without, and ``len()`` says what the
pass reads.
"""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

FRESH_NET = (
    "torch.manual_seed(3)\n"
    "net = nn.Linear(8, 1)\n"
    "opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)\n"
)
LOOP = (
    "batches = 0\n"
    "for x, y in {loader}:\n"
    "    loss = loss_fn(net(x), y)\n"
    "    opt.zero_grad(); loss.backward(); opt.step(); batches += 1\n"
)


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


def test_a_loader_made_in_the_cell_is_sharded_and_trains_as_the_kernels_loader_does(kernel):
    kernel.run_ok(FRESH_NET)
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "mine = DataLoader(TensorDataset(X, Y), batch_size=16)\n"
        "steps = len(mine)\n" + LOOP.format(loader="mine")
    )
    assert kernel.value("[steps, batches]") == [8, 8]  # 128 of the 256 samples on rank 0
    assert "mine: sharded (DistributedSampler, 128 of 256 per rank" in out.stdout, out.stdout
    assert "same first training batch" not in out.stderr and "nbtrain note" not in out.stderr, out.stderr
    kernel.run_ok("made_in_cell = {k: v.clone() for k, v in net.state_dict().items()}\n" + FRESH_NET)
    kernel.run_ok("theirs = DataLoader(TensorDataset(X, Y), batch_size=16)")
    kernel.run_ok("%%distributed --devices 2\n" + LOOP.format(loader="theirs"))
    assert kernel.value("all(torch.equal(v, net.state_dict()[k]) for k, v in made_in_cell.items())")
    assert kernel.value("[type(mine).__name__, len(mine)]") == ["DataLoader", 16]  # the kernel's is the user's own


def test_an_evaluation_pass_reads_the_whole_loader_and_a_schedule_sized_in_the_cell_ends_with_the_passes(kernel):
    kernel.run_ok(FRESH_NET)
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "train_dl = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)\n"
        "val_dl = DataLoader(TensorDataset(X, Y), batch_size=64)\n"
        "sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=2 * len(train_dl))\n"
        "seen = []\n"
        "for epoch in range(2):\n"
        "    for x, y in train_dl:\n"
        "        loss = loss_fn(net(x), y); opt.zero_grad(); loss.backward(); opt.step(); sched.step()\n"
        "    with torch.no_grad():\n"
        "        seen.append((len(val_dl), sum(len(x) for x, _ in val_dl)))\n"
    )
    assert kernel.value("[sched.total_steps, sched.last_epoch]") == [16, 16]  # 8 batches per epoch per rank
    assert kernel.value("seen") == [[4, 256], [4, 256]]
    assert "train_dl: sharded (DistributedSampler, 128 of 256 per rank" in out.stdout, out.stdout
    assert "val_dl: evaluated whole on every rank (iterated without gradients)" in out.stdout, out.stdout


def test_a_functions_loader_is_named_by_where_it_was_made_and_sharded_for_a_model_it_made_too(kernel):
    kernel.run_ok(
        FRESH_NET + "def fit(model, optimizer):\n"
        "    dl = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)\n"
        "    n = 0\n"
        "    for x, y in dl:\n"
        "        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step(); n += len(x)\n"
        "    return n\n"
        "def fold_run():\n"
        "    own = nn.Linear(8, 1)\n"
        "    return fit(own, torch.optim.SGD(own.parameters(), lr=0.05))\n"
    )
    out = kernel.run_ok("%%distributed --devices 2\nseen = fit(net, opt)\n")
    assert kernel.value("seen") == 128
    assert "the DataLoader made in fit() (Cell In[" in out.stdout and "sharded (DistributedSampler" in out.stdout
    # The function trains a model it made: kept one over the ranks, so its loader is sharded too.
    out = kernel.run_ok("%%distributed --devices 2\nseen = fold_run()\n")
    assert kernel.value("seen") == 128
    assert "the model of the optimizer made in fold_run() (Cell In[" in out.stdout, out.stdout
