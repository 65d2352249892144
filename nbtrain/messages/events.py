"""The records that travel between the kernel, the launcher and the ranks.

Everything here is a frozen dataclass of plain values, so the launcher can relay them
without importing user code and the kernel can read them without importing torch.

Two directions:
- requests, kernel -> launcher: :class:`StartRun`, :class:`StopRun`, :class:`ReleaseResult`;
- events, rank -> launcher -> kernel, on one channel: :class:`RankStarted`, :class:`Output`,
  :class:`Display`, :class:`Metrics`, :class:`MemorySample`, :class:`RankFailed`, :class:`RankExited`,
  :class:`ResultOffer` when rank 0's result holds tensors, and finally one
  :class:`RunEnded` per run.

Example:
    >>> Output(run_id=1, rank=0, stream="stdout", text="epoch 1\\n").rank
    0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbtrain.messages.logsetup import LoggingSetup

# Run states, as the live view and RunEnded name them.
FINISHED = "finished"
FAILED = "failed"
STOPPED = "stopped"
TIMED_OUT = "timed out"


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to know about its place in the run."""

    rank: int
    local_rank: int
    world_size: int
    device_type: str  # "cpu" | "cuda" | "mps"
    device_index: int | None


@dataclass(frozen=True)
class NodePlace:
    """Where one node's launcher stands in a run that spans nodes (the cluster engine).

    ``master_port`` None: this node hosts the process group's store (global rank 0 is
    here); its launcher binds ``master_addr`` on a free port and reports it with
    :class:`StoreListening`. Otherwise the ranks connect to ``master_addr:master_port``.
    """

    node_rank: int
    num_nodes: int
    local_world_size: int
    master_addr: str
    master_port: int | None = None
    label: str = ""  # how messages name this node, e.g. "node 1 (10.0.0.7)"


@dataclass(frozen=True)
class RankSettings:
    """Every setting a run's ranks read, typed: one record, built once by the kernel from its plan.

    The kernel builds it (:func:`nbtrain.planning.config.make_config` from the plan and the
    launch options, completed by :mod:`nbtrain.kernel.client` with what this machine and
    session decide); :class:`StartRun` carries it whole; on a rank,
    :mod:`nbtrain.rank.machinery.settings` is its one reader. Each launch option marked
    ``Option(rank=True)`` in :mod:`nbtrain.options` is a field of the same name, with the
    same built-in default (tests/test_settings.py holds them together): a new one is its
    field here, its Option and the code that reads it.

    >>> settings = RankSettings("ddp", precision="bf16-mixed")
    >>> settings.model_wrapper, settings.precision, settings.sync_batchnorm
    ('ddp', 'bf16-mixed', False)
    """

    # "ddp", "fsdp", "dp", ... (nbtrain.planning.config.Strategy); "": a run nbtrain did not plan (ddp over several
    # ranks)
    model_wrapper: str = ""
    dp_devices: tuple[int, ...] = ()  # strategy dp: DataParallel's GPUs, the rank's own first
    backend: str = "gloo"  # the process group's, as the plan resolved it
    threads_per_rank: int | None = None  # intra-op threads; None: the user's OMP_NUM_THREADS decides
    # Seconds a failed run's root-cause rank is held for a post-mortem (the launcher holds it); None: not held.
    debug_hold: float | None = None
    # -- the launch options marked Option(rank=True), as the plan checked them
    precision: str = "32-true"
    sync_batchnorm: bool = False


