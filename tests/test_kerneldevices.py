"""The kernel's device globals read as the rank's device (a real kernel, 2 CPU ranks).

PyTorch's tutorials name the device once (``device = torch.device("cuda:0" if ... else
"cpu")``) and move each batch with ``x.to(device)``. On a rank whose device is not the
kernel's (rank 1's GPU, or the CPU ranks of ``--accelerator cpu`` beside a kernel with a GPU)
the cell reads it as its own; the kernel keeps its value. A device object names no GPU
until used, so the CPU ranks here show the mapping without one.
"""

from __future__ import annotations

import pytest

from kernel_helpers import nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

SETUP = """
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(128, 8)
Y = X @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
net = nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
"""


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_a_kernels_gpu_device_reads_as_each_ranks_own_and_stays_in_the_kernel(kernel):
    kernel.run_ok(
        "device = torch.device('cuda:0')\n"
        "device_name = 'cuda:0'\n"
        "home = torch.device('cpu')\n"
        "device_type = 'cuda'  # an autocast device_type: no index, left as it is\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "for x, y in loader:\n"
        "    x, y = x.to(device), y.to(device_name)\n"
        "    loss = nn.functional.mse_loss(net(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "seen = [str(device), device_name, str(home), device_type, str(loss.to(home).device)]\n"
    )
    assert kernel.value("seen") == ["cpu", "cpu", "cpu", "cuda", "cpu"], out.text
    assert kernel.value("device == torch.device('cuda:0') and device_name == 'cuda:0'")
    updated = out.stdout.partition("Updated in the kernel: ")[2].split(".")[0].split(", ")
    assert "loss" in updated and "device" not in updated and "device_name" not in updated, out.stdout
