"""The caller's side of a launch: ``nbtrain.launch`` / ``nbtrain.start`` and the payload they send.

A launch is planned (this machine's launcher, or a cluster's agents, and the launch
config), admitted (the memory it needs), serialised (the function, its arguments and
their tensors) and sent to its engine as one ``StartRun``; the :class:`Run` it returns
(:mod:`nbtrain.kernel.run_handle`) follows it. The connection to this machine's launcher
is :mod:`nbtrain.kernel.launcher_connection`.

The ``StartRun`` carries the pickle, the run's ``RankSettings``, the caller's environment, cwd,
``sys.path`` and logging set-up, the notebook's imports its engine was not sent before, and the
cell sources new since the last run: each cell's source goes to this machine's launcher once
(``LauncherClient.sources_sent``), which installs them in its linecache for every rank it forks
(after 500 cells, sending them all took a re-run's first line from ~25 to ~60 ms); a cluster's
agents get the whole set with every run. A caller that never imported torch cannot be sending a
tensor: it uses plain cloudpickle and does not import torch. RNG states travel as bytes, so a
cell that ships no tensor needs no memfd.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import sys
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from nbtrain.errors import SerializationError
from nbtrain.kernel import compat, gcpause
from nbtrain.kernel.launcher_connection import LauncherClient, get_client, standby_pids
from nbtrain.kernel.run_handle import Engine, Run
from nbtrain.messages import events, logsetup, torchsettings
from nbtrain.planning import config as config_module
from nbtrain.system import processes

if TYPE_CHECKING:
    from nbtrain.options import LaunchOptions

LOG_DIR_VARIABLE = "NBTRAIN_LOG_DIR"  # where runs' log files go (default ~/.cache/nbtrain/logs)
_SOURCE_LINES_LIMIT = 4 << 20  # bytes of notebook source sent for tracebacks


def start(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    config: config_module.LaunchConfig | None = None,
    **options: Any,
) -> Run:
    """Start ``fn(*args, **kwargs)`` on every rank and return the :class:`Run` at once.

    ``options`` are the launch options ``nbtrain.launch`` takes (the fields of
    :class:`nbtrain.options.LaunchOptions` that ``nbtrain.options.keywords()`` lists), over
    its built-in defaults. Refused before anything starts (ConfigurationError) when the run
    cannot fit: more CPU processes than 4 per core (unless ``oversubscribe=True``), or more
    memory than is free. A caller that
    already built this machine's launch configuration passes it as ``config``: the options
    are then not read, and the hardware is not probed again. ``cluster="ray"`` (or a Ray
    address) runs on ``num_nodes`` nodes of a Ray cluster with ``devices`` ranks on each
    (:mod:`nbtrain.cluster`); the default runs on this machine.
    """
    # deferred: start-up time
    from nbtrain.kernel import launchplan

    with gcpause.held():  # planning too: a collection here would delay every rank the same
        launch_options = _launch_options(options)
        if config is not None and launch_options.on_this_machine:
            engine, cfg = None, config
        else:
            engine, cfg = launchplan.plan_run(launch_options)
        return start_on(engine or get_client(), cfg, fn, args, kwargs)


def _launch_options(given: dict[str, Any]) -> LaunchOptions:
    """The :class:`nbtrain.options.LaunchOptions` of ``launch``/``start`` keywords, over the built-in defaults."""
    # deferred: start-up time
    from nbtrain import options as options_module

    unknown = sorted(set(given) - options_module.keywords())
    if unknown:
        known = ", ".join(sorted(options_module.keywords()))
        raise TypeError(f"start() got an unexpected keyword argument {unknown[0]!r}; its launch options are {known}.")
    return options_module.LaunchOptions().merged(given)


def start_on(
    engine: Engine,
    cfg: config_module.LaunchConfig,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    interactive: bool = True,
) -> Run:
    """Start ``fn(*args, **kwargs)`` on an engine chosen with its plan already (the magic plans a cell's run once).

    ``engine`` is this machine's launcher (:func:`get_client`) or a cluster's warm client
    (:func:`nbtrain.kernel.launchplan.plan_run`, which also gives ``cfg``). ``interactive``
    False (a background run): a breakpoint in a rank is passed, and a failed rank not held.
    """
    local = isinstance(engine, LauncherClient)
    if isinstance(engine, LauncherClient):  # a cluster's own checks list its nodes instead
        _admit(cfg, fn, args, kwargs)
        _say_held_released(engine)
    hold = gcpause.hold_collections()  # no full collection between the call and the ranks' start
    try:
        payload, tensor_fd = _serialise(fn, args, kwargs)
        try:
            known = engine.sources_sent if isinstance(engine, LauncherClient) else ()
            modules_known = engine.modules_sent if isinstance(engine, LauncherClient) else ()
            logging_setup = logsetup.capture(engine.libraries_logging if isinstance(engine, LauncherClient) else None)
            start_message = _StartMessage(
                cfg, payload, tensor_fd is not None, with_log=local, interactive=interactive, known_sources=known,
                logging_setup=logging_setup, known_modules=modules_known,
            )
            run = _submit(engine, start_message, tensor_fd)
        finally:
            if tensor_fd is not None:
                os.close(tensor_fd)
    except BaseException:
        hold.release()
        raise
    run.hold_collections_until_started(hold)
    return run


def _say_held_released(client: LauncherClient) -> None:
    """The launcher releases a rank held for a post-mortem when a run starts: say so here."""
    held = client.held
    if held is not None:
        client.held = None
        # deferred: start-up time
        from nbtrain.kernel.display import owntext

        owntext.print_warning(
            f"nbtrain: rank {held.rank} of the failed run before, held for %nbtrain_debug, is released: "
            "this launch needs its devices and memory."
        )


def _serialise(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[bytes, int | None]:
    """The run's payload (and the memfd of its tensors), or a SerializationError saying what to do."""

    try:
        return _pickle_payload((fn, tuple(args), dict(kwargs or {})))
    except Exception as error:
        raise SerializationError(
            f"the function or its arguments cannot be sent to the ranks: {error}. "
            "Objects such as open files, locks, sockets and generators cannot travel; "
            "create them inside the function instead."
        ) from error


class _StartMessage:
    """Builds a run's ``StartRun`` once the engine has given it an id, and keeps the log file it named."""

    def __init__(
        self, cfg: config_module.LaunchConfig, payload: bytes, has_tensor_file: bool, with_log: bool,
        interactive: bool = True,
        known_sources: Collection[str] = (),
        logging_setup: logsetup.LoggingSetup | None = None,
        known_modules: Collection[str] = (),
    ) -> None:
        # deferred: start-up time
        from nbtrain.kernel import defaults, importedmodules
        from nbtrain.kernel import shell as kernel_shell
        from nbtrain.planning import probe

        self.interactive = interactive and with_log  # a cluster's agents relay no prompt (docs/cluster.md)
        # A cluster's ranks cannot be held (docs/cluster.md, its limits); a background run's failure
        # is read later, and a script (no IPython) has no %nbtrain_debug: they hold none.
        held = self.interactive and kernel_shell.get_shell() is not None
        # Every setting a rank reads (the one place that makes it): the plan's record, with what this
        # machine (its cores) and this session (a hold) decide.
        threads = config_module.intra_op_threads(probe.physical_core_count(), cfg.world_size, os.environ)
        hold = defaults.get_defaults().debug_hold if held else None
        self.rank_settings = dataclasses.replace(cfg.rank, threads_per_rank=threads, debug_hold=hold)
        self.standby_seconds = defaults.get_defaults().standby_idle or None

        self.cfg = cfg
        self.payload = payload
        self.has_tensor_file = has_tensor_file
        self.with_log = with_log  # a cluster's agents keep their own logs
        self.log_path: str | None = None
        # Cells whose lines the engine has (this machine's launcher keeps what it was sent):
        # a long session's hundreds of cells are not pickled and sent again with every run.
        self.known_sources = known_sources
        self.logging_setup = logging_setup or logsetup.LoggingSetup()
        # The notebook's imports the engine was not sent before: its ranks import the whole list before the payload.
        imported = importedmodules.notebook_modules(kernel_shell.get_shell())
        self.notebook_modules = importedmodules.not_sent(imported, known_modules)

    def __call__(self, run_id: int) -> events.StartRun:
        cfg = self.cfg
        self.log_path = _log_path(run_id) if self.with_log else None
        return events.StartRun(
            run_id=run_id,
            payload=self.payload,
            ranks=cfg.rank_specs(),
            start_method=cfg.strategy.start_method,
            environ=processes.inherited_environment(os.environ),
            cwd=os.getcwd(),
            sys_path=tuple(sys.path),
            source_lines=_notebook_source_lines(self.known_sources),
            timeout=cfg.timeout,
            has_tensor_file=self.has_tensor_file,
            strategy=cfg.strategy.name,
            log_path=self.log_path,
            interactive=self.interactive,
            standby_seconds=self.standby_seconds,
            on_stop=cfg.on_stop,
            stop_grace=cfg.stop_grace,
            stall_seconds=cfg.stall_seconds,
            logging_setup=self.logging_setup,
            torch_settings=torchsettings.changed_from_defaults(),
            notebook_modules=self.notebook_modules,
            rank_settings=self.rank_settings,  # every setting a rank reads (nbtrain.rank.machinery.settings)
        )


def _submit(client: Engine, start_message: _StartMessage, tensor_fd: int | None) -> Run:
    """Send the run to its engine and return its handle; an interrupt meanwhile stops it and is raised after."""
    # Held: an interrupt half way through sending StartRun would garble the channel, and
    # one between the send and the handle would leave a run nobody can stop.
    if isinstance(client, LauncherClient):
        client.wait_usable()  # before the hold: an interrupt may cut this wait short
    with processes.interrupts_held() as held:
        run_id, inbox = client.submit(start_message, tensor_fd)
        run = Run(client, run_id, inbox, start_message.cfg, start_message.log_path)
    if held.received:  # the caller was interrupted as the run started: it does not go on
        run.abandon()
        raise KeyboardInterrupt
    return run


def launch(fn: Callable[..., Any], *args: Any, background: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank; return rank 0's return value.

    ``fn`` may be a lambda, a closure or a function defined in the notebook: it travels
    with cloudpickle. Each rank's prints appear here, tagged with the rank. A failure in
    any rank stops all of them and raises here (:class:`nbtrain.errors.RankError`).

    Keywords that name a launch option (a field of :class:`nbtrain.options.LaunchOptions`
    that ``nbtrain.options.keywords()`` lists: ``devices``, ``accelerator``, ``strategy``,
    ``timeout``, ...) set it, over the built-in defaults (not the session's, which are the
    cells'); every other keyword goes to ``fn``. Each takes what its ``%%distributed`` flag
    does (``%%distributed --help``; docs/magic.md, "Session defaults").

    ``cluster="ray", num_nodes=2`` runs on two nodes of a Ray cluster (``RAY_ADDRESS``, the
    cluster this machine belongs to, or an address given instead of ``"ray"``), ``devices``
    ranks on each; rank 0's result comes back here all the same.

    ``background=True`` returns at once with a
    :class:`nbtrain.kernel.background.BackgroundRun` (``wait()``, ``stop()``, ``result``,
    ``state``; ``nbtrain.runs()`` lists them); in a notebook its live view, with a Stop
    button, keeps updating while other cells run.

    Example:
        >>> import nbtrain, torch.distributed as dist
        >>> nbtrain.launch(lambda: dist.get_world_size(), devices=2, accelerator="cpu")
        2
    """
    # deferred: start-up time
    from nbtrain import options as options_module

    names = options_module.keywords()
    launch_options = {name: value for name, value in kwargs.items() if name in names}
    fn_kwargs = {name: value for name, value in kwargs.items() if name not in names}
    run = start(fn, args, fn_kwargs, **launch_options)
    try:
        if background:
            # deferred: start-up time
            from nbtrain.kernel import background as _background

            return _background.follow_function(run, fn)
        return _wait_printing(run)
    except KeyboardInterrupt:
        run.abandon()  # wait() did already; not so an interrupt before it, or in follow_function
        raise


def _wait_printing(run: Run) -> Any:
    """Wait for ``run``, printing the ranks' output as a cell does and answering their pdb prompts
    in the input box (an interrupt there stops the run)."""
    # deferred: start-up time
    from nbtrain.kernel import display, pdb_relay

    relay = pdb_relay.CellRelay(run, processes.HeldInterrupts())
    printer = display.OutputPrinter("all", run.config.world_size)
    run.prompts_answered = True

    def on_event(event: Any) -> None:
        if not relay.handle(event):
            printer(event)
        if relay.held.received:
            raise KeyboardInterrupt

    try:
        return run.wait(on_event=on_event)
    finally:
        printer.finish()  # a bar left mid-line, an open line: before the result or the error


def _admit(
    cfg: config_module.LaunchConfig, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> None:
    """Refuse a run whose memory cannot fit (ConfigurationError); warn on stderr when it comes close."""
    # deferred: start-up time
    from nbtrain.planning import admission, probe

    namespace = getattr(fn, "__globals__", {})
    referenced = [namespace.get(name) for name in getattr(getattr(fn, "__code__", None), "co_names", ())]
    closure = [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _has_contents(cell)]
    need = admission.weigh([*args, *(kwargs or {}).values(), *closure, *referenced])
    gpu_free = None
    if cfg.plan.accelerator == "cuda":
        gpu_free = {gpu.index: gpu.free_bytes for gpu in probe.detect_gpus() if gpu.index in cfg.plan.device_ids}
        # The run takes the standby ranks or ends them first: their memory is the run's. (gpu_usage
        # numbers GPUs as NVML does, which is torch's numbering only without CUDA_VISIBLE_DEVICES.)
        standby = standby_pids() if "CUDA_VISIBLE_DEVICES" not in os.environ else set()
        for usage in probe.gpu_usage() if standby else ():
            if usage.index in gpu_free:
                gpu_free[usage.index] += sum(used for pid, used in usage.process_bytes.items() if pid in standby)
    warning = admission.check_memory(
        need,
        world_size=cfg.world_size,
        accelerator=cfg.plan.accelerator,
        sharded=cfg.strategy.model_wrapper in ("fsdp", "fsdp_offload"),
        start_method=cfg.strategy.start_method,
        host_available=probe.available_memory(),
        gpu_free=gpu_free,
    )
    if warning:
        # deferred: start-up time
        from nbtrain.kernel.display import owntext

        owntext.print_warning(f"nbtrain warning: {warning}")


def _has_contents(cell: Any) -> bool:
    try:
        _ = cell.cell_contents  # raises for an empty cell
    except ValueError:  # a closure variable not bound yet
        return False
    return True


def _log_path(run_id: int) -> str | None:
    """A new run's log file (created by the launcher at its first line, which prunes old ones as the run ends)."""
    directory = os.environ.get(LOG_DIR_VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nbtrain", "logs"
    )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return None  # no writable place: the run goes on without a log
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(directory, f"run-{stamp}-{os.getpid()}-{run_id}.log")


def _pickle_payload(payload: Any) -> tuple[bytes, int | None]:
    """cloudpickle, with tensors through shared memory (see :mod:`nbtrain.messages.sharedtensors`).

    A caller that never imported torch cannot be sending a tensor: plain cloudpickle then
    spares its first launch the ~1 s import of torch.
    """
    if "torch" not in sys.modules:
        # deferred: start-up time (cloudpickle)
        from nbtrain.messages import codepickle

        return codepickle.dumps_keeping_filenames(payload), None
    # deferred: start-up time (cloudpickle, torch)
    from nbtrain.messages import sharedtensors

    return sharedtensors.dumps_to_shared_memory(payload)


def _notebook_source_lines(known: Collection[str] = ()) -> dict[str, tuple[str, ...]]:
    """Source of code that exists only in this process (notebook cells), for tracebacks; ``known``: already sent."""
    lines: dict[str, tuple[str, ...]] = {}
    size = 0
    for filename, entry in list(linecache.cache.items()):
        if filename in known:
            continue
        if len(entry) == 4 and compat.only_in_memory(filename, entry) and size < _SOURCE_LINES_LIMIT:
            lines[filename] = tuple(entry[2])
            size += entry[0]
    return lines
