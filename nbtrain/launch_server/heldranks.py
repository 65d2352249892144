"""The rank a failed run keeps for a post-mortem (``%nbtrain_debug``), after the run has ended.

The run's root-cause rank stays alive, paused in its frames (nbtrain.rank.machinery.debugger), until the
kernel attaches and its debugger ends, the next launch needs its devices, the sidebar dismisses
it, or it was held idle for its whole hold time. Its pidfd then reports it gone, and the kernel
hears ``HeldReleased`` with the reason.

While held, the rank stays among the launcher's live ranks (the stray sweep spares it) and the
run's registry record carries ``held`` until the launcher reports it gone. The sidebar's Dismiss
removes the record first, then SIGKILLs the rank: the launcher, finding the record gone when
the pidfd fires, does not write it back, and its ``HeldReleased`` says it was dismissed.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections.abc import Callable
from typing import Any

from nbtrain.launch_server import registryentries
from nbtrain.launch_server.forking import send_quietly, signal_groups
from nbtrain.launch_server.launched import LauncherRun, RankProcess
from nbtrain.messages.events import AttachHeld, DebugInput, HeldReleased, RankHeld, ReleaseHeld
from nbtrain.system import processes


class HeldRanks:
    """The ranks held for a post-mortem, one per ended run at most, keyed by run id."""

    def __init__(
        self, selector: selectors.BaseSelector, send: Callable[[Any], None], board: registryentries.Board
    ) -> None:
        self.selector = selector
        self.send = send
        self.board = board
        self.held: dict[int, tuple[LauncherRun, RankProcess]] = {}  # run id -> its rank held for a post-mortem

    def __bool__(self) -> bool:
        return bool(self.held)

    def pids(self) -> set[int]:
        """The held ranks' pids (children of the launcher still alive)."""
        return {rank.pid for _run, rank in self.held.values()}

    def get(self, run_id: int, rank_number: int) -> RankProcess | None:
        """``run_id``'s held rank, if it is rank ``rank_number``."""
        held = self.held.get(run_id)
        return held[1] if held is not None and held[1].spec.rank == rank_number else None

    def keep(self, run: LauncherRun, rank: RankProcess) -> None:
        """The run ends; its root-cause rank lives on, paused in its frames, until released."""
        hold = run.debug_hold or 0.0
        rank.held_until = time.monotonic() + hold
        self.held[run.run_id] = (run, rank)
        spec = rank.spec
        device = spec.device_type if spec.device_index is None else f"{spec.device_type}:{spec.device_index}"
        rss = processes.resident_bytes(rank.pid)
        self.send(RankHeld(run.run_id, spec.rank, rank.pid, rss, rank.cuda_bytes, hold, device))
        memory = f"{(rss or 0) >> 20} MiB of host memory" + (
            f" and {rank.cuda_bytes >> 20} MiB on {device}" if rank.cuda_bytes else ""
        )
        run.held_text = f"rank {spec.rank} (pid {rank.pid}) kept for %nbtrain_debug, holding {memory}"

    def release(self, reason: str, run_id: int | None = None) -> None:
        """End held ranks (all, or ``run_id``'s): their pidfd then reports them gone."""
        for held_id, (_run, rank) in list(self.held.items()):
            if run_id is None or held_id == run_id:
                rank.held_until = None
                rank.release_reason = reason
                signal_groups([rank], signal.SIGKILL)

    def on_exit(self, run: LauncherRun, rank: RankProcess) -> None:
        """A held rank's pidfd fired: reap it, close what it had, and tell the kernel why it went."""
        signal_groups([rank], signal.SIGKILL)  # what it started goes with it
        if processes.reap(rank.pid) is None:
            return
        self.selector.unregister(rank.pidfd)
        os.close(rank.pidfd)
        rank.exited = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(rank.channel)
        rank.channel.close()
        processes.remove_torch_shared_memory({rank.pid, *rank.members})
        self.held.pop(run.run_id, None)
        if self.board.released(run.run_id) and rank.release_reason == RankProcess.release_reason:
            rank.release_reason = "it was dismissed in the JupyterLab sidebar"
        self.send(HeldReleased(run.run_id, rank.spec.rank, rank.release_reason))

    def tick(self, now: float) -> None:
        """End the held ranks whose hold time passed with no post-mortem open."""
        for _run, rank in list(self.held.values()):
            if rank.held_until is not None and now > rank.held_until:
                rank.held_until = None
                rank.release_reason = "it was held idle for its whole hold time"
                signal_groups([rank], signal.SIGKILL)

    def kill_all(self) -> list[RankProcess]:
        """The launcher shuts down: SIGKILL every held rank; the caller reaps them."""
        held = [rank for _run, rank in self.held.values()]
        self.held.clear()
        signal_groups(held, signal.SIGKILL)
        return held

    def relay(self, message: DebugInput | AttachHeld | ReleaseHeld, runs: dict[int, LauncherRun]) -> None:
        """The kernel's side of the relay: only to a rank of one of its runs, by run and rank."""
        if isinstance(message, ReleaseHeld):
            self.release(message.reason, message.run_id)
            return
        target = self._target(message.run_id, message.rank, runs)
        if target is None:
            if isinstance(message, AttachHeld):
                self.send(HeldReleased(message.run_id, message.rank, "it was no longer held"))
            return
        if isinstance(message, AttachHeld):
            target.held_until = None
        send_quietly(target.channel, message)

    def _target(self, run_id: int, rank_number: int, runs: dict[int, LauncherRun]) -> RankProcess | None:
        """The rank a debugger message is for: the held one, or a live rank of a run going on."""
        held = self.get(run_id, rank_number)
        if held is not None:
            return held
        run = runs.get(run_id)
        ranks = [] if run is None else [r for r in run.ranks if r.spec.rank == rank_number and not r.exited]
        return ranks[0] if ranks else None
