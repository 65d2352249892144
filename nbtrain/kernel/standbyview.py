"""The kernel's view of its standby ranks: listing them, :func:`release`, and when their GPU memory is given up.

The launcher keeps the next run's ranks waiting after a run (``nbtrain.launch_server.standby``)
and tells the kernel each time that changes (``StandbyChanged``). They are shown, not
hidden: ``nbtrain.runs()`` lists them first, with the memory each holds now, and the
sidebar lists them too (a registry record in state ``standby``).

They never cost the notebook GPU memory it needs. A run of another plan ends them before it
forks its own ranks (the launcher's pool). And before each cell (:func:`before_cell`, an
IPython ``pre_run_cell`` hook ``%load_ext nbtrain`` registers), where they hold GPU memory
(NVML's per-process figures, :func:`nbtrain.planning.probe.gpu_usage`: the one boundary), they are
ended, saying so with what they held, when the kernel's own GPU memory grew since the last
cell (it is using the GPU itself), or, on a GPU of 16 GiB or less (Colab's and Kaggle's T4),
before any cell but a ``%%distributed`` one (which takes them). A CUDA out-of-memory error in
a cell or a rank (:func:`after_cell`) names the standby ranks and ``nbtrain.release()`` if
they hold GPU memory.

    >>> held = GpuHeld(standby_bytes=758 << 20, kernel_bytes=1474 << 20, small=(), where="GPU 0")
    >>> release_reason(held, kernel_before=1474 << 20, distributed_cell=False)
    ''
    >>> release_reason(held, kernel_before=1000 << 20, distributed_cell=True)
    "this kernel's own GPU memory grew from 1000 MiB to 1474 MiB since the last cell"
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nbtrain.kernel import launcher_connection
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display import owntext
from nbtrain.messages import events
from nbtrain.planning import probe
from nbtrain.system import processes

RELEASE_WAIT_SECONDS = 5.0  # how long release() waits for the ranks to be gone
SMALL_GPU_BYTES = 16 << 30  # a T4 (15 GiB): the notebook needs all of it
GROWTH_BYTES = 64 << 20  # the kernel's own GPU memory grew by more than this: it uses the GPU itself


@dataclass(frozen=True)
class StandbyRank:
    """One waiting rank: its place, pid, host memory (RSS) and GPU memory (None: none, or unknown)."""

    rank: int
    pid: int
    rss_bytes: int | None
    gpu_bytes: int | None


@dataclass(frozen=True)
class StandbyRanks:
    """The ranks waiting for this kernel's next run with the same plan.

    ``state`` is ``"standby"``; ``plan`` says what they wait for (``2 cpu ranks, gloo``).
    They hold their process, a process group, and on CUDA a context (several hundred MB of
    GPU memory each) and nothing of any earlier cell. ``nbtrain.release()`` ends them; so do
    10 idle minutes (``nbtrain.set_defaults(standby_idle=...)``) and the kernel's end.
    """

    plan: str
    ranks: tuple[StandbyRank, ...]
    ready: bool
    state: str = "standby"

    def __repr__(self) -> str:
        gpu = {r.rank: "" if r.gpu_bytes is None else f", GPU {_size(r.gpu_bytes)}" for r in self.ranks}
        memory = ", ".join(f"rank {r.rank} pid {r.pid}: {_size(r.rss_bytes)}{gpu[r.rank]}" for r in self.ranks)
        return f"<standby ranks: {self.plan}; {memory}; nbtrain.release() ends them>"


def listed(changed: events.StandbyChanged | None) -> list[StandbyRanks]:
    """The standby ranks the launcher last reported, with their memory now ([] when none)."""
    if changed is None or not changed.ranks:
        return []
    gpu_held: collections.Counter[int] = collections.Counter()
    if changed.devices:

        for gpu in probe.gpu_usage():
            gpu_held.update(gpu.process_bytes)
    ranks = tuple(
        StandbyRank(rank, pid, processes.resident_bytes(pid), gpu_held.get(pid) if changed.devices else None)
        for rank, pid in changed.ranks
    )
    return [StandbyRanks(changed.plan, ranks, changed.ready)]


def wait_gone(pids: list[int], timeout: float = RELEASE_WAIT_SECONDS) -> bool:
    """Wait (bounded) until none of ``pids`` runs any more (the launcher reaps them)."""
    deadline = time.monotonic() + timeout
    while any(processes.start_time(pid) is not None for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _size(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / (1 << 20):.0f} MiB"


@dataclass(frozen=True)
class GpuHeld:
    """What the standby ranks and the kernel hold of the GPUs now, by NVML."""

    standby_bytes: int  # on every GPU together
    kernel_bytes: int
    small: tuple[str, ...]  # the GPUs of 16 GiB or less where the standby ranks hold memory, described
    where: str  # the GPUs where they hold it: "GPU 0", "GPUs 0, 1"


def held_now(standby_pids: Iterable[int], kernel_pid: int, gpus: Iterable[Any]) -> GpuHeld:
    """Sum NVML's per-process figures (``probe.GpuUsage`` records) for the standby ranks and the kernel."""
    pids = set(standby_pids)
    standby = kernel = 0
    small, where = [], []
    for gpu in gpus:
        theirs = sum(used for pid, used in gpu.process_bytes.items() if pid in pids)
        kernel += gpu.process_bytes.get(kernel_pid, 0)
        if theirs:
            standby += theirs
            where.append(str(gpu.index))
            if 0 < gpu.total_bytes <= SMALL_GPU_BYTES:
                small.append(f"GPU {gpu.index} ({gpu.name}, {gpu.total_bytes / (1 << 30):.0f} GiB)")
    label = ("GPU " if len(where) == 1 else "GPUs ") + ", ".join(where)
    return GpuHeld(standby, kernel, tuple(small), label)


