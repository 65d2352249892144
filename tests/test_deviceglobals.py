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


def test_a_device_kept_in_the_notebooks_settings_reads_as_each_ranks_own_and_stays_in_the_kernel(kernel):
    """Settings one step inside a global: a class used as a namespace, a frozen dataclass, a dict,
    a SimpleNamespace, and a model that keeps ``self.device`` for the tensors its forward makes."""
    kernel.run_ok(
        "import types\n"
        "from dataclasses import dataclass\n"
        "class CFG:\n"
        "    device = torch.device('cuda:0')\n"
        "    lr = 0.05\n"
        "@dataclass(frozen=True)\n"
        "class Config:\n"
        "    device: str = 'cuda:0'\n"
        "config = Config()\n"
        "settings = {'device': 'cuda:0', 'epochs': 1}\n"
        "args = types.SimpleNamespace(device=torch.device('cuda', 0))\n"
        "class Shifted(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(8, 1); self.device = torch.device('cuda:0')\n"
        "    def forward(self, x):\n"
        "        return self.fc(x) + torch.ones(1, device=self.device)\n"
        "shifted = Shifted()\n"
        "shifted_opt = torch.optim.SGD(shifted.parameters(), lr=CFG.lr)\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "for x, y in loader:\n"
        "    x, y = x.to(CFG.device), y.to(config.device)\n"
        "    loss = nn.functional.mse_loss(shifted(x.to(settings['device'])), y.to(args.device))\n"
        "    shifted_opt.zero_grad(); loss.backward(); shifted_opt.step()\n"
        "seen = [str(CFG.device), config.device, settings['device'], str(args.device), str(shifted.device)]\n"
    )
    assert kernel.value("seen") == ["cpu"] * 5, out.text
    kept = "CFG.device == torch.device('cuda:0') and config.device == 'cuda:0' and settings['device'] == 'cuda:0'"
    kept += " and args.device == torch.device('cuda:0') and shifted.device == torch.device('cuda:0')"
    assert kernel.value(kept)
    updated = out.stdout.partition("Updated in the kernel: ")[2].split(".")[0].split(", ")
    assert "shifted" in updated and not {"CFG", "config", "settings", "args"} & set(updated), out.stdout
