"""One GPU, one rank and two: the paths a one-GPU machine can show. Skipped without CUDA.

- One rank trains the model as it is (no DDP): the summary says so, the weights come back,
  and the rank's training equals the kernel's own loop on the same GPU.
- Two ranks sharing GPU 0 (``--devices 0,0``; gloo, since nccl refuses a GPU twice) run the
  multi-rank CUDA paths: DDP with device_ids equals one process on the whole batch, the
  kernel's CUDA model gets rank 0's weights back, a DistributedSampler's shares reach each
  rank on CUDA, and each rank's CUDA memory reaches the live view; a step that bypasses a
  DDP model's forward has its CUDA gradients averaged as DDP averages them, and the
  notebook's own ``nn.DataParallel`` trains as DDP's and comes back as itself; a kernel's
  ``device`` global naming another GPU reads as each rank's own; a model and loader the cell
  makes itself train as one process does on both ranks' batches.
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
from helpers.procs import RUN_TIMEOUT, finish
from kernel_helpers import NotebookKernel
from nbtrain.errors import ConfigurationError
from nbtrain.messages import events

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

SHARED = "0,0"  # two ranks on GPU 0


def _train(world: int, steps: int = 5) -> tuple[str, dict[str, torch.Tensor]]:
    """On a rank: the same MLP and data everywhere; each of ``world`` ranks takes its slice of the batch."""
    torch.manual_seed(0)
    model = nbtrain.prepare(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    share = slice(nbtrain.rank() * 64 // world, (nbtrain.rank() + 1) * 64 // world)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[share]), y[share])
        opt.zero_grad(); loss.backward(); opt.step()
    return type(model).__name__, {name: value.detach().cpu() for name, value in model.state_dict().items()}


def test_two_ranks_on_one_gpu_train_as_one_process_does(launcher):
    kind1, one = finish(nbtrain.start(_train, (1,), devices=1, accelerator="cuda", timeout=RUN_TIMEOUT))
    kind2, two = finish(nbtrain.start(_train, (2,), devices=SHARED, accelerator="cuda", timeout=RUN_TIMEOUT))
    assert (kind1, kind2) == ("Sequential", "DistributedDataParallel")  # one rank unwrapped, two under DDP
    diff = max((one[name] - two[name]).abs().max().item() for name in one)
    assert diff < 1e-5, diff


def test_two_ranks_on_one_gpu_use_gloo_and_nccl_is_refused_with_what_to_do(launcher):
    assert finish(nbtrain.start(lambda: torch.distributed.get_backend(), devices=SHARED, accelerator="cuda")) == "gloo"
    with pytest.raises(ConfigurationError, match="nccl refuses a GPU that two ranks of its group share"):
        nbtrain.start(lambda: None, devices=SHARED, accelerator="cuda", backend="nccl")


def test_a_sampler_shares_the_loader_between_two_ranks_on_cuda(launcher):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(40.0)), batch_size=4, shuffle=True)

    def fn(loader):
        loader = nbtrain.prepare(loader)
        seen, devices = [], set()
        for (batch,) in loader:
            devices.add(batch.device.type)
            seen += batch.long().tolist()
        everyone: list = [None, None]
        torch.distributed.all_gather_object(everyone, (seen, sorted(devices), type(loader.sampler).__name__))
        return everyone

    (first, devices0, sampler), (second, devices1, _) = finish(
        nbtrain.start(fn, (loader,), devices=SHARED, accelerator="cuda", timeout=RUN_TIMEOUT)
    )
    assert sampler == "DistributedSampler" and devices0 == devices1 == ["cuda"]
    assert len(first) == len(second) == 20 and sorted(first + second) == list(range(40))


def test_each_ranks_cuda_memory_reaches_the_live_view(launcher):
    def fn():
        import time

        keep = torch.empty((32 << 20) * (nbtrain.rank() + 1), dtype=torch.uint8, device="cuda")
        for step in range(12):
            nbtrain.log(step=step, seconds=time.time())
            time.sleep(0.05)  # the rank's own pace: the samples are taken while it runs
        return keep.numel()

    samples: list[events.MemorySample] = []

    def keep(event):
        if isinstance(event, events.MemorySample):
            samples.append(event)

    finish(nbtrain.start(fn, devices=SHARED, accelerator="cuda", timeout=RUN_TIMEOUT), on_event=keep)
    most = {rank: max((s.cuda_allocated_bytes or 0) for s in samples if s.rank == rank) for rank in (0, 1)}
    assert most[0] >= 32 << 20 and most[1] >= 64 << 20, most


KERNEL_SETUP = (
    "%load_ext nbtrain\nimport torch\ntorch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).cuda()\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
    "x, y = torch.randn(64, 16, device='cuda'), torch.randn(64, 1, device='cuda')\n"
    "start = ({k: v.clone() for k, v in model.state_dict().items()}, torch.cuda.get_rng_state())\n"
)
KERNEL_LOOP = (
    "for _ in range(5):\n"
    "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
)


def test_one_rank_on_the_gpu_is_not_wrapped_and_trains_as_the_kernels_loop_does():
    with NotebookKernel() as kernel:
        kernel.run_ok(KERNEL_SETUP)
        kernel.run_ok(KERNEL_LOOP)
        kernel.run_ok("in_kernel = {k: v.clone() for k, v in model.state_dict().items()}")
        kernel.run_ok("model.load_state_dict(start[0])")
        out = kernel.run_ok("%%distributed --devices 1 --accelerator cuda\n" + KERNEL_LOOP)
        assert "model: on cuda:0, not wrapped (one rank)" in out.stdout, out.stdout
        diff = kernel.value("max((v - in_kernel[k]).abs().max().item() for k, v in model.state_dict().items())")
        moved = kernel.value("max((v - start[0][k]).abs().max().item() for k, v in model.state_dict().items())")
        assert diff < 1e-6 and moved > 0, (diff, moved)


def test_two_ranks_sharing_a_gpu_bring_the_cuda_weights_back_to_the_kernel():
    with NotebookKernel() as kernel:
        kernel.run_ok(KERNEL_SETUP)
        out = kernel.run_ok(
            "%%distributed --devices 0,0 --accelerator cuda\n" + KERNEL_LOOP
        )
        assert "2 ranks (cuda, ddp_notebook)" in out.stdout, out.stdout
        assert "model (DistributedDataParallel)" in out.stdout, out.stdout
        moved = kernel.value("max((v - start[0][k]).abs().max().item() for k, v in model.state_dict().items())")
        assert moved > 0 and kernel.value("str(next(model.parameters()).device)") == "cuda:0"


def test_a_resnet_cell_on_one_gpu_brings_its_weights_back():
    pytest.importorskip("torchvision", reason="the ResNet cell needs torchvision")
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport torch, torchvision\ntorch.manual_seed(0)\n"
            "model = torchvision.models.resnet18(num_classes=10).cuda()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
            "x, y = torch.randn(32, 3, 64, 64, device='cuda'), torch.randint(0, 10, (32,), device='cuda')\n"
            "before = model.conv1.weight.detach().clone()\n"
        )
        kernel.run_ok(
            "%%distributed --devices 1 --accelerator cuda\n"
            "for _ in range(3):\n"
            "    loss = torch.nn.functional.cross_entropy(model(x), y)\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
        )
        assert kernel.value("(model.conv1.weight - before).abs().sum().item() > 0 and model.conv1.weight.is_cuda")


class _TwoTowers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x))


def _called_and_bypassed() -> tuple[float, bool]:
    """On a rank: one model trained through its forward (DDP averages), a copy through its parts
    (nbtrain.rank.auto.averaging averages, on the rank's GPU); their largest difference and whether the
    ranks agree."""
    torch.manual_seed(0)
    called, bypassed = _TwoTowers().cuda(), _TwoTowers().cuda()
    bypassed.load_state_dict(called.state_dict())
    called, bypassed = nbtrain.prepare(called, bypassed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (called, bypassed)]
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    share = slice(nbtrain.rank() * 32, (nbtrain.rank() + 1) * 32)
    for _ in range(5):
        torch.nn.functional.mse_loss(called(x[share]), y[share]).backward()
        torch.nn.functional.mse_loss(bypassed.head(bypassed.encode(x[share])), y[share]).backward()
        for opt in opts:
            opt.step(); opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(called.parameters(), bypassed.parameters(), strict=True))
    mine = bypassed.head.weight.detach().clone()
    rank0s = mine.clone()
    torch.distributed.broadcast(rank0s, 0)
    return diff, bool(torch.equal(mine, rank0s))


def test_a_bypassed_forwards_cuda_gradients_are_averaged_as_ddp_averages_them(launcher):
    diff, agree = finish(nbtrain.start(_called_and_bypassed, devices=SHARED, accelerator="cuda", timeout=RUN_TIMEOUT))
    assert agree and diff < 1e-5, (diff, agree)


def test_the_notebooks_cuda_data_parallel_trains_as_ddp_on_two_ranks_and_comes_back_as_itself():
    with NotebookKernel() as kernel:
        kernel.run_ok(KERNEL_SETUP + "model = torch.nn.DataParallel(model)\nkernels = id(model)\n")
        out = kernel.run_ok("%%distributed --devices 0,0 --accelerator cuda\n" + KERNEL_LOOP)
        assert "model (DistributedDataParallel, its DataParallel set aside" in out.stdout, out.stdout
        assert kernel.value("id(model) == kernels and type(model).__name__") == "DataParallel"
        moved = kernel.value("max((model.module.state_dict()[k] - v).abs().max().item() for k, v in start[0].items())")
        assert moved > 0 and kernel.value("str(next(model.parameters()).device)") == "cuda:0"


def test_a_kernels_device_global_reads_as_each_ranks_gpu():
    """``device = torch.device("cuda:1")`` and ``CFG.device = "cuda:1"`` (another GPU than the ranks';
    none here): each rank's batches go to its own GPU, and the kernel's keep their values."""
    with NotebookKernel() as kernel:
        kernel.run_ok(
            KERNEL_SETUP + "device, device_name = torch.device('cuda:1'), 'cuda:1'\n"
            "class CFG:\n    device = 'cuda:1'\n"
        )
        kernel.run_ok(
            "%%distributed --devices 0,0 --accelerator cuda\n"
            "for _ in range(3):\n"
            "    loss = torch.nn.functional.mse_loss(model(x.to(device).to(CFG.device)), y.to(device_name))\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
            "seen = (str(device), device_name, CFG.device, str(loss.device))\n"
        )
        assert kernel.value("list(seen)") == ["cuda:0", "cuda:0", "cuda:0", "cuda:0"]
        assert kernel.value("[str(device), device_name, CFG.device]") == ["cuda:1", "cuda:1", "cuda:1"]


MADE_IN_CELL = (
    "torch.manual_seed(3)\n"
    "net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)\n"
    "opt_made = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)\n"
    "for xb, yb in DataLoader(TensorDataset(xs, ys), batch_size={batch}):\n"
    "    loss = torch.nn.functional.mse_loss(net(xb.to(device)), yb.to(device))\n"
    "    opt_made.zero_grad(); loss.backward(); opt_made.step()\n"
    "made = {{k: v.detach().cpu() for k, v in net.state_dict().items()}}\n"
)


def test_a_model_and_loader_the_cell_makes_train_on_two_ranks_as_one_process_on_both_batches():
    """No DDP wraps a model the cell makes: its CUDA gradients are averaged before each step and
    its loader sharded, so two ranks' batches of 16 train it as one process's batches of 32."""
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
            "torch.manual_seed(0)\nxs, ys = torch.randn(256, 16), torch.randn(256, 1)\n"
            "device = torch.device('cuda:0')\n"
        )
        kernel.run_ok(MADE_IN_CELL.format(batch=32) + "alone = made\n")
        out = kernel.run_ok("%%distributed --devices 0,0 --accelerator cuda\n" + MADE_IN_CELL.format(batch=16))
        assert "net (made in the cell: gradients averaged before each step)" in out.stdout, out.stdout
        diff = kernel.value("max((made[k] - alone[k]).abs().max().item() for k in made)")
        assert diff < 1e-5, diff