@dataclass(frozen=True)
class StartRun:
    """Kernel -> launcher: start ``world_size`` ranks running ``payload``.

    ``payload`` is opaque to the launcher (cloudpickled user code); only the ranks
    unpickle it, so the launcher never imports the user's modules and never goes stale.
    A shared-memory file descriptor holding the payload's tensors travels beside it.
    """

    run_id: int
    payload: bytes
    ranks: tuple[RankSpec, ...]
    start_method: str  # "fork" | "spawn"
    environ: Mapping[str, str]
    cwd: str
    sys_path: tuple[str, ...]
    source_lines: Mapping[str, tuple[str, ...]]  # linecache entries of notebook cells
    timeout: float | None
    has_tensor_file: bool = False
    strategy: str = ""  # its name, for the run registry only
    log_path: str | None = None  # where the launcher writes every rank's full output
    node: NodePlace | None = None  # None: every rank is on this machine (the local engine)
    interactive: bool = True  # False (a background run): a breakpoint cannot prompt and is passed
    # After this run, keep the next run's ranks waiting this many idle seconds (standby
    # ranks, nbtrain.launch_server.standby); None: none.
    standby_seconds: float | None = None
    # A stop or a timeout: "keep" ends every rank at one optimizer step and brings its state back
    # (nbtrain.system.stepboard); "discard" stops them where they are. The grace is at least stop_grace s.
    on_stop: str = "keep"
    stop_grace: float = 2.0
    # No rank moved (no collective begun, no optimizer step) for this long while some wait on the
    # others: the kernel is told where each is (nbtrain.launch_server.stalls); None: never.
    stall_seconds: float | None = 30.0
    # Standby ranks only: library modules the last run's payload needed (its objects' classes'
    # modules), imported while they wait instead of while a cell's payload loads.
    preimport: tuple[str, ...] = ()
    # The modules the notebook imported in the kernel, in its order (nbtrain.kernel.importedmodules): each rank
    # imports them before the payload, so their import-time effects are there. The kernel sends those the
    # launcher was not sent before; the launcher keeps them and gives its ranks the whole list.
    notebook_modules: tuple[str, ...] = ()
    # The kernel's logging levels and the handlers that write to its cell (less what the launcher's
    # libraries set up on import): the launcher takes them on before it forks ranks (nbtrain.messages.logsetup).
    logging_setup: LoggingSetup = field(default_factory=LoggingSetup)
    # torch's settings the kernel changed from the defaults (nbtrain.messages.torchsettings): each rank sets them.
    torch_settings: Mapping[str, Any] = field(default_factory=dict)
    # Every setting the ranks read (precision, sync BN, backend, threads...): nbtrain.rank.machinery.settings
    # reads it, and no rank reads the launcher's copies above.
    rank_settings: RankSettings = field(default_factory=RankSettings)


@dataclass(frozen=True)
class StoreListening:
    """Launcher -> its caller, on a node hosting the store: the port it bound for it."""

    run_id: int
    port: int


@dataclass(frozen=True)
class RanksDone:
    """Launcher -> its caller, on a cluster: this node's ranks are done (rank 0's result taken).

    They wait for :class:`ReleaseRanks`: a node's ranks may not leave before every node's
    are done, or those still joining the process group would lose rank 0's store.
    """

    run_id: int


@dataclass(frozen=True)
class ReleaseRanks:
    """Kernel -> every node's launcher, on a cluster: every rank everywhere is done; leave."""

    run_id: int


@dataclass(frozen=True)
class StopRun:
    """Kernel -> launcher: stop a run (interrupt, Stop button, or the caller gave up)."""

    run_id: int
    reason: str = "stopped"
    graceful: bool = False  # end every rank at one optimizer step and keep its state, if the run can


@dataclass(frozen=True)
class StopStep:
    """Launcher -> kernel: a graceful stop chose ``step``; every rank has ``grace`` seconds to reach it."""

    run_id: int
    step: int
    grace: float


@dataclass(frozen=True)
class RankStarted:
    """Launcher -> kernel: rank ``rank`` of the run is up as process ``pid`` (on ``node``, on a cluster)."""

    run_id: int
    rank: int
    pid: int
    node: str = ""  # the node's label on a cluster; empty on one machine


@dataclass(frozen=True)
class Output:
    """One or more complete lines a rank wrote to stdout or stderr (or a tail at exit)."""

    run_id: int
    rank: int
    stream: str  # "stdout" | "stderr"
    text: str
    node: str = ""  # the node's label on a cluster; empty on one machine

    @property
    def tag(self) -> str:
        """How a printed line names its rank: ``[rank 1]``, on a cluster ``[rank 1, node 0 (10.0.0.7)]``."""
        return _tag(self.rank, self.node)


def _tag(rank: int, node: str) -> str:
    return f"[rank {rank}, {node}]" if node else f"[rank {rank}]"


@dataclass(frozen=True)
class Display:
    """What a rank showed with IPython's ``display`` (a DataFrame, ``plt.show()``'s figure).

    ``data`` is the formatted bundle (mimetype -> text; images in base64, as a notebook
    stores them). ``slot`` names the rank's display, so that an ``update`` (a display handle's,
    or the next one after ``clear_output``) replaces it where the cell shows it; ``label``
    says what it was (``Figure``) for a line that names the rank.
    """

    run_id: int
    rank: int
    data: Mapping[str, Any]
    metadata: Mapping[str, Any]
    slot: str
    update: bool = False
    label: str = ""
    node: str = ""  # the node's label on a cluster; empty on one machine

    @property
    def tag(self) -> str:
        """How a printed line names its rank (as :attr:`Output.tag`)."""
        return _tag(self.rank, self.node)

    @property
    def text(self) -> str:
        """What a frontend without rich output shows of it: its text/plain."""
        plain = self.data.get("text/plain", "")
        return plain if isinstance(plain, str) else str(plain)


