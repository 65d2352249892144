"""``%%distributed``: run a notebook cell on N ranks and bring its results back into the kernel.

``%load_ext nbtrain`` registers it. Then, with ``model``, ``opt`` and ``loader`` defined in
earlier cells::

    %%distributed --devices 2
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()

trains data-parallel on two ranks, and afterwards the kernel's ``model`` (the same
object) holds rank 0's trained weights. This module owns the magic and its registration,
and its flags (parsed once into a :class:`CellOptions`, planned once into the launch
config). Running the cell is :mod:`nbtrain.kernel.cellrun`; what it writes in the cell is
:mod:`nbtrain.kernel.display`; a failure's wording is :mod:`nbtrain.kernel.tracebacks`.
What travels and what comes back is decided in :mod:`nbtrain.kernel.namespace`; what runs
on a rank is :mod:`nbtrain.rank.cell`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from dataclasses import dataclass
from typing import Any

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbtrain import charts, config
from nbtrain.errors import ClusterError, ConfigurationError, RankError
from nbtrain.kernel import cellrun, launcher_connection, pdb_relay
from nbtrain.kernel.display import cellout

OUTPUT_MODES = ("all", "rank0", "none")


class _SessionDefault:
    """--timeout was not given: the session's default applies (None there means no limit)."""

    def __repr__(self) -> str:
        return "<the session default>"


_SESSION: Any = _SessionDefault()


def _num_nodes_flag(text: str) -> int:
    # ArgumentTypeError: argparse shows its text (a ValueError's would become "invalid value").
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-nodes takes a whole number of nodes, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--num-nodes takes a positive number of nodes, not {text!r}")
    return value


def _timeout_flag(text: str) -> float | None:
    """``--timeout``: seconds, or ``none`` for no limit (over a session default that has one)."""
    if text.strip().lower() in ("none", "off"):
        return None
    return float(text)


_timeout_flag.__name__ = "float"  # argparse names the type in its message: "invalid float value: 'soon'"


