"""The run registry: one JSON file per run of this user on this machine, kept by the launchers.

Every warm launcher writes a :class:`RunRecord` for each run it starts into one per-user
directory (mode 0700), at most about once a second and when the run starts and ends,
from its own loop: never on a rank's hot path. The Jupyter server extension
(:mod:`nbtrain.serverext`) reads the directory to list the runs of every kernel, and stops a
run by acting on its rank processes directly (see :func:`nbtrain.system.processes.signal_ranks`),
after leaving a stop request here so that the launcher ends the run as "stopped".

Where: ``$NBTRAIN_RUNTIME_DIR`` if set, else ``<jupyter runtime dir>/nbtrain-runs``
(``$JUPYTER_RUNTIME_DIR``, by default ``~/.local/share/jupyter/runtime``): the kernel, and
so its launcher, inherits the server's environment, so both find the same directory.

Files: ``<id>.json`` (the record, replaced atomically by rename, so a reader never sees
half a file) and ``<id>.stop`` (a stop request). Records of ended runs go when their
launcher exits; those of runs still going when their kernel died stay, shown as
orphaned, until cleaned up.

A record (:class:`RunRecord`) holds the kernel id (from the kernel's connection-file name on its
command line), the kernel's and launcher's pids with their start times, the notebook path
(``JPY_SESSION_NAME``, which jupyter_server sets for the kernel), strategy, accelerator, world
size, each rank's pid and start time, the state, rank 0's step, last loss and steps/s, a loss
history of one point a second, and ``reachable``: why other users of the machine could reach
the run's process-group sockets, as its launcher knew it (None when covered, and on a cluster's
node, whose threat model is its own); the server words it with
:func:`nbtrain.system.sharedhost.sentence`. The directory comes from the run's own environment
(so a kernel's runs land where its server looks); one not private to the user turns the
registry off for that launcher.

Example:
    >>> import tempfile, os
    >>> saved = dict(os.environ)
    >>> os.environ["NBTRAIN_RUNTIME_DIR"] = tempfile.mkdtemp()
    >>> record = RunRecord(id="a1", world_size=2, state="running", ranks=((0, 11, 5), (1, 12, 6)))
    >>> write(record)
    >>> [r.pids for r in read_all()]
    [(11, 12)]
    >>> os.environ.clear(); os.environ.update(saved)  # as it was, whatever it held
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DIRECTORY_VARIABLE = "NBTRAIN_RUNTIME_DIR"
ACTIVE_STATES = ("starting", "running", "stopping")
LOSS_POINTS = 120  # the sparkline's length: about two minutes at one point a second


class RegistryError(OSError):
    """The registry directory cannot be used safely (another owner, or open to others)."""


@dataclass(frozen=True)
class RunRecord:
    """What the registry knows of one run. ``ranks`` holds (rank, pid, start time) triples;
    the start time (``processes.start_time``) makes a pid name one process for good."""

    id: str
    world_size: int
    state: str
    ranks: tuple[tuple[int, int, int], ...] = ()
    kernel_id: str | None = None
    kernel_pid: int | None = None
    kernel_start: int | None = None
    launcher_pid: int | None = None
    launcher_start: int | None = None
    notebook: str | None = None
    strategy: str = ""
    accelerator: str = ""
    step: int | None = None
    loss: float | None = None
    steps_per_second: float | None = None
    losses: tuple[float, ...] = field(default_factory=tuple)
    started: float = 0.0
    updated: float = 0.0
    ended: float | None = None
    # A failed run's rank kept alive for a post-mortem, and what it holds; None once released.
    held: str | None = None
    # Its launcher answers a stop request itself: every rank ends at one optimizer step, or the launcher
    # stops them hard once the grace is over (by stop_deadline, unix time, once it chose the step).
    stop_at_step: bool = False
    stop_deadline: float | None = None
    stopped_at: int | None = None  # the step a stop kept (the sidebar says "stopped at step N")
    # Why other users of the machine could reach the run's process-group sockets (its launcher's
    # reason, nbtrain.system.privatenet); None: nobody else could, or a cluster's run (its own threat model).
    reachable: str | None = None

    @property
    def pids(self) -> tuple[int, ...]:
        """The ranks' process ids, in rank order."""
        return tuple(pid for _, pid, _ in self.ranks)

    @property
    def active(self) -> bool:
        """The run still goes on (starting, running or stopping): its ranks may be alive."""
        return self.state in ACTIVE_STATES

    def as_json(self) -> dict[str, Any]:
        """The record as the JSON its file holds (and the sidebar gets, with what the server adds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        """The record a file's JSON holds; keys of a newer nbtrain that this one does not know are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        values["ranks"] = tuple(tuple(int(part) for part in entry) for entry in values.get("ranks", ()))
        values["losses"] = tuple(float(value) for value in values.get("losses", ()))
        return cls(**values)