@dataclass(frozen=True)
class Displayed:
    """Launcher -> rank: its :class:`Display` went out after everything it printed before it.

    The rank waits for this (bounded), so what it prints next cannot overtake the display.
    """

    run_id: int


@dataclass(frozen=True)
class OutputSkipped:
    """Lines a rank printed that the cell does not show as they come (past the first thousands).

    The launcher keeps the last of them for the end of the run and writes all of them to
    the run's log; this tells the live view how many there were and the latest few.
    """

    run_id: int
    rank: int
    counted: int  # the rank's lines so far, but for the last ones held back (sent when it ends)
    latest: tuple[tuple[str, str], ...]  # (stream, line), oldest first


@dataclass(frozen=True)
class Metrics:
    """Scalars a rank logged with ``nbtrain.log``, a batch of steps at a time.

    ``rows`` holds (step, unix time, {name: value}) in the order they were logged.
    """

    run_id: int
    rank: int
    rows: tuple[tuple[int, float, Mapping[str, float]], ...]


@dataclass(frozen=True)
class TrackerCalls:
    """Calls rank 0 made on a tracker's run the kernel opened (``writer.add_scalar``, ``run.log``), in order.

    ``calls`` holds (token, attribute path, args, kwargs); the kernel makes each on its own
    object (:func:`nbtrain.messages.trackerruns.replay`).
    """

    run_id: int
    rank: int
    calls: tuple[tuple[int, tuple[str, ...], tuple[Any, ...], dict[str, Any]], ...]


@dataclass(frozen=True)
class MemorySample:
    """A rank's memory: host RSS always, CUDA allocated/peak/reserved when on GPU (bytes)."""

    run_id: int
    rank: int
    rss_bytes: int | None  # None when only CUDA figures are known (sent by the rank)
    cuda_allocated_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    time: float = 0.0
    node: str = ""  # the node's label on a cluster; empty on one machine
    cuda_reserved_bytes: int | None = None  # what the caching allocator holds from the driver


@dataclass(frozen=True)
class RankFailed:
    """A rank raised; the traceback was rendered in the rank with the notebook's source."""

    run_id: int
    rank: int
    exc_type: str
    message: str
    traceback: str
    node: str = ""  # the node's label on a cluster; empty on one machine
    held: bool = True  # the rank waits for a post-mortem (not after sys.exit(): nothing to debug there)
    # Rank -> launcher only (the kernel gets them in RunEnded): a cell's state at the raise, pickled
    # with its tensors in the shared-memory file sent beside this record; or why the rank has none.
    state: bytes | None = None
    state_note: str = ""


@dataclass(frozen=True)
class RankExited:
    """A rank process ended. Exactly one of ``exit_code`` / ``signal_number`` is set."""

    run_id: int
    rank: int
    exit_code: int | None
    signal_number: int | None
    reported: bool  # the rank said it was done (or failed) before it exited
    stopped: bool = False  # exited during a stop, of no signal or of nbtrain's own: not a cause
    node: str = ""  # the node's label on a cluster; empty on one machine
    # A death of its own (a collective library's abort, say): each rank's last collective from its ledger,
    # in words ("rank 0: all_reduce of 4 float32 elements, its 8th collective, waiting in it").
    collectives: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeLost:
    """A cluster run's node went away (its agent died, or the whole node): the cause of failure."""

    run_id: int
    node: str
    detail: str


@dataclass(frozen=True)
class RankNotStarted:
    """The launcher could not create rank ``rank``'s process (fork or spawn failed)."""

    run_id: int
    rank: int
    world_size: int
    error_name: str  # errno's name: "EAGAIN", "ENOMEM", "EMFILE", ...
    reason: str  # the system's words for it


