"""Which GPUs no other process uses: ``--devices free:2`` and ``find_usable_cuda_devices``.

Pure: the GPUs and the processes that hold them are passed in (:mod:`nbtrain.planning.probe`
asks NVML for them, never CUDA), so every rule here is tested without a GPU.

A GPU is free when NVML lists no compute process on it (the caller's own process is left
out of the list: the kernel holding a GPU does not make it busy for its ranks). Of the
free GPUs, those with the most free memory are chosen; the chosen indices come back in
ascending order, so rank 0 runs on the lowest of them, as with ``--devices 0,2``. Too few
free GPUs is an error that names each busy GPU and what holds it (pid, process name,
memory).

Example:
    >>> from nbtrain.planning.deviceplan import GpuInfo
    >>> gib = 2**30
    >>> busy = GpuOccupancy(GpuInfo(0, "A100", 80 * gib, 50 * gib), (GpuProcess(4242, "python", 30 * gib),))
    >>> idle = [GpuOccupancy(GpuInfo(i, "A100", 80 * gib, free * gib)) for i, free in ((1, 70), (2, 79))]
    >>> choose_free_gpus(1, [busy, *idle])
    (2,)
    >>> parse_free_devices("free:2"), parse_free_devices("2")
    (2, None)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from nbtrain.errors import ConfigurationError
from nbtrain.planning.deviceplan import GpuInfo

FREE_PREFIX = "free:"
ALL_FREE = -1  # free:-1: every free GPU
_GIB = 2**30
_COUNT = re.compile("-?[0-9]+")


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU, as NVML lists it."""

    pid: int
    name: str  # its command name, or "unknown" when this process cannot see it (another container)
    used_bytes: int | None  # None: NVML does not say (some drivers, MIG)

    def describe(self) -> str:
        """``'pid 4242 python (1.2 GiB)'``"""
        memory = "memory unknown" if self.used_bytes is None else f"{self.used_bytes / _GIB:.1f} GiB"
        return f"pid {self.pid} {self.name} ({memory})"


@dataclass(frozen=True)
class GpuOccupancy:
    """One visible GPU and the compute processes on it; ``known`` is False when NVML could not list them."""

    gpu: GpuInfo
    processes: tuple[GpuProcess, ...] = ()
    known: bool = True

    @property
    def free(self) -> bool:
        """No compute process holds this GPU, as far as NVML could tell (False when it could not list them)."""
        return self.known and not self.processes

    def describe_busy(self) -> str:
        """``'GPU 1 (A100) held by pid 4242 python (1.2 GiB)'``"""
        head = f"GPU {self.gpu.index} ({self.gpu.name})"
        if not self.known:
            return f"{head}: NVML cannot list its processes, so it may be in use"
        return f"{head} held by " + ", ".join(process.describe() for process in self.processes)


def parse_free_devices(devices: object) -> int | None:
    """k for ``"free:k"`` (``-1``: every free GPU), None for any other ``devices`` value.

    >>> parse_free_devices(" FREE:3 "), parse_free_devices("free:-1"), parse_free_devices([0, 1])
    (3, -1, None)
    """
    if not isinstance(devices, str) or not devices.strip().lower().startswith(FREE_PREFIX):
        return None
    text = devices.strip()[len(FREE_PREFIX) :].strip()
    count = int(text) if _COUNT.fullmatch(text) else 0
    if count == 0 or count < ALL_FREE:
        raise ConfigurationError(
            f"devices={devices!r} is not valid: free:k takes a number of GPUs that no other process uses "
            "(free:2), or free:-1 for every such GPU."
        )
    return count


def check_count(count: int) -> int:
    """``count`` for :func:`choose_free_gpus`: a positive whole number, or -1 (every free GPU)."""
    if isinstance(count, bool) or not isinstance(count, int) or count == 0 or count < ALL_FREE:
        asked = f"find_usable_cuda_devices({count!r})"
        raise ConfigurationError(f"{asked}: pass a positive number of GPUs, or -1 for every free one.")
    return count


def choose_free_gpus(count: int, occupancy: Sequence[GpuOccupancy], asked: str | None = None) -> tuple[int, ...]:
    """The indices of ``count`` free GPUs (``-1``: all), most free memory first, returned ascending.

    ``asked`` is how the request was written (``"devices='free:2'"``), for the message.
    Raises ConfigurationError naming every busy GPU and what holds it when too few are free.
    """
    asked = asked or f"find_usable_cuda_devices({count})"
    free = sorted((o for o in occupancy if o.free), key=lambda o: (-o.gpu.free_bytes, o.gpu.index))
    wanted = len(free) if count == ALL_FREE else count
    if not occupancy:
        raise ConfigurationError(
            f"{asked} found no GPU: NVML lists none visible to this process (check CUDA_VISIBLE_DEVICES); "
            "on CPU give a number of processes instead (devices=2, accelerator='cpu')."
        )
    if wanted == 0 or len(free) < wanted:
        raise ConfigurationError(_too_few(asked, count, free, occupancy))
    return tuple(sorted(o.gpu.index for o in free[:wanted]))


def _too_few(asked: str, count: int, free: Sequence[GpuOccupancy], occupancy: Sequence[GpuOccupancy]) -> str:
    wanted = "a GPU" if count == ALL_FREE else f"{count} GPU{'s' if count != 1 else ''}"
    visible = len(occupancy)
    free_text = ", ".join(o.gpu.describe() for o in free) or "none"
    busy = "; ".join(o.describe_busy() for o in occupancy if not o.free)
    fewer = f", ask for fewer (free:{len(free)})" if free else ""
    return (
        f"{asked} asks for {wanted} that no other process uses, but {len(free)} of the {visible} visible "
        f"{'is' if len(free) == 1 else 'are'} free (free: {free_text}). Busy: {busy}. Wait for those processes "
        f"to end{fewer}, or name the GPUs to share them (devices='0,1')."
    )
