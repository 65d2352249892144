"""What this machine offers for a run: its GPUs, Apple's MPS, its CPU cores.

Everything here runs in the Jupyter kernel, so nothing may initialise CUDA: a process
that has touched CUDA cannot fork healthy workers. GPUs are therefore found through
NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``), which reads the driver
without creating a CUDA context, and torch is never imported.

NVML knows nothing of ``CUDA_VISIBLE_DEVICES``; :func:`visible_device_order` applies it
the way CUDA does, so that ``GpuInfo.index`` is the index torch will use. NVML lists
GPUs in PCI bus order, while CUDA's default order (``CUDA_DEVICE_ORDER=FASTEST_FIRST``)
puts the fastest first; the two agree unless a machine mixes GPU models, and then only
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes the names and memory reported here match.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nbtrain.devices import DevicePlan, GpuInfo, plan_devices

# CUDA reads an ordinal like C's strtoul: leading digits count, the rest is ignored
# ("1gpu" is 1), and a minus sign ("-1") makes the entry invalid.
_LEADING_ORDINAL = re.compile(r"\+?[0-9]+")
_UUID_PREFIXES = ("GPU-", "MIG-")


def detect_gpus() -> list[GpuInfo]:
    """The GPUs this process may use, numbered as torch will number them.

    Returns [] when ``nvidia-ml-py`` is missing, the NVIDIA driver is absent, or
    ``CUDA_VISIBLE_DEVICES`` hides every GPU. Never initialises CUDA.

    >>> isinstance(detect_gpus(), list)
    True
    """
    pynvml = _started_nvml()
    if pynvml is None:
        return []
    try:
        return _visible_gpus(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except pynvml.NVMLError:
        # The driver cannot list its GPUs (one fell off the bus, say): numbering them
        # would be a guess, and a wrong guess would put ranks on the wrong GPUs.
        return []
    finally:
        _shutdown(pynvml)


def _started_nvml() -> ModuleType | None:
    """pynvml, initialised; None without the package, the driver library or a GPU (each
    means "no usable GPU")."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # raised for a missing driver library too (NVML_ERROR_LIBRARY_NOT_FOUND)
        return None
    return pynvml


def visible_device_order(
    cuda_visible_devices: str | None, uuids: Sequence[str], *, ordinal_count: int | None = None
) -> list[int]:
    """Positions in ``uuids`` that CUDA makes visible, in the order CUDA numbers them.

    ``uuids`` are the devices' UUIDs, physical GPUs first in NVML order (``"GPU-..."``),
    then any MIG slices (``"MIG-..."``); the first ``ordinal_count`` of them (default:
    all) are the ones integer entries address. As CUDA does: unset means every GPU;
    each entry is an ordinal or a UUID prefix; the first entry that is invalid, out of
    range or ambiguous ends the list (so ``""``, ``"-1"`` and ``"NoDevFiles"`` hide
    every GPU); and a device named twice hides them all.

    >>> uuids = ["GPU-aa11", "GPU-bb22", "GPU-ab33"]
    >>> visible_device_order(None, uuids)
    [0, 1, 2]
    >>> visible_device_order("2,GPU-b", uuids)
    [2, 1]
    >>> visible_device_order("1,7,0", uuids)  # there is no GPU 7: the list ends there
    [1]
    """
    if ordinal_count is None:
        ordinal_count = len(uuids)
    if cuda_visible_devices is None:
        return list(range(ordinal_count))
    order: list[int] = []
    for entry in cuda_visible_devices.split(","):
        position = _entry_position(entry.strip(), uuids, ordinal_count)
        if position is None:
            break
        if position in order:
            return []
        order.append(position)
    return order


