"""Running a ``%%distributed`` cell: prepare it, launch it, follow it, and bring its results back.

:func:`run_distributed_cell` is what the magic (:mod:`nbtrain.kernel.magic`) calls with the
cell's options and its planner (the flags' check, which also gives the engine and launch
config). A cell is prepared once (:func:`prepare_cell`: its syntax, what it ships, what
runs on the ranks), launched (:func:`start_cell`; the live view's total is read once the
ranks have started, just before its first frame, :func:`count_steps`), followed until
its run ends by the kernel's one run follower (:mod:`nbtrain.kernel.follower`; here on the
cell's own thread, its output and live view through :mod:`nbtrain.kernel.display.owntext`,
an interrupt asking every rank to stop at a step), and rank 0's results are put into the
kernel's objects (:func:`apply_cell_result`, which background runs use too). A failure
reads as :mod:`nbtrain.kernel.tracebacks` words it. ``last_run`` keeps the last run's
record (``nbtrain.last_run()``).
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from IPython.core.error import UsageError

from nbtrain import frameworks
from nbtrain.errors import (
    ConfigurationError,
    RunFailedError,
    RunInterrupted,
    SerializationError,
)
from nbtrain.kernel import (
    background,
    cellnames,
    client,
    follower,
    gcpause,
    launcher_connection,
    lengths,
    pdb_relay,
    tracebacks,
)
from nbtrain.kernel import namespace as ns
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display import owntext, rankoutput
from nbtrain.launch_server import lifecycle
from nbtrain.messages import events, processlocal, reach, records
from nbtrain.planning import config, steptotal
from nbtrain.rank import api
from nbtrain.rank import cell as rank_cell
from nbtrain.system import processes, sharedhost

# The flags' check (nbtrain.kernel.magic.check_flags): from the cell's options (its
# CellOptions, which every ``options`` here is), the engine (None: this machine's launcher)
# and the launch config, or a UsageError naming the bad flag.
Planner: TypeAlias = Callable[[Any], tuple[Any, config.LaunchConfig]]


@dataclass
class LastRun:
    """The last ``%%distributed`` run, for inspection: ``nbtrain.last_run()``."""

    state: str = "running"
    world_size: int = 0
    strategy: str = ""
    accelerator: str = ""
    seconds: float = 0.0
    total_steps: int | None = None  # what the live view counted towards (None: not known)
    # the last follower.METRIC_ROWS rows each rank logged: (step, unix time, {name: value})
    metrics: dict[int, collections.deque[tuple[int, float, Mapping[str, float]]]] = field(default_factory=dict)
    prepared: list[tuple[str, str]] = field(default_factory=list)
    loaders: list[tuple[str, str]] = field(default_factory=list)  # (name, what its passes read)
    updated: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    log_path: str | None = None  # every rank's full output (None: no rank printed anything)
    # Step counts the notebook sized from a loader auto mode shards (nbtrain.kernel.lengths).
    derived: list[str] = field(default_factory=list)
    stopped_at: int | None = None  # the optimizer step a stop kept: the kernel's objects hold it
    stopped: str = ""  # how a stop (interrupt, Stop, timeout) ended the run: "at a step", "hard"; "": not stopped
    failed_rank: int | None = None  # a failed cell: the rank whose state at its raise the kernel holds
    steps_alone: int = 0  # rank 0's optimizer steps with no collective joined: each rank trained alone (0: it did not)
    stall: str = ""  # while no rank moves and some wait on the others, the cell's note on it ("": none now)

    def note_stall(self, event: events.RanksStalled) -> None:
        """Keep the launcher's stall as the cell words it (or forget it: the ranks moved again)."""
        self.stall = rankoutput.stall_text(event) if event.seconds else ""


last_run: LastRun | None = None


