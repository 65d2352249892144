"""Training options: --precision, --sync-batchnorm, --backend, ddp_sharded, and the effective batch size.

Real ranks (CPU, gloo, 2 processes) through ``nbtrain.start``; the flags through a real
kernel. Rank functions are nested so that they travel by value, as notebook code does.
"""

from __future__ import annotations

import re

import pytest
import torch

import nbtrain
from helpers.procs import finish
from kernel_helpers import NotebookKernel
from nbtrain.errors import ConfigurationError
from nbtrain.options import LaunchOptions
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan

pytestmark = pytest.mark.timeout(240)


# -- the names, pure ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [("32", "32-true"), (32, "32-true"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), ("BF16-True", "bf16-true")],
)
def test_lightning_precision_names_and_short_forms(given, expected):
    assert config.resolve_precision(given, "cuda") == expected


def test_unknown_precision_lists_the_choices():
    with pytest.raises(ConfigurationError, match=r"unknown precision 'half'\. Available precisions: 32-true, 64-true"):
        config.resolve_precision("half", "cpu")


def test_fp16_on_cpu_is_refused_with_bf16_pointed_to():
    with pytest.raises(ConfigurationError) as refused:
        config.resolve_precision("16-mixed", "cpu")
    message = str(refused.value)
    assert "'16-mixed' cannot run on the cpu accelerator" in message
    assert "bf16-mixed is the CPU's mixed precision" in message


def test_the_ranks_are_told_precision_and_batchnorm_sync():
    options = LaunchOptions(devices=2, accelerator="cpu", precision="bf16-true", sync_batchnorm=True)
    told = options.config_for(DevicePlan("cpu", (0, 1))).rank
    assert (told.model_wrapper, told.precision, told.sync_batchnorm, told.dp_devices) == ("ddp", "bf16-true", True, ())


# -- the magic -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel():
    k = NotebookKernel()
    try:
        k.run_ok(
            "%load_ext nbtrain\n"
            "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
            "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)\n"
        )
        yield k
    finally:
        k.shutdown()


CELL = """%%distributed --devices 2 --accelerator cpu {flags}
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_cell_in_bf16_true_comes_back_in_the_kernels_dtype(kernel):
    before = kernel.value("model[1].running_mean.sum().item()")
    out = kernel.run_ok(CELL.format(flags="--precision bf16-true --sync-batchnorm"))
    assert "effective batch 16 = 8 per rank x 2 ranks" in out.text
    seconds = float(re.search(r"finished in ([\d.]+) s\.", out.text).group(1))
    assert seconds >= 0.1, out.text  # the run's real duration: forking and training 2 ranks takes longer
    assert kernel.value("[str(model[0].weight.dtype), type(model[1]).__name__]") == ["torch.float32", "BatchNorm1d"]
    assert kernel.value("model[1].running_mean.sum().item()") != before


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ("--precision 16-mixed", "UsageError: %%distributed: precision '16-mixed' cannot run on the cpu accelerator"),
        ("--precision half", "UsageError: %%distributed: unknown precision 'half'. Available precisions:"),
        ("--backend nccl", "UsageError: %%distributed: backend 'nccl' needs CUDA devices"),
        ("--backend tcp", "UsageError: %%distributed: unknown process-group backend 'tcp'. Available backends:"),
        ("--strategy dp", "UsageError: %%distributed: strategy 'dp' (DataParallel) splits each batch over CUDA GPUs"),
    ],
)
def test_bad_training_options_are_one_line_usage_errors(kernel, flags, needle):
    out = kernel.run(CELL.format(flags=flags))
    assert needle in out.text, out.text


SHARDED_SETUP = """
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
start = {k: v.clone() for k, v in net.state_dict().items()}
adam = torch.optim.Adam(net.parameters(), lr=0.01)
"""
SHARDED_CELL = """%%distributed --devices 2 --accelerator cpu --strategy {strategy}
for x, y in loader:
    loss = torch.nn.functional.mse_loss(net(x), y)
    adam.zero_grad(); loss.backward(); adam.step()
