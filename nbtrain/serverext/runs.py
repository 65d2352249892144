"""What the server extension shows of the run registry, and how it stops and cleans runs.

Pure of tornado: the handlers (:mod:`nbtrain.serverext.handlers`) call these. A run's shown
state is its record's, except that a run still going whose kernel or launcher is gone is
"orphaned" (its kernel can no longer end it). Stop and clean-up act on the rank processes
themselves, through :func:`nbtrain.system.processes.signal_ranks`, which signals nothing whose
pid and start time do not both match the record.

A Stop never goes through the kernel. For a run whose record says ``stop_at_step`` (its
launcher has seen an optimizer step and keeps the state on a stop) the server only leaves
``<id>.stop``: the launcher takes it up within a second and stops every rank at a step, and the
server signals the ranks only if the record is still ``running`` after 3 s or still active 3 s
past its ``stop_deadline``; ``stopped_at`` then says "stopped at step N". Otherwise the server
leaves ``<id>.stop`` and signals each rank (a pidfd, the recorded start time and process group
checked; its group through killpg; SIGKILL after 0.5 s). The launcher, finding the request,
ends the run as ``stopped`` (a peer's broken collective is then no failure), so the kernel
raises ``RunStoppedError`` as for its own Stop, without "Where each rank was": no rank was asked
for a stack. Clean-up sends SIGKILL with the same checks and removes the record.

An orphaned run's ranks are usually gone already (a launcher stops its ranks when its kernel
dies, ranks die with their launcher); they outlive their kernel only while their launcher lives
but cannot act (stopped, frozen, stuck): the case Clean up is for, which the browser test builds
by sending the launcher SIGSTOP before it kills the kernel.

Example:
    >>> from nbtrain.system.registry import RunRecord
    >>> shown_state(RunRecord(id="a-1", world_size=2, state="finished"))
    'finished'
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from nbtrain.system import processes, registry, sharedhost
from nbtrain.system.registry import RunRecord

ORPHANED = "orphaned"
STOP_GRACE_SECONDS = 0.5  # SIGTERM first; SIGKILL for what is left after this, as the launcher does
ANSWER_SECONDS = 3.0  # a launcher looks for stop requests once a second: past this it did not answer


class RunNotFound(LookupError):
    """No record of that run id in this user's run registry (the API answers 404)."""


@dataclass(frozen=True)
class StopOutcome:
    """What a stop or clean-up did: ranks signalled, and ranks it refused to touch."""

    run_id: str
    signalled: tuple[int, ...]
    refused: tuple[int, ...]  # pids alive now but not the run's ranks (another start time)
    message: str

    def as_json(self) -> dict[str, Any]:
        """The outcome as the API's JSON answer: ``id``, ``signalled`` and ``refused`` pids, ``message``."""
        signalled, refused = list(self.signalled), list(self.refused)
        return {"id": self.run_id, "signalled": signalled, "refused": refused, "message": self.message}


