"""Public training code pasted into a notebook, cell by cell, runs unchanged on 2 CPU ranks.

Each test reproduces a pattern of well-known training scripts, written here in our own
words, in a real kernel: process-group functions imported by name in a plain cell, a model
and optimizer held by a trainer object, schedules and progress totals sized from
``len(loader)`` before the ``%%distributed`` cell.
"""

from __future__ import annotations

import pytest

from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(300)

SETUP = """
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(256, 8)
Y = X @ torch.randn(8, 1)
dataset = TensorDataset(X, Y)
loader = DataLoader(dataset, batch_size=16, shuffle=True)
loss_fn = nn.MSELoss()
"""


@pytest.fixture(scope="module")
def kernel():
    k = NotebookKernel()
    try:
        k.run_ok("%load_ext nbtrain")
        k.run_ok(SETUP)
        yield k
    finally:
        k.shutdown()


def test_process_group_functions_imported_by_name_in_a_plain_cell_are_harmless_on_the_ranks(kernel):
    kernel.run_ok(
        "from torch.distributed import init_process_group, destroy_process_group as teardown\n"
        "import torch.distributed as dist\n"
        "def setup_ddp():\n"
        "    init_process_group(backend='gloo')\n"
        "kernel_init = init_process_group\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "init_process_group(backend='gloo')\n"
        "setup_ddp()\n"
        "ranks = [None, None]\n"
        "dist.all_gather_object(ranks, dist.get_rank())\n"
        "teardown()\n"
        "assert dist.is_initialized()  # the run's own group stays\n"
        "from torch.distributed import init_process_group as imported_here\n"
    )
    assert "ValueError" not in out.text
    assert kernel.value("ranks") == [0, 1]
    # In the kernel the names are still torch's own functions, the one imported on the ranks too.
    assert kernel.value("init_process_group is kernel_init is torch.distributed.distributed_c10d.init_process_group")
    assert kernel.value("imported_here is kernel_init")
    assert kernel.value("teardown is torch.distributed.distributed_c10d.destroy_process_group")


def _torch_optimizers() -> list[str]:
    import torch

    return sorted(
        name
        for name, value in vars(torch.optim).items()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    )


OPTIMIZER_SETUP = """
import copy
def make_run(name):
    torch.manual_seed(0)
    if name == 'SparseAdam':  # sparse gradients only
        net, inputs = nn.Embedding(10, 3, sparse=True), torch.arange(4)
    else:  # Muon trains 2-D weights only
        net, inputs = nn.Linear(3, 2, bias=name != 'Muon'), torch.randn(4, 3)
    return net, inputs
def closure_for(o):
    def closure():
        o.zero_grad()
        loss = net(inputs).pow(2).sum()
        loss.backward()
        return loss
    return closure
def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b
"""


@pytest.mark.parametrize("name", _torch_optimizers())
def test_every_torch_optimizer_round_trips_to_the_ranks_and_back(kernel, name):
    kernel.run_ok(
        OPTIMIZER_SETUP + f"net, inputs = make_run({name!r})\n"
        f"opt = torch.optim.{name}(net.parameters(), lr=0.01)\n"
        "opt.step(closure_for(opt))  # state made in the kernel travels too\n"
    )
    kernel.run_ok(
        "%%distributed --devices 2\n"
        "opt.step(closure_for(opt))\n"
        "opt.step(closure_for(opt))\n"
        "rank0_state = copy.deepcopy(opt.state_dict())\n"
        "fresh = type(opt)(net.parameters(), lr=0.01)  # made on the ranks, sent back whole\n"
        "fresh.step(closure_for(fresh))\n"
    )
    assert kernel.value("same(opt.state_dict(), rank0_state)")
    # The optimizer made on the ranks is bound to the kernel's own parameters and steps there.
    assert kernel.value(
        "type(fresh) is type(opt) and all(p is q for p, q in zip(fresh.param_groups[0]['params'], net.parameters()))"
    )
    kernel.run_ok("fresh.step(closure_for(fresh)); opt.step(closure_for(opt))")
    if name == "LBFGS":
        assert kernel.value("fresh._params is fresh.param_groups[0]['params'] and opt._params[0] is net.weight")
