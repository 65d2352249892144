"""A DDP-wrapped model whose forward a training step bypasses (a real kernel, 2 CPU ranks).

Code that calls a model's parts or methods (``model.head(model.encode(x))``, a ModuleDict's
entries) never runs DDP's forward, so DDP averages nothing; nbtrain.rank.auto.averaging averages
those gradients before the optimizer steps, and the summary says so once.
"""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


TWO_TOWERS = """
class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 4), nn.Linear(4, 1)
    def encode(self, x):
        return torch.relu(self.body(x))
    def forward(self, x):
        return self.head(self.encode(x))
torch.manual_seed(9)
called, bypassed = TwoTowers(), TwoTowers()
bypassed.load_state_dict(called.state_dict())
called_opt = torch.optim.SGD(called.parameters(), lr=0.05, momentum=0.9)
bypassed_opt = torch.optim.SGD(bypassed.parameters(), lr=0.05, momentum=0.9)
"""


def test_a_model_whose_parts_are_called_instead_of_it_still_trains_as_ddp_would(kernel):
    """``bypassed.head(bypassed.encode(x))`` never runs DDP's forward, so DDP averages nothing: its
    gradients are averaged before each step instead, giving the weights DDP gives ``called`` through
    ``called(x)``. ``called`` (a GAN's second model, and its evaluation forwards) stays DDP's to average."""
    kernel.run_ok(TWO_TOWERS)
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "import torch.distributed as dist\n"
        "for x, y in loader:\n"
        "    loss_fn(called(x), y).backward(); called_opt.step(); called_opt.zero_grad()\n"
        "    loss_fn(bypassed.head(bypassed.encode(x)), y).backward(); bypassed_opt.step(); bypassed_opt.zero_grad()\n"
        "    with torch.no_grad():\n"
        "        called(x)  # an evaluation forward does not count as DDP's averaging\n"
        "weights = [m.head.weight.detach().clone() for m in (called, bypassed)]\n"
        "firsts = [w.clone() for w in weights]\n"
        "for w in firsts:\n"
        "    dist.broadcast(w, 0)\n"
        "agree = [bool(torch.equal(a, b)) for a, b in zip(weights, firsts)]\n"
    )
    assert kernel.value("agree") == [True, True], out.text  # every rank stepped with the same gradients
    same = "all(torch.allclose(a, b, atol=1e-6) for a, b in zip(called.parameters(), bypassed.parameters()))"
    assert kernel.value(same)  # the same weights as DDP's own averaging gave through called(x)
    expected = "nbtrain note: the TwoTowers model's forward was not called in a training step (its parts or methods"
    assert expected in out.stderr, out.stderr
    assert out.stderr.count("forward was not called") == 1, out.stderr  # the bypassed model only, once


def test_two_optimizers_of_one_model_called_as_itself_average_nothing_more(kernel):
    """A backbone's optimizer and a head's (two steps after one forward): DDP averaged both; no note."""
    kernel.run_ok(
        TWO_TOWERS + "body_opt = torch.optim.SGD(called.body.parameters(), lr=0.05)\n"
        "head_opt = torch.optim.Adam(called.head.parameters(), lr=0.01)\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss_fn(called(x), y).backward(); body_opt.step(); head_opt.step()\n"
        "    body_opt.zero_grad(); head_opt.zero_grad()\n"
    )
    assert "forward was not called" not in out.text, out.text


def test_a_sparse_embeddings_gradients_are_averaged_too(kernel):
    """A recommender's ``Embedding(sparse=True)`` stepped by SparseAdam: its sparse gradients are
    averaged beside the dense ones, giving the weights DDP gives the same model called as itself."""
    kernel.run_ok(
        "class Recommender(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.items, self.score = nn.Embedding(32, 4, sparse=True), nn.Linear(4, 1)\n"
        "    def forward(self, ids):\n"
        "        return self.score(self.items(ids).mean(1))\n"
        "torch.manual_seed(10)\n"
        "ids = torch.randint(0, 32, (256, 3))\n"
        "id_loader = DataLoader(TensorDataset(ids, Y), batch_size=16, shuffle=True)\n"
        "pair = [Recommender(), Recommender()]\n"
        "pair[1].load_state_dict(pair[0].state_dict())\n"
        "sparse_opts = [torch.optim.SparseAdam(m.items.parameters(), lr=0.05) for m in pair]\n"
        "dense_opts = [torch.optim.SGD(m.score.parameters(), lr=0.05) for m in pair]\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "import torch.distributed as dist\n"
        "called, bypassed = pair\n"
        "for x, y in id_loader:\n"
        "    loss_fn(called(x), y).backward()\n"
        "    loss_fn(bypassed.score(bypassed.items(x).mean(1)), y).backward()\n"
        "    for opt in (*sparse_opts, *dense_opts):\n"
        "        opt.step(); opt.zero_grad()\n"
        "mine = bypassed.items.weight.detach().clone()\n"
        "rank0s = mine.clone()\n"
        "dist.broadcast(rank0s, 0)\n"
        "agree = bool(torch.equal(mine, rank0s))\n"
    )
    assert kernel.value("agree"), out.text
    same = "all(torch.allclose(a, b, atol=1e-6) for a, b in zip(pair[0].parameters(), pair[1].parameters()))"
    assert kernel.value(same), out.text
    assert "the Recommender model's forward was not called" in out.stderr, out.stderr