"""
SHARDED_RESULT = (
    "[[v.tolist() for v in net.state_dict().values()], "
    "[[s['exp_avg_sq'].tolist() for s in adam.state_dict()['state'].values()], type(adam).__name__]]"
)


def test_ddp_sharded_trains_as_ddp_and_returns_the_full_optimizer_state(kernel):
    """ZeRO partitions Adam's state across the ranks; the kernel's Adam gets all of it back."""
    results = {}
    for strategy in ("ddp_notebook", "ddp_sharded"):
        kernel.run_ok(SHARDED_SETUP)
        out = kernel.run_ok(SHARDED_CELL.format(strategy=strategy))
        results[strategy] = kernel.value(SHARDED_RESULT)
    assert "adam (ZeroRedundancyOptimizer)" in out.text
    (weights, (moments, kind)), (sharded_weights, (sharded_moments, sharded_kind)) = results.values()
    assert kind == sharded_kind == "Adam" and len(sharded_moments) == 4  # every parameter's state
    for a, b in zip([*weights, *moments], [*sharded_weights, *sharded_moments], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


# -- dp and fsdp_cpu_offload ---------------------------------------------------------------


def test_dp_is_one_rank_driving_every_chosen_gpu():
    cfg = config.make_config(DevicePlan("cuda", (0, 2)), strategy="dp", timeout=None)
    (spec,) = cfg.rank_specs()
    assert (spec.rank, spec.world_size, spec.device_type, spec.device_index) == (0, 1, "cuda", 0)
    assert cfg.rank.dp_devices == (0, 2) and cfg.rank.model_wrapper == "dp"
    assert cfg.world_size == 1


def test_dp_on_cpu_is_refused_before_launch_pointing_to_ddp_notebook(launcher, leak_guard):
    with pytest.raises(ConfigurationError) as refused:
        nbtrain.start(lambda: 1, devices=2, accelerator="cpu", strategy="dp")
    message = str(refused.value)
    assert message.startswith("strategy 'dp' (DataParallel) splits each batch over CUDA GPUs from one process")
    assert "use strategy 'ddp_notebook'" in message and "\n" not in message
    assert not leak_guard.leaks()  # nothing was started


def test_dp_refuses_sync_batchnorm():
    with pytest.raises(ConfigurationError, match="sync_batchnorm cannot go with strategy 'dp'"):
        config.make_config(
            DevicePlan("cuda", (0, 1)), strategy="dp", timeout=None, rank_options={"sync_batchnorm": True}
        )


def test_fsdp_cpu_offload_matches_one_process_with_the_combined_batch(launcher):
    """2 CPU ranks with the shards offloaded (FSDP2, CPUOffloadPolicy) step as one process with both halves."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def fn(model, x, y):
        from torch.distributed.fsdp import FSDPModule

        net = nbtrain.prepare(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        share = slice(nbtrain.rank() * 8, (nbtrain.rank() + 1) * 8)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[share]), y[share]).backward()
            opt.step()
        policy = type(net[0]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
        state = {k: v.full_tensor() for k, v in net.state_dict().items()}
        return isinstance(net, FSDPModule), policy, state

    run = nbtrain.start(fn, (model, x, y), devices=2, accelerator="cpu", strategy="fsdp_cpu_offload")
    sharded, policy, state = finish(run)
    assert sharded and policy == "CPUOffloadPolicy"
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for key, value in reference.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-6), key


def test_a_cell_under_fsdp_cpu_offload_brings_weights_and_adam_state_back_as_fsdp_does(kernel):
    results = {}
    for strategy in ("fsdp", "fsdp_cpu_offload"):
        kernel.run_ok(SHARDED_SETUP)
        out = kernel.run_ok(SHARDED_CELL.format(strategy=strategy))
        assert f"(cpu, {strategy})" in out.text, out.text
        results[strategy] = kernel.value(SHARDED_RESULT)
    (weights, (moments, kind)), (offloaded, (offloaded_moments, offloaded_kind)) = results.values()
    assert kind == offloaded_kind == "Adam" and len(offloaded_moments) == 4
    for a, b in zip([*weights, *moments], [*offloaded, *offloaded_moments], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
