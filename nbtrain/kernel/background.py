"""Runs that go on in the background: ``%%distributed --background`` and ``launch(..., background=True)``.

The cell returns at once with a :class:`BackgroundRun`; a thread of the kernel follows the
run's events, with the follower a blocking cell uses (:mod:`nbtrain.kernel.follower`), and
keeps the cell's live view up to date through its display id (a
frontend updates a display by id wherever it is, so the view moves while other cells
run). The view has a Stop button (a core ``ipywidgets.Button``): its click is handled on
the kernel's main thread, which is free because the run is not holding it.

When a background *cell* finishes, its results are applied to the kernel's objects by
:func:`nbtrain.kernel.cellrun.apply_cell_result`, the same function a blocking cell uses,
and on the kernel's main thread: the follower thread only schedules it on the kernel's
event loop, so it happens between two cells, never in the middle of one. Until then the
kernel's objects keep their values from before the cell. A cell that raises part-way brings
its state at the raise back the same way, as a blocking cell's (docs/semantics.md), and its
error's last line says whose state the kernel then holds. ``handle.wait()`` (and reading
``handle.state`` or ``handle.result``) on the main thread applies them at once, so

    h = nbtrain.runs()[-1]
    h.wait()
    model  # holds the trained weights

always sees the trained ``model``.

Decisions, for the cases around a background run:

- Other cells, blocking ``%%distributed`` cells included, run while it goes on: runs are
  independent (each has its own ranks and its own rendezvous) and share the machine.
- Interrupting the kernel interrupts the cell that is running, not a background run;
  ``handle.stop()`` or the Stop button stops that.
- A cell that uses an object a background cell will update sees its old value until the
  run finishes; a cell that rebinds such a name meanwhile gets the run's update of the
  object it had shipped, and names the background cell sets overwrite later bindings.
- When the kernel shuts down (or the Python process exits) every run still going is
  stopped (``atexit``), before the launcher is closed.

Example (in a notebook):
    >>> import nbtrain
    >>> def train():
    ...     for step in range(100):
    ...         nbtrain.log(loss=1.0 / (step + 1))
    ...     return "done"
    >>> handle = nbtrain.launch(train, devices=2, accelerator="cpu", background=True)
    >>> handle.wait(timeout=60)
    'done'
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeAlias

from nbtrain import livestate
from nbtrain.errors import RunFailedError, RunNotEndedError, RunStoppedError
from nbtrain.kernel import display, follower
from nbtrain.kernel import shell as kernel_shell
from nbtrain.messages import events

RUNNING = "running"
STOP_WAIT_SECONDS = 10.0  # a stop is answered within run_handle.INTERRUPT_GRACE_SECONDS (5 s)
EXIT_STOP_SECONDS = 6.0  # at exit, for all runs together

_runs: list[BackgroundRun] = []
_runs_lock = threading.Lock()
_ids = itertools.count(1)
_exit_hook_registered = False  # _stop_all_at_exit, registered with the first run


# nbtrain.kernel.cellrun.apply_cell_result, handed in (cellrun imports this module): (shell, rank 0's result,
# what it may name, the record) -> what it did (``shown``, ``warnings``, ``loaded``).
ApplyResult: TypeAlias = Callable[[Any, Any, dict[str, Any], Any], Any]


def runs() -> list[BackgroundRun]:
    """The background runs of this kernel, oldest first (each a :class:`BackgroundRun`).

    After two runs, one of them still going, ``[(r.id, r.state, r.world_size) for r in
    nbtrain.runs()]`` is ``[(1, 'finished', 2), (2, 'running', 2)]``.

    Example:
        >>> {r.state for r in runs()} <= {"running", "finished", "failed", "stopped", "timed out"}
        True
    """
    with _runs_lock:
        return list(_runs)


class BackgroundRun:
    """A run going on while the notebook stays usable.

    ``state`` is ``"running"`` until the run has ended *and* its results are in the kernel,
    then ``"finished"``, ``"failed"``, ``"stopped"`` or ``"timed out"``. ``wait()`` blocks
    (bounded by ``timeout``) and returns what a blocking run would return (the value of a
    cell's last expression, or the function's return value) or raises its failure, as
    does ``result``. ``stop()`` stops every rank. ``updated`` names what a finished cell
    changed in the kernel. ``strategy``, ``accelerator``, ``world_size``, ``devices`` and
    ``started`` describe the run; ``run`` is the underlying :class:`nbtrain.kernel.run_handle.Run`.
    ``repr(handle)`` tells the state as of now; a notebook shows the handle as a display
    that is updated when the run ends, together with its live view.
    """

    def __init__(
        self,
        run: Any,
        *,
        kind: str,
        name: str,
        output: str = "all",
        shell: Any = None,
        total_steps: int | None = None,
        stall_warning: float | None = livestate.STALL_SECONDS,
    ) -> None:
        cfg = run.config
        self.id = next(_ids)
        self.run = run
        self.kind = kind  # "cell" | "function"
        self.name = name
        self.strategy = cfg.strategy.name
        self.accelerator = cfg.plan.accelerator
        self.world_size = cfg.world_size
        self.devices = tuple(cfg.plan.device_ids)
        self.started = datetime.datetime.now()
        self.ended: datetime.datetime | None = None
        self.seconds: float | None = None
        self.updated: list[str] = []
        self.error: BaseException | None = None
        self.stop_button: Any = None  # an ipywidgets.Button in a notebook
        self.view: display.NotedLiveView | None = None
        self._before_stall: str | None = None  # the view's note before a stall's replaced it
        self.output = output
        self._printer = display.OutputPrinter(output, cfg.world_size)  # where no live view shows the output
        self.total_steps = total_steps  # the live view's progress total, when known
        self.stall_warning = stall_warning
        self.record: Any = None  # a cell's LastRun: what the follower keeps of the events (None: a function's run)
        self._started_at = time.monotonic()
        self._state = RUNNING
        self._value: Any = None
        self._stop_reason: str | None = None
        self._ended = threading.Event()  # the ranks are gone; the outcome is known or pending
        self._done = threading.Event()  # and it is settled: results applied, state final
        self._pending: Callable[[], None] | None = None  # applies results (on the main thread)
        self._pending_lock = threading.Lock()
        self._main_loop = kernel_shell.kernel_loop(shell)
        self._thread: threading.Thread | None = None
        self._shown_as: list[Any] = []  # display handles of this handle shown in cells (see _ipython_display_)
        self._shown_lock = threading.Lock()

    # -- the public face ---------------------------------------------------------------
    @property
    def state(self) -> str:
        """"running", "finished", "failed", "stopped" or "timed out" (settled here first, on the main thread)."""
        self._settle_here()
        return self._state

    def done(self) -> bool:
        """Whether the run is over and settled (its results, if any, are in the kernel)."""
        self._settle_here()
        return self._done.is_set()

    @property
    def result(self) -> Any:
        """What the run returned; raises its failure, or RunNotEndedError (a RuntimeError) while it is still running."""
        self._settle_here()
        if not self._done.is_set():
            raise RunNotEndedError(
                f"background run {self.id} is still running; handle.wait() waits for it, handle.stop() stops it."
            )
        if self.error is not None:
            raise self.error.with_traceback(None)
        return self._value

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until the run is over (at most ``timeout`` seconds); return :attr:`result`.

        Raises the run's failure (a RankError names the rank), or TimeoutError when it is
        still going after ``timeout`` seconds (the run goes on). Interrupting the wait does
        not stop the run either.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._ended.wait(_left(deadline)):
            raise TimeoutError(
                f"background run {self.id} is still running after {timeout:g} s; it goes on "
                "(handle.stop() stops it)."
            )
        self._settle_here()
        if not self._done.wait(_left(deadline)):
            raise TimeoutError(
                f"background run {self.id} has ended but its results are not in the kernel yet: the kernel's "
                "main thread applies them when the cell running there ends."
            )
        return self.result

    def stop(self, reason: str = "stopped") -> None:
        """Stop every rank of the run and wait (bounded) until they are gone.

        The kernel's objects keep their values. A run that already ended is left as it was.
        """
        if not self._ended.is_set():
            self._stop_reason = reason  # the follower thread stops the run: it alone reads its events
            if not self._ended.wait(STOP_WAIT_SECONDS):
                if self._thread is not None and self._thread.is_alive():
                    raise TimeoutError(
                        f"background run {self.id} did not stop within {STOP_WAIT_SECONDS:g} s; "
                        "its ranks are being stopped still (see nbtrain.runs())."
                    )
                self.run.stop(reason)  # the follower is gone: stop the run from here
                self._end(events.STOPPED, error=RunStoppedError(f"background run {self.id} was stopped."))
        self._settle_here()

    def __repr__(self) -> str:
        self._settle_here()
        return self._describe()

    def _describe(self) -> str:
        """The repr as of now, without applying pending results (safe from any thread)."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        where = f"{ranks}, {self.accelerator}, {self.strategy}"
        state = self._state
        if state == RUNNING and self._ended.is_set():
            state = "ended, its results reach the kernel when the kernel is free"
        text = f"<BackgroundRun {self.id}: {self.name} on {where}; {state}, started {self.started:%H:%M:%S}"
        if self.updated:
            text += f"; updated in the kernel: {', '.join(self.updated)}"
        return text + ">"

    def _ipython_display_(self) -> None:
        """How a notebook shows the handle (the ``%%distributed --background`` cell's value).

        A repr printed as the cell's Out would say "running" for ever, under a live view
        that says "stopped". This is a display with an id instead, updated together with
        the live view (by the follower thread, or where the run ends), so it always tells
        the run's state. A terminal gets the repr.
        """
        if not display.frontend_is_rich():
            display.show_text(repr(self))
            return
        self._settle_here()
        with self._shown_lock:
            self._shown_as.append(display.show_text(self._describe(), updatable=True))
        # The run may have ended while it was being shown: make sure the display says so.
        if self._ended.is_set():
            self._update_shown()

    def _update_shown(self) -> None:
        """Bring every display of this handle up to date (from any thread)."""
        # Under the lock: two threads updating at once cannot leave the older text last.
        with self._shown_lock:
            text = self._describe()
            for shown in self._shown_as:
                display.update_text(shown, text)

    # -- following the run (the follower thread) ---------------------------------------
    def _start(self) -> None:
        global _exit_hook_registered
        with _runs_lock:
            _runs.append(self)
            if not _exit_hook_registered:
                # Registered after the launcher's own exit hook (the run started it), so it
                # runs first: runs are stopped before the launcher is closed.
                atexit.register(_stop_all_at_exit)
                _exit_hook_registered = True
        # The thread keeps the cell's context: its display updates and any output carry
        # the cell's parent header, not that of whatever cell runs when they are sent.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._follow,), name=f"nbtrain-background-{self.id}", daemon=True
        )
        self._thread.start()

    def _follow(self) -> None:
        """The kernel's run follower (:mod:`nbtrain.kernel.follower`), on this thread: the view by its id."""
        try:
            follower.follow_events(self.run, self._show, self._stopping, _POLL_SECONDS, self.record)
            self._conclude()
        except BaseException as error:  # noqa: BLE001 - never leave a handle running forever
            if self.run.state == RUNNING:
                self.run.stop("nbtrain's background thread failed")
            self._end(events.FAILED, error=error)

    def _stopping(self) -> bool:
        """Stop the run here if ``stop()`` asked for it (this thread alone reads its events); never leave early."""
        if self._stop_reason is not None and self.run.state == RUNNING:
            self.run.stop(self._stop_reason, graceful=self._stops_at_a_step())
        return False

    def _stops_at_a_step(self) -> bool:
        """Whether a stop ends every rank at an optimizer step and keeps the state (a cell's, by default)."""
        return False

    def _show(self, event: Any) -> None:
        if self.view is None:
            self._printer(event)
            return
        if isinstance(event, events.RanksWaiting):  # the run looks slow: the note under the view says why
            self._note(f"{self.view.note}\n{display.waiting_text(event)}")
            return
        if isinstance(event, events.RanksStalled):  # the note says why while it lasts; the view says "stalled"
            if self._before_stall is None:
                self._before_stall = self.view.note
            self.view.handle(event)
            self._note(display.stall_text(event) if event.seconds else self._before_stall)
            self._before_stall = self._before_stall if event.seconds else None
            return
        if isinstance(event, events.Display):  # the view's rank lines are text: a display's text, once
            if event.update or not event.text:
                return
            event = events.Output(event.run_id, event.rank, "stdout", event.text + "\n", event.node)
        if isinstance(event, events.Output) and not self._shows_output(event):
            return
        with contextlib.suppress(Exception):  # a frontend gone away must not stop the following
            self.view.handle(event)
            self.view.refresh()

    def _shows_output(self, event: events.Output) -> bool:
        return self.output == "all" or (self.output == "rank0" and event.rank == 0)

    def _conclude(self) -> None:
        """The run ended: keep its outcome (results to apply, or its failure)."""
        self.seconds = time.monotonic() - self._started_at
        # A failed cell's state at the raise, not after a stop was asked for (as after a blocking cell's interrupt).
        outcome = follower.conclude(self.run, take_state=self.kind == "cell" and self._stop_reason is None)
        self._ended_with(outcome)

    def _ended_with(self, outcome: follower.Outcome) -> None:
        """A function run's result is its value, its failure its error (a cell's go into the kernel: overridden)."""
        self._value = outcome.raw
        self._end(events.FINISHED if outcome.error is None else outcome.state, error=outcome.error)

    def _schedule(self, apply: Callable[[], None], note: str = "") -> None:
        """Have ``apply`` run on the kernel's main thread (between cells), or here without a kernel.

        ``note``: what the view says meanwhile (by default, that the kernel's objects are updated then).
        """
        if self._main_loop is not None:
            # Said before anything else may apply it: from here on only the main thread
            # touches the view.
            self._note(
                note
                or "finished — the kernel's objects are updated as soon as the kernel is free "
                "(when the cell running now ends, or in handle.wait())"
            )
        with self._pending_lock:
            self._pending = apply
        self.ended = datetime.datetime.now()
        self._ended.set()
        self._update_shown()
        if self._main_loop is not None:
            with contextlib.suppress(Exception):  # the loop is closing: the kernel is going away
                self._main_loop.add_callback(self._settle_here)
                return
        self._settle()

    def _note(self, note: str) -> None:
        if self.view is not None:
            with contextlib.suppress(Exception):  # the frontend is gone; the handle still knows
                self.view.note = note
                self.view.refresh(force=True)

    def _settle_here(self) -> None:
        """Apply pending results if this is the thread that may write the kernel's objects."""
        if self._main_loop is None or threading.current_thread() is threading.main_thread():
            self._settle()

    def _settle(self) -> None:
        with self._pending_lock:
            apply, self._pending = self._pending, None
        if apply is None:
            return
        try:
            apply()
        except BaseException as error:  # noqa: BLE001 - shown in the view, raised by wait()
            self._end(events.FAILED, error=error)

    def _end(self, state: str, error: BaseException | None = None, note: str | None = None) -> None:
        """The final state: show it, then wake whoever waits."""
        if self._done.is_set():
            return
        if self.seconds is None:
            self.seconds = time.monotonic() - self._started_at
        self.ended = self.ended or datetime.datetime.now()
        self.error = error
        self._state = state
        self._finish_view(state, self._end_note(state, error) if note is None else note)
        self._ended.set()
        self._done.set()

    def _end_note(self, state: str, error: BaseException | None) -> str:
        if state == events.FINISHED:
            return "finished — the result is in handle.result"
        if state == events.STOPPED:
            return "stopped — every rank is gone"
        if error is None:
            return state
        render = getattr(error, "_render_traceback_", None)
        text = "\n".join(render()) if render is not None else f"{type(error).__name__}: {error}"
        return f"{state} — handle.wait() raises the error:\n{text}"

    def _finish_view(self, state: str, note: str) -> None:
        self._update_shown()
        if self.stop_button is not None:
            with contextlib.suppress(Exception):  # the frontend is gone; the handle still knows
                self.stop_button.layout.display = "none"
        if self.view is None:
            self._printer.finish()
            summary = f"[nbtrain] background run {self.id} ({self.name}) {note}"
            display.print_warning(summary)
            return
        with contextlib.suppress(Exception):  # the frontend is gone; the handle still knows
            self.view.note = note
            # The stop consumed the run's last events itself: the frame says the step it kept.
            self.view.state.stopped_at = getattr(self.run, "stopped_at", None)
            self.view.finish(state)

    # -- showing it ---------------------------------------------------------------------
    def _display(self) -> None:
        """Show the live view and its Stop button in the current cell (the main thread, at start)."""
        if not display.frontend_is_rich():
            return
        self.view = display.NotedLiveView(
            self.run.config, total_steps=self.total_steps, stall_warning=self.stall_warning
        )
        index = len(runs())  # its place in nbtrain.runs() once started
        self.view.note = (
            f"background run {self.id} · the kernel is free · "
            f"stop: the button below or nbtrain.runs()[{index}].stop()"
        )
        if self.kind == "cell":
            self.view.note += "\nthe kernel's objects keep their values until the run finishes or is stopped"
        self.view.refresh(force=True)
        what = (
            "every rank ends at its next optimizer step, and the kernel's objects get that step's state"
            if self._stops_at_a_step()
            else "every rank ends, the kernel's objects keep their values"
        )
        self.stop_button = display.stop_button(
            f"Stop background run {self.id}: {what}.",
            f"nbtrain: the Stop button of background run {self.id} (live only while the run goes on;"
            " the view above says how it ended)",
            lambda: self.stop("stopped with the Stop button"),
        )


