"""The machine probes (nbtrain.planning.probe): GPUs through NVML, CPU cores, host memory.

Everything runs without a GPU: NVML is a stand-in module where a test needs GPUs, and
the memory probes read files a test writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest

from nbtrain.planning import probe
from nbtrain.planning.deviceplan import DevicePlan, GpuInfo
from nbtrain.planning.probe import detect_gpus, visible_device_order

GIB = 2**30
FOUR_GPUS = tuple(GpuInfo(i, "NVIDIA A100-SXM4-80GB", 80 * GIB, (79 - i) * GIB) for i in range(4))


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
    assert probe.cpu_count() >= 1
    assert isinstance(probe.mps_available(), bool)
    monkeypatch.setattr(probe.sys, "platform", "darwin")
    monkeypatch.setattr(probe.platform, "machine", lambda: "arm64")
    assert probe.mps_available()
    monkeypatch.setattr(probe.platform, "machine", lambda: "x86_64")
    assert not probe.mps_available()


def test_probe_plan_uses_the_probes(monkeypatch):
    monkeypatch.setattr(probe, "detect_gpus", lambda: list(FOUR_GPUS[:2]))
    monkeypatch.setattr(probe, "mps_available", lambda: False)
    monkeypatch.setattr(probe, "cpu_count", lambda: 3)
    assert probe.probe_plan("auto", "auto") == DevicePlan("cuda", (0, 1))
    assert probe.probe_plan(-1, "cpu") == DevicePlan("cpu", (0, 1, 2))


def run_without_launcher(code: str) -> None:
    # Importing nbtrain starts the warm launcher unless told not to; these checks need none.
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_importing_does_not_import_torch():
    run_without_launcher("import nbtrain.planning.probe, sys; assert 'torch' not in sys.modules, 'torch was imported'")


def test_probing_does_not_import_torch():
    run_without_launcher(
        "import sys, nbtrain.planning.probe as h; h.probe_plan('auto', 'auto'); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )


# --- GPU usage ------------------------------------------------------------------------


@dataclass
class _UsedMemory:
    total: int
    free: int
    used: int


@dataclass
class _Rates:
    gpu: int


@dataclass
class _Held:
    pid: int
    usedGpuMemory: int | None


def test_gpu_usage_reports_every_gpu_in_nvml_order_with_what_each_process_holds(monkeypatch):
    nvml = fake_nvml(MACHINE)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: _UsedMemory(80 * GIB, 60 * GIB, 20 * GIB)
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: _Rates(37)
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [_Held(4242, 3 * GIB), _Held(4243, None)]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # usage is the machine's: NVML numbering, every GPU
    usage = probe.gpu_usage()
    assert [u.index for u in usage] == [0, 1, 2]
    assert usage[0] == probe.GpuUsage(0, "NVIDIA A100", 20 * GIB, 80 * GIB, 37, {4242: 3 * GIB, 4243: 0})
    assert nvml.calls == ["init", "shutdown"]


def test_gpu_usage_keeps_a_gpu_whose_figures_the_driver_refuses(monkeypatch):
    def refuse(handle):
        raise _NVMLError("Not Supported")

    nvml = fake_nvml(MACHINE)
    nvml.nvmlDeviceGetUtilizationRates = refuse
    nvml.nvmlDeviceGetComputeRunningProcesses = refuse
    nvml.nvmlDeviceGetMemoryInfo = refuse
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert probe.gpu_usage()[1] == probe.GpuUsage(1, "NVIDIA A100", 0, 0, None, {})


@pytest.mark.parametrize("init_fails", [True, False])
def test_gpu_usage_without_a_driver_or_a_readable_list_is_empty(monkeypatch, init_fails):
    nvml = fake_nvml(MACHINE, init_fails=init_fails)
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(_NVMLError("GPU is lost"))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert probe.gpu_usage() == []
    assert nvml.calls == (["init"] if init_fails else ["init", "shutdown"])


def test_gpu_usage_without_pynvml_is_empty(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert probe.gpu_usage() == []


# --- CPU cores and host memory ------------------------------------------------------------


def test_cpu_count_is_the_affinity_mask_not_the_machine():
    # A process pinned to one core (taskset, a cgroup's cpuset) may run one rank per core there.
    pin = "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})"
    code = f"import os, nbtrain.planning.probe as h; {pin}; print(h.cpu_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"
    assert probe.cpu_count() == len(os.sched_getaffinity(0))


def _topology(root, cores_of_cpus):
    for cpu, (package, core) in enumerate(cores_of_cpus):
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")
    return str(root)


def test_physical_cores_count_a_cores_hyper_threads_once(tmp_path):
    # This machine's CPUs as sysfs would list them if each core had two hyper-threads (0+1, 2+3, ...).
    cpus = sorted(os.sched_getaffinity(0))
    topology = _topology(tmp_path, [(0, cpu // 2) for cpu in range(max(cpus) + 1)])
    assert probe.physical_core_count(topology) == len({cpu // 2 for cpu in cpus})


def test_physical_cores_are_every_cpu_where_the_topology_cannot_be_read(tmp_path):
    assert probe.physical_core_count(str(tmp_path / "missing")) == probe.cpu_count()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != os.cpu_count(), reason="torch counts the machine's cores")
def test_physical_cores_here_are_what_torch_runs_by_default():
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    assert probe.physical_core_count() == int(out.stdout)


def test_mps_is_never_available_on_linux():
    assert sys.platform != "linux" or probe.mps_available() is False


def test_available_memory_is_at_most_what_the_kernel_reports_available():
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    available = probe.available_memory()
    assert available is not None and 0 < available <= fields["MemTotal"]


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_cgroup_limit_caps_available_memory_counting_its_page_cache_as_free(monkeypatch, tmp_path):
    limit = write(tmp_path / "memory.max", f"{4 * GIB}\n")
    usage = write(tmp_path / "memory.current", f"{3 * GIB}\n")
    stat = write(tmp_path / "memory.stat", f"anon {2 * GIB}\ninactive_file {GIB // 2}\nactive_file 7\n")
    monkeypatch.setattr(probe, "_CGROUP_MEMORY_FILES", ((limit, usage, stat, "inactive_file"),))
    monkeypatch.setattr(probe, "_meminfo_available", lambda: 64 * GIB)
    assert probe.available_memory() == GIB + GIB // 2  # 4 - 3 GiB, plus the reclaimable cache


@pytest.mark.parametrize(
    ("limit_text", "usage_text"),
    [("max\n", f"{GIB}\n"), (f"{1 << 62}\n", f"{GIB}\n"), (f"{4 * GIB}\n", None)],
    ids=["v2 no limit", "v1 no limit", "usage unreadable"],
)
def test_a_cgroup_without_a_limit_leaves_the_kernels_figure(monkeypatch, tmp_path, limit_text, usage_text):
    limit = write(tmp_path / "limit", limit_text)
    usage = write(tmp_path / "usage", usage_text) if usage_text is not None else str(tmp_path / "absent")
    monkeypatch.setattr(probe, "_CGROUP_MEMORY_FILES", ((limit, usage, str(tmp_path / "absent"), "inactive_file"),))
    monkeypatch.setattr(probe, "_meminfo_available", lambda: 8 * GIB)
    assert probe.available_memory() == 8 * GIB


def test_available_memory_is_unknown_when_nothing_can_be_read(monkeypatch, tmp_path):
    monkeypatch.setattr(probe, "_CGROUP_MEMORY_FILES", ((str(tmp_path / "a"), str(tmp_path / "b"), "", ""),))
    monkeypatch.setattr(probe, "_meminfo_available", lambda: None)
    assert probe.available_memory() is None


def test_a_cgroup_over_its_limit_has_nothing_available(monkeypatch, tmp_path):
    limit = write(tmp_path / "memory.max", f"{GIB}\n")
    usage = write(tmp_path / "memory.current", f"{2 * GIB}\n")
    monkeypatch.setattr(probe, "_CGROUP_MEMORY_FILES", ((limit, usage, str(tmp_path / "absent"), "inactive_file"),))
    monkeypatch.setattr(probe, "_meminfo_available", lambda: 8 * GIB)
    assert probe.available_memory() == 0
