"""The kernel's view of its standby ranks: listing them, and :func:`release`.

The launcher keeps the next run's ranks waiting after a run (``nbtrain.launch_server.standby``)
and tells the kernel each time that changes (``StandbyChanged``). They are shown, not
hidden: ``nbtrain.runs()`` lists them first, with the memory each holds now, and the
sidebar lists them too (a registry record in state ``standby``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nbtrain import events, processes

RELEASE_WAIT_SECONDS = 5.0  # how long release() waits for the ranks to be gone


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
        memory = ", ".join(
            f"rank {r.rank} pid {r.pid}: {_size(r.rss_bytes)}"
            + ("" if r.gpu_bytes is None else f", GPU {_size(r.gpu_bytes)}")
            for r in self.ranks
        )
        return f"<standby ranks: {self.plan}; {memory}; nbtrain.release() ends them>"


def listed(changed: events.StandbyChanged | None) -> list[StandbyRanks]:
    """The standby ranks the launcher last reported, with their memory now ([] when none)."""
    if changed is None or not changed.ranks:
        return []
    gpu_held: dict[int, int] = {}
    if changed.devices:
        from nbtrain import hardware

        for gpu in hardware.gpu_usage():
            for pid, used in gpu.process_bytes.items():
                gpu_held[pid] = gpu_held.get(pid, 0) + used
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
    if nbytes is None:
        return "?"
    return f"{nbytes / (1 << 20):.0f} MiB"