@dataclass
class PreparedCell:
    """A cell checked and ready to launch: what it ships, what runs on the ranks, its record."""

    cfg: config.LaunchConfig
    spec: Any  # nbtrain.rank.cell.CellSpec
    shipped: dict[str, Any]
    used_by: dict[str, Any]
    record: LastRun
    total_steps: int | None = None  # the steps rank 0 will log, when the cell's code tells (the bar's total)
    engine: Any = None  # a cluster's warm client, planned with cfg; None: this machine's launcher
    held: dict[str, Any] = field(default_factory=dict)  # label ("trainer.model") -> the kernel's object inside a global
    analysis: Any = None  # nbtrain.kernel.namespace's reading of the cell (for count_steps)

    @property
    def targets(self) -> dict[str, Any]:
        """What rank 0's result may name: the shipped globals and the torch objects held inside them."""
        return {**self.shipped, **self.held}

    @property
    def unchanged(self) -> str:
        """What to say about the kernel's objects when the run ends without a result."""
        return tracebacks.unchanged_note(self.shipped)


def prepare_cell(shell: Any, line: str, cell: str, options: Any, plan: Planner) -> PreparedCell:
    """Check the flags (``plan``) and the cell, and decide what it ships; raises UsageError or CellSyntaxError."""

    engine, cfg = plan(options)
    body, blank_lines = _strip_leading_blank_lines(cell)
    if not body.strip():
        magic = kernel_shell.magic_name()
        raise UsageError(f"{magic}: the cell is empty; put the code to run on every rank below the {magic} line.")
    # Blank lines in front keep the notebook's line numbers: line 1 is the %%distributed line.
    code = "\n" * (1 + blank_lines) + _transformed(shell, body)
    filename = cellnames.register_source(shell, line, cell)
    tracebacks.check_syntax(code, filename, shell)
    user_ns = kernel_shell.user_namespace(shell)
    analysis = ns.analyse_cell(code, user_ns, kernel_shell.hidden_names(shell), raw_cell=body)
    shipped = {name: user_ns[name] for name in analysis.names}
    held = reach.find_reached(shipped)  # every object inside them, tracked by where it is
    auto = options.auto and not analysis.self_distributes
    spec = rank_cell.CellSpec(
        code=code,
        filename=filename,
        names=analysis.names,
        auto=auto,
        log_loss=auto and not analysis.calls_log,
        needs_shell=analysis.needs_shell,
        display_last=analysis.display_last,
        rng=records.rng_states(),
        held=tuple(h for h, _ in held),
    )
    record = LastRun(world_size=cfg.world_size, strategy=cfg.strategy.name, accelerator=cfg.plan.accelerator)
    prepared = PreparedCell(cfg, spec, shipped, dict(analysis.used_by), record, engine=engine, analysis=analysis)
    prepared.held = {h.label: obj for h, obj in held}
    return prepared


@functools.lru_cache(maxsize=32)
def _transformed(shell: Any, body: str) -> str:
    """The cell's body as Python (IPython's transforms: ``!ls``, ``%time``), once per text: a re-run reuses it."""
    return str(shell.transform_cell(body))


def count_steps(shell: Any, prepared: PreparedCell) -> int | None:
    """The live view's total and the notes on lengths the notebook derived, read once the ranks have started.

    Nothing here changes what the ranks run, and the kernel's objects stay as they were
    while the cell goes on: reading them after the launch (the live view does, just before
    its first frame) takes this, about a millisecond on a small machine, off the way to the
    ranks' first line. Returns the total (None: not certain).
    """
    code, user_ns = prepared.spec.code, kernel_shell.user_namespace(shell)
    total = infer_total_steps(code, prepared.analysis, prepared.spec, prepared.cfg, user_ns)
    prepared.total_steps = prepared.record.total_steps = total
    prepared.record.derived = _derived_lengths(prepared, code)
    return total


