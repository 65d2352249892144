"""Experiment trackers on the ranks: one run, written by rank 0, charted in the live view.

A notebook's own tracker code (TensorBoard's or tensorboardX's ``SummaryWriter``, ``wandb.init``/``wandb.log``,
``mlflow.start_run``/``log_metric``, ``trackio.init``/``trackio.log``) runs unchanged in a
``%%distributed`` cell. Left alone, each rank would open its own run (N runs, N event files,
N writers migrating one SQLite store at once). While :func:`tracked_cell` is active the
``"trackers"`` patches of :mod:`nbtrain.patches` change each tracker as the cell imports it:

- on rank 0 the tracker writes as in one process, and the scalars it logs also go to the
  live view as metrics (charts beside the loss, in ``nbtrain.last_run().metrics``), without
  turning the automatic loss capture off;
- on the other ranks every call is accepted and returns a usable value (a writer with its
  ``log_dir``, a wandb run with its id, an MLflow run, a trackio run), and writes nothing to
  the user's run: TensorBoard's file writer writes nothing, ``wandb.init`` opens a disabled
  run (no service process), MLflow writes to a throwaway store removed at the cell's end,
  ``trackio.init`` returns a run whose calls do nothing.

At the cell's end (also after a failure or an interrupt) rank 0 closes the runs the cell
left open, each named by one note in the summary, and wandb's service process is stopped.
On the cluster engine (``NBTRAIN_NODE`` set by the runtime) one more note per run rank 0 wrote
says on which node and host, and in which directory: that node's disk, not the kernel's.
Nothing here imports a tracker: the patches wait for the cell to import it.

Example (outside a run nothing is patched):
    >>> with tracked_cell():
    ...     pass
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import sys
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from nbtrain import patches
from nbtrain.messages import trackerruns
from nbtrain.rank import api
from nbtrain.rank.auto import ledger

GROUP = "trackers"


@dataclass
class _Cell:
    """What the running cell opened on this rank, to close at its end."""

    writers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # TensorBoard SummaryWriters
    wandb_runs: list[Any] = field(default_factory=list)
    made: dict[int, tuple[str, Any]] = field(default_factory=dict)  # id -> (what, a run object rank 0 made)
    trackio_runs: dict[str, str] = field(default_factory=dict)  # what -> where: trackio runs rank 0 logged to
    throwaway: str | None = None  # the other ranks' MLflow store, removed at the cell's end


_cell = _Cell()


@contextlib.contextmanager
def tracked_cell() -> Iterator[None]:
    """Trackers patched for the cell on this rank; at its end, rank 0 closes what the cell left open."""
    global _cell
    if api.current_context() is None:
        yield
        return
    _cell = _Cell()
    with ExitStack() as stack:
        stack.callback(_remove_throwaway)
        patches.install(GROUP, stack)
        try:
            yield
        finally:
            if api.rank() == 0:
                _close_left_open()
                _say_where_written()
                trackerruns.send_calls()  # the cell's last calls on the kernel's runs
            trackerruns.kernel_wandb_run = None


def stays_on_rank(obj: Any) -> str | None:
    """Why ``obj``, a tracker's run the cell made on rank 0, does not go back to the kernel (else None)."""
    what, made = _cell.made.get(id(obj), ("", None))
    if made is not obj:
        return None
    return (
        f"{what} made in the cell stays on rank 0, where it wrote its run (its files and threads are "
        "that process's); read the run with the tracker's own tools"
    )


def _note(what: str) -> None:
    ledger.cell_registry().notes.append(
        f"{what} was still open at the cell's end: nbtrain closed it on rank 0 so that what it "
        "logged is written; close it in the cell to choose when."
    )


def _close_left_open() -> None:
    """Close (flush) the runs the cell opened on rank 0 and did not close; one note each."""
    for writer in list(_cell.writers):
        if getattr(writer, "all_writers", None) is not None:
            _closing(f"SummaryWriter({_log_dir(writer)!r})", writer.close)
    wandb = sys.modules.get("wandb")
    for run in _cell.wandb_runs:
        if not getattr(run, "_is_finished", True):
            _closing(f"wandb run {run.id!r}", run.finish)
    if wandb is not None and _cell.wandb_runs:
        # Its service process ends with the cell, not with the rank (a failed rank 0 is held).
        with contextlib.suppress(Exception):  # a service already gone has nothing to stop
            wandb.teardown()
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        _closing(f"MLflow run {mlflow.active_run().info.run_id!r}", mlflow.end_run)
    trackio, current = sys.modules.get("trackio"), sys.modules.get("trackio.context_vars")
    if trackio is not None and current is not None and current.current_run.get() is not None:
        _closing(f"trackio run {current.current_run.get().name!r}", trackio.finish)


