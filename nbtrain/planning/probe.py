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

import contextlib
import functools
import importlib
import os
import platform
import re
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nbtrain.errors import ConfigurationError
from nbtrain.planning import freegpus
from nbtrain.planning.deviceplan import DevicePlan, GpuInfo, normalize_accelerator, plan_devices

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
    # Where the driver cannot list its GPUs (one fell off the bus, say), numbering them
    # would be a guess, and a wrong guess would put ranks on the wrong GPUs: none are listed.
    return _asked_nvml(lambda nvml: _visible_gpus(nvml, os.environ.get("CUDA_VISIBLE_DEVICES")))


def _asked_nvml(ask: Callable[[ModuleType], list[Any]]) -> list[Any]:
    """What ``ask`` answers of pynvml, initialised and shut down around it; [] without the package,
    the driver library or a GPU (each means "no usable GPU"), or where NVML cannot answer."""
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # raised for a missing driver library too (NVML_ERROR_LIBRARY_NOT_FOUND)
        return []
    try:
        return ask(pynvml)
    except pynvml.NVMLError:
        return []
    finally:
        _shutdown(pynvml)


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
    return len(_cpus())


def _cpus() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


CPU_TOPOLOGY = "/sys/devices/system/cpu"


def physical_core_count(topology: str = CPU_TOPOLOGY) -> int:
    """Physical cores among the CPUs this process may run on: a core's hyper-threads count once.

    It is what torch's own intra-op threads default to (the physical cores), and what a
    rank's share of threads starts from: a pool over both threads of a core runs no faster,
    and its threads spinning between ops take the CPU beside the loop's own thread. Where
    the topology cannot be read, every CPU counts.

    >>> 1 <= physical_core_count() <= cpu_count()
    True
    """
    return _cores_of(_cpus(), topology)


@functools.lru_cache(maxsize=8)  # read once per affinity mask: it is on every launch's way
def _cores_of(cpus: frozenset[int], topology: str) -> int:
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{topology}/cpu{cpu}/topology/core_id") as core, open(
                f"{topology}/cpu{cpu}/topology/physical_package_id"
            ) as package:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def probe_plan(devices: object = "auto", accelerator: str | None = "auto", oversubscribe: bool = False) -> DevicePlan:
    """Plan ``devices`` on ``accelerator`` for this machine (see :func:`nbtrain.planning.deviceplan.plan_devices`).

    ``devices="free:k"`` picks k GPUs that no other process uses (:func:`find_usable_cuda_devices`).

    >>> probe_plan(1, "cpu")
    DevicePlan(accelerator='cpu', device_ids=(0,))
    """
    count = freegpus.parse_free_devices(devices)
    if count is not None:
        return _free_plan(devices, count, accelerator)
    gpus, mps, cpus = detect_gpus(), mps_available(), cpu_count()
    return plan_devices(devices, accelerator, gpus=gpus, mps_available=mps, cpu_count=cpus, oversubscribe=oversubscribe)


def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """The indices of ``num_devices`` GPUs that no other process uses (-1: every such GPU).

    A GPU is free when NVML lists no compute process on it other than this one (a kernel
    that moved a model to a GPU still gets that GPU for its ranks); of the free ones, those
    with the most free memory are chosen, and their indices (as torch numbers them, after
    ``CUDA_VISIBLE_DEVICES``) come back in ascending order. NVML reads the driver: no CUDA
    context is created in this process, so the kernel can still fork healthy CUDA ranks.
    Too few free GPUs raises :class:`~nbtrain.errors.ConfigurationError` naming each busy
    GPU and what holds it (pid, process name, memory); so does a machine without NVML
    (the ``nvidia-ml-py`` package and the NVIDIA driver). ``--devices free:2`` on a
    ``%%distributed`` line (or ``devices="free:2"``) makes the same choice at launch.

    Another process can still take a GPU between this call and the launch: the choice
    is a snapshot.

    Example:
        >>> import nbtrain
        >>> gpus = nbtrain.find_usable_cuda_devices(2)  # doctest: +SKIP
        >>> gpus  # doctest: +SKIP
        [0, 2]
        >>> nbtrain.launch(train, devices=gpus, accelerator="cuda")  # doctest: +SKIP
    """
    count = freegpus.check_count(num_devices)
    return list(freegpus.choose_free_gpus(count, gpu_occupancy(f"find_usable_cuda_devices({num_devices!r})")))


def _free_plan(devices: object, count: int, accelerator: str | None) -> DevicePlan:
    asked = f"devices={devices!r}"
    if normalize_accelerator(accelerator) not in ("auto", "cuda"):
        raise ConfigurationError(
            f"{asked} picks GPUs that no other process uses, but the accelerator is {accelerator!r}; "
            "use accelerator='cuda' (or 'auto'), or give a number of processes (devices=2)."
        )
    occupancy = gpu_occupancy(asked)
    chosen = freegpus.choose_free_gpus(count, occupancy, asked)
    return plan_devices(
        list(chosen), "cuda", gpus=[o.gpu for o in occupancy], mps_available=False, cpu_count=cpu_count()
    )


