"""What a rank does from its first instruction to its exit.

1. Adopt the caller's state at launch time: environment, working directory, sys.path,
   plus the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and
   torch.compile's share of the cores and private cache (nbtrain.rank.machinery.compiling).
2. Set intra-op threads to physical cores / ranks before any torch op starts an OpenMP pool.
3. Load the payload (cloudpickled; tensors mapped copy-on-write from shared memory).
4. Join the process group: on one machine through the store file every rank inherited
   (nbtrain.system.rendezvous: no port another user could reach); on a cluster rank 0 hosts the
   TCPStore on the socket the launcher bound, so the port was never free for anyone else.
5. Run the function; send the result (rank 0) or the failure; wait for the launcher's
   release (a barrier that needs no process group); exit without interpreter teardown.
   Rank 0's tensors stay in its memory until the kernel has copied them, which is why
   it waits for the kernel, through the launcher, before it may leave.
"""

from __future__ import annotations

import bdb
import contextlib
import datetime
import faulthandler
import functools
import gc
import importlib
import io
import itertools
import linecache
import os
import re
import select
import socket
import sys
import sysconfig
import threading
import traceback
import types
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from nbtrain import patches
from nbtrain.messages import logsetup, records, sharedtensors, stacktext, torchsettings, wire
from nbtrain.messages.events import (
    DebugQuit,
    NotebookModules,
    RankAssignment,
    RankDone,
    RankFailed,
    Release,
    SendResultFile,
    StandbyReady,
    StartRun,
)
from nbtrain.planning import config
from nbtrain.rank import api, cell
from nbtrain.rank.machinery import compiling, debugger, reimport, settings
from nbtrain.system import privatenet, processes, rendezvous

STORE_TIMEOUT = datetime.timedelta(minutes=5)
MULTIPROCESSING_EXIT_SECONDS = 5.0  # at most, for a rank's multiprocessing children and finalizers as it exits
_hosted_store: Any = None  # rank 0's TCPStore server; must live as long as the rank
_imported_ahead: tuple[str, ...] = ()  # a standby rank: the library modules it imported before its run


def run_rank(
    assignment: RankAssignment,
    channel: socket.socket,
    listen_fd: int | None,
    tensor_fd: int | None,
    stack_fd: int | None = None,
) -> NoReturn:
    """Run one rank to completion and exit the process. Never returns."""
    _begin(assignment, stack_fd)
    _run(assignment, channel, tensor_fd, listen_fd, prepared=False)


def run_standby(plan: RankAssignment, channel: socket.socket, listen_fd: int | None, stack_fd: int) -> NoReturn:
    """A rank forked ahead of its run (nbtrain.launch_server.standby). Never returns.

    It does now what does not depend on the cell: the plan's environment, cwd, sys.path and
    threads, its device (a CUDA context, cuDNN and cuBLAS loaded), its process group, the
    harmless ``init_process_group`` for torchrun-style code. Then it
    waits for the run's ``StartRun`` and the payload's memfd on its channel, and runs it as
    a fresh rank would. Anything failing before that ends it quietly: the launcher replaces
    it, and a run never sees the failure (a freshly forked rank would report it instead).
    """
    _begin(plan, stack_fd)
    try:
        _adopt_caller_state(plan)
        _select_device(plan.spec.device_type, plan.spec.device_index)
        _warm_device(plan.spec.device_type)
        _join_process_group(plan, listen_fd, eager=True)
        patches.install_for_process("torchrun", "collectives")  # as _run would, off the run's way
        _warm_the_way()
        reimport.import_ahead(plan.start.notebook_modules, is_library_file)  # the kernel's order, before the rest
        _import_ahead(plan.start.preimport)
        _keep_out_of_collections()
        wire.send(channel, StandbyReady(plan.spec.rank))
        message, fds = _wait_for_run(channel)
    except BaseException:  # noqa: BLE001 - the launcher sees the exit and replaces this rank
        processes.exit_now(1)
    if not isinstance(message, StartRun):
        processes.exit_now(0)
    assignment = RankAssignment(message, plan.spec, plan.master_port, plan.launcher_pid)
    _run(assignment, channel, fds[0] if fds else None, None, prepared=True)