def mps_available() -> bool:
    """Whether Apple's MPS can exist here (an Apple-silicon Mac); asks the OS, not torch."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def probe_plan(devices: object = "auto", accelerator: str | None = "auto", oversubscribe: bool = False) -> DevicePlan:
    """Plan ``devices`` on ``accelerator`` for this machine (see :func:`nbtrain.devices.plan_devices`).

    >>> probe_plan(1, "cpu")
    DevicePlan(accelerator='cpu', device_ids=(0,))
    """
    return plan_devices(
        devices,
        accelerator,
        gpus=detect_gpus(),
        mps_available=mps_available(),
        cpu_count=cpu_count(),
        oversubscribe=oversubscribe,
    )


def available_memory() -> int | None:
    """Bytes of host memory a run can still take: the kernel's estimate, within this cgroup's limit.

    ``MemAvailable`` counts reclaimable page cache as available, as the kernel's OOM
    decisions do; a container's memory limit (cgroup v2, or v1) caps it. None when
    neither can be read.

    >>> (available_memory() or 1) > 0
    True
    """
    candidates = [_meminfo_available()]
    for limit_file, usage_file, stat_file, cache_key in _CGROUP_MEMORY_FILES:
        limit, usage = _read_number(limit_file), _read_number(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # "max" or v1's "no limit"
            # The usage counts page cache, which the kernel reclaims before it kills anything.
            candidates.append(max(0, limit - usage + _memory_stat(stat_file, cache_key)))
    known = [value for value in candidates if value is not None]
    return min(known) if known else None


_CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_inactive_file",
    ),
)


def _memory_stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_number(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # absent, or "max"


def _entry_position(entry: str, uuids: Sequence[str], ordinal_count: int) -> int | None:
    if entry.startswith(_UUID_PREFIXES):
        matches = [position for position, uuid in enumerate(uuids) if uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    ordinal = _LEADING_ORDINAL.match(entry)
    if ordinal is None or int(ordinal.group()) >= ordinal_count:
        return None
    return int(ordinal.group())


@dataclass(frozen=True)
class _NvmlDevice:
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int


def _visible_gpus(nvml: ModuleType, cuda_visible_devices: str | None) -> list[GpuInfo]:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    candidates = [_describe(nvml, handle) for handle in handles]
    if cuda_visible_devices and "MIG-" in cuda_visible_devices:
        candidates += [_describe(nvml, slice_) for slice_ in _mig_slices(nvml, handles)]
    uuids = [candidate.uuid for candidate in candidates]
    order = visible_device_order(cuda_visible_devices, uuids, ordinal_count=len(handles))
    return [
        GpuInfo(logical, candidates[p].name, candidates[p].total_bytes, candidates[p].free_bytes)
        for logical, p in enumerate(order)
    ]


def _describe(nvml: ModuleType, handle: Any) -> _NvmlDevice:
    # One attribute the driver will not report should not hide the whole GPU.
    memory = _ask(nvml, nvml.nvmlDeviceGetMemoryInfo, handle, default=None)
    return _NvmlDevice(
        uuid=_text(_ask(nvml, nvml.nvmlDeviceGetUUID, handle, default="")),
        name=_text(_ask(nvml, nvml.nvmlDeviceGetName, handle, default="unknown GPU")),
        total_bytes=int(memory.total) if memory is not None else 0,
        free_bytes=int(memory.free) if memory is not None else 0,
    )


def _mig_slices(nvml: ModuleType, handles: Sequence[Any]) -> Iterator[Any]:
    for handle in handles:
        # GPUs without MIG refuse the question; empty slots answer "not found".
        for slot in range(_ask(nvml, nvml.nvmlDeviceGetMaxMigDeviceCount, handle, default=0)):
            slice_ = _ask(nvml, nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot, default=None)
            if slice_ is not None:
                yield slice_


def _ask(nvml: ModuleType, query: Callable[..., Any], *args: Any, default: Any) -> Any:
    try:
        return query(*args)
    except nvml.NVMLError:
        return default


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass  # nothing is left to release, and the GPUs are already listed


@dataclass(frozen=True)
class GpuUsage:
    """One GPU as NVML sees it now (NVML's numbering, all GPUs of the machine)."""

    index: int
    name: str
    used_bytes: int
    total_bytes: int
    utilization_percent: int | None
    process_bytes: dict[int, int]  # pid -> GPU memory it holds (compute processes)


def gpu_usage() -> list[GpuUsage]:
    """Every GPU's memory and utilisation, and what each process holds, through NVML.

    Like :func:`detect_gpus`, never creates a CUDA context; [] without a driver or GPU.

    >>> isinstance(gpu_usage(), list)
    True
    """
    pynvml = _started_nvml()
    if pynvml is None:
        return []
    try:
        return [_usage(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:
        return []
    finally:
        _shutdown(pynvml)


def _usage(nvml: ModuleType, index: int) -> GpuUsage:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = _ask(nvml, nvml.nvmlDeviceGetMemoryInfo, handle, default=None)
    rates = _ask(nvml, nvml.nvmlDeviceGetUtilizationRates, handle, default=None)
    held = _ask(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
    return GpuUsage(
        index=index,
        name=_text(_ask(nvml, nvml.nvmlDeviceGetName, handle, default="unknown GPU")),
        used_bytes=int(memory.used) if memory is not None else 0,
        total_bytes=int(memory.total) if memory is not None else 0,
        utilization_percent=int(rates.gpu) if rates is not None else None,
        process_bytes={int(p.pid): int(p.usedGpuMemory or 0) for p in held},
    )
