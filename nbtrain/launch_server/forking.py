"""Starting a rank: its descriptors, the fork (or spawn), and what the child does before it runs.

The launcher's loop (nbtrain.launch_server.server) calls :func:`start_rank_process` for each
rank of a run (and :func:`fork_standby` for standby ranks), then :func:`watch_rank` to read what
it sends; everything about the child side of the fork is here too.

Each forked child, before the rank's runtime takes over: joins the launcher's private user
namespace where its run is covered (:mod:`nbtrain.system.privatenet`), leads its own process
group, sets PDEATHSIG, puts its stdout and stderr on pipes, closes every descriptor it does not
need, and keeps the store memfd (:mod:`nbtrain.system.rendezvous`) and the payload's memfd,
which the rank maps copy-on-write.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbtrain.launch_server import standby
from nbtrain.launch_server.launched import LauncherRun, RankProcess
from nbtrain.launch_server.rankpipes import RankOutput, RunLog
from nbtrain.messages import wire
from nbtrain.messages.events import RankAssignment, StartRun, StoreListening
from nbtrain.system import privatenet, processes, rendezvous, stepboard

HAND_OVER_SECONDS = 10.0  # a standby rank reads its run within this, or it is killed


@dataclass
class RankEnds:
    """The channel and the two output pipes of a rank being started: both ends of each."""

    launcher_end: socket.socket
    rank_end: socket.socket
    out_read: int
    out_write: int
    err_read: int
    err_write: int
    stack_read: int  # the rank's faulthandler dumps (nbtrain.messages.stacktext)
    stack_write: int

    @classmethod
    def open(cls) -> RankEnds:
        """All of them, or (EMFILE half way) none: what was opened is closed before raising."""
        launcher_end, rank_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pipes: list[int] = []
        try:
            for _ in range(3):
                pipes.extend(os.pipe())
        except OSError:
            for fd in pipes:
                os.close(fd)
            launcher_end.close()
            rank_end.close()
            raise
        return cls(launcher_end, rank_end, *pipes)

    def close_child_side(self) -> None:
        """After the fork: the rank holds these now."""
        for fd in (self.out_write, self.err_write, self.stack_write):
            os.close(fd)
        self.rank_end.close()

    def close_all(self) -> None:
        """Close both ends of each, tolerating those closed already."""
        for fd in (self.out_read, self.out_write, self.err_read, self.err_write, self.stack_read, self.stack_write):
            with contextlib.suppress(OSError):  # closed already (close_child_side ran)
                os.close(fd)
        self.launcher_end.close()
        self.rank_end.close()


@dataclass(frozen=True)
class RankFds:
    """The descriptors a new rank gets: its channel, stdout/stderr pipes, the store (its file on
    one machine; on a cluster, rank 0's listening socket), the payload's tensors, and the pipe
    for its stack dumps."""

    channel: int
    out: int
    err: int
    listen: int | None
    tensor: int | None
    stack: int

    @property
    def kept(self) -> list[int]:
        """The descriptors the rank keeps as they are (stdout and stderr become fds 1 and 2)."""
        return [fd for fd in (self.channel, self.listen, self.tensor, self.stack) if fd is not None]


def start_rank_process(
    assignment: RankAssignment,
    listen_fd: int | None,
    tensor_fd: int | None,
    log: RunLog | None,
    waits: bool = False,
    steps: tuple[stepboard.StepBoard | None, int] = (None, 0),
) -> RankProcess:
    """A new rank process and the launcher's ends of its channel and pipes; ``waits``: a standby rank,
    ``steps``: the step board its optimizer steps are counted on, and its slot there."""
    ends = RankEnds.open()
    try:
        pid = _create(assignment, ends, listen_fd, tensor_fd, waits, steps)
    except BaseException:
        ends.close_all()  # the fork failed: nothing holds the other ends
        raise
    ends.close_child_side()
    try:
        pidfd = processes.open_pidfd(pid)
    except OSError:
        processes.signal_group(pid, signal.SIGKILL)  # a rank we could not watch must not run
        processes.reap_now(pid)
        ends.close_all()
        raise
    pipes = {ends.out_read: "stdout", ends.err_read: "stderr"}
    output = RankOutput(assignment.spec.rank, log)
    return RankProcess(assignment.spec, pid, pidfd, ends.launcher_end, pipes, output, stack_fd=ends.stack_read)


def _create(
    assignment: RankAssignment,
    ends: RankEnds,
    listen_fd: int | None,
    tensor_fd: int | None,
    waits: bool = False,
    steps: tuple[stepboard.StepBoard | None, int] = (None, 0),
) -> int:
    fds = RankFds(ends.rank_end.fileno(), ends.out_write, ends.err_write, listen_fd, tensor_fd, ends.stack_write)
    if assignment.start.start_method == "spawn":
        return _spawn(assignment, fds)
    rank_end = ends.rank_end
    return processes.fork_rank(lambda: _rank_main(assignment, rank_end, fds, waits, steps))


def _spawn(assignment: RankAssignment, fds: RankFds) -> int:
    env = dict(assignment.start.environ)
    # The caller's environment has no NBTRAIN_ROLE; with it, nothing in the fresh
    # interpreter ever warms a launcher of its own (one more torch import per rank).
    env[processes.ROLE_VARIABLE] = "rank"
    argv = [
        sys.executable,
        "-m",
        "nbtrain.rank",
        str(fds.channel),
        str(-1 if fds.listen is None else fds.listen),
        str(-1 if fds.tensor is None else fds.tensor),
        str(fds.stack),
    ]
    # stdout/stderr go to the pipes; posix_spawn needs them on fds 1 and 2 of the child.
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fds.out, 1)
        os.dup2(fds.err, 2)
        pid = processes.spawn_rank(argv, env, fds.kept)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    return pid


def _rank_main(
    assignment: RankAssignment,
    channel: socket.socket,
    fds: RankFds,
    waits: bool = False,
    steps: tuple[stepboard.StepBoard | None, int] = (None, 0),
) -> None:
    """In the forked child: wire up stdio, drop the launcher's descriptors, run the rank
    (``waits``: prepare, then wait for a run's payload, nbtrain.launch_server.standby)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds.out, 1)
    os.dup2(fds.err, 2)
    close_all_but({0, 1, 2, *fds.kept, *privatenet.inherited_fds()})
    privatenet.enter(assignment.start)  # while this is the process's only thread
    # deferred: start-up time (cloudpickle, torch)
    from nbtrain.rank.machinery import collectives, runtime, stepcheck

    stepcheck.attach(*steps)
    collectives.attach_ledger(*steps)

    if waits:
        runtime.run_standby(assignment, channel, fds.listen, fds.stack)
    runtime.run_rank(assignment, channel, fds.listen, fds.tensor, fds.stack)


def close_all_but(keep: set[int]) -> None:
    """Close every descriptor of this process but ``keep`` (in a child just forked)."""
    # The child must not hold the launcher's channel to the kernel or other ranks' pipes:
    # those would keep channels open after their owners die and hide EOFs.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def signal_groups(ranks: list[RankProcess], number: int) -> None:
    """Signal each rank's process group, noting its members first."""
    # Note who is in each group before signalling it: a DataLoader worker killed between
    # torch's shm_open and shm_unlink leaves a /dev/shm entry named after its pid, which
    # _finish removes once the group is gone.
    if not ranks:
        return
    groups = processes.process_groups()
    for rank in ranks:
        rank.members.update(groups.get(rank.pid, ()))
        processes.signal_group(rank.pid, number)


def hand_run(rank: RankProcess, start: memoryview, fds: tuple[int, ...]) -> None:
    """Send a standby rank its run (the run's ``StartRun`` as a :func:`nbtrain.messages.wire.frame`, made once
    for every rank). One that died just now, or cannot read it (stuck before its wait), is killed:
    its exit fails the run as any rank's would, and nothing waits forever."""
    try:
        rank.channel.settimeout(HAND_OVER_SECONDS)
        wire.send_frame(rank.channel, start, fds)
    except OSError:
        processes.signal_group(rank.pid, signal.SIGKILL)
    finally:
        rank.channel.settimeout(None)


def send_quietly(channel: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Send to a rank; one already gone is not an error (its pidfd reports its exit)."""
    with contextlib.suppress(OSError):  # the rank is already gone; its exit is handled by its pidfd
        wire.send(channel, message, fds)


def step_board(start: StartRun) -> stepboard.StepBoard | None:
    """The board a run's ranks count their optimizer steps on, for a stop at a step. A spawned
    rank starts from nothing: it cannot share it. On a cluster's node the kernel chooses the step
    over every node's board (nbtrain.cluster.crossnodestop)."""
    return stepboard.StepBoard.create(len(start.ranks)) if start.start_method == "fork" else None


class RunStore:
    """What a run's ranks meet through, held by the launcher until its ranks have it (then ``close``).

    On one machine: a nameless store file every rank inherits (nbtrain.system.rendezvous), and no
    port (``port`` 0). On a cluster the node holding global rank 0 binds a socket (on the
    address the other nodes reach it at) that rank 0 hosts a TCPStore on, and reports its
    port; the other nodes are given it and hold nothing.
    """

    def __init__(self, fd: int | None, port: int, every_rank: bool, held: socket.socket | None = None):
        self.fd, self.port, self.every_rank, self.held = fd, port, every_rank, held

    def fd_for(self, rank: int) -> int | None:
        """The descriptor global rank ``rank`` inherits: the store file (each), or the bound socket (rank 0)."""
        return self.fd if self.every_rank or rank == 0 else None

    def close(self) -> None:
        """The ranks have their copies: the launcher's goes."""
        if self.held is not None:
            self.held.close()
        elif self.fd is not None:
            os.close(self.fd)
        self.fd = None


def bind_store(start: StartRun, send: Callable[[Any], None]) -> RunStore:
    """The store ``start``'s ranks will meet through (see :class:`RunStore`)."""
    node = start.node
    if node is None:
        return RunStore(rendezvous.store_file(), 0, every_rank=True)
    if node.master_port is not None:
        return RunStore(None, node.master_port, every_rank=False)
    store_socket = socket.create_server((node.master_addr, 0), backlog=max(128, 2 * len(start.ranks)))
    port = store_socket.getsockname()[1]
    send(StoreListening(start.run_id, port))
    return RunStore(store_socket.fileno(), port, every_rank=False, held=store_socket)


def watch_rank(selector: selectors.BaseSelector, run: LauncherRun, rank: RankProcess) -> None:
    """Make the loop read the rank's channel, pipes and stack dumps, and see its exit, as ``run``'s."""
    assert rank.stack_fd is not None
    os.set_blocking(rank.stack_fd, False)
    selector.register(rank.stack_fd, selectors.EVENT_READ, ("stack", run, rank))
    selector.register(rank.channel, selectors.EVENT_READ, ("events", run, rank))
    for fd in rank.pipes:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ, ("pipe", run, rank))
    selector.register(rank.pidfd, selectors.EVENT_READ, ("pidfd", run, rank))


def fork_standby(
    selector: selectors.BaseSelector, send: Callable[[Any], None], plan: StartRun, generation: standby.Generation
) -> list[RankProcess]:
    """Fork ``plan``'s ranks to wait for a run; only their exit and channel are watched meanwhile
    (their output waits in their pipes for the run that takes them)."""
    store = bind_store(plan, send)
    board = step_board(plan)  # the run that takes them stops on it
    ranks: list[RankProcess] = []
    try:
        for slot, spec in enumerate(plan.ranks):
            assignment = RankAssignment(plan, spec, store.port, os.getpid())
            rank = start_rank_process(assignment, store.fd_for(spec.rank), None, None, True, (board, slot))
            rank.step_board = board
            ranks.append(rank)
            selector.register(rank.pidfd, selectors.EVENT_READ, ("standby-exit", generation, rank))
            selector.register(rank.channel, selectors.EVENT_READ, ("standby-events", generation, rank))
    except OSError:
        for rank in ranks:  # a generation is whole or none
            processes.signal_group(rank.pid, signal.SIGKILL)
            processes.reap_now(rank.pid)
            selector.unregister(rank.pidfd)
            selector.unregister(rank.channel)
            rank.channel.close()
            for fd in (rank.pidfd, rank.stack_fd, *rank.pipes):
                if fd is not None:
                    os.close(fd)
        raise
    finally:
        store.close()
    return ranks
