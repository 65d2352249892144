"""One rank, no DDP: a run of one rank trains the model as it is, in a real kernel (CPU, gloo).

With one rank there is nothing to average, so DDP (and plain fsdp) would only cost time:
auto mode and ``nbtrain.prepare`` leave the model unwrapped and the loader in its own order,
and the cell trains exactly as the kernel's own loop does, bit for bit.
"""

from __future__ import annotations

import pytest

import nbtrain
from helpers.procs import finish
from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(240)

SETUP = """
%load_ext nbtrain
import copy, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(96, 8)
Y = X @ torch.randn(8, 1) + 0.01 * torch.randn(96, 1)
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
"""

LOOP = """
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
"""

RESTART = """
in_kernel = {k: v.clone() for k, v in model.state_dict().items()}
model.load_state_dict(start[0]); opt.load_state_dict(start[1]); torch.set_rng_state(start[2])
"""


@pytest.mark.parametrize("strategy", ["ddp_notebook", "auto"])
def test_one_rank_trains_bit_identically_to_the_kernels_own_loop_and_says_it_is_not_wrapped(strategy):
    with NotebookKernel() as kernel:
        kernel.run_ok(SETUP)
        kernel.run_ok(LOOP)  # the kernel's own loop: shuffled loader, dropout, momentum
        kernel.run_ok(RESTART)
        out = kernel.run_ok(f"%%distributed --devices 1 --accelerator cpu --strategy {strategy}\n" + LOOP)
        assert kernel.value("all(torch.equal(v, in_kernel[k]) for k, v in model.state_dict().items())")
        assert kernel.value("any(not torch.equal(v, start[0][k]) for k, v in model.state_dict().items())")
    if strategy == "ddp_notebook":
        assert "model: on cpu, not wrapped (one rank)" in out.stdout, out.stdout
    assert "DistributedDataParallel" not in out.stdout and "DistributedSampler" not in out.stdout, out.stdout


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn", "ddp_sharded", "fsdp"])
def test_prepare_on_one_rank_leaves_the_model_optimizer_and_loader_as_they_are(launcher, strategy):
    def fn():
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.Adam(model.parameters())
        loader = DataLoader(TensorDataset(torch.zeros(8, 4)), batch_size=2, shuffle=True)
        prepared = nbtrain.prepare(model, opt, loader)
        return [a is b for a, b in zip(prepared, (model, opt, loader), strict=True)], type(model.weight).__name__

    same, weight_type = finish(nbtrain.start(fn, devices=1, accelerator="cpu", strategy=strategy))
    assert same == [True, True, True] and weight_type == "Parameter"


def test_two_ranks_are_still_wrapped(launcher):
    def fn():
        import torch

        return type(nbtrain.prepare(torch.nn.Linear(4, 1))).__name__

    assert finish(nbtrain.start(fn, devices=2, accelerator="cpu")) == "DistributedDataParallel"
