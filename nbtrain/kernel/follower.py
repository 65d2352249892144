"""Following a run to its end in the kernel: one follower for a blocking cell and a background run.

A run is followed the same way wherever it shows and whoever waits for it: its events are
read until it ends (:func:`follow_events`), each shown where the run shows and, for a cell,
kept in its record or acted on (:func:`keep_event`: logged rows, a stall, tracker calls
replayed); then its outcome is read once (:func:`conclude`), a failed cell's state at the
raise taken before ``run.result()`` frees it, and a failure or a stop at a step is worded
here for both (:func:`explain_failed`, :func:`kept_error`). What truly differs is handed in:

- where it shows (``show``): a blocking cell's live view and printed lines
  (:mod:`nbtrain.kernel.cellrun`), a background run's view updated by its display id
  (:mod:`nbtrain.kernel.background`);
- who waits (``stopping``, asked before each event): the cell's own thread with its
  interrupts held, or a background thread asked to stop by ``handle.stop()``;
- which thread applies the results (``bring_back``): the cell's own, or the kernel's main
  thread between cells, where :mod:`nbtrain.kernel.background` schedules it.

Example:
    >>> import torch
    >>> kept_message(412, ["model", "losses"], {"model": torch.nn.Linear(2, 1)})
    'stopped at step 412 on every rank; model holds step 412.'
"""

from __future__ import annotations

import collections
import functools
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nbtrain.errors import RunFailedError, RunStoppedError, RunTimeoutError
from nbtrain.kernel import tracebacks
from nbtrain.messages import events, trackerruns

METRIC_ROWS = 100_000  # per rank, kept in ``last_run`` (a long run must not grow the kernel)


class PreparedCellLike(Protocol):
    """What the follower reads of a cell's ``PreparedCell`` (:mod:`nbtrain.kernel.cellrun` imports this module)."""

    shipped: dict[str, Any]  # emptied when the run is over: the handle keeps no old objects alive
    held: dict[str, Any]  # the torch objects held inside them (trainer.model); emptied with them

    @property
    def targets(self) -> dict[str, Any]:
        """What rank 0's result may name: the shipped globals and the torch objects inside them."""

    @property
    def record(self) -> Any:
        """The cell's run record (``nbtrain.last_run()``), filled as the run goes."""

    @property
    def total_steps(self) -> int | None:
        """The steps rank 0 will log, when the cell's code tells (the progress bar's total)."""

    @property
    def unchanged(self) -> str:
        """What to say about the kernel's objects when the run ends without a result."""


def follow_events(
    run: Any, show: Callable[[Any], None], stopping: Callable[[], bool], poll: float, record: Any = None
) -> bool:
    """Read ``run``'s events until it ends; False when ``stopping()`` said to leave at once (to stop hard).

    ``stopping()`` is asked before each event and may ask the run to stop; ``show(event)`` shows it
    where the run shows (None: nothing new, a redraw, at least every ``poll`` seconds); a cell's
    ``record`` (its :class:`nbtrain.kernel.cellrun.LastRun`) keeps what :func:`keep_event` keeps.

    Example:
        >>> class Ended:
        ...     def events(self, poll):
        ...         yield from (None, "ended")
        >>> follow_events(Ended(), print, lambda: False, 0.1)
        None
        ended
        True
    """
    for event in run.events(poll=poll):
        if stopping():
            return False
        show(event)
        if record is not None and event is not None:
            keep_event(record, event)
    return True


def keep_event(record: Any, event: Any) -> None:
    """What a cell's ``record`` keeps of ``event`` (a rank's last METRIC_ROWS logged rows, a stall), or does with it."""
    if isinstance(event, events.Metrics):
        record.metrics.setdefault(event.rank, collections.deque(maxlen=METRIC_ROWS)).extend(event.rows)
    elif isinstance(event, events.TrackerCalls):  # rank 0 logged to a run the kernel opened
        trackerruns.replay(event, functools.partial(print, file=sys.stderr))
    elif isinstance(event, events.RanksStalled):
        record.note_stall(event)


@dataclass(frozen=True)
class Outcome:
    """How a followed run ended, read once: rank 0's result or the failure, and a failed cell's state at the raise."""

    state: str  # the run's final state ("finished", "failed", "stopped", "timed out")
    raw: Any = None  # rank 0's result as it came (a stop at a step: the state there)
    error: Exception | None = None  # the run's failure, or a result that cannot load
    at_raise: Any = None  # a failed cell's state at the raise: what state_at_failure gave


def conclude(run: Any, take_state: bool) -> Outcome:
    """The ended ``run``'s outcome; ``take_state``: a failed cell's state at the raise is taken first.

    Not after a stop was asked for: the stop's failure is what the run says then, as after a
    blocking cell's interrupt.
    """
    at_raise = state_at_failure(run) if take_state and run.state == events.FAILED else None
    try:
        raw = run.result()
    except Exception as error:  # noqa: BLE001 - the run's failure, or a result that cannot load
        ended = run.state in (events.FAILED, events.STOPPED, events.TIMED_OUT)
        return Outcome(run.state if ended else events.FAILED, error=error, at_raise=at_raise)
    return Outcome(run.state, raw)


def log_path(run: Any) -> str | None:
    """Where every rank's full output is (None: no rank printed anything)."""
    log = run.log_path
    return log if log and os.path.exists(log) else None


def note_end(record: Any, run: Any) -> None:
    """Note in a cell's ``record`` how its run ended with a result: finished, or stopped at a step (the state there)."""
    record.state, record.log_path = run.state, log_path(run)
    if run.stopped_at is not None:  # the kernel's objects hold that step's state
        record.stopped_at, record.stopped = run.stopped_at, "at a step"