def _derived_lengths(prepared: PreparedCell, code: str) -> list[str]:
    """What the notebook sized from a loader's length that each rank will not reach (see lengths.py)."""
    if not prepared.spec.auto or "torch.utils.data" not in sys.modules:
        return []

    try:
        wrapper = prepared.cfg.strategy.model_wrapper
        rebound, world = lengths.rebound_names(code), prepared.cfg.world_size
        derived = lengths.derived_lengths(prepared.targets, world, wrapper, rebound)
        return derived + lengths.dataset_lengths(code, prepared.targets, world, wrapper)
    except Exception:  # noqa: BLE001 - a hint must never stop a cell
        return []


def infer_total_steps(
    code: str, analysis: Any, spec: Any, cfg: config.LaunchConfig, user_ns: dict[str, Any]
) -> int | None:
    """How many steps rank 0 will log (the live view's total), or None when that is not certain.

    The cell's loops are read by :mod:`nbtrain.planning.steptotal`. A step is a ``.backward()`` when
    auto mode logs the loss, an ``nbtrain.log`` call when the cell logs itself. A
    DataLoader's length is the one each rank will see after auto mode prepared it
    (:func:`nbtrain.rank.auto.prepare.batches_per_rank`), computed here from the kernel's loader:
    its share in a pass with gradients, all of it in a pass without (an evaluation pass).
    """

    if spec.log_loss:
        kind, counting_name = steptotal.BACKWARD, "backward"
    elif analysis.calls_log:
        kind, counting_name = steptotal.LOG, "log"
    else:
        return None  # no step will be logged
    if counting_name in analysis.function_names:
        return None  # a notebook function the cell calls may advance the step too, unseen
    try:

        # The package itself, always loaded before any of its modules: importing it here
        # would make the package and the magic it registers import each other.
        nbtrain = sys.modules["nbtrain"]

        names = [n for n in analysis.names if n not in analysis.function_writes]
        ints = {n: user_ns[n] for n in names if type(user_ns[n]) is int}
        lengths: dict[str, int] = {}
        eval_lengths: dict[str, int] = {}
        if "torch.utils.data" in sys.modules:  # no DataLoader can exist without it
            wrapper = cfg.strategy.model_wrapper if spec.auto else "none"  # not auto: loaders stay as they are
            objects = {n: user_ns[n] for n in names}
            lengths, eval_lengths = rank_cell.loader_lengths(objects, cfg.world_size, wrapper)
        counter = steptotal.StepCounter(
            kind,
            log_modules=frozenset(n for n in analysis.names if user_ns[n] is nbtrain),
            log_functions=frozenset(n for n in analysis.names if user_ns[n] is api.log),
        )
        return steptotal.total_steps(
            code, counter, ints=ints, lengths=lengths, eval_lengths=eval_lengths, kernel_globals=user_ns
        )
    except Exception:  # noqa: BLE001 - a progress total is a nicety: it must never stop a cell
        return None


def start_cell(shell: Any, prepared: PreparedCell, interactive: bool = True) -> Any:
    """Launch a prepared cell; the :class:`nbtrain.kernel.run_handle.Run`. Explains what cannot travel.

    The engine and launch config planned from the flags are passed on: the hardware (or
    the cluster) is probed once per cell.
    """

    try:
        ns.refuse_open_files(prepared.shipped, prepared.used_by)
        return client.start_on(
            prepared.engine if prepared.engine is not None else launcher_connection.get_client(),
            prepared.cfg,
            rank_cell.run_cell,
            (prepared.spec, prepared.shipped, ns.anchor_function(kernel_shell.user_namespace(shell))),
            interactive=interactive,
        )
    except SerializationError as error:
        raise tracebacks.plain_error(ns.explain_unpicklable(prepared.shipped, prepared.used_by) or error) from None
    except ConfigurationError as error:  # the run cannot fit in memory: refused before it started
        raise UsageError(f"{kernel_shell.magic_name()}: {error}") from None