@dataclass(frozen=True)
class RunEnded:
    """The last event of a run. On success ``result`` holds rank 0's pickled return value."""

    run_id: int
    state: str  # FINISHED | FAILED | STOPPED | TIMED_OUT
    result: bytes | None = None
    has_tensor_file: bool = False
    failure: RankFailed | RankExited | RankNotStarted | NodeLost | None = None
    detail: str = ""
    # A run that timed out or was stopped: each rank's faulthandler dump at that moment,
    # (rank, text); "" for a rank that did not answer. Parsed by nbtrain.messages.stacktext.
    stacks: tuple[tuple[int, str], ...] = ()
    # A graceful stop: the step every rank stopped at (``result`` then holds rank 0's state there),
    # or, for one that could not keep the state, why (``stop_note``).
    stopped_at: int | None = None
    stop_note: str = ""
    # A failed cell: the rank whose state at its raise ``result`` holds (its tensors in the file beside
    # this record), or, for a failed cell with none, why (``failed_state_note``).
    failed_state_rank: int | None = None
    failed_state_note: str = ""


@dataclass(frozen=True)
class RanksWaiting:
    """Launcher -> kernel, once in a run that goes on: some ranks finished the cell a while
    ago, and the others wait in a collective (a backward's all-reduce) that a finished rank
    will never join: the ranks ran different steps (a ``break`` or an ``if`` on the rank).
    ``stacks``: (rank, faulthandler dump) of the waiting ranks."""

    run_id: int
    finished: tuple[int, ...]
    seconds: float  # since the first of them finished
    stacks: tuple[tuple[int, str], ...]
    counts: tuple[tuple[int, int], ...] = ()  # (rank, collectives it began, by its ledger) of every rank


@dataclass(frozen=True)
class RanksStalled:
    """Launcher -> kernel, while a run goes on: no rank has begun a collective or an optimizer step
    for ``seconds``, and some wait on the others (nbtrain.launch_server.stalls). ``calls``: (rank, its
    last collective in words, that collective's number among the rank's, whether it waits in it now),
    from the ranks' ledgers; ``stacks``: (rank, faulthandler dump) of every rank. Sent again when
    the picture changes; ``seconds`` 0 and no calls: the ranks moved again, the notice clears."""

    run_id: int
    seconds: float
    calls: tuple[tuple[int, str, int, bool], ...] = ()
    stacks: tuple[tuple[int, str], ...] = ()
    node: str = ""  # the node's label on a cluster (each node watches its own ranks); empty on one machine


@dataclass(frozen=True)
class RankDone:
    """Rank -> launcher only (not forwarded): the rank's work is done and its result is safe.

    Rank 0's tensors either ride in a file (``has_tensor_file``) or wait in its memory at
    ``regions`` (address, nbytes, offset) for the kernel to read them.
    """

    run_id: int
    rank: int
    result: bytes | None = None
    has_tensor_file: bool = False
    regions: tuple[tuple[int, int, int], ...] = ()
    total_bytes: int = 0
    imported: tuple[str, ...] = ()  # rank 0: the library modules it imported to load the payload


@dataclass(frozen=True)
class ResultOffer:
    """Launcher -> kernel: every rank is done; rank 0 (``pid``) holds the result's tensors.

    The kernel copies them out of rank 0's memory, then answers :class:`ReleaseResult`.
    """

    run_id: int
    pid: int
    result: bytes
    regions: tuple[tuple[int, int, int], ...]
    total_bytes: int


@dataclass(frozen=True)
class ReleaseResult:
    """Kernel -> launcher: done with rank 0's memory; or, ``send_file``, it could not be read
    here (a sandbox forbids it): rank 0 is to send the tensors in a shared-memory file."""

    run_id: int
    send_file: bool = False


@dataclass(frozen=True)
class SendResultFile:
    """Launcher -> rank 0: the kernel could not read your memory; send the result as a file."""

    run_id: int


@dataclass(frozen=True)
class RankAssignment:
    """Launcher -> rank: the run and this rank's place in it (sent first to a spawned rank)."""

    start: StartRun
    spec: RankSpec
    master_port: int
    launcher_pid: int


@dataclass(frozen=True)
class Release:
    """Launcher -> rank: every rank is done, leave now (a final barrier that needs no process group)."""

    run_id: int


@dataclass(frozen=True)
class LauncherReady:
    """Launcher -> kernel, once: the launcher imported what ranks need and can fork."""

    pid: int
    preloaded: tuple[str, ...] = field(default_factory=tuple)
    # The logging its preloaded libraries set up on import, which every rank it forks has: the
    # kernel sends a run only the rest of its own (nbtrain.messages.logsetup).
    libraries_logging: LoggingSetup = field(default_factory=LoggingSetup)


@dataclass(frozen=True)
class StandbyReady:
    """Standby rank -> launcher: it joined its process group and waits for a run."""

    rank: int


