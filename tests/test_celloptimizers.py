"""What a cell's function makes and trains itself is kept one over the ranks and named (a real kernel, 2 CPU ranks).

A k-fold loop calls ``run_training(fold)``, which makes its model, optimizer and loader: none
of them is a global the cell sees, and auto mode prepares what the kernel had. Their
gradients are averaged at each step (the model kept one over the ranks) and the loader is
sharded; the summary names the model by where its optimizer was made, and the loader by
where it was made. Nothing is said where the function prepares them or wraps the model in
DDP itself. (tests/test_keptmodels.py shows such a model trains as DDP would train it.)
"""

from __future__ import annotations

import re

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

FUNCTIONS = """
import nbtrain
def run_training(fold, wrap=lambda net: net, make=torch.optim.AdamW):
    torch.manual_seed(fold)
    net = nn.Linear(8, 1)
    opt = make(net.parameters(), lr=1e-2)
    fold_loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
    net = wrap(net)
    seen = 0
    for x, y in fold_loader:
        def closure():
            opt.zero_grad(); loss = loss_fn(net(x), y); loss.backward(); return loss
        opt.step(closure)
        seen += len(x)
    return seen
"""

# A module of the user's that wraps the model in DDP itself: auto mode does not read its code.
HELPER = """
from torch.nn.parallel import DistributedDataParallel

def wrap(net):
    return DistributedDataParallel(net)
"""


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP, FUNCTIONS)


def test_a_functions_model_is_kept_one_over_the_ranks_and_its_loader_sharded(kernel):
    out = kernel.run_ok("%%distributed --devices 2\nseen = [run_training(fold) for fold in range(2)]\n")
    assert kernel.value("seen") == [128, 128]  # each rank read its half
    line = FUNCTIONS.strip().splitlines().index("    opt = make(net.parameters(), lr=1e-2)") + 1
    model = rf"the model of the optimizer made in run_training\(\) \(Cell In\[\d+\], line {line}\) \(made in the cell: "
    assert re.search(model + r"gradients averaged before each step\)", out.stdout), out.stdout
    loader = rf"the DataLoader made in run_training\(\) \(Cell In\[\d+\], line {line + 1}\): sharded "
    assert re.search(loader, out.stdout), out.stdout
    assert "nbtrain note" not in out.stderr, out.stderr


def test_nothing_is_said_where_the_function_prepares_them_or_a_module_wraps_them_in_ddp(kernel, tmp_path):
    kernel.run_ok(
        "def run_prepared():\n"
        "    net = nn.Linear(8, 1); opt = torch.optim.AdamW(net.parameters(), lr=1e-2)\n"
        "    net, opt, fold_loader = nbtrain.prepare(net, opt, DataLoader(TensorDataset(X, Y), batch_size=16))\n"
        "    for x, y in fold_loader:\n"
        "        opt.zero_grad(); loss_fn(net(x), y).backward(); opt.step()\n"
        "    return len(fold_loader)\n"
    )
    out = kernel.run_ok("%%distributed --devices 2\nbatches = run_prepared()\n")
    assert kernel.value("batches") == 8 and "nbtrain note" not in out.stderr, out.stderr  # a half of 16 batches
    (tmp_path / "ddp_helper.py").write_text(HELPER)
    kernel.run_ok(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\nimport ddp_helper\n")
    out = kernel.run_ok("%%distributed --devices 2\nseen = run_training(0, ddp_helper.wrap)\n")
    assert kernel.value("seen") == 128 and "nbtrain note" not in out.stderr, out.stderr  # its DDP averages: sharded
    assert "gradients averaged before each step" not in out.stdout, out.stdout
