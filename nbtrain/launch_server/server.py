"""The warm launcher: a clean, single-threaded process that forks ranks and supervises them.

It runs one loop over a selector: the kernel's channel (requests), and for each rank its
event socket, its stdout and stderr pipes and a pidfd that fires when it exits. It never
unpickles user code (the payload is opaque bytes that only the ranks load), so it never
imports the user's modules and a launch always runs the code the kernel has now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import select
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from nbtrain import events, processes, stacks, stopboard, wire
from nbtrain.events import (
    AttachHeld,
    DebugEnded,
    DebugInput,
    DebugOutput,
    DebugPrompt,
    DebugQuit,
    HeldReleased,
    MemorySample,
    Metrics,
    Output,
    OutputSkipped,
    RankAssignment,
    RankDone,
    RankExited,
    RankFailed,
    RankHeld,
    RankNotStarted,
    RanksDone,
    RankStarted,
    Release,
    ReleaseHeld,
    ReleaseRanks,
    ReleaseResult,
    ReleaseStandby,
    ResultOffer,
    RunEnded,
    SendResultFile,
    StartRun,
    StopRun,
    StopStep,
    StoreListening,
)
from nbtrain.launch_server import graceful, standby, tracker
from nbtrain.launch_server.output import STREAMS, RankOutput, RunLog

# Imported once here so that no rank pays for it: DistributedDataParallel's constructor
# alone imports torch._dynamo, 1.5-2 s per rank on a small machine.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.utils.data",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    # imported by the first record_function (DDP's forward, an optimizer's step): ~2 ms
    "torch.profiler._cupti_monitor",
    "cloudpickle",
    "nbtrain.sharedtensors",
    "nbtrain.rank.runtime",
)

STOP_GRACE_SECONDS = 0.5  # SIGTERM first; SIGKILL for what is left after this
# Before stopping a run that timed out or was stopped, each rank dumps its stack: wait for
# every dump to arrive and go quiet, but never longer than STACK_WAIT_SECONDS in all.
STACK_WAIT_SECONDS = 1.0
STACK_QUIET_SECONDS = 0.05
DRAIN_SECONDS = 1.0  # how long to wait for output pipes to close once every rank exited
MEMORY_SAMPLE_SECONDS = 0.5
TICK_SECONDS = 0.1
HAND_OVER_SECONDS = 10.0  # a standby rank reads its run within this, or it is killed


@dataclass
class RankProcess:
    spec: events.RankSpec
    pid: int
    pidfd: int
    channel: socket.socket
    pipes: dict[int, str]  # read fd -> "stdout" | "stderr"
    output: RankOutput
    done: bool = False
    failed: bool = False
    exited: bool = False
    members: set[int] = field(default_factory=set)  # pids seen in its process group
    stack_fd: int | None = None  # read end of the pipe its faulthandler dumps to
    stack: bytes = b""
    stack_asked: bool = False
    stack_seen_at: float = 0.0  # when the last bytes of its dump arrived
    held: bool = False  # the failed run's root cause, kept alive for a post-mortem
    held_until: float | None = None  # released then, unless a post-mortem is open
    cuda_bytes: int | None = None  # what it last reported holding on its GPU
    release_reason: str = "its debugger ended"  # what HeldReleased says when it is gone
    step_board: stopboard.StepBoard | None = None  # a standby rank's: the run that takes it stops on it


@dataclass
class Run:
    run_id: int
    ranks: list[RankProcess]
    deadline: float | None
    end_state: str | None = None  # set once the run is finishing or being stopped
    stop_started: float | None = None
    killed: bool = False
    stopped_outside: bool = False  # by the server extension, which SIGKILLs after its own grace
    failure: RankFailed | RankExited | RankNotStarted | None = None
    result: bytes | None = None
    result_fd: int | None = None
    offer: RankDone | None = None  # rank 0's result, tensors still in its memory
    result_pending: bool = False  # the kernel has not taken rank 0's result yet
    all_exited_at: float | None = None
    last_memory_sample: float = 0.0
    hold: bool = False  # a cluster run: done ranks wait for ReleaseRanks (every node done)
    stacks_until: float | None = None  # collecting stack dumps before the stop, until then
    log: RunLog | None = None  # every rank's full output
    last_skipped_report: float = 0.0
    debug_hold: float | None = None  # seconds a failed run's root-cause rank is held
    debugging: set[int] = field(default_factory=set)  # ranks at a pdb prompt: the timeout waits
    paused_at: float = 0.0  # when the first of them stopped
    detail: str = ""  # how a stop came, for RunEnded
    held_text: str | None = None  # its held rank, as the sidebar lists it
    plan: StartRun | None = None  # what standby ranks for the next run are forked for
    board: stopboard.StepBoard | None = None  # the ranks' optimizer steps (forked ranks only)
    on_stop: str = "keep"
    stop_grace: float = 2.0
    graceful: graceful.GracefulStop | None = None
    stop_note: str = ""  # why a stop could not keep the state (sent with RunEnded)
    late: list[int] = field(default_factory=list)  # the ranks a graceful stop gave up on


class Launcher:
    def __init__(self, control: socket.socket, parent_pid: int, kernel_pidfd: int | None = None):
        """``kernel_pidfd``: a launcher forked by the warm template watches its kernel through
        it (its parent is the template, whose death must not end it)."""
        self.control = control
        self.parent_pid = parent_pid
        self.watch_parent = kernel_pidfd is None
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, ("control", None, None))
        if kernel_pidfd is not None:
            self.selector.register(kernel_pidfd, selectors.EVENT_READ, ("kernel", None, None))
        self.runs: dict[int, Run] = {}
        self.held: dict[int, tuple[Run, RankProcess]] = {}  # run id -> its rank held for a post-mortem
        self.board = tracker.Board(tracker.find_owner(parent_pid))
        self.standby = standby.Pool(
            self.selector, self._fork_standby, self._send, self.board.show_standby, self.board.standby_dismissed
        )

    # -- main loop ---------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            timeout = TICK_SECONDS if self.runs else 0.5 if self.held else 1.0
            for key, _ in self.selector.select(timeout):
                kind, run, rank = key.data
                if kind == "control":
                    if not self._on_control():
                        return self._shutdown()
                elif kind == "kernel":  # the kernel died
                    return self._shutdown()
                elif kind == "events":
                    self._on_rank_event(run, rank)
                elif kind == "pipe":
                    self._on_output(run, rank, key.fd)
                elif kind == "pidfd" and rank.held and run.run_id not in self.runs:
                    self._on_held_exit(run, rank)
                elif kind == "pidfd":
                    self._on_exit(run, rank)
                elif kind == "stack":
                    self._on_stack(rank)
                elif kind == "standby-events":
                    self.standby.on_message(run, rank)
                elif kind == "standby-exit":
                    self.standby.on_exit(run, rank)
            # the kernel died and its socket is held elsewhere
            if self.watch_parent and os.getppid() != self.parent_pid:
                return self._shutdown()
            # Before _tick ends a run: what a rank left behind must not hold its pipes open.
            processes.kill_strays(self._live_ranks())
            self._tick(time.monotonic())
            self._tick_held(time.monotonic())

    def _live_ranks(self) -> set[int]:
        """The pids of ranks not yet reaped: the launcher's only legitimate children."""
        live = {rank.pid for run in self.runs.values() for rank in run.ranks if not rank.exited}
        return live | {rank.pid for _run, rank in self.held.values()} | self.standby.pids()

    def _on_control(self) -> bool:
        try:
            message, fds = wire.receive(self.control)
        except (wire.ChannelClosed, OSError):
            return False
        if isinstance(message, StartRun):
            self._start(message, fds[0] if fds else None)
        elif isinstance(message, StopRun):
            run = self.runs.get(message.run_id)
            if run is not None:
                self._on_stop_request(run, message.graceful)
        elif isinstance(message, ReleaseResult):
            run = self.runs.get(message.run_id)
            if run is not None and run.result_pending:
                if message.send_file:
                    rank_zero = next(rank for rank in run.ranks if rank.spec.rank == 0)
                    _send_quietly(rank_zero.channel, SendResultFile(run.run_id))
                else:
                    self._release(run)
        elif isinstance(message, (DebugInput, AttachHeld, ReleaseHeld)):
            self._on_debug_request(message)
        elif isinstance(message, ReleaseStandby):
            ended = self.standby.release(time.monotonic() + standby.RELEASE_SECONDS)
            self._send(events.StandbyChanged(released=tuple(sorted(ended))))
        elif isinstance(message, events.StepChosen):  # a cluster's kernel chose the step over every node
            run = self.runs.get(message.run_id)
            stop = None if run is None or run.end_state is not None else run.graceful
            if run is not None and stop is not None and run.board and stop.adopt(run.board, message, time.monotonic()):
                self._announce_step(run, stop)
        elif isinstance(message, ReleaseRanks):
            run = self.runs.get(message.run_id)
            if run is not None and run.hold:
                run.hold = False
                self._release(run)
        return True

    def _on_stop_request(self, run: Run, gracefully: bool) -> None:
        # The reason is the caller's words, not a state: the run ends STOPPED (which the
        # kernel turns into RunStoppedError). A run whose result the kernel has taken
        # keeps it, and one already failing keeps its failure; a result not taken yet
        # is given up (the kernel does not copy it), and rank 0 is stopped with the rest.
        # Every rank is done: the result on its way is what a stop at a step would keep, when the
        # run took an optimizer step; one that never did stops as before, its result given up.
        finished = run.end_state == events.FINISHED and _stepped(run)
        if gracefully and (finished or self._stop_gracefully(run, events.STOPPED)):
            return
        if gracefully and run.graceful is not None and run.graceful.across_nodes:
            return  # a cluster's node stopping already (its own timeout): the kernel asks every node once
        if run.graceful is not None and run.end_state is None:  # asked again while stopping at a step
            run.graceful.gave_up = True
            run.stop_note = "stopped hard at once (asked to stop a second time)"
            run.end_state = events.STOPPED
            self._stop_now(run)  # no stack dumps: a second stop means now
            return
        if run.end_state is None or run.result_pending:
            run.result_pending = False
            run.end_state = None
            self._stop(run, events.STOPPED)

    def _stop_gracefully(self, run: Run, state: str) -> bool:
        """Begin a stop at a step boundary (nbtrain.launch_server.graceful); False when the run cannot have one."""
        if run.end_state is not None or run.graceful is not None or run.stop_started or run.stacks_until:
            return False
        run.stop_note = graceful.why_none(run.board, run.on_stop)
        if run.board is None or run.on_stop != "keep" or run.stop_note:
            return False
        run.board.request_stop()
        run.graceful = graceful.GracefulStop(state, time.monotonic(), across_nodes=run.hold)
        entry = self.board.get(run.run_id)
        if entry is not None:
            entry.update(state="stopping")
        return True

    def _note_steps(self, run: Run) -> None:
        """Once a rank has begun an optimizer step, the run's record says a stop request can keep its state."""
        entry = self.board.get(run.run_id)
        if entry is None or entry.record.stop_at_step or run.end_state is not None:
            return
        if _stepped(run):
            entry.update(stop_at_step=True)

    def _follow_graceful(self, run: Run, now: float) -> None:
        """Choose the stop step when it is time; stop hard once the grace is over."""
        stop = run.graceful
        if stop is None or run.board is None or run.end_state is not None:
            return
        report = stop.report(run.run_id, run.board, run.stop_grace, now)  # a cluster's node: the kernel chooses
        if report is not None:
            self._send(report)
        if stop.choose(run.board, run.stop_grace, now):
            if not stop.step:  # every rank's count went back to none meanwhile: nothing to keep
                stop.gave_up = True
                run.stop_note = graceful.why_none(run.board, run.on_stop)
                self._stop(run, stop.state)
                return
            self._announce_step(run, stop)
        elif stop.overdue(now):
            stop.gave_up = True
            run.late = [rank.spec.rank for rank in run.ranks if not rank.done]
            run.stop_note = self._laggards(run)
            self._stop(run, stop.state)  # its stack dumps then say who waited for whom (_finish)

    def _announce_step(self, run: Run, stop: graceful.GracefulStop) -> None:
        assert stop.step is not None
        self._send(StopStep(run.run_id, stop.step, stop.grace))
        entry = self.board.get(run.run_id)
        if entry is not None:  # the server extension signals the ranks itself after this
            entry.update(stop_deadline=time.time() + stop.grace)

    def _laggards(self, run: Run) -> str:
        """The note naming the ranks that kept a graceful stop from its step (after the dumps: not those waiting)."""
        if run.graceful is None or run.board is None:
            return run.stop_note
        slots = {rank.spec.rank: index for index, rank in enumerate(run.ranks)}
        waiting = frozenset(r.spec.rank for r in run.ranks if r.stack and stacks.waits_on_peers(_frames(r)))
        backward = frozenset(r.spec.rank for r in run.ranks if r.stack and stacks.in_backward(_frames(r)))
        return graceful.laggards_note(run.graceful, run.board, run.late, slots, waiting, backward)

    def _send(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            wire.send(self.control, message, fds)
        except OSError:
            pass  # the kernel is gone; the next select sees EOF and shuts down

    # -- starting ranks ----------------------------------------------------------------
    def _start(self, start: StartRun, tensor_fd: int | None) -> None:
        run = Run(start.run_id, [], None if start.timeout is None else time.monotonic() + start.timeout)
        run.hold = start.node is not None
        run.debug_hold = start.debug_hold
        self._release_held(f"the next launch (run {start.run_id}) needs its devices")
        run.log = RunLog(start.log_path) if start.log_path else None
        run.plan = standby.plan_of(start)
        run.on_stop, run.stop_grace = start.on_stop, start.stop_grace
        run.board = _step_board(start)
        self.runs[start.run_id] = run
        taken = self.standby.take(start)
        if taken is not None:
            self._start_taken(run, start, taken, tensor_fd)
            return
        store_socket = None
        try:
            store_socket, port = self._store_socket(start)
            for slot, spec in enumerate(start.ranks):
                assignment = RankAssignment(start, spec, port, os.getpid())
                listen_fd = store_socket.fileno() if store_socket is not None and spec.rank == 0 else None
                run.ranks.append(self._start_rank(run, assignment, listen_fd, tensor_fd, slot))
        except OSError as error:
            # On a cluster a node's first rank is not rank 0: name the global rank.
            first = start.ranks[len(run.ranks)].rank if len(run.ranks) < len(start.ranks) else len(run.ranks)
            # EAGAIN (a process limit), ENOMEM, EMFILE: the run cannot have all its ranks, so it
            # ends now, and the ranks already started (waiting for their peers) are stopped.
            name = errno.errorcode.get(error.errno or 0, type(error).__name__)
            reason = error.strerror or str(error)
            run.failure = RankNotStarted(run.run_id, first, len(start.ranks), name, reason)
            self._stop(run, events.FAILED)
        finally:
            self.board.start(start, [(rank.spec.rank, rank.pid) for rank in run.ranks])
            # The store's port stayed bound from here until rank 0 took the socket over:
            # no other process could take it in between.
            if store_socket is not None:
                store_socket.close()
            if tensor_fd is not None:
                os.close(tensor_fd)

    def _store_socket(self, start: StartRun) -> tuple[socket.socket | None, int]:
        """The bound socket rank 0 will host the store on, and its port.

        On a cluster only the node holding global rank 0 binds one (on the address the
        other nodes reach it at) and reports its port; the other nodes are given it.
        """
        node = start.node
        if node is not None and node.master_port is not None:
            return None, node.master_port
        address = "127.0.0.1" if node is None else node.master_addr
        store_socket = socket.create_server((address, 0), backlog=max(128, 2 * len(start.ranks)))
        port = store_socket.getsockname()[1]
        if node is not None:
            self._send(StoreListening(start.run_id, port))
        return store_socket, port

    def _start_rank(
        self, run: Run, assignment: RankAssignment, listen_fd: int | None, tensor_fd: int | None, slot: int = 0
    ) -> RankProcess:
        rank = self._fork_rank(assignment, listen_fd, tensor_fd, run.log, steps=(run.board, slot))
        self._watch(run, rank)
        if assignment.start.start_method == "spawn":
            _send_quietly(rank.channel, assignment)  # a fresh interpreter has nothing in memory
        self._send(RankStarted(run.run_id, assignment.spec.rank, rank.pid))
        return rank

    def _fork_rank(
        self,
        assignment: RankAssignment,
        listen_fd: int | None,
        tensor_fd: int | None,
        log: RunLog | None,
        waits: bool = False,
        steps: tuple[stopboard.StepBoard | None, int] = (None, 0),
    ) -> RankProcess:
        """A new rank process and the launcher's ends of its channel and pipes; ``waits``: a standby rank,
        ``steps``: the step board its optimizer steps are counted on, and its slot there."""
        ends = _RankEnds.open()
        try:
            pid = self._create(assignment, ends, listen_fd, tensor_fd, waits, steps)
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
        rank = RankProcess(assignment.spec, pid, pidfd, ends.launcher_end, pipes, output)
        rank.stack_fd = ends.stack_read
        return rank

    def _watch(self, run: Run, rank: RankProcess) -> None:
        """Make the loop read the rank's channel, pipes and stack dumps, and see its exit, as ``run``'s."""
        assert rank.stack_fd is not None
        os.set_blocking(rank.stack_fd, False)
        self.selector.register(rank.stack_fd, selectors.EVENT_READ, ("stack", run, rank))
        self.selector.register(rank.channel, selectors.EVENT_READ, ("events", run, rank))
        for fd in rank.pipes:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", run, rank))
        self.selector.register(rank.pidfd, selectors.EVENT_READ, ("pidfd", run, rank))

    # -- standby ranks (nbtrain.launch_server.standby) ---------------------------------
    def _fork_standby(self, plan: StartRun, generation: standby.Generation) -> list[RankProcess]:
        """Fork ``plan``'s ranks to wait for a run; only their exit and channel are watched meanwhile
        (their output waits in their pipes for the run that takes them)."""
        store_socket, port = self._store_socket(plan)
        board = _step_board(plan)  # the run that takes them stops on it
        ranks: list[RankProcess] = []
        try:
            for slot, spec in enumerate(plan.ranks):
                listen_fd = store_socket.fileno() if store_socket is not None and spec.rank == 0 else None
                assignment = RankAssignment(plan, spec, port, os.getpid())
                rank = self._fork_rank(assignment, listen_fd, None, None, True, (board, slot))
                rank.step_board = board
                ranks.append(rank)
                self.selector.register(rank.pidfd, selectors.EVENT_READ, ("standby-exit", generation, rank))
                self.selector.register(rank.channel, selectors.EVENT_READ, ("standby-events", generation, rank))
        except OSError:
            for rank in ranks:  # a generation is whole or none
                processes.signal_group(rank.pid, signal.SIGKILL)
                processes.reap_now(rank.pid)
                self.selector.unregister(rank.pidfd)
                self.selector.unregister(rank.channel)
                rank.channel.close()
                for fd in (rank.pidfd, rank.stack_fd, *rank.pipes):
                    if fd is not None:
                        os.close(fd)
            raise
        finally:
            if store_socket is not None:
                store_socket.close()
        return ranks

    def _start_taken(self, run: Run, start: StartRun, ranks: list[RankProcess], tensor_fd: int | None) -> None:
        """Hand the run to standby ranks: its StartRun and payload memfd to each, over its channel."""
        fds = () if tensor_fd is None else (tensor_fd,)
        if run.board is not None:  # the board the ranks were forked with is the run's
            run.board.close()
        run.board = ranks[0].step_board if ranks else None
        try:
            for rank in ranks:
                rank.output.log = run.log
                run.ranks.append(rank)
                self._watch(run, rank)
                _hand_run(rank, start, fds)
                self._send(RankStarted(run.run_id, rank.spec.rank, rank.pid))
        finally:
            self.standby.changed()  # they wait no more
            self.board.start(start, [(rank.spec.rank, rank.pid) for rank in run.ranks])
            if tensor_fd is not None:
                os.close(tensor_fd)

    def _create(
        self,
        assignment: RankAssignment,
        ends: _RankEnds,
        listen_fd: int | None,
        tensor_fd: int | None,
        waits: bool = False,
        steps: tuple[stopboard.StepBoard | None, int] = (None, 0),
    ) -> int:
        fds = RankFds(ends.rank_end.fileno(), ends.out_write, ends.err_write, listen_fd, tensor_fd, ends.stack_write)
        if assignment.start.start_method == "spawn":
            return self._spawn(assignment, fds)
        rank_end = ends.rank_end
        return processes.fork_rank(lambda: _rank_main(assignment, rank_end, fds, waits, steps))

    def _spawn(self, assignment: RankAssignment, fds: RankFds) -> int:
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

    # -- events from ranks -------------------------------------------------------------
    def _on_rank_event(self, run: Run, rank: RankProcess) -> None:
        if not self._registered(rank.channel) or not _readable_now(rank.channel):
            return  # already read (or closed) by _on_exit in this same round of select
        try:
            message, fds = wire.receive(rank.channel)
        except (wire.ChannelClosed, OSError):
            self.selector.unregister(rank.channel)
            return
        if isinstance(message, (DebugOutput, DebugPrompt, DebugEnded, DebugQuit)):
            self._on_debug_event(run, rank, message)
        elif isinstance(message, (Metrics, MemorySample)):
            if isinstance(message, MemorySample) and message.cuda_allocated_bytes is not None:
                rank.cuda_bytes = message.cuda_reserved_bytes or message.cuda_allocated_bytes
            self._send(message)
            entry = self.board.get(run.run_id)
            if entry is not None and isinstance(message, Metrics):
                entry.on_metrics(message)
        elif isinstance(message, RankFailed):
            rank.failed = True
            if self._stopped_from_outside(run):
                return  # a peer's signal broke its collective: not a failure of the run
            self._send(message)
            if run.failure is None:
                run.failure = message
                # The root cause stays alive, paused in its frames, for a post-mortem.
                rank.held = run.debug_hold is not None and run.stop_started is None
            self._stop(run, events.FAILED)
        elif isinstance(message, RankDone):
            rank.done = True
            if message.regions:
                run.offer = message
            elif message.result is not None:  # no tensors, or their file: all of it is here
                run.result = message.result
                run.result_fd = fds[0] if fds else None
                if run.result_pending:  # the file the kernel asked for: the result is safe
                    self._release(run)
            if all(r.done for r in run.ranks) and run.end_state is None:
                # Every rank ended its cell at the stop step: the run keeps its result, and says it stopped.
                stopped = run.graceful is not None and not run.graceful.gave_up
                run.end_state = run.graceful.state if stopped and run.graceful else events.FINISHED
                self._hand_over(run)

    def _hand_over(self, run: Run) -> None:
        """Every rank is done: release them all, or first offer rank 0's result to the kernel.

        While the kernel reads rank 0's memory, the other ranks wait too: their exits free
        memory, which takes CPU the read needs on a small machine; afterwards all exits overlap.
        """
        offer = run.offer
        if offer is None or offer.result is None:  # rank 0 offers regions with its result only
            self._release(run)
            return
        run.result_pending = True
        rank_zero = next(rank for rank in run.ranks if rank.spec.rank == 0)
        self._send(ResultOffer(run.run_id, rank_zero.pid, offer.result, offer.regions, offer.total_bytes))

    def _release(self, run: Run) -> None:
        run.result_pending = False
        if run.hold:  # the caller releases every node's ranks together
            self._send(RanksDone(run.run_id))
            return
        for rank in run.ranks:
            _send_quietly(rank.channel, Release(run.run_id))

    def _on_output(self, run: Run, rank: RankProcess, fd: int) -> None:
        stream = rank.pipes[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_pipe(rank, fd)
            self._send_output(run, rank, rank.output.flush(stream, final=True))
            return
        # Bounded (nbtrain.launch_server.output): past the first lines only the last are
        # kept, so a flood costs the kernel nothing and cannot outlast a stop.
        self._send_output(run, rank, rank.output.feed(stream, data))

    def _send_output(self, run: Run, rank: RankProcess, pieces: list[tuple[str, str]]) -> None:
        for stream, text in pieces:
            self._send(Output(run.run_id, rank.spec.rank, stream, text))

    def _close_pipe(self, rank: RankProcess, fd: int) -> None:
        self.selector.unregister(fd)
        os.close(fd)
        del rank.pipes[fd]

    def _on_exit(self, run: Run, rank: RankProcess) -> None:
        # Kill the rank's group while its leader is still an unreaped zombie: the group id
        # cannot have been reused yet, and stray DataLoader workers go with it.
        self._signal_groups([rank], signal.SIGKILL)
        status = processes.reap(rank.pid)
        if status is None:
            return
        exit_code, signal_number = status
        self.selector.unregister(rank.pidfd)
        os.close(rank.pidfd)
        rank.exited = True
        # What the rank sent just before exiting may still be unread: its channel and its
        # pidfd can be ready in the same select, in either order. Read it first, or a rank
        # that reported its exception and exited would count as one that died silently.
        while self._registered(rank.channel) and _readable_now(rank.channel):
            self._on_rank_event(run, rank)
        # Rank 0 holding a result the kernel has not taken yet has not finished its part.
        reported = (rank.done and not (rank.spec.rank == 0 and run.result_pending)) or rank.failed
        if not reported:
            self._stopped_from_outside(run)
        if rank.spec.rank == 0:
            run.result_pending = False
        ours = _our_signal(run, signal_number)
        exited = RankExited(
            run.run_id, rank.spec.rank, exit_code, signal_number, reported,
            # A signal we did not send (an OOM kill, a segfault) is the rank's own death even
            # when it is reaped after the stop began: its peers' errors race ahead of it.
            stopped=(run.stop_started is not None or run.stacks_until is not None) and (signal_number is None or ours),
        )
        self._send(exited)
        if not reported and run.end_state in (None, events.FINISHED):
            if run.failure is None:
                run.failure = exited
            run.end_state = None  # a rank died after the others finished: still a failure
            self._stop(run, events.FAILED)
        elif not reported and not ours and run.end_state == events.FAILED and isinstance(run.failure, RankFailed):
            # A rank that dies hard (OOM kill, segfault, os._exit) closes its sockets before
            # its pidfd fires, so a peer blocked in a collective can report the broken
            # connection first. Unless this death is our own stop signal, it is the cause
            # and the peer's error its consequence.
            run.failure = exited
            self._unhold(run)
        if all(r.exited or r.held for r in run.ranks):
            run.all_exited_at = time.monotonic()

    def _registered(self, fileobj: Any) -> bool:
        try:
            self.selector.get_key(fileobj)
        except KeyError:
            return False
        return True

    # -- stopping and finishing --------------------------------------------------------
    def _stopped_from_outside(self, run: Run) -> bool:
        """Whether the run was stopped from the browser (the server extension signals the
        ranks itself after leaving a stop request): it then ends as stopped, not failed.
        While the ranks go to a stop step nobody signals them: a rank that fails then fails."""
        if run.stop_started is None and run.graceful is None and self.board.stop_requested(run.run_id):
            self._stop_asked_outside(run)
        return run.end_state == events.STOPPED

    def _stop_asked_outside(self, run: Run) -> None:
        """Stop a run asked to stop through the registry, without asking for stack dumps: the
        server signals every rank itself as it asks, so a rank still alive is already dying
        and would only be reported as one that "did not answer in time"."""
        if run.stop_started is not None or run.stacks_until is not None or run.graceful is not None:
            return
        if self._stop_gracefully(run, events.STOPPED):
            return  # the record says so (stop_at_step): the server leaves the ranks to this launcher
        run.end_state = events.STOPPED
        run.stopped_outside = True
        self._stop_now(run)

    def _stop(self, run: Run, state: str) -> None:
        if run.stop_started is not None or run.stacks_until is not None:
            return
        run.end_state = state
        if state in (events.STOPPED, events.TIMED_OUT) and self._ask_for_stacks(run):
            return  # _tick stops the ranks once their dumps are in
        self._stop_now(run)

    def _stop_now(self, run: Run) -> None:
        run.stacks_until = None
        run.stop_started = time.monotonic()
        entry = self.board.get(run.run_id)
        if entry is not None:
            entry.update(state="stopping")
        self._signal_groups([rank for rank in run.ranks if not rank.exited and not rank.held], signal.SIGTERM)

    def _ask_for_stacks(self, run: Run) -> bool:
        """Signal every live rank for its stack dump; False when none can answer."""
        for rank in run.ranks:
            rank.stack_asked = not rank.exited and processes.request_stack(rank.pid)
        if not any(rank.stack_asked for rank in run.ranks):
            return False
        run.stacks_until = time.monotonic() + STACK_WAIT_SECONDS
        return True

    def _stacks_in(self, run: Run, now: float) -> bool:
        return all(
            rank.exited or not rank.stack_asked or (rank.stack and now - rank.stack_seen_at > STACK_QUIET_SECONDS)
            for rank in run.ranks
        )

    def _on_stack(self, rank: RankProcess) -> None:
        assert rank.stack_fd is not None
        try:
            data = os.read(rank.stack_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # every holder of the write end is gone
            self._close_stack(rank)
            return
        rank.stack += data
        rank.stack_seen_at = time.monotonic()

    def _close_stack(self, rank: RankProcess) -> None:
        if rank.stack_fd is not None:
            self.selector.unregister(rank.stack_fd)
            os.close(rank.stack_fd)
            rank.stack_fd = None

    def _signal_groups(self, ranks: list[RankProcess], number: int) -> None:
        # Note who is in each group before signalling it: a DataLoader worker killed between
        # torch's shm_open and shm_unlink leaves a /dev/shm entry named after its pid, which
        # _finish removes once the group is gone.
        if not ranks:
            return
        groups = processes.process_groups()
        for rank in ranks:
            rank.members.update(groups.get(rank.pid, ()))
            processes.signal_group(rank.pid, number)

    def _tick(self, now: float) -> None:
        self.standby.tick(now)
        for run_id in self.board.tick(now):  # stop requests, looked for about once a second
            run = self.runs.get(run_id)
            if run is not None and run.end_state is None:
                self._stop_asked_outside(run)
        for run in list(self.runs.values()):
            timed_out = run.deadline is not None and now > run.deadline and run.graceful is None
            timed_out = timed_out and not run.debugging  # a rank at a pdb prompt: the clock waits
            if timed_out and run.end_state is None and not self._stop_gracefully(run, events.TIMED_OUT):
                self._stop(run, events.TIMED_OUT)
            self._follow_graceful(run, now)
            self._note_steps(run)
            if run.stacks_until is not None and (now > run.stacks_until or self._stacks_in(run, now)):
                self._stop_now(run)
            if run.stop_started is not None and not run.killed and now - run.stop_started > STOP_GRACE_SECONDS:
                run.killed = True
                self._signal_groups([rank for rank in run.ranks if not rank.exited and not rank.held], signal.SIGKILL)
            if (
                run.all_exited_at is None
                and run.end_state is not None
                and run.stacks_until is None
                and all(r.exited or r.held for r in run.ranks)
            ):
                run.all_exited_at = now  # also covers a run whose ranks could not all start
            self._sample_memory(run, now)
            for rank in run.ranks:
                for stream in STREAMS:  # a line in progress: a prompt, a progress bar redrawn with "\r"
                    self._send_output(run, rank, rank.output.flush(stream))
            self._report_skipped(run, now)
            if run.all_exited_at is not None:
                drained = not any(rank.pipes for rank in run.ranks if not rank.held)
                if drained or now - run.all_exited_at > DRAIN_SECONDS:
                    self._finish(run)

    def _report_skipped(self, run: Run, now: float) -> None:
        """Twice a second, tell the live view about lines the cell does not show (a flood)."""
        if now - run.last_skipped_report < MEMORY_SAMPLE_SECONDS:
            return
        run.last_skipped_report = now
        for rank in run.ranks:
            skipped = rank.output.skipped()
            if skipped is not None:
                self._send(OutputSkipped(run.run_id, rank.spec.rank, *skipped))

    def _sample_memory(self, run: Run, now: float) -> None:
        if now - run.last_memory_sample < MEMORY_SAMPLE_SECONDS:
            return
        run.last_memory_sample = now
        for rank in run.ranks:
            if not rank.exited:
                rss = processes.resident_bytes(rank.pid)
                if rss is not None:
                    self._send(MemorySample(run.run_id, rank.spec.rank, rss, time=time.time()))

    def _finish(self, run: Run) -> None:
        for rank in run.ranks:
            if rank.held and not rank.exited:
                self._keep_held(run, rank)
                continue
            for fd in list(rank.pipes):
                self._close_pipe(rank, fd)
            self._send_output(run, rank, rank.output.finish())  # the note, and the last lines held back
            try:
                self.selector.unregister(rank.channel)
            except (KeyError, ValueError):
                pass
            rank.channel.close()
            self._close_stack(rank)
            # Its pipes are drained, so every process that held them (workers too) is gone.
            processes.remove_torch_shared_memory({rank.pid, *rank.members})
        del self.runs[run.run_id]
        if run.log is not None:
            run.log.close()
        if run.late:
            run.stop_note = self._laggards(run)
        if run.board is not None:
            run.board.close()
        state = run.end_state or events.FAILED
        kept = _kept_step(run)
        entry = self.board.get(run.run_id)
        if entry is not None and kept is not None:
            entry.update(stopped_at=kept)
        self.board.end(run.run_id, state, run.held_text)
        if (state == events.FINISHED or kept is not None) and run.failure is None:
            fds = () if run.result_fd is None else (run.result_fd,)
            self._send(RunEnded(run.run_id, state, run.result, run.result_fd is not None, stopped_at=kept), fds)
        else:
            failed = RunEnded(run.run_id, state, failure=run.failure, detail=run.detail, stacks=_stacks(run))
            self._send(dataclasses.replace(failed, stop_note=run.stop_note))
        if run.result_fd is not None:
            os.close(run.result_fd)
        # After a stop or a timeout the user wants things to stop: no new processes until a run
        # asks. While other runs go on, none either: forking would take CPU from them.
        if run.plan is not None and state in (events.FINISHED, events.FAILED) and not self.runs:
            self.standby.after_run(run.plan)

    # -- the debugger relay and the held rank (nbtrain.rank.debugger) ----------------------
    def _on_debug_event(self, run: Run, rank: RankProcess, message: Any) -> None:
        """pdb's output and prompts go to the kernel; while a rank sits at a prompt the
        run's timeout waits (the user is reading, not the rank hanging)."""
        now = time.monotonic()
        if isinstance(message, DebugQuit):  # `q`: the user ended the run
            if run.end_state is None:
                run.end_state = events.STOPPED
                run.detail = f"the run was stopped by `q` in rank {message.rank}'s debugger; every rank is gone."
                self._stop_now(run)
            return
        if isinstance(message, DebugPrompt) and rank.held:
            rank.held_until = None  # a post-mortem is open: no idle clock while it lasts
        elif isinstance(message, DebugPrompt):
            if not run.debugging:
                run.paused_at = now
            run.debugging.add(rank.spec.rank)
        elif isinstance(message, DebugEnded) and rank.spec.rank in run.debugging:
            run.debugging.discard(rank.spec.rank)
            if not run.debugging and run.deadline is not None:
                run.deadline += now - run.paused_at
        self._send(message)

    def _on_debug_request(self, message: DebugInput | AttachHeld | ReleaseHeld) -> None:
        """The kernel's side of the relay: only to a rank of one of its runs, by run and rank."""
        if isinstance(message, ReleaseHeld):
            self._release_held(message.reason, message.run_id)
            return
        target = self._debug_target(message.run_id, message.rank)
        if target is None:
            if isinstance(message, AttachHeld):
                self._send(HeldReleased(message.run_id, message.rank, "it was no longer held"))
            return
        if isinstance(message, AttachHeld):
            target.held_until = None
        _send_quietly(target.channel, message)

    def _debug_target(self, run_id: int, rank_number: int) -> RankProcess | None:
        held = self.held.get(run_id)
        if held is not None and held[1].spec.rank == rank_number:
            return held[1]
        run = self.runs.get(run_id)
        ranks = [] if run is None else [r for r in run.ranks if r.spec.rank == rank_number and not r.exited]
        return ranks[0] if ranks else None

    def _keep_held(self, run: Run, rank: RankProcess) -> None:
        """The run ends; its root-cause rank lives on, paused in its frames, until released."""
        for fd in list(rank.pipes):  # what it prints from now on (in pdb, its relay) is not the run's
            self._close_pipe(rank, fd)
        self._send_output(run, rank, rank.output.finish())
        self._close_stack(rank)
        hold = run.debug_hold or 0.0
        rank.held_until = time.monotonic() + hold
        self.held[run.run_id] = (run, rank)
        spec = rank.spec
        device = spec.device_type if spec.device_index is None else f"{spec.device_type}:{spec.device_index}"
        rss = processes.resident_bytes(rank.pid)
        self._send(RankHeld(run.run_id, spec.rank, rank.pid, rss, rank.cuda_bytes, hold, device))
        memory = f"{(rss or 0) >> 20} MiB of host memory" + (
            f" and {rank.cuda_bytes >> 20} MiB on {device}" if rank.cuda_bytes else ""
        )
        run.held_text = f"rank {spec.rank} (pid {rank.pid}) kept for %nbtrain_debug, holding {memory}"

    def _release_held(self, reason: str, run_id: int | None = None) -> None:
        """End held ranks (all, or ``run_id``'s): their pidfd then reports them gone."""
        for held_id, (_run, rank) in list(self.held.items()):
            if run_id is None or held_id == run_id:
                rank.held_until = None
                rank.release_reason = reason
                self._signal_groups([rank], signal.SIGKILL)

    def _unhold(self, run: Run) -> None:
        """A hard death turned out to be the cause: the rank held for it is stopped as the rest."""
        for rank in run.ranks:
            if rank.held and not rank.exited:
                rank.held = False
                if run.stop_started is not None:
                    self._signal_groups([rank], signal.SIGTERM)

    def _on_held_exit(self, run: Run, rank: RankProcess) -> None:
        self._signal_groups([rank], signal.SIGKILL)  # what it started goes with it
        if processes.reap(rank.pid) is None:
            return
        self.selector.unregister(rank.pidfd)
        os.close(rank.pidfd)
        rank.exited = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(rank.channel)
        rank.channel.close()
        processes.remove_torch_shared_memory({rank.pid, *rank.members})
        self.held.pop(run.run_id, None)
        if self.board.released(run.run_id) and rank.release_reason == RankProcess.release_reason:
            rank.release_reason = "it was dismissed in the JupyterLab sidebar"
        self._send(HeldReleased(run.run_id, rank.spec.rank, rank.release_reason))

    def _tick_held(self, now: float) -> None:
        for _run, rank in list(self.held.values()):
            if rank.held_until is not None and now > rank.held_until:
                rank.held_until = None
                rank.release_reason = "it was held idle for its whole hold time"
                self._signal_groups([rank], signal.SIGKILL)

    def _shutdown(self) -> None:
        self.standby.shutdown(time.monotonic() + 2.0)
        self.board.close()
        held = [rank for _run, rank in self.held.values()]
        self.held.clear()
        self._signal_groups(held, signal.SIGKILL)
        for run in self.runs.values():
            self._signal_groups([rank for rank in run.ranks if not rank.exited], signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        for run in self.runs.values():
            for rank in run.ranks:
                while not rank.exited and processes.reap(rank.pid) is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                processes.remove_torch_shared_memory({rank.pid, *rank.members})
        for rank in held:
            while processes.reap(rank.pid) is None and time.monotonic() < deadline:
                time.sleep(0.01)
        # What the ranks left behind is ours now; once the launcher is gone it would be init's.
        while processes.kill_strays(self._live_ranks()) and time.monotonic() < deadline:
            time.sleep(0.01)


def _frames(rank: RankProcess) -> tuple[stacks.Frame, ...]:
    return stacks.parse_dump(rank.stack.decode("utf-8", "replace"))


def _kept_step(run: Run) -> int | None:
    """The step a graceful stop kept (every rank ended its cell there), or None."""
    stop = run.graceful
    if stop is None or stop.gave_up or run.end_state == events.FINISHED or not all(r.done for r in run.ranks):
        return None
    return stop.step


def _stacks(run: Run) -> tuple[tuple[int, str], ...]:
    """What each rank's dump said, for a run that ended by a timeout or a stop."""
    if run.end_state not in (events.STOPPED, events.TIMED_OUT):
        return ()
    return tuple(
        (rank.spec.rank, rank.stack.decode("utf-8", "replace")) for rank in run.ranks if rank.stack or rank.stack_asked
    )


@dataclass
class _RankEnds:
    """The channel and the two output pipes of a rank being started: both ends of each."""

    launcher_end: socket.socket
    rank_end: socket.socket
    out_read: int
    out_write: int
    err_read: int
    err_write: int
    stack_read: int  # the rank's faulthandler dumps (nbtrain.stacks)
    stack_write: int

    @classmethod
    def open(cls) -> _RankEnds:
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
        for fd in (self.out_write, self.err_write, self.stack_write):
            os.close(fd)
        self.rank_end.close()

    def close_all(self) -> None:
        for fd in (self.out_read, self.out_write, self.err_read, self.err_write, self.stack_read, self.stack_write):
            try:
                os.close(fd)
            except OSError:
                pass  # closed already (close_child_side ran)
        self.launcher_end.close()
        self.rank_end.close()


def _our_signal(run: Run, signal_number: int | None) -> bool:
    """Whether a rank died of nbtrain's own stop: SIGTERM, or SIGKILL once the launcher (or,
    for a stop asked in the browser, the server extension) sends it."""
    return signal_number == signal.SIGTERM or (
        signal_number == signal.SIGKILL and (run.killed or run.stopped_outside)
    )


def _readable_now(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _hand_run(rank: RankProcess, start: StartRun, fds: tuple[int, ...]) -> None:
    """Send a standby rank its run. One that died just now, or cannot read it (stuck before its
    wait), is killed: its exit fails the run as any rank's would, and nothing waits forever."""
    try:
        rank.channel.settimeout(HAND_OVER_SECONDS)
        wire.send(rank.channel, start, fds)
    except OSError:
        processes.signal_group(rank.pid, signal.SIGKILL)
    finally:
        rank.channel.settimeout(None)


def _send_quietly(channel: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    try:
        wire.send(channel, message, fds)
    except OSError:
        pass  # the rank is already gone; its exit is handled by its pidfd


@dataclass(frozen=True)
class RankFds:
    """The descriptors a new rank gets: its channel, stdout/stderr pipes, the store's
    listening socket (rank 0), the payload's tensors, and the pipe for its stack dumps."""

    channel: int
    out: int
    err: int
    listen: int | None
    tensor: int | None
    stack: int

    @property
    def kept(self) -> list[int]:
        return [fd for fd in (self.channel, self.listen, self.tensor, self.stack) if fd is not None]


def _stepped(run: Run) -> bool:
    """Whether a rank of ``run`` has begun an optimizer step that a stop could keep."""
    return run.board is not None and run.on_stop == "keep" and any(run.board.counts())


def _step_board(start: StartRun) -> stopboard.StepBoard | None:
    """The board a run's ranks count their optimizer steps on, for a stop at a step. A spawned
    rank starts from nothing: it cannot share it. On a cluster's node the kernel chooses the step
    over every node's board (nbtrain.cluster.stepstop)."""
    if start.start_method == "fork":
        return stopboard.StepBoard.create(len(start.ranks))
    return None


def _rank_main(
    assignment: RankAssignment,
    channel: socket.socket,
    fds: RankFds,
    waits: bool = False,
    steps: tuple[stopboard.StepBoard | None, int] = (None, 0),
) -> None:
    """In the forked child: wire up stdio, drop the launcher's descriptors, run the rank
    (``waits``: prepare, then wait for a run's payload, nbtrain.launch_server.standby)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds.out, 1)
    os.dup2(fds.err, 2)
    _close_all_but({0, 1, 2, *fds.kept})
    from nbtrain.rank import runtime, stopping

    stopping.attach(*steps)

    if waits:
        runtime.run_standby(assignment, channel, fds.listen, fds.stack)
    runtime.run_rank(assignment, channel, fds.listen, fds.tensor, fds.stack)


def _close_all_but(keep: set[int]) -> None:
    # The child must not hold the launcher's channel to the kernel or other ranks' pipes:
    # those would keep channels open after their owners die and hide EOFs.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def preload() -> tuple[str, ...]:
    loaded = []
    for module in PRELOAD:
        with contextlib.suppress(Exception):  # a missing optional module only costs speed
            __import__(module)
            loaded.append(module)
    return tuple(loaded)


def main() -> None:
    control = socket.socket(fileno=int(os.environ.pop(processes.CONTROL_FD_VARIABLE)))
    processes.ignore_interrupts()
    processes.become_subreaper()
    parent_pid = os.getppid()
    loaded = preload()
    wire.send(control, events.LauncherReady(os.getpid(), loaded))
    if processes.thread_count() != 1:
        print(f"nbtrain launcher: {processes.thread_count()} threads after preload; fork is unsafe", file=sys.stderr)
    Launcher(control, parent_pid).serve()
    # Every rank is gone and nothing here needs flushing. Interpreter teardown with torch
    # loaded takes about a second (several on a loaded machine), and the kernel waits for
    # it when it closes: past stop_launcher's grace the launcher would be killed instead.
    processes.exit_now(0)
