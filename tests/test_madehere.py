"""A model a cell's function made and trained itself is named by where it was made (a real kernel, 2 CPU ranks).

A k-fold loop calls ``run_training(fold)``, which makes its model, optimizer and loader: none
of them is a global the cell sees, and auto mode prepares what the kernel had. Each rank then
trains its own copy on all of the data, the one-device result at twice the work: the summary
says so, naming the function and the cell's line, unless something averages the gradients
(``nbtrain.prepare`` there, or the function's own DDP).
"""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

FUNCTIONS = """
import nbtrain
def run_training(fold, wrap=lambda net: net):
    torch.manual_seed(fold)
    net = nn.Linear(8, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    fold_loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
    net = wrap(net)
    seen = 0
    for x, y in fold_loader:
        opt.zero_grad(); loss_fn(net(x), y).backward(); opt.step()
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


def test_optimizers_a_function_made_and_stepped_unaveraged_are_named_by_where(kernel):
    out = kernel.run_ok("%%distributed --devices 2\nseen = [run_training(fold) for fold in range(2)]\n")
    assert kernel.value("seen") == [256, 256]  # every rank read all of the data
    note = out.stderr.partition("nbtrain note: ")[2]
    assert note.startswith("2 optimizers (AdamW) made in run_training() (Cell In["), out.stderr
    line = FUNCTIONS.strip().splitlines().index("    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)") + 1
    assert f", line {line}) stepped a model auto mode did not prepare" in note, note
    assert "the one-device result at 2 times the work" in note and "nbtrain.prepare(" in note, note


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
    assert kernel.value("seen") == 256 and "nbtrain note" not in out.stderr, out.stderr
