"""The CUDA paths on a real GPU: skipped where no CUDA device exists (CI has none).

Run on a GPU machine with ``.venv/bin/python -m pytest tests/gpu -m gpu``. What they show:
the kernel may initialise CUDA and still launch CUDA ranks (they fork from the launcher,
never from the kernel), nccl groups, mixed precision with the loss scaler, FSDP on one GPU,
CUDA memory in the live view's samples, CUDA tensors coming back, and an out-of-memory
error named as such.
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
from helpers.procs import RUN_TIMEOUT, finish
from kernel_helpers import NotebookKernel
from nbtrain import events
from nbtrain.errors import RankError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


def _start(fn, *args, **settings):
    return nbtrain.start(fn, args, devices=1, accelerator="cuda", timeout=RUN_TIMEOUT, **settings)


def test_a_kernel_that_touched_cuda_trains_a_cuda_cell_and_gets_its_weights_back():
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport torch\ntorch.cuda.init()\ntorch.manual_seed(0)\n"
            "model = torch.nn.Linear(8, 1).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "x, y = torch.randn(64, 8, device='cuda'), torch.randn(64, 1, device='cuda')\n"
            "before = model.weight.detach().clone()\n"
        )
        kernel.run_ok(
            "%%distributed --accelerator cuda --devices 1\n"
            "for _ in range(5):\n"
            "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
        )
        moved, device = kernel.value("[(model.weight - before).abs().sum().item(), str(model.weight.device)]")
        assert moved > 0 and device.startswith("cuda")


def test_cuda_ranks_join_an_nccl_group(launcher):
    assert finish(_start(lambda: torch.distributed.get_backend())) == "nccl"


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_precision_on_cuda_trains(launcher, precision, dtype):
    def fn():
        torch.manual_seed(0)
        net = nbtrain.prepare(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x, y = torch.randn(128, 32, device="cuda"), torch.randn(128, 1, device="cuda")
        losses, out_dtype = [], None
        for _ in range(30):
            out = net(x)
            out_dtype = out.dtype
            loss = torch.nn.functional.mse_loss(out.float(), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        return losses, str(out_dtype), str(next(net.parameters()).dtype)

    losses, out_dtype, weight_dtype = finish(_start(fn, precision=precision))
    assert out_dtype == str(dtype) and weight_dtype == "torch.float32"
    assert losses[-1] < 0.9 * losses[0]


def test_fsdp_on_one_gpu_brings_full_weights_back(launcher):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

    def fn(model):
        net = nbtrain.prepare(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.randn(4, 8, device="cuda")).sum().backward()
        opt.step()
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in net.state_dict().items()}

    state = finish(_start(fn, model, strategy="fsdp"))
    assert set(state) == set(model.state_dict())


def test_cuda_memory_reaches_the_live_view(launcher):
    def fn():
        keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        for step in range(20):
            nbtrain.log(step=step)
            torch.cuda.synchronize()
            import time

            time.sleep(0.05)  # the rank's own pace: the samples are taken while it runs
        return keep.numel()

    samples = []
    finish(_start(fn), on_event=lambda e: samples.append(e) if isinstance(e, events.MemorySample) else None)
    assert any((s.cuda_allocated_bytes or 0) >= 64 << 20 for s in samples)


def test_a_cuda_result_tensor_comes_back(launcher):
    value = finish(_start(lambda: torch.arange(4.0, device="cuda") * 2))
    assert torch.equal(value.cpu(), torch.arange(4.0) * 2)


def test_cuda_out_of_memory_is_reported_as_such(launcher):
    def fn():
        free, _ = torch.cuda.mem_get_info()
        return torch.empty(free * 4, dtype=torch.uint8, device="cuda")

    with pytest.raises(RankError, match="(?i)out of memory"):
        finish(_start(fn))