def gpu_occupancy(asked: str = "free-GPU selection") -> list[freegpus.GpuOccupancy]:
    """The visible GPUs (numbered as torch will) and the compute processes on each, through NVML.

    Unlike :func:`detect_gpus`, a machine where NVML cannot be used is an error here
    (ConfigurationError saying what is missing), not an empty list: "no GPU is free"
    must not be the answer when nobody could look. Never initialises CUDA.
    """
    try:
        # deferred: start-up time (pynvml)
        import pynvml
    except ImportError:
        raise ConfigurationError(
            f"{asked} needs NVML to see which GPUs other processes use, but the nvidia-ml-py package "
            "is not installed: pip install nvidia-ml-py, or name the GPUs (devices='0,1')."
        ) from None
    try:
        pynvml.nvmlInit()
    except Exception as error:  # noqa: BLE001 - NVMLError, or a broken package: the same advice
        raise ConfigurationError(
            f"{asked} needs NVML, which could not start ({error}): is the NVIDIA driver installed? "
            "On a machine without GPUs, give a number of CPU processes (devices=2, accelerator='cpu')."
        ) from None
    try:
        visible = _visible_devices(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return [_occupancy(pynvml, logical, handle, device) for logical, (handle, device) in enumerate(visible)]
    except pynvml.NVMLError as error:
        raise ConfigurationError(f"{asked}: NVML could not list the GPUs ({error}).") from None
    finally:
        _shutdown(pynvml)


# The pids of this kernel's standby ranks (nbtrain.kernel.launcher_connection sets it with its first
# launcher): a GPU only they hold is free, since a run that needs it ends them first.
standby_pids: Callable[[], Collection[int]] = frozenset


def _occupancy(nvml: ModuleType, logical: int, handle: Any, device: _NvmlDevice) -> freegpus.GpuOccupancy:
    gpu = GpuInfo(logical, device.name, device.total_bytes, device.free_bytes)
    held = _ask(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle, default=None)
    if held is None:  # the driver will not say: the GPU cannot be called free
        return freegpus.GpuOccupancy(gpu, known=False)
    # This process (the kernel, which may have moved a model to the GPU) does not make a GPU
    # busy: its ranks are meant to share it, and "busy" means some other program holds it.
    ours = {os.getpid(), *standby_pids()}
    processes = tuple(
        freegpus.GpuProcess(int(p.pid), _process_name(nvml, int(p.pid)), _used_bytes(p))
        for p in held
        if int(p.pid) not in ours
    )
    return freegpus.GpuOccupancy(gpu, processes)


def _used_bytes(process: Any) -> int | None:
    used = getattr(process, "usedGpuMemory", None)
    # NVML reports NVML_VALUE_NOT_AVAILABLE (an all-ones value) where it does not know.
    return None if used is None or used >= 1 << 63 else int(used)


def _process_name(nvml: ModuleType, pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:  # OSError: another pid namespace, or gone
        return f.read().strip() or "unknown"
    query = getattr(nvml, "nvmlSystemGetProcessName", None)
    name = _ask(nvml, query, pid, default="") if query is not None else ""
    return _text(name).strip() or "unknown"


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
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
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
    visible = _visible_devices(nvml, cuda_visible_devices)
    return [GpuInfo(logical, d.name, d.total_bytes, d.free_bytes) for logical, (_, d) in enumerate(visible)]


def _visible_devices(nvml: ModuleType, cuda_visible_devices: str | None) -> list[tuple[Any, _NvmlDevice]]:
    """(NVML handle, description) of each device CUDA will show, in CUDA's order."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    candidates = list(handles)
    if cuda_visible_devices and "MIG-" in cuda_visible_devices:
        candidates += list(_mig_slices(nvml, handles))
    described = [_describe(nvml, handle) for handle in candidates]
    order = visible_device_order(cuda_visible_devices, [d.uuid for d in described], ordinal_count=len(handles))
    return [(candidates[p], described[p]) for p in order]


def _describe(nvml: ModuleType, handle: Any) -> _NvmlDevice:
    # One attribute the driver will not report should not hide the whole GPU.
    memory = _ask(nvml, nvml.nvmlDeviceGetMemoryInfo, handle, default=None)
    uuid = _text(_ask(nvml, nvml.nvmlDeviceGetUUID, handle, default=""))
    name = _text(_ask(nvml, nvml.nvmlDeviceGetName, handle, default="unknown GPU"))
    return _NvmlDevice(uuid, name, *((int(memory.total), int(memory.free)) if memory is not None else (0, 0)))


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
    with contextlib.suppress(nvml.NVMLError):  # nothing is left to release, and the GPUs are already listed
        nvml.nvmlShutdown()


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
    return _asked_nvml(lambda nvml: [_usage(nvml, index) for index in range(nvml.nvmlDeviceGetCount())])


def _usage(nvml: ModuleType, index: int) -> GpuUsage:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = _ask(nvml, nvml.nvmlDeviceGetMemoryInfo, handle, default=None)
    rates = _ask(nvml, nvml.nvmlDeviceGetUtilizationRates, handle, default=None)
    held = _ask(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
    used, total = (int(memory.used), int(memory.total)) if memory is not None else (0, 0)
    name = _text(_ask(nvml, nvml.nvmlDeviceGetName, handle, default="unknown GPU"))
    utilization = int(rates.gpu) if rates is not None else None
    return GpuUsage(index, name, used, total, utilization, {int(p.pid): int(p.usedGpuMemory or 0) for p in held})