@magics_class
class DistributedMagics(Magics):
    """The ``%%distributed`` cell magic."""

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("-h", "--help", action="store_true", help="Show this help and do not run the cell.")
    @magic_arguments.argument(
        "--devices",
        default=None,
        help="How many ranks, or which GPUs: 2, -1 (every GPU or core), auto (every GPU, else 1), 0,2, "
        "free:2 (2 GPUs no other process uses, most free memory first; NVML). "
        "Default: the session default (auto unless nbtrain.set_defaults or nbtrain.launcher() changed it).",
    )
    @magic_arguments.argument(
        "--accelerator",
        default=None,
        help="auto (CUDA, then MPS, then CPU), cpu, cuda (or gpu), mps. Default: the session default (auto).",
    )
    @magic_arguments.argument(
        "--strategy",
        default=None,
        help="ddp_notebook, ddp_spawn, ddp_find_unused_parameters_true, ddp_sharded, fsdp, fsdp_cpu_offload, dp"
        " or auto: see Strategies above. Default: the session default (ddp_notebook).",
    )
    @magic_arguments.argument(
        "--timeout",
        type=_timeout_flag,
        default=_SESSION,
        help="Stop every rank after this many seconds; none: no limit. Default: the session default (no limit).",
    )
    @magic_arguments.argument(
        "--on-stop",
        default=None,
        choices=("keep", "discard"),
        help="What an interrupt, a Stop or --timeout does: keep (every rank ends at the last optimizer step "
        "they all reach, and the kernel's objects hold that step) or discard (every rank stops at once; the "
        "kernel keeps what it had). Default: the session default (keep).",
    )
    @magic_arguments.argument(
        "--stall-warning",
        type=_timeout_flag,
        default=_SESSION,
        help="The live view names a rank that logged no step for this many seconds while it "
        "runs; none: never. Default: the session default (30).",
    )
    @magic_arguments.argument(
        "--output",
        default="all",
        choices=OUTPUT_MODES,
        help="Whose prints show: all (each line tagged [rank N]), rank0 (rank 0's, untagged), none. Default: all.",
    )
    @magic_arguments.argument(
        "--no-auto",
        dest="auto",
        action="store_false",
        help="Do not prepare the kernel's models, optimizers and loaders, nor log the loss: the cell does it all.",
    )
    @magic_arguments.argument(
        "--precision",
        default=None,
        help="32-true (32), 64-true, 16-mixed (16), bf16-mixed (bf16), 16-true, bf16-true: mixed runs the "
        "prepared model's forward under autocast (16-mixed on CUDA also scales the loss); -true casts the "
        "model on the ranks. The kernel's objects keep their dtype. Default: the session default (32-true).",
    )
    @magic_arguments.argument(
        "--sync-batchnorm",
        action="store_true",
        default=None,
        help="Compute BatchNorm statistics over every rank's batch (SyncBatchNorm on the ranks; "
        "the kernel's model keeps plain BatchNorm and gets the synced running statistics). "
        "Default: the session default (off).",
    )
    @magic_arguments.argument(
        "--no-sync-batchnorm",
        dest="sync_batchnorm",
        action="store_false",
        default=None,
        help="Plain BatchNorm on each rank, over a session default of --sync-batchnorm.",
    )
    @magic_arguments.argument(
        "--backend",
        default=None,
        help="Process-group backend: gloo, nccl, mpi or cpu:gloo,cuda:nccl. Default: the session default "
        "(gloo on CPU, nccl on CUDA).",
    )
    @magic_arguments.argument(
        "--allow-oversubscribe",
        action="store_true",
        help="Allow more CPU processes than 4 per core (refused otherwise, as a likely typo).",
    )
    @magic_arguments.argument(
        "--cluster",
        default=None,
        help="Where the ranks run: local (this machine), ray (the Ray cluster in RAY_ADDRESS, or the one "
        "this machine belongs to), or a Ray address (ray://host:10001, host:6379). Default: the session "
        "default (local).",
    )
    @magic_arguments.argument(
        "--num-nodes",
        type=_num_nodes_flag,
        default=None,
        help="With --cluster: how many nodes the run spans; --devices ranks on each. Default: the session "
        "default (1).",
    )
    @magic_arguments.argument(
        "--background",
        action="store_true",
        help="Return at once with a handle (nbtrain.runs() lists them) while the run goes on; "
        "the live view keeps updating and has a Stop button. The kernel's objects are updated when it finishes.",
    )
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
            cellout.print_line(help_text(self.distributed))
            return None
        return cellrun.run_distributed_cell(self.shell, line, cell, options, check_flags)

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
    try:
        pdb_relay.post_mortem(launcher_connection.current_client())
    except pdb_relay.NoRankHeldError as error:
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
        error = getattr(sys, "last_value", None)
        held = getattr(launcher_connection.current_client(), "held", None)
        if not line.strip() and isinstance(error, RankError) and held is not None and held.rank == error.rank:
            return nbtrain_debug()
        return original(line, local_ns=local_ns)

    debug.needs_local_scope = True  # type: ignore[attr-defined]  # IPython's flag, as on its own %debug
    debug.nbtrain_wrapped = True  # type: ignore[attr-defined]  # a second %load_ext does not wrap twice
    debug.__doc__ = original.__doc__
    return debug


@dataclass(frozen=True)
class CellOptions:
    """The flags of one ``%%distributed`` line, session defaults filled in (see :func:`parse_flags`)."""

    devices: Any = "auto"  # as --devices or nbtrain.set_defaults gave it: 2, "0,2", "auto", [0, 2]
    accelerator: str = "auto"
    strategy: str = "ddp_notebook"
    timeout: float | None = None  # seconds; None: no limit
    stall_warning: float | None = charts.STALL_SECONDS  # seconds without a step before the view warns; None: never
    output: str = "all"  # one of OUTPUT_MODES
    auto: bool = True  # prepare the kernel's models, optimizers and loaders, and log the loss
    precision: str = "32-true"
    sync_batchnorm: bool = False
    backend: str | None = None  # None: gloo on CPU, nccl on CUDA
    cluster: str | None = None  # None or "local": this machine; "ray" or a Ray address
    num_nodes: int | None = None  # with a cluster: nodes the run spans
    allow_oversubscribe: bool = False
    background: bool = False
    help: bool = False
    on_stop: str = "keep"  # "keep" the state at a step when stopped, or "discard" it
    stop_grace: float = 2.0  # the session's least grace for reaching the stop step


def parse_flags(magic: Any, line: str) -> CellOptions:
    """The flags of ``line`` as a :class:`CellOptions`; any problem is one UsageError line."""
    try:
        parsed = magic_arguments.parse_argstring(magic, line)
    except UsageError as error:
        hint = _flag_hint(magic, str(error))
        raise UsageError(f"%%distributed: {error}. {hint + ' ' if hint else ''}{_SEE_HELP}") from None
    except ValueError as error:  # unbalanced quotes
        raise UsageError(
            f"%%distributed: cannot read the flags {line!r}: {error}. Close the quote, or write the value "
            f"without quotes (--devices 0,1). {_SEE_HELP}"
        ) from None
    return fill_defaults(parsed)