def _wait_for_run(channel: socket.socket) -> tuple[Any, list[int]]:
    """A standby rank's wait for its run; the modules cells import meanwhile are imported as they come."""
    while True:
        message, fds = wire.receive(channel)
        if not isinstance(message, NotebookModules):
            return message, fds
        import_libraries(message.modules)
        _keep_out_of_collections()


def _keep_out_of_collections() -> None:
    """What a standby rank's imports made is never collected, as the template's objects are (gc.freeze).

    Left young, those objects are what the run's first full collection walks: one such
    collection after importing scipy, pandas, matplotlib and sklearn took ~95 ms on 2 cores,
    inside the cell. Modules live as long as the rank anyway.
    """
    gc.freeze()


def _warm_the_way() -> None:
    """Go once, with nothing of a run's, the way a run takes from its payload to the cell's first line.

    A rank is forked from the launcher: the first time it touches a page of the launcher's
    objects (a reference count, a pool of the allocator) the kernel copies it, and the
    first call of torch's RNG setters, the payload's unpickling, the compiler and the cell's
    bookkeeping paid for those copies (and a lazy set-up or two): 2-4 ms on the way to the
    cell's first line on 2 cores. A standby rank pays them now. Nothing stays: the RNGs are
    set to their own state, and the cell runs in a namespace of its own that is dropped.
    """

    with contextlib.suppress(Exception):  # a way not warmed costs time, never the rank
        records.set_rng_states(records.rng_states())
        payload, fd = sharedtensors.dumps_to_shared_memory((len, ([1.0, (2, None)],), {}))
        sharedtensors.loads(payload, fd)
        if fd is not None:
            os.close(fd)
        cell.run_cell(cell.CellSpec(code="x = len(y)\n", filename="<warm-up>", names=("y",), log_loss=False), {"y": []})


def _import_ahead(names: Iterable[str]) -> None:
    """Import the library modules the last run's payload needed, so this run's payload finds them.

    Unpickling a payload imports its objects' modules: a cell naming one matplotlib object
    took its 2 ranks 0.15-0.3 s longer to reach the first line on 2 cores. Only libraries
    (:func:`library_modules`): the user's own files are imported by the run, as edited by then.
    """
    global _imported_ahead
    _imported_ahead = tuple(names)  # still needed by the next ones while re-runs keep needing them
    for name in names:
        with contextlib.suppress(Exception):  # the run imports it again, and reports what fails
            importlib.import_module(name)


def _newest_modules(known: int) -> list[str]:
    """The modules imported since sys.modules held ``known`` (the newest are last in it).

    Read from the end: a copy of the whole of sys.modules in a just-forked rank touched (and
    so copied) the pages of every module's name, about 3 ms on 2 cores.
    """
    return list(itertools.islice(reversed(sys.modules), max(0, len(sys.modules) - known)))[::-1]


def library_modules(names: Iterable[str]) -> tuple[str, ...]:
    """Of the imported modules ``names``, those installed as libraries (the standard library, site-packages).

    >>> import json
    >>> library_modules(["json", "sys"])  # sys is built in: nothing to import ahead
    ('json',)
    """
    paths = [(name, getattr(sys.modules.get(name), "__file__", None) or "") for name in names]
    return tuple(name for name, path in paths if is_library_file(path))


def import_libraries(names: Iterable[str]) -> None:
    """Import the libraries among the notebook's modules ``names`` ahead of a run, never the user's own files
    (the run imports those as they are by then): a standby rank's wait, the launcher's idle time. A failure
    is kept, and a rank forked after reports it in its run (nbtrain.rank.machinery.reimport)."""
    reimport.import_ahead(names, is_library_file)


def is_library_file(path: str) -> bool:
    """Whether ``path`` is in the standard library or site-packages (not the user's own file)."""
    return bool(path) and (path.startswith(_LIBRARY_ROOTS) or _SITE_PACKAGES.search(path) is not None)


