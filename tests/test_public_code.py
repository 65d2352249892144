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
