"""A simulated NVML (``pynvml``) for real processes: put this folder first on PYTHONPATH.

The machine it pretends to be comes from the ``NBTRAIN_FAKE_NVML`` environment variable,
JSON: ``{"gpus": [{"uuid": "GPU-aa11", "name": "NVIDIA A100", "total": bytes, "free":
bytes, "processes": [{"pid": 4242, "used": bytes}]}], "init_error": "..."}``. A GPU
whose ``"processes"`` is null answers "Not Supported" when asked for them. The value
``"absent"`` makes ``import pynvml`` fail, as on a machine without nvidia-ml-py; ``"@<file>"``
reads the JSON from that file at each ``nvmlInit`` (a machine whose processes change).

Only what nbtrain asks of NVML is here; everything nbtrain does with the answers is real.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

_SPEC = os.environ.get("NBTRAIN_FAKE_NVML", '{"gpus": []}')
if _SPEC == "absent":
    raise ImportError("No module named 'pynvml' (simulated: nvidia-ml-py is not installed)")
_MACHINE = json.loads(_SPEC) if not _SPEC.startswith("@") else {"gpus": []}
_GPUS = {gpu["uuid"]: gpu for gpu in _MACHINE["gpus"]}


def _reread() -> None:
    """``NBTRAIN_FAKE_NVML=@<file>``: the machine is that file's JSON, read at each nvmlInit (a test changes it)."""
    global _MACHINE, _GPUS
    if _SPEC.startswith("@"):
        with open(_SPEC[1:]) as spec:
            _MACHINE = json.load(spec)
        _GPUS = {gpu["uuid"]: gpu for gpu in _MACHINE["gpus"]}


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    _reread()
    if _MACHINE.get("init_error"):
        raise NVMLError(_MACHINE["init_error"])


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_GPUS)


def nvmlDeviceGetHandleByIndex(index: int) -> str:
    return list(_GPUS)[index]  # the handle is the UUID


def nvmlDeviceGetUUID(handle: str) -> str:
    return handle


def nvmlDeviceGetName(handle: str) -> bytes:
    return _GPUS[handle]["name"].encode()  # old releases return bytes


def nvmlDeviceGetMemoryInfo(handle: str) -> SimpleNamespace:
    gpu = _GPUS[handle]
    return SimpleNamespace(total=gpu["total"], free=gpu["free"], used=gpu["total"] - gpu["free"])


def nvmlDeviceGetUtilizationRates(handle: str) -> SimpleNamespace:
    return SimpleNamespace(gpu=0, memory=0)


def nvmlDeviceGetComputeRunningProcesses(handle: str) -> list[SimpleNamespace]:
    processes = _GPUS[handle].get("processes", [])
    if processes is None:
        raise NVMLError("Not Supported")
    return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used")) for p in processes]


def nvmlDeviceGetMaxMigDeviceCount(handle: str) -> int:
    raise NVMLError("Not Supported")


def nvmlDeviceGetMigDeviceHandleByIndex(handle: str, slot: int) -> str:
    raise NVMLError("Not Found")
