"""torch's settings as the kernel has them, on each run's ranks (nbtrain.messages.torchsettings), in a real kernel."""

from __future__ import annotations

import pytest

from helpers import procs
from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(240)

REPORT = (
    "%%distributed --devices 2 --accelerator cpu\n"
    "import torch, nbtrain\n"
    "settings = (str(torch.get_default_dtype()), torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,\n"
    "            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),\n"
    "            torch.is_anomaly_enabled(), torch.get_float32_matmul_precision())\n"
    "print('settings', *settings)\n"
)


def _reported(out: str) -> list[str]:
    lines = sorted(line.split("settings ", 1)[1] for line in out.splitlines() if "] settings " in line)
    assert len(lines) == 2, out
    assert lines[0] == lines[1], out  # both ranks alike
    return lines[0].split()


def test_the_kernels_torch_settings_are_the_ranks_and_a_float64_notebook_trains():
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport torch")
        assert _reported(kernel.run_ok(REPORT).stdout) == [
            "torch.float32", "False", "False", "False", "False", "False", "highest",
        ]
        kernel.run_ok(
            "torch.set_default_dtype(torch.float64)\n"
            "torch.backends.cudnn.benchmark = True\n"
            "torch.backends.cudnn.deterministic = True\n"
            "torch.use_deterministic_algorithms(True, warn_only=True)\n"
            "torch.autograd.set_detect_anomaly(True)\n"
            "torch.set_float32_matmul_precision('high')\n"
            "model = torch.nn.Linear(4, 1)\n"  # float64 parameters, as the notebook made them
        )
        assert _reported(kernel.run_ok(REPORT).stdout) == [
            "torch.float64", "True", "True", "True", "True", "True", "high",
        ]
        # The cell's own tensors are float64 too, as in the kernel: it trains without a dtype error.
        kernel.run_ok(
            "%%distributed --devices 2 --accelerator cpu\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "loss = model(torch.randn(8, 4)).pow(2).mean()\n"
            "loss.backward()\nopt.step()\n"
        )
        assert kernel.value("str(model.weight.dtype)") == "torch.float64"
        # Back to the defaults in the kernel: the next run's ranks (standby ones included) are too.
        kernel.run_ok(
            "torch.set_default_dtype(torch.float32)\ntorch.backends.cudnn.benchmark = False\n"
            "torch.backends.cudnn.deterministic = False\ntorch.use_deterministic_algorithms(False)\n"
            "torch.autograd.set_detect_anomaly(False)\ntorch.set_float32_matmul_precision('highest')\n"
        )
        assert _reported(kernel.run_ok(REPORT).stdout)[0] == "torch.float32"


def test_a_tf32_setting_made_either_way_is_read_without_a_warning_and_set_on_a_rank():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import torch\n"
        "from nbtrain.messages import torchsettings\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"  # the newer way
        "newer = torchsettings.changed_from_defaults()\n"
        "torch.backends.cuda.matmul.fp32_precision = 'ieee'\n"
        "torch.backends.cuda.matmul.allow_tf32 = True\n"  # the older way
        "older = torchsettings.changed_from_defaults()\n"
        "torch.set_float32_matmul_precision('highest')\n"
        "torchsettings.take_on({**older, 'default_device': 'cuda'}, 'cpu')  # a CPU rank keeps the CPU\n"
        "print(newer, older, torch.get_float32_matmul_precision(), torch.get_default_device())\n"
    )
    assert procs.python_output(code).split() == ["{'tf32_matmul':", "True}", "{'tf32_matmul':", "True}", "high", "cpu"]
