"""Device planning (nbtrain.devices) and the machine probes (nbtrain.hardware).

Everything runs without a GPU: GPUs are GpuInfo lists, and NVML is a fake module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest

from nbtrain import hardware
from nbtrain.devices import ACCELERATORS, DevicePlan, GpuInfo, plan_devices, resolve_accelerator
from nbtrain.errors import ConfigurationError
from nbtrain.hardware import detect_gpus, visible_device_order

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
        ([1, 1], "index 1 appears more than once"),
        ("2, 0, 2", "index 2 appears more than once"),
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


# --- CUDA_VISIBLE_DEVICES --------------------------------------------------------------

UUIDS = ["GPU-aa11-0000", "GPU-bb22-0000", "GPU-ab33-0000", "GPU-cc44-0000"]


@pytest.mark.parametrize(
    ("cuda_visible_devices", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
        ("0", [0]),
        ("2,0", [2, 0]),
        ("3, 1", [3, 1]),
        (" 1 ", [1]),
        ("1,-1,2", [1]),  # a negative entry ends the list
        ("1,4,2", [1]),  # GPU 4 does not exist
        ("1,x,2", [1]),
        ("1,,2", [1]),
        ("0,1,", [0, 1]),
        ("1gpu,2", [1, 2]),  # ordinals are read like strtoul
        ("+2", [2]),
        ("1,0,1", []),  # a repeated device hides every device, as in CUDA
        ("GPU-bb22-0000", [1]),  # a full UUID
        ("GPU-c", [3]),  # a unique prefix
        ("GPU-cc44,GPU-aa", [3, 0]),
        ("GPU-a", []),  # ambiguous: aa11 and ab33
        ("GPU-bb,GPU-a,GPU-cc", [1]),
        ("GPU-ffff", []),
        ("GPU-bb,GPU-bb22", []),
        ("2,GPU-aa", [2, 0]),
        ("GPU-cc,1", [3, 1]),
        ("MIG-aa", []),
    ],
)
def test_visible_device_order(cuda_visible_devices, expected):
    assert visible_device_order(cuda_visible_devices, UUIDS) == expected


def test_visible_device_order_ordinals_address_physical_gpus_only():
    uuids = ["GPU-aa", "GPU-bb", "MIG-0001", "MIG-0002"]
    assert visible_device_order(None, uuids, ordinal_count=2) == [0, 1]
    assert visible_device_order("2", uuids, ordinal_count=2) == []
    assert visible_device_order("MIG-0002,MIG-0001", uuids, ordinal_count=2) == [3, 2]


# --- hardware probes -------------------------------------------------------------------


def test_detect_gpus_returns_a_list_of_gpu_info():
    gpus = detect_gpus()  # [] on a machine without an NVIDIA driver
    assert isinstance(gpus, list)
    assert all(isinstance(gpu, GpuInfo) for gpu in gpus)
    assert [gpu.index for gpu in gpus] == list(range(len(gpus)))


@dataclass
class _Memory:
    total: int
    free: int


class _NVMLError(Exception):
    pass


def fake_nvml(devices: dict[str, tuple[str, int, int]], *, init_fails: bool = False, mig=None) -> types.ModuleType:
    """A stand-in for pynvml: devices maps UUID -> (name, total, free), in NVML order."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = _NVMLError
    nvml.calls = []
    uuids = list(devices)
    mig = mig or {}

    def init():
        nvml.calls.append("init")
        if init_fails:
            raise _NVMLError("NVML Shared Library Not Found")

    def memory(handle):
        if handle not in devices:
            raise _NVMLError("Not Supported")
        return _Memory(devices[handle][1], devices[handle][2])

    def mig_handle(handle, slot):
        slices = mig.get(handle, [])
        if slot >= len(slices) or slices[slot] is None:
            raise _NVMLError("Not Found")
        return slices[slot]

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: len(uuids)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: uuids[index]  # the handle is the UUID
    nvml.nvmlDeviceGetUUID = lambda handle: handle
    nvml.nvmlDeviceGetName = lambda handle: devices[handle][0].encode()  # old releases return bytes
    nvml.nvmlDeviceGetMemoryInfo = memory
    nvml.nvmlDeviceGetMaxMigDeviceCount = lambda handle: len(mig[handle]) if handle in mig else 0
    nvml.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    return nvml