def test_clipping_reads_the_averaged_gradients_of_a_model_called_past_ddp(kernel):
    """A loop that calls the model's parts (or, where auto mode cannot put the wrapper in its
    place, the model through what else holds it) bypasses DDP; one process clips the gradients
    of the whole batch, so the ranks' are averaged before ``clip_grad_norm_`` (and
    ``clip_grad_value_``, imported by name in the kernel) reads them, and before a GradScaler
    unscales them: the weights are those DDP gives the same model called as itself, clipped alike."""
    kernel.run_ok(
        TWO_TOWERS + "from torch.nn.utils import clip_grad_value_\n"
        "towers = [TwoTowers() for _ in range(4)]\n"
        "for tower in towers:\n"
        "    tower.load_state_dict(called.state_dict())\n"
        "norm_called, norm_parts, value_called, value_parts = towers\n"
        "tower_opts = [torch.optim.SGD(tower.parameters(), lr=0.05) for tower in towers]\n"
        'scaler = torch.amp.GradScaler("cpu", enabled=False)\n'
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss_fn(norm_called(x), y).backward()\n"
        "    loss_fn(norm_parts.head(norm_parts.encode(x)), y).backward()\n"
        "    scaler.unscale_(tower_opts[1])\n"
        "    nn.utils.clip_grad_norm_(norm_called.parameters(), 0.05)\n"
        "    nn.utils.clip_grad_norm_(norm_parts.parameters(), 0.05)\n"
        "    loss_fn(value_called(x), y).backward()\n"
        "    loss_fn(value_parts.head(value_parts.encode(x)), y).backward()\n"
        "    clip_grad_value_(value_called.parameters(), 0.01)\n"
        "    clip_grad_value_(value_parts.parameters(), 0.01)\n"
        "    for opt in tower_opts:\n"
        "        opt.step(); opt.zero_grad()\n"
    )
    for a, b in (("norm_called", "norm_parts"), ("value_called", "value_parts")):
        same = f"[torch.allclose(p, q, atol=1e-6) for p, q in zip({a}.parameters(), {b}.parameters())]"
        assert kernel.value(same) == [True] * 4, out.text
    assert kernel.value("not torch.allclose(norm_called.head.weight, value_called.head.weight)")  # clips differ


ACCUMULATING = """torch.set_num_threads(1)
for i, (x, y) in enumerate({loader}):
    (loss_fn(towers_acc.head(towers_acc.encode(x)), y) / 2).backward()  # its parts: DDP's forward bypassed
    if i % 2 == 1:
        towers_acc_opt.step(); towers_acc_opt.zero_grad()
    if i == {at}:
        raise RuntimeError("the cell fails between a backward and its step")
"""


@pytest.mark.parametrize("at", [0, 2])
def test_a_cell_raising_between_a_backward_and_its_step_brings_back_the_whole_batchs_gradients(kernel, at):
    """A bypassed model's gradients are averaged as each backward ends, as DDP's would be: a cell raising
    after an accumulating micro-batch's backward (before the first step too) leaves the kernel's model
    holding the two ranks' batches' gradients together, as one process on that union batch."""
    setup = (
        "torch.manual_seed(9)\ntowers_acc = TwoTowers()\n"
        "towers_acc_opt = torch.optim.SGD(towers_acc.parameters(), lr=0.05)\n"
        "acc_start = {k: v.clone() for k, v in towers_acc.state_dict().items()}\n"
        "in_order = DataLoader(TensorDataset(X, Y), batch_size=16)  # rank r reads samples r, r + 2, ...\n"
    )
    kernel.run_ok(TWO_TOWERS + setup)
    failed = kernel.run(ACCUMULATING.format(loader="DataLoader(TensorDataset(X, Y), batch_size=32)", at=at))
    assert failed.error is not None and failed.error["evalue"] == "the cell fails between a backward and its step"
    kernel.run_ok(
        "one_process = [p.grad.clone() for p in towers_acc.parameters()]\n"
        "towers_acc.load_state_dict(acc_start); towers_acc_opt.zero_grad()\n"
        "towers_acc_opt = torch.optim.SGD(towers_acc.parameters(), lr=0.05)\n"
    )
    out = kernel.run("%%distributed --devices 2 --accelerator cpu\n" + ACCUMULATING.format(loader="in_order", at=at))
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    gap = "max(float((p.grad - q).abs().max()) for p, q in zip(towers_acc.parameters(), one_process))"
    assert kernel.value(gap) < 1e-6, out.text
    assert kernel.value("float(one_process[0].abs().max())") > 1e-3