_SEE_HELP = "%%distributed --help (or %distributed?) says what each flag takes."


def _flag_hint(magic: Any, error: str) -> str:
    """What the flag named in argparse's ``error`` takes, or the flag a misspelt one may have meant."""
    helps = {option: action.help or "" for action in magic.parser._actions for option in action.option_strings}
    flags = [option for option in helps if option.startswith("--") and option != "--help"]
    unknown = re.match(r"unrecognized arguments: (\S+)", error)
    if unknown:
        close = difflib.get_close_matches(unknown.group(1).split("=")[0], flags, n=1)
        return f"Did you mean {close[0]}?" if close else f"The flags are {', '.join(flags)}."
    named = re.match(r"argument (--[\w-]+)", error)
    if named and "choose from" not in error:  # argparse already listed the choices
        return f"{named.group(1)}: {helps.get(named.group(1), '')}".rstrip(": ")
    return ""


def fill_defaults(parsed: Any) -> CellOptions:
    """The options of parsed flags; each launch flag the cell did not set takes the session's default."""
    from nbtrain.kernel import defaults

    session = defaults.get_defaults()
    cluster = session.cluster if parsed.cluster is None else parsed.cluster
    num_nodes = parsed.num_nodes
    if num_nodes is None:
        num_nodes = session.num_nodes if cluster == session.cluster else None
    return CellOptions(
        devices=session.devices if parsed.devices is None else parsed.devices,
        accelerator=session.accelerator if parsed.accelerator is None else parsed.accelerator,
        strategy=session.strategy if parsed.strategy is None else parsed.strategy,
        timeout=session.timeout if parsed.timeout is _SESSION else parsed.timeout,
        stall_warning=_stall_warning(parsed.stall_warning, session.stall_warning),
        output=parsed.output,
        auto=parsed.auto,
        precision=session.precision if parsed.precision is None else parsed.precision,
        sync_batchnorm=session.sync_batchnorm if parsed.sync_batchnorm is None else parsed.sync_batchnorm,
        backend=session.backend if parsed.backend is None else parsed.backend,
        allow_oversubscribe=parsed.allow_oversubscribe,
        background=parsed.background,
        help=parsed.help,
        cluster=cluster,
        num_nodes=num_nodes,
        on_stop=session.on_stop if parsed.on_stop is None else parsed.on_stop,
        stop_grace=session.stop_grace,
    )


def _stall_warning(flag: Any, session: float | None) -> float | None:
    if flag is _SESSION:
        return session
    if flag is not None and not flag > 0:
        raise UsageError(
            f"%%distributed: --stall-warning {flag:g} is not a positive number of seconds; "
            "give one, or none for no warning."
        )
    seconds: float | None = flag
    return seconds


def help_text(magic: Any) -> str:
    text: str = magic.parser.format_help().rstrip()
    return text.removeprefix("::\n\n  ")  # an RST code-block marker


def check_flags(options: CellOptions) -> tuple[Any, config.LaunchConfig]:
    """The engine (None: this machine's launcher) and launch configuration, planned once per cell.

    Raises a UsageError naming the bad flag and what is possible.
    """
    engine, cfg = _plan(options)
    return engine, dataclasses.replace(cfg, on_stop=options.on_stop, stop_grace=options.stop_grace)


def _plan(options: CellOptions) -> tuple[Any, config.LaunchConfig]:
    from nbtrain import hardware

    try:
        if options.cluster is not None and _on_cluster(options):
            from nbtrain.cluster import engine

            return engine.prepare(
                options.cluster, options.num_nodes, options.devices, options.accelerator, options.strategy,
                options.timeout, options.backend, options.precision, options.sync_batchnorm,
            )
        if options.num_nodes not in (None, 1):
            raise ConfigurationError(
                f"--num-nodes {options.num_nodes} needs a cluster: without --cluster every rank runs on this "
                "machine. Add --cluster ray to run across the nodes of a Ray cluster."
            )
        plan = hardware.probe_plan(options.devices, options.accelerator, options.allow_oversubscribe)
        return None, config.make_config(
            plan,
            strategy=options.strategy,
            timeout=options.timeout,
            backend=options.backend,
            precision=options.precision,
            sync_batchnorm=options.sync_batchnorm,
        )
    except (ConfigurationError, ClusterError) as error:
        raise UsageError(f"%%distributed: {error}") from None


def _on_cluster(options: CellOptions) -> bool:
    cluster = options.cluster
    return cluster is not None and str(cluster).strip().lower() != "local"