def _say_where_written() -> None:
    """On the cluster engine: one note per run rank 0 wrote, naming its node, host and directory."""
    node = os.environ.get("NBTRAIN_NODE")
    if not node:
        return
    host = socket.gethostname()
    written = [(what, _written_in(what, made)) for what, made in _cell.made.values()]
    for what, where in [*written, *_mlflow_written(), *_cell.trackio_runs.items()]:
        if where:
            ledger.cell_registry().notes.append(
                f"{what} wrote on rank 0's {node}, host {host!r}, in {where!r}: "
                "it is there, not on the kernel's machine unless that directory is shared; read it on that node."
            )


def _mlflow_written() -> list[tuple[str, str]]:
    """The MLflow run rank 0 wrote in the cell to a store on its own disk (SQLite, files), if any."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return []
    try:
        run, uri = mlflow.last_active_run(), mlflow.get_tracking_uri()
    except Exception:  # noqa: BLE001 - a store that cannot answer names no place; the cell's outcome stands
        return []
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if run is None or scheme not in ("", "sqlite", "file") or uri.startswith("databricks"):
        return []  # none, or a tracking server: reachable from the kernel as it is
    return [(f"MLflow run {run.info.run_id!r}", f"{uri} (artifacts {run.info.artifact_uri})")]


def _written_in(what: str, made: Any) -> str | None:
    """The directory a run rank 0 made was written to (absolute), if it has one."""
    if what == "a SummaryWriter":
        where = _log_dir(made)
    else:
        where = getattr(getattr(made, "settings", None), "sync_dir", None) or getattr(made, "dir", None)
    return os.path.abspath(where) if where else None


def _log_dir(writer: Any) -> str | None:
    """A SummaryWriter's directory: ``log_dir`` (torch.utils.tensorboard) or ``logdir`` (tensorboardX)."""
    return getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)


def _closing(what: str, close: Callable[[], Any]) -> None:
    try:
        close()
    except Exception as error:  # noqa: BLE001 - the cell's own outcome matters more than this close
        ledger.cell_registry().notes.append(f"{what} could not be closed at the cell's end: {error}")
        return
    _note(what)


def _remove_throwaway() -> None:
    if _cell.throwaway is not None:
        shutil.rmtree(_cell.throwaway, ignore_errors=True)


def _rank_zero() -> bool:
    return api.rank() == 0