_SITE_PACKAGES = re.compile(r"[/\\](site|dist)-packages[/\\]")


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.join(paths[key], "") for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths)


# Read once where this module is imported (the launcher's template): a just-forked rank took
# about 4 ms to ask sysconfig.
_LIBRARY_ROOTS = _library_roots()


def _begin(assignment: RankAssignment, stack_fd: int | None) -> None:
    settings.adopt(assignment.start.rank_settings)  # its threads and backend, read before a run's arrive
    register_stack_dump(stack_fd, assignment.start.environ)
    # Orphans of this rank's subtree (a double fork, say) become its children, and the
    # launcher's once it exits: so nothing it started outlives the run (nbtrain.system.processes).
    processes.become_subreaper()
    # stdout, stderr and input(); a spawned rank's "notebook only" (a forked one has its launcher's);
    # notebook code by value to the DataLoader workers and pools the cell starts.
    patches.install_for_process("rank", "notebook only", "child processes")


def _run(
    assignment: RankAssignment, channel: socket.socket, tensor_fd: int | None, listen_fd: int | None, prepared: bool
) -> NoReturn:
    """Load the payload, run it, report; a standby rank ``prepared`` its state and group already."""
    start, spec = assignment.start, assignment.spec
    context = api.RankContext(
        start.run_id,
        spec.rank,
        spec.local_rank,
        spec.world_size,
        spec.device_type,
        spec.device_index,
        # One sender at a time: the cell's own threads may log or display beside its main thread.
        send=functools.partial(_send_locked, channel, sending := threading.Lock()),
        send_in_order=functools.partial(_send_in_order, channel, sending),
    )
    api._set_context(context)
    settings.adopt(start.rank_settings)  # the run's: a standby rank was forked for an earlier one
    try:
        if not prepared:
            _adopt_caller_state(assignment)
        install_source_lines(start.source_lines)
        logsetup.follow(start.logging_setup)  # as its launcher has it already, unless it changed
        debugger.install_breakpoint_hook(channel, start.run_id, spec.rank, start.interactive)
        if not prepared:
            _select_device(spec.device_type, spec.device_index)
        patches.install_for_process("torchrun", "collectives")  # before the payload: its names resolve to ours
        # What the notebook's imports did (a method patched on, a registry filled), before its objects arrive.
        reimport.import_for_run(start.notebook_modules, report=spec.rank == 0)
        known = len(sys.modules)
        fn, args, kwargs = sharedtensors.loads(start.payload, tensor_fd, map_location=spec.device_type)
        if spec.rank == 0 and start.standby_seconds:  # what the next standby ranks import ahead
            context.imported = tuple(dict.fromkeys([*_imported_ahead, *library_modules(_newest_modules(known))]))
        if tensor_fd is not None:
            os.close(tensor_fd)
        if not prepared:
            _join_process_group(assignment, listen_fd)
        # As the kernel set torch; after nbtrain's own set-up, which a default device must not move.
        torchsettings.take_on(start.torch_settings, spec.device_type)
        result = fn(*args, **kwargs)
        context.flush()
        sent = _send_done(channel, context, result if spec.rank == 0 else None)
        del result  # the sent pickle holds what the kernel still has to read
        _wait_for_release(channel, sent)
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then we leave
        # No debugger reaches a cluster's rank (docs/cluster.md): its traceback names the failing frame's locals.
        # Nothing to debug after sys.exit() (nor pdb's own quit): the rank is not kept.
        held = settings.current().debug_hold is not None and not isinstance(error, (bdb.BdbQuit, SystemExit))
        state = _state_at_failure(context, start.node is None)
        traceback_ = _report_failure(channel, start.run_id, spec.rank, error, start.node is not None, held, state)
        if held:
            header = "".join(traceback.format_exception_only(type(error), error))
            del error  # the traceback holds its frames; nothing else is kept
            debugger.hold_for_post_mortem(channel, start.run_id, spec.rank, traceback_, header)
        _leave(1)
    _leave(0)