class BackgroundCell(BackgroundRun):
    """A ``%%distributed --background`` cell: on success its results go into the kernel."""

    def __init__(
        self, shell: Any, run: Any, prepared: follower.PreparedCellLike, apply_result: ApplyResult, output: str,
        stall_warning: float | None,
    ) -> None:
        number = kernel_shell.current_cell_number(shell)
        super().__init__(
            run,
            kind="cell",
            name=f"cell In[{number}]" if number else "cell",
            output=output,
            shell=shell,
            total_steps=prepared.total_steps,
            stall_warning=stall_warning,
        )
        self.shell = shell
        self.prepared = prepared
        self.record = prepared.record
        self.apply_result = apply_result

    def _stops_at_a_step(self) -> bool:
        return bool(getattr(self.run.config, "on_stop", "keep") == "keep")

    def _ended_with(self, outcome: follower.Outcome) -> None:
        """Rank 0's results, or a failed cell's state at the raise if it came back, go into the kernel on the
        main thread, when the kernel is free; a failure is explained."""
        self.record.seconds = self.seconds or 0.0
        if outcome.error is None:
            self._schedule(lambda: self._apply(outcome.raw))
            return
        self.record.state = self.run.state
        error, at_raise = outcome.error, outcome.at_raise
        if isinstance(error, RunStoppedError):
            error = RunStoppedError(f"background run {self.id} was stopped; every rank is gone.", error.where)
        if not isinstance(error, RunFailedError):  # a result that cannot load says so itself
            self._end(outcome.state, error=error)
            return
        if not isinstance(at_raise, tuple):
            explained = follower.explain_failed(self.shell, self.run, error, at_raise, self.prepared, None)
            self._end(outcome.state, error=explained)
            return
        self._schedule(
            lambda: self._apply_failed(at_raise, error),
            f"failed — rank {at_raise[0]}'s state at the failing line goes into the kernel as soon as the kernel "
            "is free (when the cell running now ends, or in handle.wait(), which then raises the error)",
        )

    def _apply_failed(self, at_raise: tuple[int, Any], error: RunFailedError) -> None:
        """On the main thread: the state at the raise into the kernel; wait() raises the error saying whose it is."""
        warnings: list[str] = []

        def bring_back(raw: Any) -> None:
            warnings.extend(self.apply_result(self.shell, raw, self.prepared.targets, self.record).warnings)

        explained = follower.explain_failed(self.shell, self.run, error, at_raise, self.prepared, bring_back)
        self.record.state = events.FAILED
        self.updated = list(self.record.updated)
        note = self._end_note(events.FAILED, explained) + "".join(f"\nnbtrain {warning}" for warning in warnings)
        self._end(events.FAILED, error=explained, note=note)

    def _apply(self, raw: Any) -> None:
        applied = self.apply_result(self.shell, raw, self.prepared.targets, self.record)
        follower.note_end(self.record, self.run)
        self.updated = list(self.record.updated)
        self._value = applied.shown
        if self.run.stopped_at is not None:  # wait() raises the stop, saying which step the kernel holds
            error = follower.kept_error(self.run, self.updated, self.prepared.shipped)
            updated = ", ".join(self.updated) or "nothing"
            note = f"{self.run.state} at step {self.run.stopped_at} — kernel updated: {updated}{self._log_note()}"
            self._end(self.run.state, error=error, note=note)
            return
        if not applied.loaded:
            note = "finished — nothing in the kernel changed"
        elif self.updated:
            note = f"finished — kernel updated: {', '.join(self.updated)}"
        else:
            note = "finished — nothing in the kernel needed updating"
        for warning in applied.warnings:
            note += f"\nnbtrain {warning}"
        for sentence in getattr(self.record, "derived", ()):  # what the notebook sized from len(loader)
            note += f"\nnbtrain note: {sentence}."
        self._end(events.FINISHED, note=note + self._log_note())

    def _end(self, state: str, error: BaseException | None = None, note: str | None = None) -> None:
        self.record.log_path = follower.log_path(self.run)
        super()._end(state, error, note)
        self.prepared.shipped = {}  # the handle stays in nbtrain.runs(): keep no old objects alive
        self.prepared.held = {}

    def _log_note(self) -> str:
        """" Full output: <path>", as a blocking cell's summary ends, when a rank printed anything."""
        log = follower.log_path(self.run)
        return f" Full output: {log}" if log else ""

    def _end_note(self, state: str, error: BaseException | None) -> str:
        if state == events.STOPPED:
            return f"stopped — every rank is gone. {self.prepared.unchanged}{self._log_note()}"
        return super()._end_note(state, error) + self._log_note()