def run_distributed_cell(shell: Any, line: str, cell: str, options: Any, plan: Planner) -> Any:
    """Launch ``cell`` on the ranks, show its output, apply rank 0's results to the kernel.

    With ``--background`` it returns the run's :class:`nbtrain.kernel.background.BackgroundRun`
    at once; :mod:`nbtrain.kernel.background` then follows the run and applies its results
    with :func:`apply_cell_result`, as this function does for a blocking run.

    An interrupt at any moment either prevents the run or stops it, and ends the cell with
    :class:`RunInterrupted`; ``last_run`` is left in a final state. Until the launch, an
    interrupt raises where it lands (nothing has started); from the launch on, interrupts
    are held and acted on where that is safe (see :func:`nbtrain.system.processes.interrupts_held`).
    """
    try:
        stage: list[str] = []  # "finished" once the results are in
        return _run_cell(shell, line, cell, options, stage, plan)
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        try:
            late = "finished" in stage
        except NameError:  # it came before the first statement: nothing started
            late = False
        if late:  # in the instant after interrupts stopped being held
            raise RunInterrupted(_LATE) from None
        raise RunInterrupted(
            "the cell was interrupted before it started: nothing ran and nothing in the kernel changed. "
            "The kernel is ready."
        ) from None


def _run_cell(shell: Any, line: str, cell: str, options: Any, stage: list[str], plan: Planner) -> Any:
    planning = gcpause.hold_collections()  # until the run is sent (see gcpause); its own hold goes on
    try:
        prepared = prepare_cell(shell, line, cell, options, plan)  # an interrupt here: nothing has started
        with processes.interrupts_held() as held:
            value = _launch_and_follow(shell, prepared, options, held, planning)
            stage.append("finished")
    finally:
        planning.release()
    if held.received:  # it came after the last look
        if options.background:
            value.stop("interrupted")
            raise _interrupted(prepared, value.run)
        raise RunInterrupted(_LATE)
    return value


_LATE = "the cell was interrupted after its run had finished; its results are in the kernel."


def _launch_and_follow(
    shell: Any, prepared: PreparedCell, options: Any, held: processes.HeldInterrupts, planning: gcpause.Hold
) -> Any:
    global last_run
    record = last_run = prepared.record
    started = time.monotonic()
    try:
        run = start_cell(shell, prepared, interactive=not options.background)
    except BaseException:
        record.state = events.FAILED  # refused before it started (what cannot travel, or fit)
        raise
    finally:
        planning.release()
    if options.background:

        count_steps(shell, prepared)
        handle = background.follow_cell(shell, run, prepared, apply_cell_result, options.output, options.stall_warning)
        if held.received:  # the cell that starts it was interrupted: the run does not go on
            handle.stop("interrupted")
            raise _interrupted(prepared, run)
        return handle
    try:
        return _follow(shell, run, prepared, options, held, started)
    finally:
        record.seconds = time.monotonic() - started
        record.log_path = follower.log_path(run)