def _leave(code: int) -> NoReturn:
    """Exit without interpreter teardown (a gloo group's can hang), but with multiprocessing's: what the
    cell started (DataLoader workers, pools) ends with the rank, and leaves no semaphore in /dev/shm."""
    processes.end_multiprocessing(MULTIPROCESSING_EXIT_SECONDS)
    processes.exit_now(code)


def no_input(original: Any) -> Any:
    """``input()`` on a rank (the patch table's): ``original`` where ``sys.stdin`` is not the rank's own."""
    return functools.partial(_no_input, original, sys.stdin)


def _no_input(original: Any, stdin: Any, prompt: object = "") -> str:
    """``input()`` on a rank: its stdin is empty, nobody can answer; say so, and what to do instead.

    pdb's ``interact`` on a rank reads its relay, put in ``sys.stdin`` meanwhile: that one answers.
    """
    if sys.stdin is not stdin:
        return original(prompt)  # type: ignore[no-any-return]
    raise EOFError(
        f"input({prompt!r}) cannot be answered on a rank (a rank has no keyboard): ask in a cell "
        "before %%distributed and use the answer in this one (every rank gets the kernel's variables)"
    )


# How long a rank waits for the launcher to pass on a display (it goes on after that anyway).
DISPLAYED_SECONDS = 10.0


def _send_locked(channel: socket.socket, sending: threading.Lock, message: Any) -> None:
    with sending:
        wire.send(channel, message)


def _send_in_order(channel: socket.socket, sending: threading.Lock, message: Any) -> None:
    """Send ``message`` (a display); return once the launcher sent what this rank printed before it.

    The answer is :class:`~nbtrain.messages.events.Displayed`: nothing else reaches a rank's channel
    while it runs (the launcher sends pdb's commands only to a rank at its prompt, the release
    once it is done). A late answer is skipped by every later read of the channel.
    """
    _send_locked(channel, sending, message)
    ready, _, _ = select.select([channel], [], [], DISPLAYED_SECONDS)
    if ready:
        _, fds = wire.receive(channel)
        for fd in fds:
            os.close(fd)


def register_stack_dump(stack_fd: int | None, environ: Mapping[str, str]) -> None:
    """Let the launcher ask for this rank's stack at any moment, even inside a collective.

    faulthandler dumps from its C signal handler, which runs while the main thread is
    blocked in C++ (gloo, NCCL): a Python handler would wait for the call to return. The
    dump goes to a pipe only the launcher reads. This is the whole cost to a healthy run.
    """
    if stack_fd is None or environ.get(stacktext.DISABLE_VARIABLE) == "0":
        return
    faulthandler.register(stacktext.DUMP_SIGNAL, file=stack_fd, all_threads=True, chain=False)


def line_buffered_stdout(_original: Any) -> io.TextIOWrapper:
    """A rank's ``sys.stdout`` (the patch table's): fd 1, a pipe to the launcher, line-buffered so
    that each print appears live."""
    return io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="replace")


def line_buffered_stderr(_original: Any) -> io.TextIOWrapper:
    """A rank's ``sys.stderr`` (the patch table's): fd 2, line-buffered as ``sys.stdout``."""
    return io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="replace")


def _adopt_caller_state(assignment: RankAssignment) -> None:
    start = assignment.start
    environ = dict(start.environ)
    environ.update(_torchrun_variables(assignment))
    environ.update(compiling.variables(environ))  # torch.compile's share of the cores, its private cache
    os.environ.clear()
    os.environ.update(environ)
    patches.install_for_process("compiling")  # inductor read its variables in the launcher: again, from these
    os.chdir(start.cwd)
    sys.path[:] = list(start.sys_path)
    threads = settings.current().threads_per_rank or config.user_thread_count(environ)
    if threads is not None:
        # deferred: start-up time (torch)
        import torch

        # OpenMP read its variables when the launcher loaded torch, before this run's
        # environment existed: the count has to be set explicitly.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def _torchrun_variables(assignment: RankAssignment) -> Mapping[str, str]:
    spec = assignment.spec
    node = assignment.start.node
    return {
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(spec.local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.world_size if node is None else node.local_world_size),
        "GROUP_RANK": str(0 if node is None else node.node_rank),
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": _master_address(assignment),
        "MASTER_PORT": str(assignment.master_port),
        # Rank 0 hosts the store itself (on the pre-bound socket); every rank, rank 0
        # included, connects to it as a client, as under torchrun's agent.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        # torchrun's mark that a launcher set the world: frameworks (Lightning) then read it rather than their own.
        "TORCHELASTIC_RUN_ID": str(assignment.start.run_id),
        "NBTRAIN_ROLE": "rank",
        # On a cluster: the node's label, so that what rank 0 writes there says where (trackers).
        **({} if node is None else {"NBTRAIN_NODE": node.label}),
        # On a cluster the node's agent names the interface holding the node's address.
        **(_loopback_variables() if node is None else {}),
    }


