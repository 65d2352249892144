"""The devices the sidebar shows: each GPU through NVML, the host's CPU and memory, each rank's memory.

Read from NVML and /proc only: the Jupyter server never imports torch and never creates
a CUDA context for this. The CPU figure is the busy share of all cores since the last
call (the first call measures over a short moment).

Example:
    >>> host = HostSampler().sample()
    >>> host["cpus"] >= 1 and host["memory_total"] > 0
    True
"""

from __future__ import annotations

import collections
import time
from typing import Any

from nbtrain.planning import probe
from nbtrain.serverext import runs
from nbtrain.system import processes

_FIRST_SAMPLE_SECONDS = 0.1


class HostSampler:
    """CPU busy share between calls (from /proc/stat) and memory in use (from /proc/meminfo)."""

    def __init__(self) -> None:
        self._last = _cpu_times()

    def sample(self) -> dict[str, Any]:
        """The host's CPU count, busy share since the last call (percent), and memory total and in use."""
        now = _cpu_times()
        if now == self._last:  # called twice at once: measure over a short moment
            time.sleep(_FIRST_SAMPLE_SECONDS)
            now = _cpu_times()
        busy = (now[0] - self._last[0]) / max(1, now[1] - self._last[1])
        self._last = now
        total, available = _memory()
        cpus, percent = probe.cpu_count(), round(100.0 * busy, 1)
        return {"cpus": cpus, "cpu_percent": percent, "memory_used": total - available, "memory_total": total}


def snapshot(host: HostSampler) -> dict[str, Any]:
    """GPUs, host, and the memory of every live rank of every run in the registry."""
    gpus = probe.gpu_usage()
    held: collections.Counter[int] = collections.Counter()
    for gpu in gpus:
        held.update(gpu.process_bytes)
    ranks = [
        {"run": run["id"], "rank": rank, "pid": pid, "rss": processes.resident_bytes(pid), "gpu_memory": held.get(pid)}
        for run in runs.list_runs()
        for rank, pid, _started in run["ranks"]
        if pid in run["live_pids"]
    ]
    shown = [
        {"index": gpu.index, "name": gpu.name, "memory_used": gpu.used_bytes, "memory_total": gpu.total_bytes,
         "utilization": gpu.utilization_percent}
        for gpu in gpus
    ]
    return {"gpus": shown, "host": host.sample(), "ranks": ranks}


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores together, from the first line of /proc/stat."""
    with open("/proc/stat") as file:
        values = [int(v) for v in file.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user time
    return total - idle, total


def _memory() -> tuple[int, int]:
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as file:
        for line in file:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
