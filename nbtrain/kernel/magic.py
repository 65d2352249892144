"""``%%distributed``: run a notebook cell on N ranks and bring its results back into the kernel.

``%load_ext nbtrain`` registers it. Then, with ``model``, ``opt`` and ``loader`` defined in
earlier cells::

    %%distributed --devices 2
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()

trains data-parallel on two ranks, and afterwards the kernel's ``model`` (the same
object) holds rank 0's trained weights. This module owns the magic: its flags come from
:mod:`nbtrain.kernel.flags` (parsed once into a :class:`~nbtrain.kernel.flags.CellOptions`,
planned once), the run's output in the cell, and turning failures into one readable error. It asks
:mod:`nbtrain.kernel.shell` for what it needs of IPython's shell. What
travels and what comes back is decided in :mod:`nbtrain.kernel.namespace`; what runs on
a rank is :mod:`nbtrain.rank.cell`.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbtrain import config, events, processes, reach, records, runstate
from nbtrain.errors import (
    ConfigurationError,
    NbtrainError,
    RankError,
    RunFailedError,
    RunInterrupted,
    RunStoppedError,
    RunTimeoutError,
    SerializationError,
)
from nbtrain.kernel import flags, gcpause
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.flags import CellOptions, check_flags, help_text, parse_flags

METRIC_ROWS = 100_000  # per rank, kept in ``last_run`` (a long run must not grow the kernel)


@dataclass
class CellRun:
    """The last ``%%distributed`` run, for inspection: ``nbtrain.kernel.magic.last_run``."""

    state: str = "running"
    world_size: int = 0
    strategy: str = ""
    accelerator: str = ""
    seconds: float = 0.0
    total_steps: int | None = None  # what the live view counted towards (None: not known)
    # the last METRIC_ROWS rows each rank logged: (step, unix time, {name: value})
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


last_run: CellRun | None = None


@magics_class
class DistributedMagics(Magics):
    """The ``%%distributed`` cell magic."""

    @flags.flag_arguments
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every rank, data-parallel, and bring rank 0's results back.

        The cell is plain single-device code: in auto mode (the default) the kernel's
        Modules, Optimizers and DataLoaders it uses are prepared on each rank (wrapped in
        DistributedDataParallel, sharded with FSDP2, given a DistributedSampler), and the
        loss passed to .backward() is logged. Code written for torchrun (its own
        init_process_group, DDP, DistributedSampler) runs unchanged; auto mode then
        steps aside. When the run ends, the kernel's models, optimizers and LR schedulers
        hold rank 0's final state (the same objects), and names the cell set are set in
        the kernel. Interrupt the kernel to stop every rank; nothing changes then.

        Strategies:
          ddp_notebook  data parallel; ranks fork from a warm, clean launcher (fast start)
          ddp_spawn     data parallel; each rank is a fresh interpreter (for libraries
                        that break after fork)
          ddp_find_unused_parameters_true
                        ddp_notebook for a model that skips some parameters in a step
                        (DDP then searches for them at every step, at some cost)
          ddp_sharded   data parallel, optimizer state partitioned across ranks (ZeRO)
          fsdp          fully sharded with FSDP2: each rank holds a slice of every weight
          fsdp_cpu_offload
                        fsdp with the shards and the optimizer step in host memory
          dp            DataParallel: one process splits each batch over the GPUs
                        (CUDA only; on CPU use ddp_notebook)
          auto          ddp_notebook for more than one device, a single worker for one

        Example (a DataLoader, model, loss_fn and opt defined in earlier cells):

            %%distributed --devices 2 --strategy ddp_notebook
            for x, y in loader:
                loss = loss_fn(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()

        Inside the cell (and functions it calls): nbtrain.rank(), nbtrain.world_size(),
        nbtrain.device(), nbtrain.log(loss=...), nbtrain.prepare(model, opt, loader).

        Defaults: a flag not given takes the session default, which
        nbtrain.set_defaults(devices=2, accelerator="cpu") or the form of
        nbtrain.launcher() set (built in: --devices auto --accelerator auto
        --strategy ddp_notebook, no timeout). A flag on the cell always wins.

        Background: with --background the cell returns at once with a handle
        (also in nbtrain.runs()); other cells run meanwhile. handle.wait() returns the
        cell's value or raises its failure, handle.stop() (or the view's Stop button)
        stops every rank. The kernel's objects keep their old values until the run
        finishes; then they are updated as above, between two cells (or in
        handle.wait()). Interrupting the kernel does not stop a background run.
        """
        options = parse_flags(self.distributed, line)
        if options.help:
            print(help_text(self.distributed))
            return None
        return run_distributed_cell(self.shell, line, cell, options)

    @line_magic
    def nbtrain_debug(self, line: str) -> None:
        """Open pdb in the frames of the rank kept after the last failed run (see README, "Debugging a rank").

        Commands are typed in the input box, as for %debug; q or c ends it and releases the rank.
        """
        nbtrain_debug()