def _master_address(assignment: RankAssignment) -> str:
    node = assignment.start.node
    return "127.0.0.1" if node is None else node.master_addr


def _loopback_variables() -> Mapping[str, str]:
    """Keep every process-group socket on loopback, whatever the host name resolves to.

    Without an interface, gloo listens on the address the host name resolves to, and NCCL's
    bootstrap on the first non-loopback interface: in containers, Colab and Kaggle that is
    a routable address, reachable from outside the machine. Every rank of a single-machine
    run is on this host, so loopback is always right; a setting of the caller's is replaced.
    """
    interface = _loopback_interface()
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


_IFF_LOOPBACK = 0x8


def _loopback_interface(directory: str = "/sys/class/net") -> str:
    """The loopback interface's name: the one flagged IFF_LOOPBACK, "lo" where none is listed."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return "lo"
    for name in names:
        try:
            with open(os.path.join(directory, name, "flags")) as f:
                if int(f.read().strip(), 16) & _IFF_LOOPBACK:
                    return name
        except (OSError, ValueError):
            continue
    return "lo"


def install_source_lines(source_lines: Mapping[str, tuple[str, ...]]) -> None:
    """Put notebook cells' lines in this process's linecache (the launcher's, which its forks inherit, or a rank's).

    Notebook cells exist only in the kernel's linecache; with them here, a rank's traceback
    shows the cell's own source lines.
    """
    for filename, lines in source_lines.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)


def _select_device(device_type: str, device_index: int | None) -> None:
    if device_type == "cuda" and device_index is not None:
        # deferred: start-up time (torch)
        import torch

        torch.cuda.set_device(device_index)


def _warm_device(device_type: str) -> None:
    """On CUDA, pay now what a cell's first step would: the context, the libraries, the kernels.

    CUDA loads each kernel the first time it runs (lazy loading), and cuDNN and cuBLAS
    their handles: a training step of a small conv net (convolution, batch norm, pooling, a
    linear layer, cross-entropy, backward, SGD with momentum and AdamW) loads the ones most
    cells' first steps use. Then nothing of it stays: its memory is freed and the memory
    statistics start again, so a cell sees the device as a fresh process would.
    """
    if device_type != "cuda":
        return
    # deferred: start-up time (torch)
    import torch

    with contextlib.suppress(Exception):  # a warm-up not done costs the first step time, never the rank
        _a_small_training_step(torch)
    torch.cuda.synchronize()
    # cuBLAS keeps its workspace (32 MiB) allocated through the caching allocator: a cell
    # would see it in memory_allocated(). Freed, the handles and loaded kernels stay; a
    # cell's first matmul allocates its own workspace again (one allocation, no loading).
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()  # then nothing of ours is cached: only the context stays
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()


def _a_small_training_step(torch: Any) -> None:
    """Three steps of a tiny conv net on the current GPU, from constants (no random draw)."""
    functional = torch.nn.functional
    images = torch.linspace(-1.0, 1.0, 4 * 3 * 16 * 16, device="cuda").reshape(4, 3, 16, 16)
    labels = torch.arange(4, device="cuda")
    params = [
        torch.full(shape, value, device="cuda", requires_grad=True)
        for shape, value in (((8, 3, 3, 3), 0.1), ((8,), 1.0), ((8,), 0.0), ((10, 8), 0.1), ((10,), 0.0))
    ]
    conv, scale, shift, weight, bias = params
    mean, var = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
    sgd = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    for optimizer in (sgd, sgd, torch.optim.AdamW(params)):  # SGD's second step takes the momentum path
        hidden = functional.batch_norm(functional.conv2d(images, conv, padding=1), mean, var, scale, shift, True)
        hidden = functional.max_pool2d(functional.relu(hidden), 2) + 1.0
        pooled = functional.adaptive_avg_pool2d(hidden, 1).flatten(1)
        loss = functional.cross_entropy(functional.linear(pooled, weight, bias), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _join_process_group(assignment: RankAssignment, listen_fd: int | None, eager: bool = False) -> None:
    """Join the run's group; ``eager`` (standby ranks, several): NCCL's communicator now, not at the first collective.

    One rank has nothing to send: its model is not wrapped and nbtrain's own collectives
    return at once, so building the communicator ahead (0.39 s on an H200) only held up a
    cell sent before its standby rank was ready. A cell's own collective builds it then.
    """
    global _hosted_store
    # deferred: start-up time (torch)
    import torch
    import torch.distributed as dist

    spec = assignment.spec
    store = None
    if assignment.start.node is None and listen_fd is not None:
        store = rendezvous.open_store(listen_fd, spec.world_size)  # every rank's: no port for anyone to reach
    elif listen_fd is not None:
        _hosted_store = dist.TCPStore(  # type: ignore[attr-defined]  # re-exported by torch.distributed, not marked public
            _master_address(assignment),
            assignment.master_port,
            spec.world_size,
            True,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    device = None
    if eager and spec.world_size > 1 and spec.device_type == "cuda" and "nccl" in settings.current().backend:
        device = torch.device("cuda", torch.cuda.current_device())
    join = {"store": store} if store is not None else {}  # else env:// (a cluster's TCPStore)
    # gloo's listener and pairs are made in the rank's private network where it joined one.
    privatenet.in_private_network(
        functools.partial(
            dist.init_process_group,
            settings.current().backend,
            rank=spec.rank,
            world_size=spec.world_size,
            device_id=device,
            **join,
        )
    )


# Code written for torchrun runs unchanged: its own init/destroy of the group become harmless.
# Destroying the group is skipped because a gloo group destroyed while DDP still holds it can
# hang in its destructor; the rank exits without teardown anyway. The table sets them in the
# module that defines them too (torch.distributed.distributed_c10d), one replacement for both
# (made once per original): so a name the notebook bound in the kernel (``from torch.distributed
# import init_process_group as setup``), which travels as a reference to that module's
# attribute, arrives as the replacement; and the replacement, which takes the original's module
# and name, travels back to the kernel as torch's own function.


@functools.cache
def harmless_init(original: Any) -> Any:
    """``init_process_group`` on a rank (the patch table's): joins nothing when the rank has joined."""

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not sys.modules["torch.distributed"].is_initialized():
            original(*args, **kwargs)

    return init_process_group


@functools.cache
def harmless_destroy(original: Any) -> Any:
    """``destroy_process_group`` on a rank (the patch table's): destroys a subgroup only."""

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is not None:
            original(group)

    return destroy_process_group




def _send_done(channel: socket.socket, context: api.RankContext, result: Any) -> sharedtensors.InPlace | None:
    """Tell the launcher this rank is done; rank 0 sends its result, tensors left in place."""
    if context.rank != 0:
        wire.send(channel, RankDone(context.run_id, context.rank))
        return None
    try:
        pickled = sharedtensors.dumps_in_place(result)
    except Exception as error:
        raise TypeError(
            f"rank 0's return value (a {type(result).__name__}) cannot be sent back to the kernel: {error}. "
            "Return plain data, tensors or state_dicts."
        ) from error
    done = RankDone(
        context.run_id,
        0,
        pickled.data,
        regions=pickled.regions,
        total_bytes=pickled.total_bytes,
        imported=context.imported,
    )
    wire.send(channel, done)
    return pickled


def _state_at_failure(context: api.RankContext, here: bool) -> tuple[bytes | None, str, int | None]:
    """A failed cell's state at the raise, pickled with its tensors in a new shared-memory file:
    (pickle, why there is none, the file's descriptor). ``here``: a run on this machine (a cluster's
    nodes send no state: nothing there would bring it back)."""
    result, context.state_at_failure = context.state_at_failure, None
    if result is None or not here:
        return None, context.no_state_why, None
    try:
        data, fd = sharedtensors.dumps_to_shared_memory(result)
    except Exception as error:  # noqa: BLE001 - the failure itself is what must reach the kernel
        return None, f"its state could not be sent ({type(error).__name__}: {error})", None
    return data, "", fd


def _report_failure(
    channel: socket.socket,
    run_id: int,
    rank: int,
    error: BaseException,
    with_locals: bool = False,
    held: bool = True,
    state: tuple[bytes | None, str, int | None] = (None, "", None),
) -> Any:
    """Tell the launcher how this rank failed (``q`` in pdb: a stop); the user's part of the traceback.

    ``state``: the cell's state at the raise (:func:`_state_at_failure`), sent with the failure.
    """
    if isinstance(error, bdb.BdbQuit):
        with contextlib.suppress(OSError):
            wire.send(channel, DebugQuit(run_id, rank))
        return None
    tb = error.__traceback__
    # Drop the runtime's own frames, and those of nbtrain functions that set
    # __tracebackhide__ (pytest's and IPython's convention): the user's traceback starts
    # in their code (for %%distributed, the cell's own line).
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or _hidden(tb)):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, _users_frames(tb)))
    if with_locals:
        text += debugger.locals_summary(tb)
    data, note, fd = state
    failed = RankFailed(run_id, rank, type(error).__name__, str(error), text, held=held, state=data, state_note=note)
    try:
        wire.send(channel, failed, () if fd is None else (fd,))
    except OSError:
        pass  # the launcher is gone: nobody is left to tell
    finally:
        if fd is not None:
            os.close(fd)
    return tb


