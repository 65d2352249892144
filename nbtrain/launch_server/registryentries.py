"""The launcher's entries in the run registry (:mod:`nbtrain.system.registry`): one per run.

The launcher already sees every event of its runs, so it keeps the registry without
asking the ranks for anything: rank pids when it forks them, rank 0's step and loss from
the Metrics it relays, the state as the run starts, stops and ends. It writes a run's
record when the run starts and ends and otherwise at most once a second (from its tick),
so a rank never waits on it. A registry that cannot be written (a read-only home, a
directory open to others) turns the registry off for this launcher and changes nothing else.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from nbtrain.messages.events import Metrics, StartRun
from nbtrain.system import privatenet, processes, registry

WRITE_SECONDS = 1.0  # the most often a running run's record is rewritten
RATE_WINDOW_SECONDS = 5.0  # steps/s is measured over about this long
KEEP_ENDED = 20  # records of ended runs a launcher keeps while its kernel lives
_T = TypeVar("_T")
_KERNEL_FILE = re.compile(rb"kernel-([0-9A-Za-z_-]+)\.json")


@dataclass(frozen=True)
class Owner:
    """Who launches: the kernel (its id when Jupyter started it) and this launcher."""

    kernel_id: str | None
    kernel_pid: int
    kernel_start: int | None
    launcher_pid: int
    launcher_start: int | None


def find_owner(kernel_pid: int) -> Owner:
    """The kernel's id comes from its connection file's name on its command line
    (``-f .../kernel-<id>.json``, as jupyter_client starts every kernel)."""
    try:
        with open(f"/proc/{kernel_pid}/cmdline", "rb") as file:
            found = _KERNEL_FILE.search(file.read())
    except OSError:
        found = None
    kernel_id = found.group(1).decode() if found else None
    own = os.getpid()
    return Owner(kernel_id, kernel_pid, processes.start_time(kernel_pid), own, processes.start_time(own))


@dataclass
class RunTracker:
    """One run's record as the launcher keeps it (mutable here; written as a frozen record)."""

    record: registry.RunRecord
    folder: str  # the registry directory of the caller's environment
    written: float = 0.0
    dirty: bool = False
    rate_points: list[tuple[float, int]] = field(default_factory=list)  # (time, step) of rank 0
    last_loss_point: float = 0.0

    def on_metrics(self, metrics: Metrics) -> None:
        """Rank 0's last row of a batch: its step, its loss; nothing else is looked at."""
        if metrics.rank != 0 or not metrics.rows:
            return
        step, when, values = metrics.rows[-1]
        loss = values.get("loss", next(iter(values.values()), None))
        self.rate_points = [p for p in self.rate_points if when - p[0] <= RATE_WINDOW_SECONDS] + [(when, step)]
        (first_time, first_step), (last_time, last_step) = self.rate_points[0], self.rate_points[-1]
        rate = (last_step - first_step) / (last_time - first_time) if last_time > first_time else None
        losses = self.record.losses
        if loss is not None and when - self.last_loss_point >= 1.0:  # the sparkline: one point a second
            self.last_loss_point = when
            losses = (losses + (float(loss),))[-registry.LOSS_POINTS :]
        self.update(step=step, loss=None if loss is None else float(loss), losses=losses, steps_per_second=rate)

    def update(self, **changes: Any) -> None:
        """Change the run's record; written at the next tick."""
        self.record = replace(self.record, **changes)
        self.dirty = True