def _follow(
    shell: Any, run: Any, prepared: PreparedCell, options: Any, held: processes.HeldInterrupts, started: float
) -> Any:
    """Show the run until it ends, then bring its results back; every check of ``held`` is a safe point."""
    record = prepared.record
    view: owntext.CellView | None = None
    asked = False  # a first interrupt asked every rank to stop at a step

    def stopping() -> bool:  # asked before each event: where an interrupt held since is acted on
        nonlocal asked
        if held.received and not asked and options.on_stop == "keep":
            run.ask_to_stop("interrupted", graceful=True)  # the launcher stops hard if it cannot
            asked, held.received = True, False
        # A second interrupt, or a launcher that did not answer: stop hard, now.
        return held.received or (asked and time.monotonic() > (run.stop_deadline() or 0.0))

    if not held.received:
        printer = rankoutput.OutputPrinter(options.output, prepared.cfg.world_size)
        view = owntext.CellView(run, functools.partial(count_steps, shell, prepared), options.stall_warning)
        shown = _in_the_cell(view, printer, run, held)
        follower.follow_events(run, shown, stopping, view.poll_seconds, record)  # wakes at least every poll
        printer.finish()  # a progress bar a rank other than 0 left mid-line
    if held.received or view is None or run.state == "running":  # view is None only when the interrupt came first
        run.abandon()  # stops the run and frees any result it brought back
        _stopped_hard(record, view)
        raise _interrupted(prepared, run, "stopped hard at once (a second interrupt)" if asked else "")
    outcome = follower.conclude(run, take_state=not asked)
    record.seconds = time.monotonic() - started  # the summary _bring_back prints states it
    if isinstance(outcome.error, RunFailedError):
        record.state = run.state
        view.finish(run.state)
        if asked:  # the interrupt's stop could not keep the state: the launcher said why
            _stopped_hard(record, None)
            raise _interrupted(prepared, run, run.stop_note) from None
        raise _failed(shell, run, outcome.error, outcome.at_raise, prepared, options) from None
    if outcome.error is not None:  # a result that cannot load says so itself
        raise outcome.error
    follower.note_end(record, run)  # finished, or stopped at a step that the kernel's objects then hold
    view.finish(run.state)
    value = _bring_back(shell, outcome.raw, prepared.targets, record, options.output, prepared.engine is not None)
    if run.stopped_at is not None:
        raise _kept(run, prepared, asked)
    if held.received or asked:  # it came while the results went in, or as the run finished: they are in, all of them
        raise RunInterrupted(_LATE)
    return value


def _in_the_cell(
    view: owntext.CellView, printer: rankoutput.OutputPrinter, run: Any, held: processes.HeldInterrupts
) -> Callable[[Any], None]:
    """Where a blocking cell shows an event: its view first (its first frame stays above the output), then its lines."""

    run.prompts_answered = True
    relay = pdb_relay.CellRelay(run, held)

    def show(event: Any) -> None:
        view.show(event)
        printer(event)
        relay.handle(event)  # a rank's pdb: its output, and its prompt in the input box

    return show


def _failed(
    shell: Any, run: Any, error: RunFailedError, at_raise: Any, prepared: PreparedCell, options: Any
) -> BaseException:
    """The failed cell's error, as the notebook shows it, once its state at the raise is in the kernel."""
    def bring_back(result: Any) -> None:
        _bring_back(shell, result, prepared.targets, prepared.record, options.output, prepared.engine is not None)

    return follower.explain_failed(shell, run, error, at_raise, prepared, bring_back)


def _interrupted(prepared: PreparedCell, run: Any, how: str = "") -> RunInterrupted:
    where = run.where_ranks_were()  # each rank's stack when it was stopped, if the launcher got one
    if how.startswith(lifecycle.HARD_STOP):  # "stopped hard (rank 1 did not reach step 412 within 2.0 s); nothing ..."
        unchanged = prepared.unchanged
        text = f"the cell was interrupted and {how}; {unchanged[0].lower()}{unchanged[1:]} The kernel is ready."
    else:  # as an interrupt always said; then why no step was kept, if one was asked for
        text = f"the cell was interrupted and every rank was stopped. {prepared.unchanged} The kernel is ready."
        text += f" {how}" if how else ""
    return RunInterrupted(text + (f"\n{where}" if where else ""))


def _stopped_hard(record: LastRun, view: owntext.CellView | None) -> None:
    record.state = events.STOPPED
    record.stopped = "hard"
    if view is not None:  # an interrupt's stop: now, not after one more drawing of the chart
        view.finish(events.STOPPED, redraw_chart=False)


def _kept(run: Any, prepared: PreparedCell, interrupted: bool) -> BaseException:
    """A stop kept the state at a step, brought back as after a finished run: the error the cell raises."""
    record = prepared.record
    if interrupted:
        message = follower.kept_message(run.stopped_at, record.updated, prepared.targets)
        return RunInterrupted(f"the cell was interrupted and {message} The kernel is ready.")
    return follower.kept_error(run, record.updated, prepared.targets)