def release_reason(held: GpuHeld, kernel_before: int | None, distributed_cell: bool) -> str:
    """Why the standby ranks must give their GPU memory up before the next cell ("" when they may stay)."""
    if held.standby_bytes == 0:
        return ""
    if kernel_before is not None and held.kernel_bytes > kernel_before + GROWTH_BYTES:
        return (
            f"this kernel's own GPU memory grew from {_size(kernel_before)} to {_size(held.kernel_bytes)} "
            "since the last cell"
        )
    if held.small and not distributed_cell:
        return f"{', '.join(held.small)} has 16 GiB or less, and the cell may need all of it"
    return ""


class _Seen:
    kernel_bytes: int | None = None  # the kernel's own GPU memory at the last cell's check
    gpus_here: bool | None = None  # whether NVML lists any GPU (asked once)


def before_cell(info: Any = None) -> None:
    """IPython's ``pre_run_cell``: end the standby ranks where the cell may need the GPU memory they hold.

    Costs nothing without standby ranks, and without GPUs; otherwise one NVML query (~ms).
    """

    client = launcher_connection.current_client()
    changed = client.standby if client is not None else None
    if client is None or changed is None or not changed.ranks or not _gpus_here(changed):
        return
    held = held_now((pid for _, pid in changed.ranks), os.getpid(), probe.gpu_usage())
    cell = getattr(info, "raw_cell", "") or ""
    why = release_reason(held, _Seen.kernel_bytes, kernel_shell.is_nbtrain_cell(cell))
    _Seen.kernel_bytes = held.kernel_bytes
    if why:

        wait_gone(client.release_standby())
        owntext.print_warning(
            f"nbtrain: the standby ranks ({changed.plan}) gave up the {_size(held.standby_bytes)} they held "
            f"on {held.where}: {why}. The next {kernel_shell.magic_name()} run forks new ranks (a second or so more)."
        )


def after_cell(result: Any = None) -> None:
    """IPython's ``post_run_cell``: a CUDA out-of-memory error names the standby ranks holding GPU memory."""
    error = getattr(result, "error_in_exec", None)
    if error is None or not _out_of_memory(error):
        return

    client = launcher_connection.current_client()
    changed = client.standby if client is not None else None
    if changed is None or not changed.ranks:
        return
    pids = [pid for _, pid in changed.ranks]
    held = held_now(pids, os.getpid(), probe.gpu_usage())
    if held.standby_bytes:

        owntext.print_warning(
            f"nbtrain: this kernel's standby ranks ({changed.plan}, pids {', '.join(map(str, pids))}) hold "
            f"{_size(held.standby_bytes)} on {held.where}: nbtrain.release() frees it for the notebook."
        )


def _out_of_memory(error: BaseException) -> bool:
    """A CUDA out-of-memory error: torch's own (the kernel's), or a rank's (a RankError naming it)."""
    if "OutOfMemoryError" in {kind.__name__ for kind in type(error).__mro__}:
        return True
    exc_type, exc_message = str(getattr(error, "exc_type", "")), str(getattr(error, "exc_message", ""))  # a RankError's
    return "OutOfMemoryError" in exc_type or "CUDA out of memory" in exc_message


def _gpus_here(changed: events.StandbyChanged) -> bool:
    if changed.devices:
        return True  # CUDA ranks
    if _Seen.gpus_here is None:

        _Seen.gpus_here = bool(probe.gpu_usage())
    return _Seen.gpus_here