def _hidden(tb: types.TracebackType) -> bool:
    return bool(tb.tb_frame.f_locals.get("__tracebackhide__"))


# DDP's own forward, called by the wrapper a prepared model is (hidden): not the user's code.
_WRAPPER_FILES = (os.path.join("torch", "nn", "parallel", "distributed.py"),)
_MODULE_CALLS = ("_wrapped_call_impl", "_call_impl")  # nn.Module.__call__ on its way to forward


def _users_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the prepared model's wrapper in the middle of it, as the kernel's traceback would read.

    A shape error in the model showed five frames more than in the kernel: DDP's module
    call, nbtrain's read-through ``forward`` (hidden) and DDP's own forward. Frames that
    hide themselves, DDP's forward, and the module-call frames that led into a hidden one go.
    """
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    hidden = [_hidden(t) or t.tb_frame.f_code.co_filename.endswith(_WRAPPER_FILES) for t in frames]
    for i in range(len(frames) - 2, -1, -1):  # the calls into a hidden frame are the wrapper's too
        if hidden[i + 1] and frames[i].tb_frame.f_code.co_name in _MODULE_CALLS:
            hidden[i] = True
    kept: types.TracebackType | None = None
    for t, drop in zip(reversed(frames), reversed(hidden), strict=True):
        if not drop:
            kept = types.TracebackType(kept, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return kept


def _wait_for_release(channel: socket.socket, sent: sharedtensors.InPlace | None) -> None:
    try:
        while True:
            message, fds = wire.receive(channel)
            for fd in fds:
                os.close(fd)
            if isinstance(message, Release):
                if sent is not None:  # the kernel has its copy; this process exits next
                    sent.discard_before_exit()
                return
            if isinstance(message, SendResultFile) and sent is not None:
                fd = sent.write_file()
                try:
                    wire.send(channel, RankDone(message.run_id, 0, sent.data, has_tensor_file=True), (fd,))
                finally:
                    os.close(fd)
    except (wire.ChannelClosed, OSError):
        return