MACHINE = {
    "GPU-aa11": ("NVIDIA A100", 80 * GIB, 70 * GIB),
    "GPU-bb22": ("NVIDIA A100", 80 * GIB, 60 * GIB),
    "GPU-cc33": ("NVIDIA A100", 80 * GIB, 50 * GIB),
}


@pytest.mark.parametrize(
    ("cuda_visible_devices", "expected"),
    [
        (None, [(0, 70), (1, 60), (2, 50)]),
        ("2,0", [(0, 50), (1, 70)]),
        ("GPU-bb", [(0, 60)]),
        ("", []),
        ("-1", []),
    ],
)
def test_detect_gpus_applies_cuda_visible_devices(monkeypatch, cuda_visible_devices, expected):
    nvml = fake_nvml(MACHINE)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if cuda_visible_devices is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)
    gpus = detect_gpus()
    assert [(gpu.index, gpu.free_bytes // GIB) for gpu in gpus] == expected
    assert all(gpu.name == "NVIDIA A100" and gpu.total_bytes == 80 * GIB for gpu in gpus)
    assert nvml.calls == ["init", "shutdown"]


def test_detect_gpus_finds_mig_slices_named_in_cuda_visible_devices(monkeypatch):
    machine = {**MACHINE, "MIG-0001": ("NVIDIA A100 MIG 3g.40gb", 40 * GIB, 39 * GIB)}
    nvml = fake_nvml(MACHINE, mig={"GPU-aa11": [None, "MIG-0001"]})
    nvml.nvmlDeviceGetName = lambda handle: machine[handle][0]
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: _Memory(machine[handle][1], machine[handle][2])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0001")
    assert detect_gpus() == [GpuInfo(0, "NVIDIA A100 MIG 3g.40gb", 40 * GIB, 39 * GIB)]


def test_detect_gpus_without_a_driver_is_empty_and_skips_shutdown(monkeypatch):
    nvml = fake_nvml(MACHINE, init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert detect_gpus() == []
    assert nvml.calls == ["init"]


def test_detect_gpus_without_pynvml_is_empty(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert detect_gpus() == []


def test_detect_gpus_shuts_nvml_down_when_listing_fails(monkeypatch):
    nvml = fake_nvml(MACHINE)

    def lost_gpu():
        raise _NVMLError("GPU is lost")

    nvml.nvmlDeviceGetCount = lost_gpu
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert detect_gpus() == []
    assert nvml.calls == ["init", "shutdown"]


def test_detect_gpus_keeps_a_gpu_whose_memory_is_not_reported(monkeypatch):
    nvml = fake_nvml(MACHINE)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: (_ for _ in ()).throw(_NVMLError("Not Supported"))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert detect_gpus() == [GpuInfo(0, "NVIDIA A100", 0, 0)]


def test_machine_probes(monkeypatch):
    assert hardware.cpu_count() >= 1
    assert isinstance(hardware.mps_available(), bool)
    monkeypatch.setattr(hardware.sys, "platform", "darwin")
    monkeypatch.setattr(hardware.platform, "machine", lambda: "arm64")
    assert hardware.mps_available()
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    assert not hardware.mps_available()


def test_probe_plan_uses_the_probes(monkeypatch):
    monkeypatch.setattr(hardware, "detect_gpus", lambda: list(FOUR_GPUS[:2]))
    monkeypatch.setattr(hardware, "mps_available", lambda: False)
    monkeypatch.setattr(hardware, "cpu_count", lambda: 3)
    assert hardware.probe_plan("auto", "auto") == DevicePlan("cuda", (0, 1))
    assert hardware.probe_plan(-1, "cpu") == DevicePlan("cpu", (0, 1, 2))


def run_without_launcher(code: str) -> None:
    # Importing nbtrain starts the warm launcher unless told not to; these checks need none.
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize("module", ["nbtrain.devices", "nbtrain.hardware"])
def test_importing_does_not_import_torch(module):
    run_without_launcher(f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'")


def test_probing_does_not_import_torch():
    run_without_launcher(
        "import sys, nbtrain.hardware as h; h.probe_plan('auto', 'auto'); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