def state_at_failure(run: Any) -> tuple[int, Any] | None | str:
    """A failed cell's state at the raise as the run brought it ((rank, result), None), or why it cannot load.

    Call it before ``run.result()``, which frees that state as it raises the failure.
    """
    try:
        return run.state_at_failure()  # type: ignore[no-any-return]
    except Exception as error:  # noqa: BLE001 - the cell's own error is what the user must see
        return f"the kernel could not load it: {type(error).__name__}: {error}"


def explain_failed(
    shell: Any, run: Any, error: RunFailedError, at_raise: Any, prepared: PreparedCellLike,
    bring_back: Callable[[Any], Any] | None,
) -> BaseException:
    """The failed cell's error as the notebook shows it, once its state at the raise is in (:func:`kept_at_failure`)."""
    return tracebacks.explain_failure(error, shell, kept_at_failure(shell, run, at_raise, error, prepared, bring_back))


def kept_at_failure(
    shell: Any, run: Any, failed: tuple[int, Any] | None | str, error: RunFailedError, prepared: PreparedCellLike,
    bring_back: Callable[[Any], Any] | None,
) -> str:
    """Put a failed cell's state at the raise into the kernel, as one process would hold it; what its error says of it.

    ``failed`` is what :func:`state_at_failure` gave; ``bring_back(result)`` applies it as after a
    finished cell (a blocking cell's summary, then the error; a background cell's, on the kernel's
    main thread): the names the cell bound before the raise, the models and optimizers as they were
    at that line. Without it, the kernel is as before the cell, and the note says why.
    """
    if not isinstance(failed, tuple) or bring_back is None:
        why = failed if isinstance(failed, str) else run.no_state_note
        return prepared.unchanged + (f" The state at the failing line did not come back ({why})." if why else "")
    rank, result = failed
    record = prepared.record
    record.failed_rank = rank
    bring_back(result)
    where = _failing_line(error, shell)
    return failed_message(rank, where, record.updated, prepared.targets)


def _failing_line(error: RunFailedError, shell: Any) -> str:
    """Where the rank raised, as the notebook names it ("Cell In[7], line 12"), or ""."""
    text = getattr(error, "remote_traceback", "")
    if not text:
        return ""
    named = tracebacks.cell_traceback(text, shell)
    found = _CELL_LINE.findall(named) or _FILE_LINE.findall(named)
    return found[-1] if found else ""


_CELL_LINE = re.compile(r"Cell In\[\d+\], line \d+")
_FILE_LINE = re.compile(r'File "[^"]+", line \d+')


def failed_message(rank: int, where: str, updated: list[str], shipped: dict[str, Any]) -> str:
    """The line a failed cell's error ends with once the state at its raise is in: whose state, from where.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> shipped = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    >>> print(failed_message(0, "Cell In[7], line 12", ["model", "opt", "epoch", "loss"], shipped))
    ... # doctest: +NORMALIZE_WHITESPACE
    The kernel holds rank 0's state at the failing line (Cell In[7], line 12), as one process would:
    model and opt as they were there, and epoch, loss as the cell had set them.
    >>> failed_message(1, "", [], shipped)
    "The kernel holds rank 1's state at the failing line, as one process would: nothing in it had changed there."
    """
    at = f" ({where})" if where else ""
    head = f"The kernel holds rank {rank}'s state at the failing line{at}, as one process would"
    if not updated:
        return f"{head}: nothing in it had changed there."
    held = [name for name in updated if hasattr(shipped.get(name), "state_dict")]
    others = [name for name in updated if name not in held]
    parts = []
    if held:
        names = held[0] if len(held) == 1 else ", ".join(held[:-1]) + " and " + held[-1]
        parts.append(f"{names} as {'it was' if len(held) == 1 else 'they were'} there")
    if others:
        listed = ", ".join(others[:8]) + (", ..." if len(others) > 8 else "")
        parts.append(f"{listed} as the cell had set {'it' if len(others) == 1 else 'them'}")
    return f"{head}: {', and '.join(parts)}."


def kept_error(run: Any, updated: list[str], shipped: dict[str, Any]) -> BaseException:
    """What a run stopped at a step raises once its state is in (RunTimeoutError, RunStoppedError), naming the step."""
    message = kept_message(run.stopped_at, updated, shipped)
    if run.state == events.TIMED_OUT:
        error = RunTimeoutError(run.config.timeout or 0.0)
        error._set_message(f"the run exceeded timeout={run.config.timeout or 0:g} s and was {message}", "")
        return error
    return RunStoppedError(f"the run was {message}")


def kept_message(step: int, updated: list[str], shipped: dict[str, Any]) -> str:
    """What a stop that kept the state says: which of the kernel's objects hold which step.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> shipped = {"model": model, "opt": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 10), "i": 3}
    >>> kept_message(412, ["model", "opt", "losses", "i", "scheduler"], shipped)
    'stopped at step 412 on every rank; model, opt and scheduler hold step 412.'
    """
    held = [name for name in updated if hasattr(shipped.get(name), "state_dict")]
    if not held:
        return f"stopped at step {step} on every rank; the cell's results at that step are in the kernel."
    names = held[0] if len(held) == 1 else ", ".join(held[:-1]) + " and " + held[-1]
    verb = "holds" if len(held) == 1 else "hold"
    return f"stopped at step {step} on every rank; {names} {verb} step {step}."