@dataclass
class Applied:
    """What applying rank 0's results did: the cell's shown value and what to tell the user."""

    value: tuple[Any] | None = None  # (the value of the cell's last expression,) or None
    warnings: list[str] = field(default_factory=list)  # each shown as "nbtrain <warning>"
    loaded: bool = False  # False: nothing in the kernel changed

    @property
    def shown(self) -> Any:
        """The cell's value, as the cell shows it (None: nothing to show)."""
        return self.value[0] if self.value else None


def apply_cell_result(shell: Any, result: Any, shipped: dict[str, Any], record: LastRun) -> Applied:
    """Put rank 0's results into the kernel's objects; fills ``record`` (updated, skipped).

    The one place a cell's results reach the kernel, for blocking and background runs
    alike. Call it on the kernel's main thread: it writes the user's namespace.
    """

    if result is None:  # the cell ran, but rank 0 sent nothing (it should always send something)
        return Applied()
    try:
        outcome = ns.decode_result(result, shipped, kernel_shell.user_namespace(shell))
    except Exception as error:  # noqa: BLE001 - the values are unusable; the kernel keeps its own
        return Applied(
            warnings=[f"rank 0's results could not be loaded in the kernel ({error}); nothing in the kernel changed."]
        )
    # A framework's per-process state the results hold (accelerate's) is the kernel's own: one process.
    rebuilt = processlocal.initialize()
    with kernel_shell.interrupts_deferred():  # all of it or, if interrupted before, none of it
        report = ns.apply_result(outcome, shipped, kernel_shell.user_namespace(shell), result.deleted)
    if "lightning" in sys.modules or "pytorch_lightning" in sys.modules:  # a Trainer that came back: one process's
        frameworks.with_world(list(kernel_shell.user_namespace(shell).values()), devices=1, num_nodes=1)
    # What a notebook function made is named by where: Cell In[N], as IPython says it.
    record.prepared = [(cellnames.name_cells(name, shell), how) for name, how in result.prepared]
    record.loaders = [(cellnames.name_cells(name, shell), how) for name, how in result.loaders]
    if record.derived:  # a dataset's size is only worth a note where a training pass read a share of it

        record.derived = lengths.read_in_training(record.derived, record.loaders)
    record.updated = report.updated + [f"del {n}" for n in report.deleted]
    record.skipped = list(result.skipped) + report.skipped
    record.steps_alone = result.steps_alone
    warnings = [f"note: {cellnames.name_cells(note, shell)}" for note in result.notes]  # Cell In[N], as IPython
    warnings += [f"warning: {failure}: the kernel's objects that hold it may not work" for failure in rebuilt]
    if record.skipped:
        described = ", ".join(f"{name} ({kind}: {why})" for name, kind, why in record.skipped)
        warnings.append(f"warning: not brought back to the kernel, so they keep their old values there: {described}.")
    return Applied(outcome.get("display"), warnings, loaded=True)


def _bring_back(
    shell: Any, result: Any, shipped: dict[str, Any], record: LastRun, output: str, on_cluster: bool = False
) -> Any:
    applied = apply_cell_result(shell, result, shipped, record)
    for warning in applied.warnings:
        owntext.print_warning(f"nbtrain {warning}")
    if applied.loaded and output != "none":
        owntext.show_summary(record)
        reachable = sharedhost.after_run(record.accelerator, record.strategy, on_cluster)  # once, several users
        if reachable is not None:
            owntext.print_warning(reachable)
    return applied.shown


def _strip_leading_blank_lines(cell: str) -> tuple[str, int]:
    lines = cell.splitlines(keepends=True)
    count = next((index for index, line in enumerate(lines) if line.strip()), len(lines))
    return "".join(lines[count:]), count