def follow_cell(
    shell: Any, run: Any, prepared: follower.PreparedCellLike, apply_result: ApplyResult, output: str,
    stall_warning: float | None,
) -> BackgroundCell:
    """Follow a started ``%%distributed --background`` cell; its handle, at once.

    ``prepared`` is the cell's :class:`nbtrain.kernel.cellrun.PreparedCell` (``shipped``, ``record``, ``total_steps``,
    ``unchanged``); ``apply_result`` is :func:`nbtrain.kernel.cellrun.apply_cell_result`, called on the kernel's
    main thread; ``output`` and ``stall_warning`` the cell's ``--output`` and ``--stall-warning``.
    """
    handle = BackgroundCell(shell, run, prepared, apply_result, output, stall_warning)
    handle._display()
    handle._start()
    return handle


def follow_function(run: Any, fn: Any) -> BackgroundRun:
    """Follow a run started by ``launch(..., background=True)``; its handle, at once."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    handle = BackgroundRun(run, kind="function", name=str(name), shell=kernel_shell.get_shell())
    handle._display()
    handle._start()
    return handle


# -- pieces ----------------------------------------------------------------------------------

_POLL_SECONDS = 0.125  # twice the fastest frame rate: a due frame is never a whole period late


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _stop_all_at_exit() -> None:
    """Stop every run still going: the kernel is shutting down."""
    going = [handle for handle in runs() if not handle._ended.is_set()]
    for handle in going:
        handle._stop_reason = "the kernel is shutting down"
    deadline = time.monotonic() + EXIT_STOP_SECONDS
    for handle in going:
        handle._ended.wait(_left(deadline))

