"""The cluster engine with CUDA ranks, on a real one-node Ray cluster on the GPU machine.

One GPU means one node: two raylets declaring the same GPU would hand both nodes the same
device, which nccl refuses. What this shows: the agent's placement-group bundle holds the
GPU, Ray's CUDA_VISIBLE_DEVICES reaches the ranks, the rank trains on CUDA in an nccl group,
and CUDA weights come back through the object store into the kernel's CPU model. Skipped
where there is no CUDA device or no Ray (``bash .ci/gpu`` says how to bring Ray along).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import nbtrain
from helpers import raycluster
from helpers.procs import finish, wait_gone
from kernel_helpers import NotebookKernel
from nbtrain.errors import ConfigurationError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]
ray = pytest.importorskip("ray", reason="the GPU cluster test needs Ray: pip install 'nbtrain[ray]'")

GONE_SECONDS = 15.0


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[Any]:
    """A head node holding this machine's first GPU and two CPUs; ended by PID afterwards."""
    from ray.cluster_utils import Cluster

    with raycluster.environment(NBTRAIN_PREWARM="0"):  # raylets pass it on: the agent starts its own launcher
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "num_gpus": 1, "object_store_memory": 200 << 20, "include_dashboard": False},
        )
    pids = [info.process.pid for infos in cluster.head_node.all_processes.values() for info in infos]
    try:
        with raycluster.connected_to(cluster):
            yield cluster
    finally:
        for pid in wait_gone(pids, GONE_SECONDS, reaped=False):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _train(model: torch.nn.Module) -> dict[str, Any]:
    import torch.distributed as dist

    net = nbtrain.prepare(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 1, device="cuda")
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    return {
        "backend": dist.get_backend(),
        "device": str(next(net.parameters()).device),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "state": model.state_dict(),  # CUDA tensors: they cross on the CPU
    }


def test_a_cuda_rank_on_a_cluster_node_trains_in_nccl_and_its_weights_come_back(gpu_cluster: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    before = model.weight.detach().clone()
    # the first run places the agent and imports torch on the node
    run = nbtrain.start(_train, (model,), devices=1, accelerator="cuda", cluster="ray", num_nodes=1, timeout=240.0)
    out = finish(run, 300.0)
    assert out["backend"] == "nccl" and out["device"] == "cuda:0"
    assert out["visible"], "Ray gave the agent's bundle no GPU"
    model.load_state_dict(out["state"])
    assert not torch.equal(model.weight.detach(), before)


def test_a_cuda_cell_on_the_cluster_updates_the_kernels_model(gpu_cluster: Any) -> None:
    from nbtrain.cluster import engine

    engine.close()  # this process's warm agent holds the node's only GPU: the kernel's needs it
    with NotebookKernel(env={"RAY_ADDRESS": gpu_cluster.address}) as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport torch\ntorch.manual_seed(0)\n"
            "model = torch.nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "before = model.weight.detach().clone()\n"
        )
        kernel.run_ok(
            "%%distributed --cluster ray --num-nodes 1 --accelerator cuda --devices 1\n"
            "x, y = torch.randn(64, 8, device='cuda'), torch.randn(64, 1, device='cuda')\n"
            "for _ in range(5):\n"
            "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
        )
        moved, device = kernel.value("[(model.weight - before).abs().sum().item(), str(model.weight.device)]")
        assert moved > 0 and device == "cpu"


def test_more_gpus_than_the_node_has_fails_at_once_listing_it(gpu_cluster: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        nbtrain.start(_train, (torch.nn.Linear(8, 1),), devices=2, accelerator="cuda", cluster="ray", num_nodes=1)
    assert "1 GPUs" in str(caught.value), str(caught.value)
