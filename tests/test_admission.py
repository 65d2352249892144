"""Admission: a run that cannot fit this machine is refused before any process starts.

The rules are pure (nbtrain.planning.deviceplan, nbtrain.planning.admission) and tested directly; then the same
refusals through ``nbtrain.launch`` and a real kernel's ``%%distributed``, checking that no
process was started.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import nbtrain
from helpers import procs
from nbtrain.errors import ConfigurationError
from nbtrain.planning import admission, deviceplan, probe

pytestmark = pytest.mark.timeout(240)

_GIB = 2**30


def plan_cpu(count, cores=2, **kwargs):
    return deviceplan.plan_devices(count, "cpu", gpus=[], mps_available=False, cpu_count=cores, **kwargs)


# -- how many CPU processes ----------------------------------------------------------------


def test_more_than_four_processes_per_core_are_refused_with_the_numbers_and_the_fix():
    with pytest.raises(ConfigurationError) as refused:
        plan_cpu(10000)
    message = str(refused.value)
    assert "devices=10000 is not valid: it asks for 10000 CPU processes, more than 4 per usable core" in message
    assert "(8 for the 2 cores here)" in message and "devices=2 runs one per core" in message
    assert "oversubscribe=True (--allow-oversubscribe on the %%distributed line)" in message
    assert plan_cpu(8).world_size == 8  # exactly 4 per core is allowed


def test_oversubscribe_allows_more_up_to_what_gloo_can_connect():
    assert plan_cpu(64, oversubscribe=True).world_size == 64
    with pytest.raises(ConfigurationError, match="more than the 1,024 one machine can connect"):
        plan_cpu(deviceplan.MOST_CPU_RANKS + 1, oversubscribe=True)


@pytest.mark.parametrize("oversubscribe", [False, True])
@pytest.mark.parametrize("value", [99999999999999999999, "99999999999999999999"])
def test_an_absurd_number_is_a_plain_configuration_error(value, oversubscribe):
    with pytest.raises(ConfigurationError) as refused:  # not an OverflowError building the plan
        plan_cpu(value, oversubscribe=oversubscribe)
    assert "99999999999999999999 CPU processes" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_gpu_indices_with_the_cpu_are_refused():
    with pytest.raises(ConfigurationError, match="it lists device indices, which select GPUs"):
        plan_cpu("1,3")


# -- how much memory -----------------------------------------------------------------------


def test_a_meta_model_is_weighed_by_its_shapes_with_gradients_and_adam_state():
    model = nn.Linear(1000, 1000, device="meta")
    optimizer = torch.optim.Adam(model.parameters())
    need = admission.weigh([model, optimizer])
    params = (1000 * 1000 + 1000) * 4
    assert need == admission.Footprint(parameters=params, gradients=params, optimizer_state=2 * params, shared=0)


def test_tensors_are_counted_once_per_storage_and_shared_once():
    data = torch.zeros(1000, 250)  # 1 MB
    model = nn.Linear(10, 10)
    values = [{"a": data[:10], "b": data[10:], "again": data}, model, [model], torch.optim.SGD(model.parameters(), 0.1)]
    need = admission.weigh(values)
    params = 110 * 4
    expected = admission.Footprint(parameters=params, gradients=params, optimizer_state=0, shared=params + 1_000_000)
    assert need == expected


def test_an_optimizers_existing_state_is_counted_as_it_is():
    model = nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()  # one momentum buffer per parameter now exists
    assert admission.weigh([optimizer]).optimizer_state == 110 * 4


def test_without_torch_imported_nothing_weighs_anything():
    assert admission.weigh([[1, 2.0], {"x": "y"}, None]) == admission.Footprint()


def test_a_run_that_cannot_fit_is_refused_and_one_that_comes_close_is_warned():
    need = admission.Footprint(parameters=_GIB, gradients=_GIB, optimizer_state=2 * _GIB)
    settings = {"world_size": 4, "accelerator": "cpu", "sharded": False, "start_method": "fork"}
    with pytest.raises(ConfigurationError) as refused:
        admission.check_memory(need, host_available=8 * _GIB, **settings)
    assert str(refused.value).startswith(
        "this run needs about 16.1 GiB of host memory (4 ranks x 4.0 GiB per rank: parameters 1.0 GiB"
    )
    assert "only 8.0 GiB is available, so it was not started. Use fewer devices" in str(refused.value)
    warning = admission.check_memory(need, host_available=18 * _GIB, **settings)
    assert warning.startswith("this run needs about 16.1 GiB of the 18.0 GiB of host memory available")
    assert admission.check_memory(need, host_available=64 * _GIB, **settings) is None
    # under FSDP each rank holds a quarter
    assert admission.check_memory(need, host_available=8 * _GIB, **{**settings, "sharded": True}) is None


def test_on_cuda_the_model_is_checked_against_each_gpus_free_memory():
    need = admission.Footprint(parameters=4 * _GIB, gradients=4 * _GIB)
    settings = {"world_size": 2, "accelerator": "cuda", "sharded": False, "start_method": "fork"}
    with pytest.raises(ConfigurationError, match="8.0 GiB of memory on GPU 1 .* only 6.0 GiB is available"):
        admission.check_memory(need, host_available=64 * _GIB, gpu_free={0: 40 * _GIB, 1: 6 * _GIB}, **settings)
    roomy = {0: 40 * _GIB, 1: 40 * _GIB}
    assert admission.check_memory(need, host_available=1 * _GIB, gpu_free=roomy, **settings) is None


def test_available_memory_is_what_the_machine_reports():
    with open("/proc/meminfo") as f:
        reported = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0 < probe.available_memory() <= reported * 1.5  # moves a little between the two reads


# -- through launch() ----------------------------------------------------------------------


def test_launch_refuses_before_any_process_starts(launcher):
    before = {p.pid for p in procs.launcher_children()}
    with pytest.raises(ConfigurationError, match="10000 CPU processes"):
        nbtrain.launch(lambda: 1, devices=10000, accelerator="cpu")
    model = nn.Linear(100_000, 100_000, device="meta")  # 40 GB of parameters, 0 bytes here
    with pytest.raises(ConfigurationError, match="GiB of host memory .* so it was not started"):
        nbtrain.launch(lambda: model.weight.shape, devices=2, accelerator="cpu")
    assert {p.pid for p in procs.launcher_children()} == before


def test_on_cuda_free_gpu_memory_is_read_through_nvml_before_launch(launcher, monkeypatch):
    from test_probe import fake_nvml

    nvml = fake_nvml({"GPU-aa11": ("NVIDIA A100", 80 * _GIB, 70 * _GIB), "GPU-bb22": ("NVIDIA A100", 80 * _GIB, _GIB)})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # no GPU in CI: NVML simulated, nothing else
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    before = {p.pid for p in procs.launcher_children()}
    model = nn.Linear(32_768, 32_768, bias=False, device="meta")  # 4 GiB of parameters, 8 with gradients
    with pytest.raises(ConfigurationError) as refused:
        nbtrain.start(lambda: model.weight.shape, devices=2, accelerator="cuda")
    assert str(refused.value).startswith(
        "this run needs about 8.0 GiB of memory on GPU 1 (8.0 GiB per rank: parameters 4.0 GiB + gradients 4.0 GiB), "
        "but only 1.0 GiB is available, so it was not started."
    )
    assert {p.pid for p in procs.launcher_children()} == before


def test_a_run_close_to_the_memory_limit_starts_with_a_one_line_warning(launcher, capfd):
    # parameters + gradients of a meta model (no memory here or on the rank) at 90% of what is free
    features = int((0.45 * probe.available_memory() / 4) ** 0.5)
    model = nn.Linear(features, features, bias=False, device="meta")
    assert procs.finish(nbtrain.start(lambda: tuple(model.weight.shape), devices=1, accelerator="cpu")) == (
        features,
        features,
    )
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("nbtrain warning:")]
    assert len(warnings) == 1 and " of host memory available (" in warnings[0], warnings
    assert warnings[0].endswith("it may run out of memory.")


# -- through a real kernel -----------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel():
    from kernel_helpers import NotebookKernel

    k = NotebookKernel()
    try:
        k.run_ok("%load_ext nbtrain\nimport time, torch\nfrom torch import nn")
        k.run_ok("from IPython.core.error import UsageError")
        k.run_ok("from nbtrain.kernel import launcher_connection\nnbtrain_launcher = launcher_connection.get_client()")
        assert k.value("nbtrain_launcher.ready.wait(120)")
        yield k
    finally:
        k.shutdown()


def refused_in_kernel(kernel, flags: str, body: str = "print('ran')") -> tuple[str, float]:
    """The UsageError a %%distributed cell gives and how long the refusal took, timed in the kernel."""
    descendants = {p.pid for p in kernel.descendants()}
    out = kernel.run_ok(
        "started = time.monotonic()\n"
        "try:\n"
        f"    get_ipython().run_cell_magic('distributed', {flags!r}, {body!r})\n"
        "    refusal = None\n"
        "except UsageError as error:\n"
        "    refusal = str(error)\n"
        "print(__import__('json').dumps([refusal, time.monotonic() - started]))\n"
    )
    refusal, seconds = json.loads(out.stdout.strip().splitlines()[-1])
    assert refusal is not None and "ran" not in out.stdout.splitlines(), out.text
    assert {p.pid for p in kernel.descendants()} == descendants  # no process started
    return refusal, seconds


def test_ten_thousand_cpu_ranks_are_refused_in_under_a_second_with_the_core_count(kernel):
    cores = kernel.value("len(__import__('os').sched_getaffinity(0))")
    refusal, seconds = refused_in_kernel(kernel, "--devices 10000 --accelerator cpu")
    assert seconds < 1.0, seconds
    print(f"--devices 10000 refused in {seconds * 1000:.0f} ms")
    assert refusal.startswith("%%distributed: devices='10000' is not valid: it asks for 10000 CPU processes")
    assert f"for the {cores} core" in refusal and f"({cores} CPU cores here)" in refusal
    assert "--allow-oversubscribe" in refusal


def test_the_refusal_is_one_usage_error_line_in_the_cell(kernel):
    for flags, expected in [
        ("--devices 99999999999999999999", "99999999999999999999 CPU processes"),
        ("--devices 1,3 --accelerator cpu", "it lists device indices, which select GPUs"),
    ]:
        out = kernel.run(f"%%distributed {flags}\nprint('ran')\n")
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("UsageError: %%distributed: "), out.text
        assert expected in lines[0] and out.error is None and "ran" not in out.stdout


def test_a_meta_model_too_large_for_the_machine_is_refused_before_launch(kernel):
    kernel.run_ok("big = nn.Linear(100_000, 100_000, device='meta')\nopt = torch.optim.Adam(big.parameters())")
    refusal, seconds = refused_in_kernel(
        kernel,
        "--devices 2 --accelerator cpu",
        "loss = big(torch.ones(1, 100_000, device='meta')).sum()\nopt.zero_grad(); loss.backward(); opt.step()",
    )
    assert refusal.startswith(
        "%%distributed: this run needs about 298 GiB of host memory (2 ranks x 149 GiB per rank: "
        "parameters 37.3 GiB + gradients 37.3 GiB + optimizer state 74.5 GiB)"
    )
    assert "so it was not started" in refusal and "--strategy fsdp" in refusal
    assert seconds < 1.0, seconds
    print(f"a 298 GiB meta model refused in {seconds * 1000:.0f} ms")


def test_oversubscribe_flag_lets_a_deliberate_run_through(kernel):
    count = 4 * kernel.value("len(__import__('os').sched_getaffinity(0))") + 1
    out = kernel.run_ok(
        f"%%distributed --devices {count} --accelerator cpu --allow-oversubscribe --output rank0\n"
        "import torch.distributed as dist\nprint('world', dist.get_world_size())\n"
    )
    assert f"world {count}" in out.stdout