def runs_directory(create: bool = True, environ: Mapping[str, str] | None = None) -> str:
    """The registry directory of this user, made (mode 0700) if missing and ``create``.

    ``environ`` (default: this process's) decides where: the launcher passes the caller's
    environment of each run, so a run lands where its kernel's server looks.
    Raises :class:`RegistryError` if it belongs to someone else or others may enter it:
    records name processes to signal, so nobody else may write them.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(DIRECTORY_VARIABLE)
    if not path:
        runtime = environ.get("JUPYTER_RUNTIME_DIR")
        if not runtime:
            # deferred: start-up time (jupyter_core)
            from jupyter_core.paths import jupyter_data_dir

            runtime = os.path.join(jupyter_data_dir(), "runtime")  # jupyter_runtime_dir()'s default
        path = os.path.join(runtime, "nbtrain-runs")
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return path
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise RegistryError(
            f"nbtrain's run registry {path} is not private to this user (owner uid {info.st_uid}, "
            f"mode {stat.S_IMODE(info.st_mode):o}): records name processes to stop. "
            f"Run `chmod 700 {path}` if it is yours, or set {DIRECTORY_VARIABLE} to a private directory."
        )
    return path


def write(record: RunRecord, folder: str | None = None) -> None:
    """Write ``record`` atomically: a reader sees the old file or the new one, never half."""
    folder = folder or runs_directory()
    fd, temporary = tempfile.mkstemp(prefix=f".{record.id}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(record.as_json(), file)
        os.replace(temporary, os.path.join(folder, f"{record.id}.json"))
    except BaseException:
        _unlink(temporary)
        raise


def read(run_id: str) -> RunRecord | None:
    """The record of ``run_id``, or None if there is none (or it cannot be read)."""
    if not _valid_id(run_id):
        return None
    return _load(os.path.join(runs_directory(create=False), f"{run_id}.json"))


def read_all() -> list[RunRecord]:
    """Every readable record, oldest first."""
    folder = runs_directory(create=False)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    records = [_load(os.path.join(folder, name)) for name in names if name.endswith(".json")]
    return sorted((r for r in records if r is not None), key=lambda r: r.started)


def remove(run_id: str, folder: str | None = None) -> None:
    """Forget a run: its record and any stop request."""
    if _valid_id(run_id):
        folder = folder or runs_directory(create=False)
        for suffix in (".json", ".stop"):
            _unlink(os.path.join(folder, run_id + suffix))


def request_stop(run_id: str) -> None:
    """Leave a stop request: the launcher then ends the run as stopped, not failed."""
    if _valid_id(run_id):
        open(os.path.join(runs_directory(), f"{run_id}.stop"), "w").close()  # an empty file


def stop_requested(run_id: str, folder: str | None = None) -> bool:
    """Whether a stop request (``<id>.stop``) waits for run ``run_id`` in ``folder`` (default: this user's registry)."""
    return os.path.exists(os.path.join(folder or runs_directory(create=False), f"{run_id}.stop"))


def withdraw_stop(run_id: str, folder: str | None = None) -> None:
    """The run ended: its stop request has done its work."""
    _unlink(os.path.join(folder or runs_directory(create=False), f"{run_id}.stop"))


def _load(path: str) -> RunRecord | None:
    try:
        with open(path) as file:
            return RunRecord.from_json(json.load(file))
    except (OSError, ValueError, TypeError):
        return None  # gone meanwhile, or not ours to understand


def _valid_id(run_id: str) -> bool:
    # Ids become file names: no separators, no dots, nothing a path could climb with.
    return bool(run_id) and len(run_id) <= 64 and all(c.isalnum() or c in "-_" for c in run_id)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
