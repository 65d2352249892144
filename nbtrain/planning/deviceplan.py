"""Turn the user's ``devices`` and ``accelerator`` settings into a :class:`DevicePlan`.

This module is pure: it imports only the standard library and :mod:`nbtrain.errors`.
What the machine has (its GPUs, whether Apple's MPS exists, how many CPU cores) is
passed in; :mod:`nbtrain.planning.probe` probes it. That keeps every rule below testable
without a GPU and keeps torch (and CUDA) out of the Jupyter kernel.

``accelerator`` is one of ``"auto"``, ``"cpu"``, ``"cuda"`` (alias ``"gpu"``) or
``"mps"``; ``"auto"`` picks CUDA when a GPU is visible, else MPS, else the CPU.

``devices`` takes every form PyTorch Lightning documents:

=====================  =====================================  ==========================
``devices``            on CUDA                                on CPU
=====================  =====================================  ==========================
``2`` or ``"2"``       the first two GPUs, 0 and 1            two processes
``-1`` or ``"-1"``     every visible GPU                      one process per CPU core
``"auto"`` / ``None``  every visible GPU                      one process
``[1, 3]``             GPUs 1 and 3                           error: not a count
``"1,3"``              GPUs 1 and 3                           error: not a count
``"1,"``               GPU 1 (a trailing comma makes a list)  error: not a count
``"0,0"``              two ranks sharing GPU 0 (gloo; tests)  error: not a count
``"free:2"``           two GPUs no other process uses         error: needs GPUs
=====================  =====================================  ==========================

``"free:k"`` is resolved through NVML by :func:`nbtrain.planning.probe.probe_plan` (see
:mod:`nbtrain.planning.freegpus`); :func:`plan_devices` itself never sees which processes hold a GPU.

GPU indices count from 0 among the GPUs this process can see, that is after
``CUDA_VISIBLE_DEVICES``, exactly as ``torch.cuda`` numbers them. On MPS there is a
single device, so only requests for one device (or ``"auto"``/``-1``) are accepted.

Rejected, each with a message naming the value and listing what is available: zero,
negative numbers other than -1, more GPUs than are visible, indices out of range,
floats, booleans, and strings that are not a count, ``"-1"``, ``"auto"`` or a comma list
(``"two"``, ``"1.5"``, ``""``, ``"[1,2]"``; for the last, pass the list itself or ``"1,2"``).

CPU processes are bounded before anything starts: more than ``OVERSUBSCRIBE_FACTOR``
processes per usable core (a typo such as ``10000`` for ``100``) is refused unless the
caller passes ``oversubscribe=True``, and more than ``MOST_CPU_RANKS`` always is.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex

from nbtrain.errors import ConfigurationError

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")
PLAN_ACCELERATORS = ("cpu", "cuda", "mps")

_GIB = 2**30

# More CPU processes than this per usable core is refused without oversubscribe=True: the
# ranks only share the cores, so each extra one slows every step, and 4 per core is
# already past where data parallelism on CPU helps.
OVERSUBSCRIBE_FACTOR = 4
# Refused even with oversubscribe=True: gloo connects every pair of ranks, so each rank
# holds a socket per peer and a larger group exhausts the usual 1,024 open files per process.
MOST_CPU_RANKS = 1024


@dataclass(frozen=True)
class GpuInfo:
    """One GPU visible to this process."""

    index: int  # logical index as torch will see it (after CUDA_VISIBLE_DEVICES)
    name: str
    total_bytes: int
    free_bytes: int

    def describe(self) -> str:
        """``'0 (NVIDIA A100, 79.2 GiB free)'``"""
        return f"{self.index} ({self.name}, {self.free_bytes / _GIB:.1f} GiB free)"


@dataclass(frozen=True)
class DevicePlan:
    """Which device each rank uses: rank ``r`` runs on ``device_ids[r]``.

    ``device_ids`` holds logical GPU indices on CUDA, ``tuple(range(n))`` on CPU and
    ``(0,)`` on MPS.

    >>> DevicePlan("cuda", (1, 3)).world_size
    2
    """

    accelerator: str
    device_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        # A plan that crossed a process boundary as JSON carries a list.
        object.__setattr__(self, "device_ids", tuple(self.device_ids))
        if self.accelerator not in PLAN_ACCELERATORS:
            raise ValueError(f"DevicePlan.accelerator {self.accelerator!r} is not one of {PLAN_ACCELERATORS}")
        if not self.device_ids:
            raise ValueError("a DevicePlan needs at least one device")

    @property
    def world_size(self) -> int:
        """How many ranks the plan makes: one per device id."""
        return len(self.device_ids)

    @property
    def shared_gpus(self) -> tuple[int, ...]:
        """GPUs that hold more than one rank (listed more than once), in order.

        >>> DevicePlan("cuda", (0, 0)).shared_gpus, DevicePlan("cuda", (0, 1)).shared_gpus
        ((0,), ())
        """
        if self.accelerator != "cuda":
            return ()
        ids = self.device_ids
        return tuple(sorted({index for position, index in enumerate(ids) if index in ids[:position]}))


# What a ``devices`` value asks for, before looking at the machine: "auto", "all"
# (for -1), a count > 0, or a tuple of indices.
_AUTO = "auto"
_ALL = "all"
_DeviceRequest = str | int | tuple[int, ...]

_FORMS = "use a count (devices=2), -1, 'auto', or GPU indices ([1, 3] or '1,3')"


class _InvalidDevices(Exception):
    """Why a ``devices`` value cannot be used; plan_devices adds the value and the machine."""


def resolve_accelerator(accelerator: str | None, *, gpus: Sequence[GpuInfo], mps_available: bool) -> str:
    """The accelerator to run on: ``"cpu"``, ``"cuda"`` or ``"mps"``.

    ``"auto"`` (or None) prefers CUDA, then MPS, then the CPU; ``"gpu"`` means CUDA.
    Names are case-insensitive and may carry surrounding spaces.

    >>> a100 = GpuInfo(0, "NVIDIA A100", 80 * 2**30, 79 * 2**30)
    >>> resolve_accelerator("auto", gpus=[a100], mps_available=False)
    'cuda'
    >>> resolve_accelerator(" GPU ", gpus=[a100], mps_available=False)
    'cuda'
    >>> resolve_accelerator("auto", gpus=[], mps_available=False)
    'cpu'
    """
    name = normalize_accelerator(accelerator)
    if name == "auto":
        return "cuda" if gpus else "mps" if mps_available else "cpu"
    if name == "cuda" and not gpus:
        raise ConfigurationError(
            f"accelerator={accelerator!r} needs a GPU, but none is visible to this process. "
            "Check that the NVIDIA driver is installed (NVML finds no GPU without it) and that "
            "CUDA_VISIBLE_DEVICES does not hide the GPUs, or use accelerator='cpu'."
        )
    if name == "mps" and not mps_available:
        raise ConfigurationError(
            f"accelerator={accelerator!r} needs Apple's MPS, which exists only on Apple-silicon Macs "
            "and is not available here; use accelerator='auto' or 'cpu'."
        )
    return name


def plan_devices(
    devices: object = "auto", accelerator: str | None = "auto", *,
    gpus: Sequence[GpuInfo], mps_available: bool, cpu_count: int, oversubscribe: bool = False,
) -> DevicePlan:
    """Which accelerator and which devices the run uses, one device per rank.

    ``gpus`` are the GPUs visible to this process, in logical order; ``devices=None``
    means ``"auto"``. Raises ConfigurationError naming the bad value and what exists.
    On CPU, more than ``OVERSUBSCRIBE_FACTOR`` processes per core needs ``oversubscribe``.

    >>> gpus = [GpuInfo(i, "NVIDIA A100", 80 * 2**30, 79 * 2**30) for i in range(4)]
    >>> plan_devices(2, gpus=gpus, mps_available=False, cpu_count=8)
    DevicePlan(accelerator='cuda', device_ids=(0, 1))
    >>> plan_devices("1,3", gpus=gpus, mps_available=False, cpu_count=8).device_ids
    (1, 3)
    >>> plan_devices(-1, "cpu", gpus=gpus, mps_available=False, cpu_count=8).world_size
    8
    >>> plan_devices(64, "cpu", gpus=[], mps_available=False, cpu_count=8, oversubscribe=True).world_size
    64
    """
    resolved = resolve_accelerator(accelerator, gpus=gpus, mps_available=mps_available)
    try:
        request = _parse_devices(devices)
        if resolved == "cuda":
            device_ids = _choose_gpus(request, gpus)
        elif resolved == "mps":
            device_ids = _choose_mps(request)
        else:
            device_ids = tuple(range(_cpu_process_count(request, gpus, cpu_count, oversubscribe)))
    except _InvalidDevices as invalid:
        available = _describe_available(resolved, gpus, cpu_count)
        raise ConfigurationError(f"devices={devices!r} is not valid: {invalid}. {available}.") from None
    return DevicePlan(resolved, device_ids)


def describe_gpus(gpus: Sequence[GpuInfo]) -> str:
    """The visible GPUs, for messages.

    >>> describe_gpus([GpuInfo(0, "NVIDIA A100", 80 * 2**30, 79 * 2**30)])
    'visible GPUs: 0 (NVIDIA A100, 79.0 GiB free)'
    >>> describe_gpus([])
    'this machine has no visible GPU'
    """
    if not gpus:
        return "this machine has no visible GPU"
    return "visible GPUs: " + ", ".join(gpu.describe() for gpu in gpus)


def _describe_available(accelerator: str, gpus: Sequence[GpuInfo], cpu_count: int) -> str:
    if accelerator == "cuda":
        return _capitalized(describe_gpus(gpus))
    if accelerator == "mps":
        return "Available: one MPS device, 0; use devices=1 or 'auto'"
    setting = "on CPU" if not gpus else "with accelerator='cpu'"
    return (
        f"{_capitalized(describe_gpus(gpus))}; {setting}, devices is a number of processes, "
        f"e.g. devices=2 ({cpu_count} CPU cores here)"
    )


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]  # str.capitalize would lower-case the GPU names


def _parse_devices(devices: object) -> _DeviceRequest:
    if devices is None:
        return _AUTO
    if isinstance(devices, bool):
        # True is an int in Python; Lightning's old gpus=True is ambiguous, so say what to write.
        raise _InvalidDevices("it is a bool; pass a number of devices (e.g. devices=1) or 'auto'")
    if isinstance(devices, str):
        return _parse_devices_string(devices)
    if isinstance(devices, (list, tuple, range)):
        return _parse_index_list([_as_index(item) for item in devices])
    if isinstance(devices, float):
        raise _InvalidDevices("it is a float; pass a whole number such as devices=2")
    count = _as_int(devices)
    if count is None:
        raise _InvalidDevices(f"a {type(devices).__name__} is not a form devices accepts; {_FORMS}")
    return _parse_count(count)


def _parse_devices_string(devices: str) -> _DeviceRequest:
    text = devices.strip()
    if text.lower() == "auto":
        return _AUTO
    if text.lower().startswith("free:"):
        # nbtrain.planning.probe.probe_plan resolves free:k on this machine, through NVML, before this.
        raise _InvalidDevices(
            "free:k picks GPUs of this machine that no other process uses, and is not planned here "
            "(on a cluster, give the number of GPUs per node)"
        )
    if text.startswith(("[", "(")):
        raise _InvalidDevices("write the list itself (devices=[1, 2]) or a comma list (devices='1,2')")
    if "," in text:
        # As in Lightning, "1," is the index list [1]: empty pieces are dropped.
        pieces = [piece.strip() for piece in text.split(",") if piece.strip()]
        if not all(_DIGITS.fullmatch(piece) for piece in pieces):
            raise _InvalidDevices(f"a comma list must hold GPU indices (whole numbers from 0); {_FORMS}")
        return _parse_index_list([int(piece) for piece in pieces])
    if _SIGNED_DIGITS.fullmatch(text):
        return _parse_count(int(text))
    raise _InvalidDevices(f"it is not a number of devices; {_FORMS}")


# ASCII only: str.isdigit and \d accept digits such as "²" or "٣".
_DIGITS = re.compile("[0-9]+")
_SIGNED_DIGITS = re.compile("-?[0-9]+")


def _parse_count(count: int) -> _DeviceRequest:
    if count == -1:
        return _ALL
    if count == 0:
        raise _InvalidDevices("a run needs at least one device; use devices=1 for a single one")
    if count < 0:
        raise _InvalidDevices("the only negative value allowed is -1 (all devices)")
    return count


def _parse_index_list(indices: list[int]) -> tuple[int, ...]:
    if not indices:
        raise _InvalidDevices(f"it lists no device; {_FORMS}")
    negative = [index for index in indices if index < 0]
    if negative:
        raise _InvalidDevices(f"device indices count from 0, but it holds {negative[0]}")
    # A GPU listed twice holds two ranks: a way to run multi-rank CUDA code on one GPU, for
    # testing (gloo only: nbtrain.planning.config refuses nccl, which cannot share a GPU between ranks).
    return tuple(indices)


def _as_index(item: object) -> int:
    index = None if isinstance(item, bool) else _as_int(item)
    if index is None:
        raise _InvalidDevices(f"its entry {item!r} is not a GPU index (a whole number from 0)")
    return index


def _as_int(value: object) -> int | None:
    # operator.index takes int-like types such as numpy.int64, but not floats or strings.
    if not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _choose_gpus(request: _DeviceRequest, gpus: Sequence[GpuInfo]) -> tuple[int, ...]:
    visible = tuple(gpu.index for gpu in gpus)
    if isinstance(request, str):  # _AUTO or _ALL, the only strings a request holds
        return visible
    if isinstance(request, int):
        if request > len(visible):
            verb = "is" if len(visible) == 1 else "are"
            raise _InvalidDevices(f"it asks for {request} GPUs but only {len(visible)} {verb} visible")
        return visible[:request]
    missing = [index for index in request if index not in visible]
    if missing:
        after = "indices count from 0 among the GPUs visible after CUDA_VISIBLE_DEVICES"
        raise _InvalidDevices(f"there is no GPU {missing[0]} ({after})")
    return request


def _choose_mps(request: _DeviceRequest) -> tuple[int, ...]:
    if request in (_AUTO, _ALL, 1, (0,)):
        return (0,)
    if isinstance(request, int):
        raise _InvalidDevices(f"it asks for {request} devices, but MPS (the Apple GPU) is a single device")
    raise _InvalidDevices("MPS (the Apple GPU) is a single device, numbered 0")


def _cpu_process_count(request: _DeviceRequest, gpus: Sequence[GpuInfo], cpu_count: int, oversubscribe: bool) -> int:
    if request == _AUTO:
        return 1  # as Lightning: on CPU, "auto" is one process
    if request == _ALL:
        return max(cpu_count, 1)
    if isinstance(request, int):
        _check_cpu_ranks(request, max(cpu_count, 1), oversubscribe)
        return request
    use_gpus = "; pass accelerator='cuda' to run on them" if gpus else ""
    raise _InvalidDevices(f"it lists device indices, which select GPUs{use_gpus}")


def _check_cpu_ranks(count: int, cores: int, oversubscribe: bool) -> None:
    # Checked before the plan is built: a run of 10,000 ranks would otherwise start forking
    # them, and 99999999999999999999 would overflow building the plan itself.
    bound = OVERSUBSCRIBE_FACTOR * cores
    if count > bound and not oversubscribe:
        raise _InvalidDevices(
            f"it asks for {count} CPU processes, more than {OVERSUBSCRIBE_FACTOR} per usable core "
            f"({bound} for the {cores} core{'s' if cores != 1 else ''} here); use at most {bound} "
            f"(devices={cores} runs one per core), or pass oversubscribe=True "
            "(--allow-oversubscribe on the %%distributed line) if you mean it"
        )
    if count > MOST_CPU_RANKS:
        raise _InvalidDevices(
            f"it asks for {count} CPU processes, more than the {MOST_CPU_RANKS:,} one machine can connect "
            "(gloo holds a socket per pair of ranks); use fewer devices"
        )


def normalize_accelerator(accelerator: str | None) -> str:
    """The accelerator's canonical name (``gpu`` is ``cuda``); the one place one is validated.

    >>> normalize_accelerator(" GPU "), normalize_accelerator(None)
    ('cuda', 'auto')
    """
    if accelerator is None:
        return "auto"
    name = accelerator.strip().lower() if isinstance(accelerator, str) else None
    if name not in ACCELERATORS:
        choices = ", ".join(repr(choice) for choice in ACCELERATORS)
        raise ConfigurationError(f"accelerator={accelerator!r} is not supported; choose one of {choices}.")
    return "cuda" if name == "gpu" else name