def alive(pid: int | None, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (not a zombie)."""
    return pid is not None and started is not None and processes.start_time(pid) == started


def shown_state(record: RunRecord) -> str:
    """The state the sidebar shows: the record's, or "orphaned" for an active run whose kernel or launcher is gone."""
    lives = alive(record.kernel_pid, record.kernel_start) and alive(record.launcher_pid, record.launcher_start)
    return ORPHANED if record.active and not lives else record.state


def live_ranks(record: RunRecord) -> list[tuple[int, int, int]]:
    """The ranks of ``record`` still alive (same pid and start time): (rank, pid, start time)."""
    return [(rank, pid, started) for rank, pid, started in record.ranks if alive(pid, started)]


def contents_path(notebook: str | None, root: str | None) -> str | None:
    """The notebook's path as the server's contents API names it ('/'-separated, relative to
    the server's root), which is what the front end opens; None when it is unknown or lies
    outside the root. jupyter_server gives a kernel ``JPY_SESSION_NAME`` as a file system path.

    Example:
        >>> contents_path("/home/me/work/sub/train.ipynb", "/home/me/work")
        'sub/train.ipynb'
        >>> contents_path("/tmp/train.ipynb", "/home/me/work") is None
        True
    """
    if not notebook or not root:
        return None
    if not os.path.isabs(notebook):
        return notebook.replace(os.sep, "/")
    relative = os.path.relpath(notebook, root)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return None
    return relative.replace(os.sep, "/")


def run_json(
    record: RunRecord, now: float | None = None, root: str | None = None, accounts: int | None = None
) -> dict[str, Any]:
    """The JSON the sidebar gets for one run (``root``: the server's root directory; ``accounts``: the
    machine's human accounts, read if None). ``shared_host``: on a machine of several people, what
    other users could reach of the run and what to do (:func:`nbtrain.system.sharedhost.standing`), else None."""
    now = time.time() if now is None else now
    data = record.as_json()
    data["path"] = contents_path(record.notebook, root)
    data["state"] = shown_state(record)
    data["recorded_state"] = record.state
    data["pids"] = list(record.pids)
    data["live_pids"] = [pid for _, pid, _ in live_ranks(record)]
    data["elapsed"] = max(0.0, (record.ended or now) - record.started)
    data["shared_host"] = sharedhost.standing(record.reachable, accounts)
    return data


def list_runs(root: str | None = None) -> list[dict[str, Any]]:
    """Every run in the registry, as shown; records of ended runs whose launcher is gone are
    removed on the way (a launcher killed outright could not remove them itself)."""
    shown = []
    accounts = sharedhost.human_accounts()  # once for the list
    for record in registry.read_all():
        if not record.active and not alive(record.launcher_pid, record.launcher_start):
            registry.remove(record.id)
            continue
        shown.append(run_json(record, root=root, accounts=accounts))
    return shown


def stop(run_id: str, number: int = signal.SIGTERM) -> StopOutcome:
    """Ask the run's launcher to end it as stopped, and signal its ranks (pid and start time checked).

    Raises RunNotFound if the registry has no such run.
    """
    record = _record(run_id)
    if not record.active:
        return StopOutcome(run_id, (), (), f"run {run_id} already ended ({record.state}); nothing to stop.")
    registry.request_stop(run_id)
    if stops_at_step(record):
        return StopOutcome(
            run_id, (), (),
            f"asked run {run_id}'s launcher to stop every rank at the last optimizer step they all reach "
            "(its state then reaches the kernel); ranks not there within the grace period are stopped hard.",
        )
    return _signal(record, number)


def stops_at_step(record: RunRecord) -> bool:
    """Whether the run's launcher answers a stop request itself, ending every rank at an optimizer step."""
    return record.stop_at_step and alive(record.launcher_pid, record.launcher_start)


def follow_up(run_id: str, now: float | None = None) -> float | None:
    """A stop left to the run's launcher: seconds until the next look, or None when it is over.

    The launcher takes a stop request up within a second (the record says "stopping") and ends
    the run by its stop deadline. One that does not (stopped, frozen) gets what a stop without
    it gets: SIGTERM to every rank now, SIGKILL after STOP_GRACE_SECONDS (the caller's).
    """
    record = registry.read(run_id)
    if record is None or not record.active:
        return None
    now = time.time() if now is None else now
    overdue = record.stop_deadline is not None and now > record.stop_deadline + ANSWER_SECONDS
    late = record.state == "running" or overdue
    if late or not alive(record.launcher_pid, record.launcher_start):
        _signal(record, signal.SIGTERM)
        return None
    if record.stop_deadline is None:
        return ANSWER_SECONDS
    return max(0.1, record.stop_deadline + ANSWER_SECONDS - now)


def kill_rest(run_id: str) -> StopOutcome | None:
    """After the grace period: SIGKILL whatever of the run's ranks is still there."""
    record = registry.read(run_id)
    return None if record is None else _signal(record, signal.SIGKILL)


def clean(run_id: str) -> StopOutcome:
    """Forget a run that is no longer going (ended, or orphaned): SIGKILL what is left of its
    ranks (pid and start time checked: a rank held for a post-mortem is released), then remove
    its record. A live run must be stopped first."""
    record = _record(run_id)
    if record.active and shown_state(record) != ORPHANED:
        raise ValueError(
            f"run {run_id} is still {record.state} and its kernel lives: "
            "stop it first (POST .../stop), then clean it up."
        )
    # Record first: its launcher, seeing it gone, does not replace the standby ranks, nor write
    # the record back when the rank held for a post-mortem (killed below with the rest) is gone.
    if record.state == "standby" or record.held:
        registry.remove(run_id)
    outcome = _signal(record, signal.SIGKILL)
    registry.remove(run_id)
    return outcome


def _record(run_id: str) -> RunRecord:
    record = registry.read(run_id)
    if record is None:
        raise RunNotFound(
            f"nbtrain has no run {run_id!r} in its registry {registry.runs_directory(create=False)}; "
            "it may have ended and been cleaned up. Refresh the list of runs."
        )
    return record


def _signal(record: RunRecord, number: int) -> StopOutcome:
    ranks = [(pid, started) for _, pid, started in record.ranks]
    signalled = tuple(processes.signal_ranks(ranks, number))
    refused = tuple(pid for pid, at in ranks if pid not in signalled and processes.start_time(pid) not in (None, at))
    name = signal.Signals(number).name
    message = f"sent {name} to rank processes {list(signalled)} of run {record.id}."
    if refused:
        message += (
            f" Refused pids {list(refused)}: they run, but started at another time than the run's ranks did "
            "(the pid now belongs to another process), so nothing was sent to them."
        )
    return StopOutcome(record.id, signalled, refused, message)
