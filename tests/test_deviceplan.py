"""Device planning (nbtrain.planning.deviceplan); the machine probes are in test_probe.py.

Everything runs without a GPU: GPUs are GpuInfo lists.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nbtrain.errors import ConfigurationError
from nbtrain.planning.deviceplan import ACCELERATORS, DevicePlan, GpuInfo, plan_devices, resolve_accelerator

GIB = 2**30
FOUR_GPUS = tuple(GpuInfo(i, "NVIDIA A100-SXM4-80GB", 80 * GIB, (79 - i) * GIB) for i in range(4))
CPU_COUNT = 8


def plan_cuda(devices: object, accelerator: str = "auto") -> DevicePlan:
    return plan_devices(devices, accelerator, gpus=FOUR_GPUS, mps_available=False, cpu_count=CPU_COUNT)


def plan_cpu_only(devices: object, accelerator: str = "auto") -> DevicePlan:
    return plan_devices(devices, accelerator, gpus=[], mps_available=False, cpu_count=CPU_COUNT)


def plan_mps(devices: object) -> DevicePlan:
    return plan_devices(devices, "auto", gpus=[], mps_available=True, cpu_count=CPU_COUNT)


# --- accelerator -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accelerator", "gpus", "mps", "expected"),
    [
        ("auto", FOUR_GPUS, True, "cuda"),
        ("auto", (), True, "mps"),
        ("auto", (), False, "cpu"),
        (None, FOUR_GPUS, False, "cuda"),
        ("cuda", FOUR_GPUS, False, "cuda"),
        ("gpu", FOUR_GPUS, False, "cuda"),
        (" GPU ", FOUR_GPUS, False, "cuda"),
        ("CUDA", FOUR_GPUS, False, "cuda"),
        ("cpu", FOUR_GPUS, True, "cpu"),
        ("Cpu", (), False, "cpu"),
        ("mps", (), True, "mps"),
        ("mps", FOUR_GPUS, True, "mps"),
    ],
)
def test_resolve_accelerator(accelerator, gpus, mps, expected):
    assert resolve_accelerator(accelerator, gpus=gpus, mps_available=mps) == expected


@pytest.mark.parametrize("accelerator", ["cuda", "gpu", " Cuda "])
def test_cuda_without_gpus_says_none_is_visible(accelerator):
    with pytest.raises(ConfigurationError) as raised:
        resolve_accelerator(accelerator, gpus=[], mps_available=False)
    message = str(raised.value)
    assert repr(accelerator) in message
    assert "none is visible" in message
    assert "CUDA_VISIBLE_DEVICES" in message and "NVML" in message
    assert "accelerator='cpu'" in message


def test_mps_without_mps_is_an_error():
    with pytest.raises(ConfigurationError, match="accelerator='mps'.*not available"):
        resolve_accelerator("mps", gpus=FOUR_GPUS, mps_available=False)


@pytest.mark.parametrize("accelerator", ["tpu", "", "cuda:0", 1, "hpu"])
def test_unknown_accelerator_lists_the_valid_names(accelerator):
    with pytest.raises(ConfigurationError) as raised:
        resolve_accelerator(accelerator, gpus=FOUR_GPUS, mps_available=False)
    message = str(raised.value)
    assert f"accelerator={accelerator!r}" in message
    assert all(repr(name) in message for name in ACCELERATORS)


def test_accelerator_error_comes_before_devices_error():
    with pytest.raises(ConfigurationError, match="^accelerator='tpu'"):
        plan_cuda("two", "tpu")


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (1, (0,)),
        (2, (0, 1)),
        (4, (0, 1, 2, 3)),
        ("2", (0, 1)),
        (" 3 ", (0, 1, 2)),
        (-1, (0, 1, 2, 3)),
        ("-1", (0, 1, 2, 3)),
        ("auto", (0, 1, 2, 3)),
        ("AUTO", (0, 1, 2, 3)),
        (None, (0, 1, 2, 3)),
        ([1, 3], (1, 3)),
        ((3, 1), (3, 1)),
        ([2], (2,)),
        (range(2, 4), (2, 3)),
        ("1,3", (1, 3)),
        ("0, 1", (0, 1)),
        (" 2 ,0 ", (2, 0)),
        ("1,", (1,)),
        ("0,", (0,)),
    ],
)
def test_cuda_forms(devices, expected):
    assert plan_cuda(devices) == DevicePlan("cuda", expected)


def test_cuda_plan_uses_the_logical_indices_of_the_gpus_given():
    # A count picks the first GPUs in the order given, whatever their index.
    two_gpus = [GpuInfo(0, "NVIDIA H100", 80 * GIB, 80 * GIB), GpuInfo(1, "NVIDIA H100", 80 * GIB, 80 * GIB)]
    plan = plan_devices(2, "gpu", gpus=two_gpus, mps_available=False, cpu_count=CPU_COUNT)
    assert plan == DevicePlan("cuda", (0, 1))
    assert plan.world_size == 2


def test_numpy_style_integers_are_accepted():
    class IntLike:  # numpy.int64 is not an int subclass but has __index__
        def __init__(self, value: int):
            self.value = value

        def __index__(self) -> int:
            return self.value

    assert plan_cuda(IntLike(2)).device_ids == (0, 1)
    assert plan_cuda([IntLike(3), IntLike(0)]).device_ids == (3, 0)


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        (0, "at least one device"),
        ("0", "at least one device"),
        (-2, "only negative value allowed is -1"),
        ("-3", "only negative value allowed is -1"),
        (5, "asks for 5 GPUs but only 4 are visible"),
        ("8", "asks for 8 GPUs but only 4 are visible"),
        ([1, 4], "there is no GPU 4"),
        ("0,7", "there is no GPU 7"),
        ([-1], "count from 0"),
        ([], "lists no device"),
        (",", "lists no device"),
        ([0, "1"], "entry '1' is not a GPU index"),
        ([0.0], "entry 0.0 is not a GPU index"),
        ([True], "entry True is not a GPU index"),
        ("two", "not a number of devices"),
        ("1.5", "not a number of devices"),
        ("", "not a number of devices"),
        ("  ", "not a number of devices"),
        ("--1", "not a number of devices"),
        ("²", "not a number of devices"),
        ("[1,2]", "write the list itself"),
        ("(1, 2)", "write the list itself"),
        ("1,a", "comma list must hold GPU indices"),
        ("1,-1", "comma list must hold GPU indices"),
        ("1.0,2", "comma list must hold GPU indices"),
        (1.5, "it is a float"),
        (2.0, "it is a float"),
        (True, "it is a bool"),
        (False, "it is a bool"),
        ({0, 1}, "set is not a form devices accepts"),
        (b"2", "bytes is not a form devices accepts"),
    ],
)
def test_bad_devices_on_cuda_name_the_value_and_list_the_gpus(devices, why):
    with pytest.raises(ConfigurationError) as raised:
        plan_cuda(devices)
    message = str(raised.value)
    assert message.startswith(f"devices={devices!r} is not valid")
    assert why in message
    assert "Visible GPUs: 0 (NVIDIA A100-SXM4-80GB, 79.0 GiB free), 1 (NVIDIA A100-SXM4-80GB, 78.0 GiB free)" in message
    assert "3 (NVIDIA A100-SXM4-80GB, 76.0 GiB free)." in message


def test_one_gpu_message_uses_the_singular():
    with pytest.raises(ConfigurationError, match="only 1 is visible"):
        plan_devices(2, gpus=FOUR_GPUS[:1], mps_available=False, cpu_count=CPU_COUNT)


def test_out_of_range_index_explains_cuda_visible_devices_numbering():
    with pytest.raises(ConfigurationError, match="after CUDA_VISIBLE_DEVICES"):
        plan_cuda([4])


# --- CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "world_size"),
    [
        (1, 1),
        (2, 2),
        ("3", 3),
        (16, 16),  # more processes than cores is allowed (slow, but useful for testing)
        ("auto", 1),
        (None, 1),
        (-1, CPU_COUNT),
        ("-1", CPU_COUNT),
    ],
)
@pytest.mark.parametrize("plan", [plan_cpu_only, lambda devices: plan_cuda(devices, "cpu")])
def test_cpu_forms(plan, devices, world_size):
    assert plan(devices) == DevicePlan("cpu", tuple(range(world_size)))


def test_cpu_all_cores_is_at_least_one_process():
    assert plan_devices(-1, "cpu", gpus=[], mps_available=False, cpu_count=0).world_size == 1


@pytest.mark.parametrize("devices", [[1, 3], (0,), "1,3", "0,", range(2)])
def test_index_list_on_a_machine_without_gpu_explains_devices_is_a_count(devices):
    with pytest.raises(ConfigurationError) as raised:
        plan_cpu_only(devices)
    message = str(raised.value)
    assert message.startswith(f"devices={devices!r} is not valid")
    assert "select GPUs" in message
    assert "This machine has no visible GPU; on CPU, devices is a number of processes, e.g. devices=2" in message
    assert f"{CPU_COUNT} CPU cores" in message


def test_index_list_with_accelerator_cpu_points_at_cuda_and_lists_the_gpus():
    with pytest.raises(ConfigurationError) as raised:
        plan_cuda([1, 3], "cpu")
    message = str(raised.value)
    assert "devices=[1, 3]" in message
    assert "accelerator='cuda'" in message
    assert "Visible GPUs: 0 (NVIDIA A100-SXM4-80GB" in message
    assert "devices is a number of processes" in message


@pytest.mark.parametrize(
    ("devices", "why"),
    [(0, "at least one device"), (-4, "-1"), ("two", "not a number"), (True, "bool"), (2.5, "float")],
)
def test_bad_devices_on_cpu_name_the_value_and_say_what_exists(devices, why):
    with pytest.raises(ConfigurationError) as raised:
        plan_cpu_only(devices)
    message = str(raised.value)
    assert f"devices={devices!r}" in message and why in message
    assert "This machine has no visible GPU" in message


# --- MPS -------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [1, "1", "auto", None, -1, "-1", [0], "0,"])
def test_mps_forms(devices):
    assert plan_mps(devices) == DevicePlan("mps", (0,))


@pytest.mark.parametrize("devices", [2, "2", [1], [0, 1], "0,1"])
def test_mps_rejects_more_than_one_device(devices):
    with pytest.raises(ConfigurationError) as raised:
        plan_mps(devices)
    message = str(raised.value)
    assert f"devices={devices!r}" in message
    assert "single device" in message
    assert "use devices=1 or 'auto'" in message


# --- DevicePlan ------------------------------------------------------------------------


def test_device_plan_world_size_and_list_ids():
    plan = DevicePlan("cpu", [0, 1, 2])  # type: ignore[arg-type]  # as decoded from JSON
    assert plan.device_ids == (0, 1, 2)
    assert plan.world_size == 3


@pytest.mark.parametrize(("accelerator", "device_ids"), [("gpu", (0,)), ("cuda", ())])
def test_device_plan_rejects_what_cannot_run(accelerator, device_ids):
    with pytest.raises(ValueError):
        DevicePlan(accelerator, device_ids)


def test_importing_does_not_import_torch():
    # Importing nbtrain starts the warm launcher unless told not to; this check needs none.
    code = "import nbtrain.planning.deviceplan, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "NBTRAIN_PREWARM": "0"}, timeout=120)


@pytest.mark.parametrize("devices", [[0, 0], "0,0", "1, 1, 0"])
def test_a_gpu_listed_twice_holds_two_ranks(devices):
    gpus = [GpuInfo(i, "NVIDIA H200", 140 * 2**30, 139 * 2**30) for i in range(2)]
    plan = plan_devices(devices, "cuda", gpus=gpus, mps_available=False, cpu_count=16)
    assert plan.world_size == (2 if devices != "1, 1, 0" else 3)
    assert plan.shared_gpus == ((0,) if devices != "1, 1, 0" else (1,))