class Board:
    """The launcher's view of the registry: a tracker per run, written off the hot path."""

    def __init__(self, owner: Owner):
        self.owner = owner
        self.prefix = secrets.token_hex(3)
        self.trackers: dict[int, RunTracker] = {}
        self.ended: list[tuple[str, str]] = []  # (record id, its folder)
        self.holding: dict[int, RunTracker] = {}  # ended runs whose failed rank is held: rewritten at its release
        self.enabled = True
        self.standby_shown: tuple[str, str] | None = None  # (record id, folder) of the standby ranks
        self.standby_count = 0

    def start(
        self, start: StartRun, pids: list[tuple[int, int]], record_id: str | None = None, state: str = "running"
    ) -> None:
        """A run's ranks are forked: write its first record at once (pids and their start times)."""
        ranks = tuple((rank, pid, processes.start_time(pid) or 0) for rank, pid in pids)
        wrapper = start.rank_settings.model_wrapper
        record = registry.RunRecord(
            id=record_id or f"{self.prefix}-{start.run_id}",
            world_size=len(start.ranks),
            state=state,
            ranks=ranks,
            kernel_id=self.owner.kernel_id,
            kernel_pid=self.owner.kernel_pid,
            kernel_start=self.owner.kernel_start,
            launcher_pid=self.owner.launcher_pid,
            launcher_start=self.owner.launcher_start,
            notebook=start.environ.get("JPY_SESSION_NAME") or None,
            strategy=start.strategy or ("fsdp" if wrapper == "fsdp" else f"ddp_{start.start_method}"),
            accelerator=start.ranks[0].device_type if start.ranks else "",
            started=time.time(),
            # Whether this launcher could make the namespaces is known here; the sidebar says what it means.
            reachable=None if start.node is not None else privatenet.uncovered(start, privatenet.refused()),
        )
        folder = self._safely(lambda: registry.runs_directory(environ=start.environ), None)
        if folder is None:
            return
        tracker = self.trackers[start.run_id] = RunTracker(record, folder)
        self._write(tracker)

    def show_standby(self, generation: Any) -> None:
        """Keep one record (state ``standby``) for the standby ranks now waiting, none when none
        wait: the sidebar lists them and their memory (``nbtrain.launch_server.standby``)."""
        shown = self.standby_shown
        if shown is not None:
            self.standby_shown = None
            self._safely(functools.partial(registry.remove, *shown), None)
        if generation is None or not self.enabled:
            return
        self.standby_count += 1
        plan: StartRun = generation.plan
        ranks = [(rank.spec.rank, rank.pid) for rank in generation.ranks]
        self.start(replace(plan, run_id=0), ranks, f"{self.prefix}-standby-{self.standby_count}", "standby")
        tracker = self.trackers.pop(0, None)  # its record stays as written: nothing updates it
        if tracker is not None:
            self.standby_shown = (tracker.record.id, tracker.folder)

    def standby_dismissed(self) -> bool:
        """Whether the standby ranks' record was removed from outside (the sidebar's Dismiss)."""
        shown = self.standby_shown
        if shown is None or not self.enabled:
            return False
        record_id, folder = shown
        return not os.path.exists(os.path.join(folder, f"{record_id}.json"))

    def get(self, run_id: int) -> RunTracker | None:
        """The run's tracker, if its record is kept."""
        return self.trackers.get(run_id)

    def update(self, run_id: int, **changes: Any) -> None:
        """Change the run's record, if it is kept; written at the next tick."""
        tracker = self.trackers.get(run_id)
        if tracker is not None:
            tracker.update(**changes)

    def stop_requested(self, run_id: int) -> bool:
        """Whether the run was asked to stop from outside the kernel (the server extension)."""
        tracker = self.trackers.get(run_id)
        if tracker is None or not self.enabled:
            return False
        return self._safely(lambda: registry.stop_requested(tracker.record.id, tracker.folder), False)

    def tick(self, now: float) -> list[int]:
        """Write what changed (at most once a second a run); the runs asked to stop meanwhile."""
        asked = []
        for run_id, tracker in self.trackers.items():
            if now - tracker.written < WRITE_SECONDS:
                continue
            if tracker.dirty:
                self._write(tracker)
            else:
                tracker.written = now  # the stop request is looked for at the same pace
            if tracker.record.state == "running" and self.stop_requested(run_id):
                asked.append(run_id)
        return asked

    def end(self, run_id: int, state: str, held: str | None = None) -> None:
        """Write the run's final record (``held``: its rank kept for a post-mortem)."""
        tracker = self.trackers.pop(run_id, None)
        if tracker is None:
            return
        tracker.update(state=state, ended=time.time(), held=held)
        if held is not None:
            self.holding[run_id] = tracker
        self._write(tracker)
        self._safely(lambda: registry.withdraw_stop(tracker.record.id, tracker.folder), None)
        self.ended.append((tracker.record.id, tracker.folder))
        while len(self.ended) > KEEP_ENDED:
            old, folder = self.ended.pop(0)
            self._safely(functools.partial(registry.remove, old, folder), None)

    def released(self, run_id: int) -> bool:
        """The run's held rank is gone: its record says so. True when the record was removed from
        outside (the sidebar's Dismiss, which is what ended the rank): it is not written back."""
        tracker = self.holding.pop(run_id, None)
        if tracker is None or not self.enabled:
            return False
        if not os.path.exists(os.path.join(tracker.folder, f"{tracker.record.id}.json")):
            return True
        tracker.update(held=None)
        self._write(tracker)
        return False

    def close(self) -> None:
        """The kernel is gone: forget the ended runs; runs still going stay (shown as orphaned)."""
        self.show_standby(None)
        for record_id, folder in self.ended:
            self._safely(functools.partial(registry.remove, record_id, folder), None)

    def _write(self, tracker: RunTracker) -> None:
        tracker.written = time.monotonic()
        tracker.dirty = False
        if self.enabled:
            self._safely(lambda: registry.write(replace(tracker.record, updated=time.time()), tracker.folder), None)

    def _safely(self, action: Callable[[], _T], fallback: _T) -> _T:
        try:
            return action()
        except OSError as error:  # RegistryError included: the registry goes, the runs stay
            self.enabled = False
            print(f"nbtrain launcher: the run registry is off: {error}", file=sys.stderr)
            return fallback