# magic_arguments names every magic "%name" (its usage prefix adds one "%"); this one is a
# cell magic.
DistributedMagics.distributed.parser.prog = "%distributed"
DistributedMagics.distributed.__doc__ = DistributedMagics.distributed.__doc__.replace(
    "%distributed [", "%%distributed [", 1
)


def nbtrain_debug() -> None:
    """``%nbtrain_debug`` and ``nbtrain.debug()``: the post-mortem of the held rank, in this cell."""
    from nbtrain.kernel import client, debugger

    try:
        debugger.post_mortem(client.current_client())
    except debugger.NoRankHeldError as error:
        raise UsageError(f"%nbtrain_debug: {error}") from None


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext nbtrain``: register ``%%distributed`` (and ``%debug`` after a rank's error)."""
    ip.register_magics(DistributedMagics)
    original = ip.magics_manager.magics["line"].get("debug")
    if original is not None and not getattr(original, "nbtrain_wrapped", False):
        ip.register_magic_function(_debug_rank_first(original), "line", "debug")


def _debug_rank_first(original: Any) -> Any:
    """IPython's ``%debug`` right after a RankError whose rank is held: the rank's frames, not the kernel's."""

    def debug(line: str = "", local_ns: Any = None) -> Any:
        from nbtrain.kernel import client

        error = getattr(sys, "last_value", None)
        held = getattr(client.current_client(), "held", None)
        if not line.strip() and isinstance(error, RankError) and held is not None and held.rank == error.rank:
            return nbtrain_debug()
        return original(line, local_ns=local_ns)

    debug.needs_local_scope = True  # type: ignore[attr-defined]  # IPython's flag, as on its own %debug
    debug.nbtrain_wrapped = True  # type: ignore[attr-defined]  # a second %load_ext does not wrap twice
    debug.__doc__ = original.__doc__
    return debug


# -- running a cell ------------------------------------------------------------------------


@dataclass
class PreparedCell:
    """A cell checked and ready to launch: what it ships, what runs on the ranks, its record."""

    cfg: config.LaunchConfig
    spec: Any  # nbtrain.rank.cell.CellSpec
    shipped: dict[str, Any]
    used_by: dict[str, Any]
    record: CellRun
    total_steps: int | None = None  # the steps rank 0 will log, when the cell's code tells (the bar's total)
    engine: Any = None  # a cluster's warm client, planned with cfg; None: this machine's launcher
    held: dict[str, Any] = field(default_factory=dict)  # label ("trainer.model") -> the kernel's object

    @property
    def targets(self) -> dict[str, Any]:
        """What rank 0's result may name: the shipped globals and the torch objects held inside them."""
        return {**self.shipped, **self.held}

    @property
    def unchanged(self) -> str:
        """What to say about the kernel's objects when the run ends without a result."""
        return _unchanged_note(self.shipped)


def prepare_cell(shell: Any, line: str, cell: str, options: CellOptions) -> PreparedCell:
    """Check the flags and the cell, and decide what it ships; raises UsageError or CellSyntaxError."""
    from nbtrain.kernel import namespace as ns
    from nbtrain.rank import cell as rank_cell

    engine, cfg = check_flags(options)
    body, blank_lines = _strip_leading_blank_lines(cell)
    if not body.strip():
        raise UsageError(
            "%%distributed: the cell is empty; put the code to run on every rank below the %%distributed line."
        )
    # Blank lines in front keep the notebook's line numbers: line 1 is the %%distributed line.
    code = "\n" * (1 + blank_lines) + shell.transform_cell(body)
    filename = register_source(shell, line, cell)
    _check_syntax(code, filename, shell)
    user_ns = kernel_shell.user_namespace(shell)
    analysis = ns.analyse_cell(code, user_ns, kernel_shell.hidden_names(shell), raw_cell=body)
    shipped = {name: user_ns[name] for name in analysis.names}
    held = reach.find_held(shipped)
    auto = options.auto and not analysis.self_distributes
    spec = rank_cell.CellSpec(
        code=code,
        filename=filename,
        names=analysis.names,
        auto=auto,
        log_loss=auto and not analysis.calls_log,
        model_wrapper=cfg.strategy.model_wrapper,
        needs_shell=analysis.needs_shell,
        display_last=analysis.display_last,
        rng=records.rng_states(),
        held=tuple(h for h, _ in held),
    )
    total = infer_total_steps(code, analysis, spec, cfg, user_ns)
    record = CellRun(
        world_size=cfg.world_size, strategy=cfg.strategy.name, accelerator=cfg.plan.accelerator, total_steps=total
    )
    prepared = PreparedCell(cfg, spec, shipped, dict(analysis.used_by), record, total, engine)
    prepared.held = {h.label: obj for h, obj in held}
    record.derived = _derived_lengths(prepared, code)
    return prepared


def _derived_lengths(prepared: PreparedCell, code: str) -> list[str]:
    """What the notebook sized from a loader's length that each rank will not reach (see lengths.py)."""
    if not prepared.spec.auto or "torch.utils.data" not in sys.modules:
        return []
    from nbtrain.kernel import lengths

    try:
        wrapper = prepared.cfg.strategy.model_wrapper
        rebound = lengths.rebound_names(code)
        return lengths.derived_lengths(prepared.targets, prepared.cfg.world_size, wrapper, rebound)
    except Exception:  # noqa: BLE001 - a hint must never stop a cell
        return []


def infer_total_steps(
    code: str, analysis: Any, spec: Any, cfg: config.LaunchConfig, user_ns: dict[str, Any]
) -> int | None:
    """How many steps rank 0 will log (the live view's total), or None when that is not certain.

    The cell's loops are read by :mod:`nbtrain.cellplan`. A step is a ``.backward()`` when
    auto mode logs the loss, an ``nbtrain.log`` call when the cell logs itself. A
    DataLoader's length is the one each rank will see after auto mode prepared it
    (:func:`nbtrain.rank.loaders.batches_per_rank`), computed here from the kernel's loader:
    its share in a pass with gradients, all of it in a pass without (an evaluation pass).
    """
    from nbtrain import cellplan

    if spec.log_loss:
        kind, counting_name = cellplan.BACKWARD, "backward"
    elif analysis.calls_log:
        kind, counting_name = cellplan.LOG, "log"
    else:
        return None  # no step will be logged
    if counting_name in analysis.function_names:
        return None  # a notebook function the cell calls may advance the step too, unseen
    try:
        import nbtrain
        from nbtrain.rank import loaders

        names = [n for n in analysis.names if n not in analysis.function_writes]
        ints = {n: user_ns[n] for n in names if type(user_ns[n]) is int}
        lengths: dict[str, int] = {}
        eval_lengths: dict[str, int] = {}
        if "torch.utils.data" in sys.modules:  # no DataLoader can exist without it
            wrapper = cfg.strategy.model_wrapper if spec.auto else "none"  # not auto: loaders stay as they are
            objects = {n: user_ns[n] for n in names}
            lengths, eval_lengths = loaders.loader_lengths(objects, cfg.world_size, wrapper)
        counter = cellplan.StepCounter(
            kind,
            log_modules=frozenset(n for n in analysis.names if user_ns[n] is nbtrain),
            log_functions=frozenset(n for n in analysis.names if user_ns[n] is nbtrain.log),
        )
        return cellplan.total_steps(
            code, counter, ints=ints, lengths=lengths, eval_lengths=eval_lengths, kernel_globals=user_ns
        )
    except Exception:  # noqa: BLE001 - a progress total is a nicety: it must never stop a cell
        return None


def start_cell(shell: Any, prepared: PreparedCell, interactive: bool = True) -> Any:
    """Launch a prepared cell; the :class:`nbtrain.kernel.client.Run`. Explains what cannot travel.

    The engine and launch config planned from the flags are passed on: the hardware (or
    the cluster) is probed once per cell.
    """
    from nbtrain.kernel import client
    from nbtrain.kernel import namespace as ns
    from nbtrain.rank import cell as rank_cell

    try:
        ns.refuse_open_files(prepared.shipped, prepared.used_by)
        return client.start_on(
            prepared.engine if prepared.engine is not None else client.get_client(),
            prepared.cfg,
            rank_cell.run_cell,
            (prepared.spec, prepared.shipped, ns.anchor_function(kernel_shell.user_namespace(shell))),
            interactive=interactive,
        )
    except SerializationError as error:
        raise _plain(ns.explain_unpicklable(prepared.shipped, prepared.used_by) or error) from None
    except ConfigurationError as error:  # the run cannot fit in memory: refused before it started
        raise UsageError(f"%%distributed: {error}") from None


def run_distributed_cell(shell: Any, line: str, cell: str, options: CellOptions) -> Any:
    """Launch ``cell`` on the ranks, show its output, apply rank 0's results to the kernel.

    With ``--background`` it returns the run's :class:`nbtrain.kernel.background.BackgroundRun`
    at once; :mod:`nbtrain.kernel.background` then follows the run and applies its results
    with :func:`apply_cell_result`, as this function does for a blocking run.

    An interrupt at any moment either prevents the run or stops it, and ends the cell with
    :class:`RunInterrupted`; ``last_run`` is left in a final state. Until the launch, an
    interrupt raises where it lands (nothing has started); from the launch on, interrupts
    are held and acted on where that is safe (see :func:`nbtrain.processes.interrupts_held`).
    """
    try:
        stage: list[str] = []  # "finished" once the results are in
        return _run_cell(shell, line, cell, options, stage)
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


def _run_cell(shell: Any, line: str, cell: str, options: CellOptions, stage: list[str]) -> Any:
    planning = gcpause.hold_collections()  # until the run is sent (see gcpause); its own hold goes on
    try:
        prepared = prepare_cell(shell, line, cell, options)  # an interrupt here: nothing has started
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
    shell: Any, prepared: PreparedCell, options: CellOptions, held: processes.HeldInterrupts, planning: gcpause.Hold
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
        from nbtrain.kernel import background

        callbacks = background.CellCallbacks(
            keep_metrics=keep_metrics, explain_failure=explain_failure, apply_result=apply_cell_result,
            kept_error=kept_error,
        )
        handle = background.follow_cell(shell, run, prepared, options, callbacks)
        if held.received:  # the cell that starts it was interrupted: the run does not go on
            handle.stop("interrupted")
            raise _interrupted(prepared, run)
        return handle
    try:
        return _follow(shell, run, prepared, options, held, started)
    finally:
        record.seconds = time.monotonic() - started
        record.log_path = run.log_path if run.log_path and os.path.exists(run.log_path) else None


def _follow(
    shell: Any, run: Any, prepared: PreparedCell, options: CellOptions, held: processes.HeldInterrupts, started: float
) -> Any:
    """Show the run until it ends, then bring its results back; every check of ``held`` is a safe point."""
    record = prepared.record
    view: _CellView | None = None
    asked = False  # a first interrupt asked every rank to stop at a step
    if not held.received:
        show = _OutputPrinter(options.output, prepared.cfg.world_size, record)
        view = _CellView(run, prepared.total_steps, options.stall_warning)
        relay = _debugger_relay(run, held)
        for event in run.events(poll=view.poll_seconds):  # wakes at least every poll
            if held.received and not asked and options.on_stop == "keep":
                run.ask_to_stop("interrupted", graceful=True)  # the launcher stops hard if it cannot
                asked, held.received = True, False
            if held.received or (asked and time.monotonic() > (run.stop_deadline() or 0.0)):
                break  # a second interrupt, or a launcher that did not answer: stop hard, now
            if event is not None:
                show(event)
            view.show(event)
            relay.handle(event)  # a rank's pdb: its output, and its prompt in the input box
    if held.received or view is None or run.state == "running":  # view is None only when the interrupt came first
        run.abandon()  # stops the run and frees any result it brought back
        _stopped_hard(record, view)
        raise _interrupted(prepared, run, "stopped hard at once (a second interrupt)" if asked else "")
    if run.stopped_at is not None:
        record.seconds = time.monotonic() - started  # the summary states it
        raise _kept(shell, run, prepared, options, view, asked)
    try:
        result = run.result()
    except RunFailedError as error:
        record.state = run.state
        view.finish(run.state)
        if asked:  # the interrupt's stop could not keep the state: the launcher said why
            _stopped_hard(record, None)
            raise _interrupted(prepared, run, run.stop_note) from None
        raise explain_failure(error, shell, prepared.unchanged) from None
    record.state = events.FINISHED
    record.seconds = time.monotonic() - started  # the summary _bring_back prints states it
    record.log_path = run.log_path if run.log_path and os.path.exists(run.log_path) else None  # and names it
    view.finish(events.FINISHED)
    value = _bring_back(shell, result, prepared.targets, record, options.output)
    if held.received or asked:  # it came while the results went in, or as the run finished: they are in, all of them
        raise RunInterrupted(_LATE)
    return value


def _debugger_relay(run: Any, held: processes.HeldInterrupts) -> Any:
    from nbtrain.kernel import debugger

    run.prompts_answered = True
    return debugger.CellRelay(run, held)


def _interrupted(prepared: PreparedCell, run: Any, how: str = "") -> RunInterrupted:
    where = run.where_ranks_were()  # each rank's stack when it was stopped, if the launcher got one
    if how.startswith("stopped hard"):  # "stopped hard (rank 1 did not reach step 412 within 2.0 s); nothing ..."
        unchanged = prepared.unchanged
        text = f"the cell was interrupted and {how}; {unchanged[0].lower()}{unchanged[1:]} The kernel is ready."
    else:  # as an interrupt always said; then why no step was kept, if one was asked for
        text = f"the cell was interrupted and every rank was stopped. {prepared.unchanged} The kernel is ready."
        text += f" {how}" if how else ""
    return RunInterrupted(text + (f"\n{where}" if where else ""))


def _stopped_hard(record: CellRun, view: _CellView | None) -> None:
    record.state = events.STOPPED
    record.stopped = "hard"
    if view is not None:
        view.finish(events.STOPPED)


def _kept(
    shell: Any, run: Any, prepared: PreparedCell, options: CellOptions, view: _CellView, interrupted: bool
) -> BaseException:
    """A stop kept the state at a step: bring it back as after a finished run; the error the cell raises."""
    record = prepared.record
    result = run.result()
    record.state, record.stopped_at, record.stopped = run.state, run.stopped_at, "at a step"
    record.log_path = run.log_path if run.log_path and os.path.exists(run.log_path) else None
    view.finish(run.state)
    _bring_back(shell, result, prepared.targets, record, options.output)
    if interrupted:
        message = kept_message(run.stopped_at, record.updated, prepared.targets)
        return RunInterrupted(f"the cell was interrupted and {message} The kernel is ready.")
    return kept_error(run, record.updated, prepared.targets)


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


@dataclass
class Applied:
    """What applying rank 0's results did: the cell's shown value and what to tell the user."""

    value: tuple[Any] | None = None  # (the value of the cell's last expression,) or None
    warnings: list[str] = field(default_factory=list)  # each shown as "nbtrain <warning>"
    loaded: bool = False  # False: nothing in the kernel changed

    @property
    def shown(self) -> Any:
        return self.value[0] if self.value else None


def apply_cell_result(shell: Any, result: Any, shipped: dict[str, Any], record: CellRun) -> Applied:
    """Put rank 0's results into the kernel's objects; fills ``record`` (updated, skipped).

    The one place a cell's results reach the kernel, for blocking and background runs
    alike. Call it on the kernel's main thread: it writes the user's namespace.
    """
    from nbtrain.kernel import namespace as ns

    if result is None:  # the cell ran, but rank 0 sent nothing (it should always send something)
        return Applied()
    try:
        outcome = ns.decode_result(result, shipped, kernel_shell.user_namespace(shell))
    except Exception as error:  # noqa: BLE001 - the values are unusable; the kernel keeps its own
        return Applied(
            warnings=[f"rank 0's results could not be loaded in the kernel ({error}); nothing in the kernel changed."]
        )
    with kernel_shell.interrupts_deferred():  # all of it or, if interrupted before, none of it
        report = ns.apply_result(outcome, shipped, kernel_shell.user_namespace(shell), result.deleted)
    record.prepared = list(result.prepared)
    record.loaders = list(result.loaders)
    record.updated = report.updated + [f"del {n}" for n in report.deleted]
    record.skipped = list(result.skipped) + report.skipped
    warnings = [f"note: {note}" for note in result.notes]
    if record.skipped:
        described = ", ".join(f"{name} ({kind}: {why})" for name, kind, why in record.skipped)
        warnings.append(f"warning: not brought back to the kernel, so they keep their old values there: {described}.")
    return Applied(outcome.get("display"), warnings, loaded=True)


def _bring_back(shell: Any, result: Any, shipped: dict[str, Any], record: CellRun, output: str) -> Any:
    applied = apply_cell_result(shell, result, shipped, record)
    for warning in applied.warnings:
        _warn(warning)
    if applied.loaded and output != "none":
        print(_summary(record))
    return applied.shown


def _summary(record: CellRun) -> str:
    ranks = f"{record.world_size} rank{'s' if record.world_size != 1 else ''}"
    ended = "finished" if record.stopped_at is None else f"{record.state} at step {record.stopped_at}"
    text = f"nbtrain: {ranks} ({record.accelerator}, {record.strategy}) {ended} in {record.seconds:.1f} s."
    loaders = dict(record.loaders)
    left = [(name, how) for name, how in record.prepared if how.startswith("not prepared")]
    wrapped = [  # "model (DistributedDataParallel)", or "model: on cuda:0, not wrapped (one rank)"
        f"{name}: {how}" if how.startswith("on ") else f"{name} ({how})"
        for name, how in record.prepared
        if how not in ("moved", "bound") and name not in loaders and (name, how) not in left
    ]
    if wrapped:
        text += f" Auto-prepared: {', '.join(wrapped)}."
    if left:  # e.g. "trainer.models[0]: not prepared (a tuple cannot hold another object; ...)"
        text += " " + "; ".join(f"{name}: {how}" for name, how in left) + "."
    if loaders:  # e.g. "test_loader: evaluated whole on every rank (iterated without gradients)"
        text += " " + "; ".join(f"{name}: {how}" for name, how in loaders.items()) + "."
    if record.updated:
        text += f" Updated in the kernel: {', '.join(record.updated)}."
    for sentence in record.derived:  # "lr_scheduler expects 240 steps; each rank runs 120 (...): ..."
        text += f" {sentence}."
    if record.log_path:
        text += f" Full output: {record.log_path}"
    return text


class _CellView:
    """The run's live view (status, progress, charts) above the cell's printed output.

    Rank prints are printed by _OutputPrinter in every frontend; the text view of a
    terminal would print them again, so it gets every event but those.
    """

    def __init__(self, run: Any, total_steps: int | None = None, stall_warning: float | None = runstate.STALL_SECONDS):
        from nbtrain.kernel import display

        # The cell's stream lines (_OutputPrinter) are where rank output goes: the whole of it,
        # kept in the saved notebook, chosen by --output. The view shows no second copy.
        self.view = display.LiveView(
            run.config, total_steps=total_steps, stall_warning=stall_warning, show_logs=False
        )
        self.poll_seconds = display.FASTEST_FRAME_SECONDS / 2
        self.view.refresh(force=True)

    def show(self, event: Any) -> None:
        if self.view.rich or not isinstance(event, events.Output):
            self.view.handle(event)
        # A prompt blocks the cell's thread: "rank 1 in the debugger" must be drawn first.
        self.view.refresh(force=isinstance(event, (events.DebugPrompt, events.DebugEnded)))

    def finish(self, state: str) -> None:
        self.view.finish(state)


def keep_metrics(record: CellRun, event: events.Metrics) -> None:
    """Keep the rows a rank logged in ``record`` (the last METRIC_ROWS per rank)."""
    rows = record.metrics.setdefault(event.rank, collections.deque(maxlen=METRIC_ROWS))
    rows.extend(event.rows)


class _OutputPrinter:
    """Shows rank output in the cell as it arrives; keeps logged metrics for ``last_run``."""

    def __init__(self, mode: str, world_size: int, record: CellRun):
        self.mode = mode
        self.tagged = mode == "all" and world_size > 1
        self.record = record

    def __call__(self, event: Any) -> None:
        if isinstance(event, events.Metrics):
            keep_metrics(self.record, event)
        elif isinstance(event, events.Output):
            if self.mode == "none" or (self.mode == "rank0" and event.rank != 0):
                return
            stream = sys.stderr if event.stream == "stderr" else sys.stdout
            text = event.text
            if self.tagged:
                text = "".join(f"{event.tag} {line}" for line in text.splitlines(keepends=True))
            stream.write(text)
            stream.flush()


# -- errors --------------------------------------------------------------------------------


def _plain(error: BaseException) -> BaseException:
    """Make IPython show ``error`` as its one message, without our frames."""
    if not hasattr(error, "_render_traceback_"):
        message = f"{type(error).__name__}: {error}"
        error._render_traceback_ = lambda: [message]  # type: ignore[attr-defined]  # IPython's hook, on any error
    return error


def _unchanged_note(shipped: dict[str, Any]) -> str:
    names = [n for n, v in shipped.items() if not callable(v) or hasattr(v, "state_dict")]
    names = [n for n in names if type(shipped[n]).__name__ != "module"]
    if not names:
        return "Nothing in the kernel was changed."
    listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    verb = "is as it was" if len(names) == 1 else "are as they were"
    return f"Nothing in the kernel was changed: {listed} {verb} before the cell."


def explain_failure(error: RunFailedError, shell: Any, note: str) -> BaseException:
    """The run's failure as the notebook shows it: rank tracebacks name cells, plus ``note``."""
    if isinstance(error, RankError):
        text = cell_traceback(error.remote_traceback, shell)
        note = " ".join(part for part in (device_hint(error.exc_message), note) if part)
        note += f"\n{error.note}" if error.note else ""  # the held rank's %nbtrain_debug
        return RankError(error.rank, error.exc_type, error.exc_message, text, note, node=error.node)
    where = getattr(error, "where", "")
    message = f"{error.headline or error} {note}" + (f"\n{where}" if where else "")
    error.args = (message,)  # RunFailedError._render_traceback_ shows it
    return error


_DEVICE_MISMATCH = ("Expected all tensors to be on the same device", "found at least two devices")


def device_hint(message: str) -> str:
    """What to do when a rank mixed devices: the commonest first error of a CUDA cell.

    >>> device_hint("Expected all tensors to be on the same device, but found at least two devices")[:40]
    'Each rank computes on its own device (nb'
    >>> device_hint("bad batch")
    ''
    """
    if not any(marker in message for marker in _DEVICE_MISMATCH):
        return ""
    return (
        "Each rank computes on its own device (nbtrain.device()): auto mode moved the model there, and "
        "what is passed to it, but other tensors made in the kernel (a target, say) stay where they were "
        "made. Move them with `.to(nbtrain.device())`, or iterate a DataLoader, whose batches auto mode "
        "moves for you."
    )


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def cell_traceback(text: str, shell: Any) -> str:
    """Name notebook cells as IPython does: ``File "/tmp/ipykernel_1/23.py", line 4`` -> ``Cell In[7], line 4``."""
    names = kernel_shell.cell_filenames(shell)

    def rename(match: re.Match[str]) -> str:
        number = names.get(match.group(1))
        return match.group(0) if number is None else f"Cell In[{number}], line {match.group(2)}"

    return _FRAME.sub(rename, text)


def _check_syntax(code: str, filename: str, shell: Any) -> None:
    import traceback

    try:
        compile(code, filename, "exec")
    except SyntaxError as error:
        text = cell_traceback("".join(traceback.format_exception_only(type(error), error)), shell)
        raise CellSyntaxError(text) from None


class CellSyntaxError(NbtrainError):
    """The cell does not compile: shown as Python shows a SyntaxError, at the cell's own line.

    Not a SyntaxError subclass: IPython would show one with nbtrain's frames around it.
    """

    def __init__(self, text: str):
        Exception.__init__(self, text)

    def _render_traceback_(self) -> list[str]:
        return str(self).rstrip().splitlines()


# -- helpers -------------------------------------------------------------------------------


def register_source(shell: Any, line: str, cell: str) -> str:
    """Register the cell, as the user wrote it, in linecache; return the filename to compile with.

    The engine ships the kernel's in-memory linecache entries to the ranks, so a rank's
    traceback shows the cell's own lines. IPython's compiler also remembers the cell's
    number for the name, which :func:`cell_traceback` uses.
    """
    source = f"%%distributed {line}".rstrip() + "\n" + cell
    return kernel_shell.register_source(shell, source)


def _strip_leading_blank_lines(cell: str) -> tuple[str, int]:
    lines = cell.splitlines(keepends=True)
    count = 0
    while count < len(lines) and not lines[count].strip():
        count += 1
    return "".join(lines[count:]), count


def _warn(text: str) -> None:
    sys.stderr.write(f"nbtrain {text}\n")
    sys.stderr.flush()