def _on_rank_zero(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A patch factory that changes rank 0's function only: the other ranks keep the original."""
    return functools.wraps(factory)(lambda original: factory(original) if _rank_zero() else original)


def _off_rank_zero(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A patch factory that changes the other ranks' function only: rank 0 keeps the original."""
    return functools.wraps(factory)(lambda original: original if _rank_zero() else factory(original))


# --- TensorBoard (torch.utils.tensorboard, and tensorboardX alike) -----------------------------


class _SilentFileWriter:
    """TensorBoard's (or tensorboardX's) FileWriter on a rank other than 0: it takes every event and writes nothing."""

    def __init__(self, log_dir: str | None = None, *args: Any, logdir: str | None = None, **kwargs: Any) -> None:
        self.log_dir = str(log_dir if logdir is None else logdir)  # tensorboardX names it logdir

    def get_logdir(self) -> str:
        """The directory rank 0 writes to."""
        return self.log_dir

    def __getattr__(self, name: str) -> Callable[..., None]:  # add_event, add_summary, flush, close...
        return _nothing


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def tensorboard_file_writer(original: Any) -> Any:
    """Patch factory: ranks other than 0 get a file writer that writes nothing."""
    return original if _rank_zero() else _SilentFileWriter


@_on_rank_zero
def tensorboard_init(original: Any) -> Any:
    """Patch factory: rank 0 remembers the writers the cell opens (to close those left open)."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _cell.writers.add(self)
        _cell.made[id(self)] = ("a SummaryWriter", self)

    return __init__


@_on_rank_zero
def tensorboard_add_scalar(original: Any) -> Any:
    """Patch factory: rank 0's ``add_scalar`` also charts the scalar in the live view."""
    def add_scalar(self: Any, tag: str, scalar_value: Any, global_step: Any = None, *args: Any, **kwargs: Any) -> Any:
        trackerruns.chart({tag: scalar_value}, global_step)
        return original(self, tag, scalar_value, global_step, *args, **kwargs)

    return add_scalar


@_on_rank_zero
def tensorboard_add_scalars(original: Any) -> Any:
    """Patch factory: rank 0's ``add_scalars`` also charts each scalar (``main_tag/tag``)."""
    def add_scalars(
        self: Any, main_tag: str, tag_scalar_dict: Any, global_step: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        trackerruns.chart({f"{main_tag}/{tag}": value for tag, value in tag_scalar_dict.items()}, global_step)
        return original(self, main_tag, tag_scalar_dict, global_step, *args, **kwargs)

    return add_scalars


# --- Weights & Biases ----------------------------------------------------------------------


def wandb_init(original: Any) -> Any:
    """Patch factory: ``wandb.init`` opens a disabled run on ranks other than 0; rank 0's is remembered."""
    if not _rank_zero():

        def init_disabled(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **{**kwargs, "mode": "disabled"})

        return init_disabled

    def init(*args: Any, **kwargs: Any) -> Any:
        run = original(*args, **kwargs)
        _cell.wandb_runs.append(run)
        _cell.made[id(run)] = ("a wandb run", run)
        return run

    return init


@_on_rank_zero
def wandb_log(original: Any) -> Any:
    """Patch factory: rank 0's ``run.log`` (and ``wandb.log``) also charts the scalars logged."""
    def log(self: Any, data: Mapping[str, Any], step: Any = None, *args: Any, **kwargs: Any) -> Any:
        trackerruns.chart(data, step)
        return original(self, data, step, *args, **kwargs)

    return log


def wandb_module_log(original: Any) -> Any:
    """Patch factory: ``wandb.log`` reaches the kernel's active run when the cell opened none of its own."""

    def log(*args: Any, **kwargs: Any) -> Any:
        kernel_run = trackerruns.kernel_wandb_run
        if kernel_run is not None and getattr(sys.modules.get("wandb"), "run", None) is None:
            return kernel_run.log(*args, **kwargs)
        return original(*args, **kwargs)

    return log


# --- MLflow ---------------------------------------------------------------------------------


@_off_rank_zero
def mlflow_store(original: Any) -> Any:
    """Patch factory: ranks other than 0 track into a throwaway store (removed at the cell's end)."""
    def _get_store(store_uri: Any = None, artifact_uri: Any = None) -> Any:
        if _cell.throwaway is None:
            _cell.throwaway = tempfile.mkdtemp(prefix="nbtrain-mlflow-")
        return original(f"sqlite:///{_cell.throwaway}/mlflow.db", f"{_cell.throwaway}/artifacts")

    return _get_store


@_on_rank_zero
def mlflow_log_metric(original: Any) -> Any:
    """Patch factory: rank 0's ``log_metric`` also charts the metric in the live view."""
    def log_metric(
        self: Any, run_id: str, key: str, value: Any, timestamp: Any = None, step: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        trackerruns.chart({key: value}, step)
        return original(self, run_id, key, value, timestamp, step, *args, **kwargs)

    return log_metric


@_on_rank_zero
def mlflow_log_batch(original: Any) -> Any:
    """Patch factory: rank 0's ``log_metrics`` (a batch) also charts its metrics."""
    def log_batch(self: Any, run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
        for metric in metrics:
            trackerruns.chart({metric.key: metric.value}, metric.step)
        return original(self, run_id, metrics, *args, **kwargs)

    return log_batch


# --- trackio --------------------------------------------------------------------------------


class _SilentRun:
    """A trackio run on a rank other than 0: its calls are accepted and do nothing."""

    def __init__(self, project: str, name: str | None, config: Any) -> None:

        self.project = project
        self.name = name or f"rank-copy-{uuid.uuid4().hex[:8]}"
        self.id = uuid.uuid4().hex
        self.config = dict(config or {})

    def __getattr__(self, name: str) -> Callable[..., None]:  # log, finish, alert, log_system...
        return _nothing


@_off_rank_zero
def trackio_init(original: Any) -> Any:
    """Patch factory: ``trackio.init`` on ranks other than 0 returns a run that writes nothing."""
    def init(project: str, name: str | None = None, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        run = _SilentRun(project, name, config)
        sys.modules["trackio.context_vars"].current_run.set(run)  # trackio.log/finish find it
        return run

    return init


@_on_rank_zero
def trackio_log(original: Any) -> Any:
    """Patch factory: rank 0's trackio ``log`` also charts the scalars logged."""
    def log(self: Any, metrics: Mapping[str, Any], step: Any = None, *args: Any, **kwargs: Any) -> Any:
        trackerruns.chart(metrics, step)
        what = f"trackio run {getattr(self, 'name', '')!r} of project {getattr(self, 'project', '')!r}"
        _cell.trackio_runs.setdefault(what, str(sys.modules["trackio.utils"].TRACKIO_DIR))  # its local store
        return original(self, metrics, step, *args, **kwargs)

    return log