@dataclass(frozen=True)
class StandbyChanged:
    """Launcher -> kernel: the standby ranks now waiting, (rank, pid) each; () when none.

    ``plan`` says what they are for (``2 cpu ranks, gloo``); the kernel lists them in
    ``nbtrain.runs()`` and counts GPUs only they hold as free for ``--devices free:k``.
    """

    ranks: tuple[tuple[int, int], ...] = ()
    plan: str = ""
    devices: tuple[int, ...] = ()  # the GPUs they hold (CUDA ranks)
    ready: bool = False  # every one of them joined its process group
    released: tuple[int, ...] | None = None  # the answer to ReleaseStandby: the pids it ended


@dataclass(frozen=True)
class NotebookModules:
    """Kernel -> launcher -> standby ranks: modules a cell imported since the last run, in the kernel's order.

    The launcher adds them to the list every rank gets (``StartRun.notebook_modules``); a standby rank
    waiting for the next run imports the libraries among them now, not as that run's cell arrives, and
    so does the launcher itself once no run goes, in the kernel's environment, cwd and sys.path as the
    cell imported them (``environ``, ``cwd``, ``sys_path``: None to the standby ranks, which have a plan's).
    """

    modules: tuple[str, ...]
    environ: Mapping[str, str] | None = None
    cwd: str = ""
    sys_path: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReleaseStandby:
    """Kernel -> launcher: end the standby ranks now (``nbtrain.release()``, or a run needs the memory)."""


# -- the debugger relay (nbtrain.rank.machinery.debugger <-> nbtrain.kernel.pdb_relay) ---------------
# Rank -> launcher -> kernel: pdb's output, and its prompt when it waits for a command;
# kernel -> launcher -> that rank: the command. Every hop is one of the run's own channels.


@dataclass(frozen=True)
class DebugOutput:
    """What pdb wrote in a rank (a listing, a value, a stack), for the cell to show."""

    run_id: int
    rank: int
    text: str


@dataclass(frozen=True)
class DebugPrompt:
    """A rank's pdb waits for a command; ``prompt`` is pdb's (``(Pdb) ``)."""

    run_id: int
    rank: int
    prompt: str
    post_mortem: bool = False  # in a held rank's frames, after the run ended


@dataclass(frozen=True)
class DebugInput:
    """Kernel -> launcher -> rank: the line typed at a :class:`DebugPrompt` (``eof``: none will come)."""

    run_id: int
    rank: int
    line: str
    eof: bool = False


@dataclass(frozen=True)
class DebugEnded:
    """A rank left the debugger: ``c`` (it runs on), or a post-mortem's end (it exits next)."""

    run_id: int
    rank: int


@dataclass(frozen=True)
class DebugQuit:
    """Rank -> launcher: ``q`` in pdb ended this rank's code; the run ends as stopped."""

    run_id: int
    rank: int


@dataclass(frozen=True)
class RankHeld:
    """Launcher -> kernel, before a failed run's RunEnded: its root-cause rank is kept alive,
    paused in its exception's frames, for a post-mortem (``%nbtrain_debug``)."""

    run_id: int
    rank: int
    pid: int
    rss_bytes: int | None
    cuda_bytes: int | None
    hold_seconds: float
    device: str  # "cpu", "cuda:1": what it holds


@dataclass(frozen=True)
class AttachHeld:
    """Kernel -> launcher -> the held rank: open pdb's post-mortem in its frames."""

    run_id: int
    rank: int


@dataclass(frozen=True)
class ReleaseHeld:
    """Kernel -> launcher: end the held rank (a new launch, the kernel's own request)."""

    run_id: int
    reason: str


@dataclass(frozen=True)
class HeldReleased:
    """Launcher -> kernel: the held rank is gone; ``reason`` says why (its words end a sentence)."""

    run_id: int
    rank: int
    reason: str


# A stop at a step on a cluster: every node's launcher counts its own ranks' steps; the kernel
# chooses the step across nodes (nbtrain.cluster.crossnodestop).
@dataclass(frozen=True)
class StepsBegun:
    """Node launcher -> kernel: asked to stop at a step, this node's ranks wait while the kernel chooses.

    ``highest``: the highest optimizer step any of its ranks began; ``grace``: the grace its own step times
    ask for (``max(stop_grace, 3 x the median step)``); ``state``: how it would end (STOPPED, TIMED_OUT).
    """

    run_id: int
    highest: int
    grace: float
    state: str


@dataclass(frozen=True)
class StepChosen:
    """Kernel -> node launcher: every rank of the run stops at ``step``, within ``grace`` seconds from now."""

    run_id: int
    step: int
    grace: float
