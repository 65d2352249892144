"""The warm launcher: a clean, single-threaded process that forks ranks and supervises them.

It runs one loop over a selector: the kernel's channel (requests), and for each rank its
event socket, its stdout and stderr pipes and a pidfd that fires when it exits. It never
unpickles user code (the payload is opaque bytes that only the ranks load), so it never
imports the user's modules and a launch always runs the code the kernel has now. The libraries
a cell imports (site-packages, the standard library) it imports too, once no run goes
(:meth:`Launcher._import_ahead`), so the next ranks it forks have them.

Why a loop of its own around ``os.fork`` rather than multiprocessing's forkserver or the
``multiprocess`` package: both fork from a server too, but not with fd-level stdout/stderr
capture per rank, a process group per rank, PDEATHSIG, pidfd-based death detection, passing
shared-memory descriptors, and a server outside the kernel's process group. Warm: the launcher
imports torch and ``torch._dynamo`` (which DDP's constructor imports), seconds, once, and with
them the rank-side modules :data:`PRELOAD` names, which a rank would otherwise import while it
loads its payload (about 12 ms of a re-run on 2 cores).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import gc
import os
import select
import selectors
import signal
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from nbtrain import patches
from nbtrain.launch_server import heldranks, registryentries, stackdumps, stalls, standby, stopatstep, uneven
from nbtrain.launch_server.forking import (
    bind_store,
    fork_standby,
    hand_run,
    send_quietly,
    signal_groups,
    start_rank_process,
    step_board,
    watch_rank,
)
from nbtrain.launch_server.launched import (
    LauncherRun,
    RankProcess,
    awaits_rank_zero,
    failed_state,
    kept_step,
    our_signal,
    stop_began,
    takes_over,
    took_a_step,
)
from nbtrain.launch_server.lifecycle import ACTIVE, CAN_DRAIN, SECOND_STOP, STOPPABLE, Lifecycle, RunPhase
from nbtrain.launch_server.rankpipes import STREAMS, RunLog
from nbtrain.messages import events, logsetup, wire
from nbtrain.messages.events import (
    AttachHeld,
    DebugEnded,
    DebugInput,
    DebugOutput,
    DebugPrompt,
    DebugQuit,
    Display,
    Displayed,
    MemorySample,
    Metrics,
    Output,
    OutputSkipped,
    RankAssignment,
    RankDone,
    RankExited,
    RankFailed,
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
    TrackerCalls,
)
from nbtrain.system import privatenet, processes, stepboard

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
    "nbtrain.messages.sharedtensors",
    "nbtrain.rank.machinery.runtime",
    "nbtrain.rank.cell",
    "nbtrain.rank.auto.precision",
    "nbtrain.rank.machinery.settings",
    "nbtrain.rank.auto.syncbn",
    "nbtrain.rank.machinery.stepcheck",  # a forked rank's first import (forking.run_child)
    "nbtrain.rank.machinery.collectives",  # and its second: the board's ledger
    "nbtrain.messages.reach",
)

# A library may initialise CUDA as it imports (a device query), after which no CUDA rank forked from here
# works: until a GPU run has shown it safe, the launcher imports the notebook's libraries ahead only on a
# machine without an NVIDIA device (its ranks import them themselves there, as before).
IMPORTS_AHEAD = not os.path.exists("/dev/nvidiactl")
STOP_GRACE_SECONDS = 0.5  # SIGTERM first; SIGKILL for what is left after this
# How long a failure of a rank other than 0 waits for rank 0's own (launched.awaits_rank_zero) before
# the ranks are stopped. Every rank of a deterministic cell raises at the same line within a few ms of
# the others; without it the state brought back would be whichever report came first (rank 1's batch and
# loss, often). A rank 0 stuck in a collective (it did not raise) costs the failure this much, once.
RANK_ZERO_GRACE_SECONDS = 0.3
DRAIN_SECONDS = 1.0  # how long to wait for output pipes to close once every rank exited
MEMORY_SAMPLE_SECONDS = 0.5
TICK_SECONDS = 0.1


class Launcher:
    """The launcher's event loop: requests from the kernel, events, output and exits of ranks.

    One selector, one thread. Each run is a :class:`LauncherRun` whose phase is its lifecycle
    (nbtrain.launch_server.lifecycle): the handlers below move it, ``_tick`` moves it on with
    the clock (timeouts, stack dumps, SIGKILL after the grace, draining), ``_finish`` ends it.
    Forking is in nbtrain.launch_server.forking, stack dumps in stackdumps, the rank held for
    a post-mortem in heldranks, standby ranks in standby, the sidebar's records in tracker.
    """

    def __init__(self, control: socket.socket, parent_pid: int, kernel_pidfd: int | None = None):
        """``kernel_pidfd``: a launcher forked by the warm template watches its kernel through
        it (its parent is the template, whose death must not end it)."""
        self.control = control
        self.parent_pid = parent_pid
        self.watch_parent = kernel_pidfd is None
        privatenet.namespaces()  # made before LauncherReady (main, the template): then this does nothing
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, ("control", None, None))
        if kernel_pidfd is not None:
            self.selector.register(kernel_pidfd, selectors.EVENT_READ, ("kernel", None, None))
        self.runs: dict[int, LauncherRun] = {}
        self.sources: dict[str, tuple[str, ...]] = {}  # notebook cells' lines, as the kernel sent them
        # The notebook's imports, in the kernel's order, as it sent them (each once); and those of them this
        # launcher has not imported itself: a rank forked from here has the rest (torch's, mostly) already.
        self.notebook_modules: dict[str, None] = {}
        self.not_imported_here: dict[str, None] = {}
        self.import_when_idle: dict[str, None] = {}  # of those, to import here once no run goes (_import_ahead)
        self.imported_as: events.NotebookModules | None = None  # the kernel's environment, cwd and path for it
        self.board = registryentries.Board(registryentries.find_owner(parent_pid))
        self.held_ranks = heldranks.HeldRanks(self.selector, self._send, self.board)
        self.standby = standby.Pool(
            self.selector,
            functools.partial(fork_standby, self.selector, self._send),
            self._send,
            self.board.show_standby,
            self.board.standby_dismissed,
        )

    # -- main loop ---------------------------------------------------------------------
    def serve(self) -> None:
        """Run until the kernel closes the channel or dies; every rank is gone when it returns."""
        while True:
            timeout = TICK_SECONDS if self.runs else 0.5 if self.held_ranks else 1.0
            for key, _ in self.selector.select(timeout):
                if self.selector.get_map().get(key.fd) is not key:
                    continue  # unregistered by an earlier event of this batch (its rank was reaped, say)
                kind, run, rank = key.data
                if kind == "control":
                    if not self._on_control():
                        return self._shutdown()
                elif kind == "kernel":  # the kernel died
                    _say(f"its kernel (pid {self.parent_pid}) has exited; stopping its runs")
                    return self._shutdown()
                elif kind == "events":
                    self._on_rank_event(run, rank)
                elif kind == "pipe":
                    self._on_output(run, rank, key.fd)
                elif kind == "pidfd" and rank.held and run.run_id not in self.runs:
                    self.held_ranks.on_exit(run, rank)
                elif kind == "pidfd":
                    self._on_exit(run, rank)
                elif kind == "stack":
                    stackdumps.read_dump(self.selector, rank)
                elif kind == "standby-events":
                    self.standby.on_message(run, rank)
                elif kind == "standby-exit":
                    self.standby.on_exit(run, rank)
            # the kernel died and its socket is held elsewhere
            if self.watch_parent and os.getppid() != self.parent_pid:
                _say(f"its kernel (pid {self.parent_pid}) has exited; stopping its runs")
                return self._shutdown()
            # Before _tick ends a run: what a rank left behind must not hold its pipes open.
            processes.kill_strays(self._live_ranks())
            self._tick(time.monotonic())
            self.held_ranks.tick(time.monotonic())
            if self.import_when_idle and self.imported_as is not None and not self.runs and IMPORTS_AHEAD:
                self._import_ahead()

    def _live_ranks(self) -> set[int]:
        """The pids of ranks not yet reaped: the launcher's only legitimate children."""
        live = {rank.pid for run in self.runs.values() for rank in run.ranks if not rank.exited}
        return live | self.held_ranks.pids() | self.standby.pids()

    def _on_control(self) -> bool:
        try:
            message, fds = wire.receive(self.control)
        except wire.ChannelClosed:
            return False  # the kernel closed it: its end, or it exited
        except OSError as error:
            _say(f"its channel to the kernel failed ({error}); stopping its runs")
            return False
        run = self.runs.get(getattr(message, "run_id", -1))  # the run it is about, for those about one
        if isinstance(message, StartRun):
            self._start(message, fds[0] if fds else None)
        elif isinstance(message, StopRun) and run is not None:
            self._on_stop_request(run, message.graceful)
        elif isinstance(message, ReleaseResult) and run is not None and run.state is RunPhase.OFFERING:
            if message.send_file:
                rank_zero = next(rank for rank in run.ranks if rank.spec.rank == 0)
                send_quietly(rank_zero.channel, SendResultFile(run.run_id))
            else:
                self._release(run)
        elif isinstance(message, (DebugInput, AttachHeld, ReleaseHeld)):
            self.held_ranks.relay(message, self.runs)
        elif isinstance(message, events.NotebookModules):  # a cell imported them: in every rank from now on
            lacking = self._note_modules(message.modules)
            self.standby.tell_waiting(events.NotebookModules(lacking))
            self.import_when_idle.update(dict.fromkeys(lacking))
            self.imported_as = message if message.environ is not None else self.imported_as
        elif isinstance(message, ReleaseStandby):
            ended = self.standby.release(time.monotonic() + standby.RELEASE_SECONDS)
            self._send(events.StandbyChanged(released=tuple(sorted(ended))))
        elif isinstance(message, events.StepChosen) and run is not None:  # a cluster's kernel chose the step
            stop = run.graceful if run.state is RunPhase.STOPPING_AT_STEP else None
            if stop is not None and run.board and stop.adopt(run.board, message, time.monotonic()):
                self._announce_step(run, stop)
        elif isinstance(message, ReleaseRanks) and run is not None and run.state is RunPhase.WAITING_FOR_NODES:
            self._release(run)
        return True

    def _on_stop_request(self, run: LauncherRun, gracefully: bool) -> None:
        # The reason is the caller's words, not a state: the run ends STOPPED (which the
        # kernel turns into RunStoppedError). A run whose result the kernel has taken
        # keeps it, and one already failing keeps its failure; a result not taken yet
        # is given up (the kernel does not copy it), and rank 0 is stopped with the rest.
        # Every rank is done: the result on its way is what a stop at a step would keep, when the
        # run took an optimizer step; one that never did stops as before, its result given up.
        finished = run.ending.outcome == events.FINISHED and took_a_step(run)
        if gracefully and (finished or self._stop_gracefully(run, events.STOPPED)):
            return
        if gracefully and run.graceful is not None and run.graceful.across_nodes:
            return  # a cluster's node stopping already (its own timeout): the kernel asks every node once
        if run.state is RunPhase.STOPPING_AT_STEP and run.graceful is not None:  # asked again
            self._stop_now(run, outcome=events.STOPPED, gave_up=True, note=SECOND_STOP)  # no dumps: it means now
            return
        if run.state in (RunPhase.RUNNING, RunPhase.OFFERING):
            self._stop(run, events.STOPPED)

    def _stop_gracefully(self, run: LauncherRun, state: str) -> bool:
        """Begin a stop at a step boundary (nbtrain.launch_server.stopatstep); False when the run cannot have one."""
        if run.state is not RunPhase.RUNNING:
            return False
        run.lifecycle.learn(note=stopatstep.why_none(run.board, run.on_stop))  # said if the stop comes hard
        if run.board is None or run.on_stop != "keep" or run.ending.note:
            return False
        run.board.request_stop()
        run.graceful = stopatstep.GracefulStop(state, time.monotonic(), across_nodes=run.on_cluster)
        run.move(RunPhase.STOPPING_AT_STEP)
        self.board.update(run.run_id, state="stopping")
        return True

    def _note_steps(self, run: LauncherRun) -> None:
        """Once a rank has begun an optimizer step, the run's record says a stop request can keep its state."""
        entry = self.board.get(run.run_id)
        if entry is None or entry.record.stop_at_step or run.state not in ACTIVE:
            return
        if took_a_step(run):
            entry.update(stop_at_step=True)

    def _follow_graceful(self, run: LauncherRun, now: float) -> None:
        """Choose the stop step when it is time; stop hard once the grace is over."""
        stop = run.graceful
        if stop is None or run.board is None or run.state is not RunPhase.STOPPING_AT_STEP:
            return
        report = stop.report(run.run_id, run.board, run.stop_grace, now)  # a cluster's node: the kernel chooses
        if report is not None:
            self._send(report)
        if stop.choose(run.board, run.stop_grace, now):
            if not stop.step:  # every rank's count went back to none meanwhile: nothing to keep
                self._stop(run, stop.state, gave_up=True, note=stopatstep.why_none(run.board, run.on_stop))
                return
            self._announce_step(run, stop)
            return
        ending = all(run.board.stopped(slot) for slot, rank in enumerate(run.ranks) if not rank.done)
        if stop.overdue(now, ending):  # the note names the late ranks; their dumps say who waited for whom (_finish)
            run.lifecycle.learn(late=tuple(rank.spec.rank for rank in run.ranks if not rank.done))
            self._stop(run, stop.state, gave_up=True, note=stackdumps.laggards(run))

    def _announce_step(self, run: LauncherRun, stop: stopatstep.GracefulStop) -> None:
        assert stop.step is not None
        self._send(StopStep(run.run_id, stop.step, stop.grace))
        # the server extension signals the ranks itself after this
        self.board.update(run.run_id, stop_deadline=time.time() + stop.grace + stepboard.ENDING_SECONDS)

    def _send(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        with contextlib.suppress(OSError):  # the kernel is gone; the next select sees EOF and shuts down
            wire.send(self.control, message, fds)

    # -- starting ranks ----------------------------------------------------------------
    def _start(self, start: StartRun, tensor_fd: int | None) -> None:
        start = self._with_sources(start)
        start = self._with_notebook_modules(start)
        logsetup.follow(start.logging_setup)  # the kernel's logging: in every rank forked from here on
        now = time.monotonic()
        deadline = None if start.timeout is None else now + start.timeout
        run = LauncherRun(start.run_id, [], deadline, Lifecycle(start.run_id, now), on_cluster=start.node is not None)
        run.debug_hold = start.rank_settings.debug_hold
        self.held_ranks.release(f"the next launch (run {start.run_id}) needs its devices")
        run.log = RunLog(start.log_path) if start.log_path else None
        run.plan = standby.plan_of(start)
        run.on_stop, run.stop_grace = start.on_stop, start.stop_grace
        run.stall.seconds = start.stall_seconds
        self.runs[start.run_id] = run
        taken = self.standby.take(start)
        if taken is not None:
            self._start_taken(run, start, taken, tensor_fd)
            return
        run.board = step_board(start)
        store = None
        try:
            store = bind_store(start, self._send)
            for slot, spec in enumerate(start.ranks):
                assignment = RankAssignment(start, spec, store.port, os.getpid())
                run.ranks.append(self._start_rank(run, assignment, store.fd_for(spec.rank), tensor_fd, slot))
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
            # On a cluster the store's port stayed bound from here until rank 0 took the
            # socket over: no other process could take it in between.
            if store is not None:
                store.close()
            if tensor_fd is not None:
                os.close(tensor_fd)

    def _with_sources(self, start: StartRun) -> StartRun:
        """Keep the notebook cells' lines the kernel sent (each cell's once); a spawned rank gets them all.

        Installed in the launcher's own linecache, they are in every rank it forks from now on
        (standby ranks included); the run's new ones go with it to ranks forked before.
        """
        # deferred: start-up time (cloudpickle, torch)
        from nbtrain.rank.machinery.runtime import install_source_lines

        self.sources.update(start.source_lines)
        install_source_lines(start.source_lines)
        if start.start_method == "spawn":  # a fresh interpreter has nothing in memory
            return dataclasses.replace(start, source_lines=dict(self.sources))
        return start

    def _with_notebook_modules(self, start: StartRun) -> StartRun:
        """The run with the whole list of the notebook's imports, which the kernel sends each once (names only:
        the launcher imports none). A spawned rank, a fresh interpreter, gets all; a forked one what it lacks."""
        self._note_modules(start.notebook_modules)
        modules = self.notebook_modules if start.start_method == "spawn" else self.not_imported_here
        return dataclasses.replace(start, notebook_modules=tuple(modules))

    def _note_modules(self, names: Iterable[str]) -> tuple[str, ...]:
        """Keep the notebook's imports the kernel sent; those new that a forked rank lacks."""
        lacking = []
        for name in names:
            if name not in self.notebook_modules:
                self.notebook_modules[name] = None
                if name not in sys.modules:
                    self.not_imported_here[name] = None
                    lacking.append(name)
        return tuple(lacking)

    def _import_ahead(self) -> None:
        """Import here the libraries the notebook imported, while no run goes: every rank forked after (the
        next run's, standby ranks) has them, as a rank forked from the kernel would, rather than importing
        them on its cell's way (a first run's first step under Lightning came 8.5 s after the cell on 2
        cores, against 0.3 s under Lightning's own ddp_notebook, which forks the kernel). The user's own
        modules are never imported here: the run imports them as edited by then."""
        # deferred: start-up time (torch; preloaded by then)
        from nbtrain.rank.machinery.runtime import import_libraries

        names, self.import_when_idle = tuple(self.import_when_idle), {}
        threads, began = processes.thread_count(), time.monotonic()
        gc.disable()  # as the template's preload: what the imports make is never collected (gc.freeze)
        try:
            assert self.imported_as is not None
            with _as_the_kernel(self.imported_as):  # what a library reads as it imports is the kernel's
                import_libraries(names)  # a failure is kept: the run's ranks report it
        finally:
            gc.freeze()
            gc.enable()
        imported = [name for name in names if name in sys.modules]
        for name in imported:
            self.not_imported_here.pop(name, None)
        if imported:
            _say(f"imported the notebook's {', '.join(imported[:3])}{' ...' if len(imported) > 3 else ''} ahead "
                 f"of its next run ({len(imported)} modules, {time.monotonic() - began:.2f} s)")
        if processes.thread_count() != threads:  # a library started a thread: forking after it is unsafe
            _say(f"{processes.thread_count() - threads} thread(s) started by importing {', '.join(names[:3])}")

    def _start_rank(
        self, run: LauncherRun, assignment: RankAssignment, listen_fd: int | None, tensor_fd: int | None, slot: int = 0
    ) -> RankProcess:
        rank = start_rank_process(assignment, listen_fd, tensor_fd, run.log, steps=(run.board, slot))
        watch_rank(self.selector, run, rank)
        if assignment.start.start_method == "spawn":
            send_quietly(rank.channel, assignment)  # a fresh interpreter has nothing in memory
        self._send(RankStarted(run.run_id, assignment.spec.rank, rank.pid))
        return rank

    def _start_taken(self, run: LauncherRun, start: StartRun, ranks: list[RankProcess], tensor_fd: int | None) -> None:
        """Hand the run to standby ranks: its StartRun and payload memfd to each, over its channel."""
        fds = () if tensor_fd is None else (tensor_fd,)
        run.board = ranks[0].step_board if ranks else None  # the board they were forked with
        try:
            handed = wire.frame(start)
            for rank in ranks:
                rank.output.log = run.log
                run.ranks.append(rank)
                watch_rank(self.selector, run, rank)
                hand_run(rank, handed, fds)
            for rank in ranks:  # once every rank has its run: none waits for the kernel's news
                self._send(RankStarted(run.run_id, rank.spec.rank, rank.pid))
        finally:
            self.standby.changed()  # they wait no more
            self.board.start(start, [(rank.spec.rank, rank.pid) for rank in run.ranks])
            if tensor_fd is not None:
                os.close(tensor_fd)

    # -- events from ranks -------------------------------------------------------------
    def _on_rank_event(self, run: LauncherRun, rank: RankProcess) -> None:
        if not standby.registered(self.selector, rank.channel) or not _readable_now(rank.channel):
            return  # already read (or closed) by _on_exit in this same round of select
        try:
            message, fds = wire.receive(rank.channel)
        except (wire.ChannelClosed, OSError):
            self.selector.unregister(rank.channel)
            return
        if isinstance(message, (DebugOutput, DebugPrompt, DebugEnded, DebugQuit)):
            self._on_debug_event(run, rank, message)
        elif isinstance(message, (Metrics, MemorySample, TrackerCalls)):  # TrackerCalls: for the kernel's run
            if isinstance(message, MemorySample) and message.cuda_allocated_bytes is not None:
                rank.cuda_bytes = message.cuda_reserved_bytes or message.cuda_allocated_bytes
            self._send(message)
            entry = self.board.get(run.run_id)
            if entry is not None and isinstance(message, Metrics):
                entry.on_metrics(message)
        elif isinstance(message, Display):
            self._send_output_so_far(run, rank)  # printed before it, shown before it
            self._send(message)
            send_quietly(rank.channel, Displayed(run.run_id))  # the rank, waiting for this, goes on
        elif isinstance(message, RankFailed):
            self._on_rank_failed(run, rank, message, fds[0] if fds else None)
        elif isinstance(message, RankDone):
            rank.done = True
            uneven.on_done(run, time.monotonic())
            if message.imported and run.plan is not None:  # the next standby ranks import them ahead
                run.plan = dataclasses.replace(run.plan, preimport=message.imported)
            if message.regions:
                run.offer = message
            elif message.result is not None:  # no tensors, or their file: all of it is here
                run.result = message.result
                run.result_fd = fds[0] if fds else None
                if run.state is RunPhase.OFFERING:  # the file the kernel asked for: the result is safe
                    self._release(run)
            if all(r.done for r in run.ranks) and run.state in ACTIVE:
                # Every rank ended its cell at the stop step: the run keeps its result, and says it stopped.
                stop = run.graceful if run.state is RunPhase.STOPPING_AT_STEP else None
                run.lifecycle.learn(outcome=stop.state if stop else events.FINISHED)
                self._hand_over(run)

    def _on_rank_failed(self, run: LauncherRun, rank: RankProcess, message: RankFailed, fd: int | None) -> None:
        """A rank raised: the run fails (its first failure is the cause); ``fd``: its state's tensor file."""
        rank.failed = True
        if self._stopped_from_outside(run):
            if fd is not None:
                os.close(fd)
            return  # a peer's signal broke its collective: not a failure of the run
        if message.state is not None or message.state_note:  # a cell's state at the raise (failed_state)
            run.failed_states[rank.spec.rank] = (message, fd)
        elif fd is not None:
            os.close(fd)
        message = dataclasses.replace(message, state=None)  # the state goes once, with RunEnded
        self._send(message)
        if run.failure is None or takes_over(run, message):
            self._unhold(run)  # a lower rank's same raise, come while rank 0 was awaited: the cause is its
            run.failure = message
            # The root cause stays alive, paused in its frames, for a post-mortem.
            rank.held = message.held and run.debug_hold is not None and not run.lifecycle.has_been(RunPhase.TERMINATING)
        if run.state is RunPhase.RUNNING and awaits_rank_zero(run):
            # _tick stops the ranks once rank 0 failed, or after the grace
            run.move(RunPhase.AWAITING_RANK_ZERO, outcome=events.FAILED)
            return
        self._stop(run, events.FAILED)

    def _hand_over(self, run: LauncherRun) -> None:
        """Every rank is done: release them all, or first offer rank 0's result to the kernel.

        While the kernel reads rank 0's memory, the other ranks wait too: their exits free
        memory, which takes CPU the read needs on a small machine; afterwards all exits overlap.
        """
        offer = run.offer
        if offer is None or offer.result is None:  # rank 0 offers regions with its result only
            self._release(run)
            return
        run.move(RunPhase.OFFERING)
        rank_zero = next(rank for rank in run.ranks if rank.spec.rank == 0)
        self._send(ResultOffer(run.run_id, rank_zero.pid, offer.result, offer.regions, offer.total_bytes))

    def _release(self, run: LauncherRun) -> None:
        """Let every rank leave; a cluster node's, once every node's are done (the caller says so)."""
        if run.on_cluster and run.state is not RunPhase.WAITING_FOR_NODES:
            run.move(RunPhase.WAITING_FOR_NODES)  # the caller releases every node's ranks together
            self._send(RanksDone(run.run_id))
            return
        run.move(RunPhase.RELEASED)
        for rank in run.ranks:
            send_quietly(rank.channel, Release(run.run_id))
        self._standby_after(run, run.ending.outcome)  # forked as they exit (on a GPU, about 0.15 s), not after

    def _standby_after(self, run: LauncherRun, state: str | None) -> None:
        """Have the run's plan's next ranks wait for a re-run, unless the user wants things to stop."""
        # After a stop or a timeout the user wants things to stop: no new processes until a run
        # asks. While other runs go on, none either: forking would take CPU from them.
        if run.plan is not None and state in (events.FINISHED, events.FAILED) and self.runs.keys() <= {run.run_id}:
            self.standby.after_run(run.plan)

    def _on_output(self, run: LauncherRun, rank: RankProcess, fd: int) -> None:
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
        # Bounded (nbtrain.launch_server.rankpipes): past the first lines only the last are
        # kept, so a flood costs the kernel nothing and cannot outlast a stop.
        self._send_output(run, rank, rank.output.feed(stream, data))

    def _send_output_so_far(self, run: LauncherRun, rank: RankProcess) -> None:
        """Send what the rank wrote to its pipes until now, a line in progress too (bounded: it may still write)."""
        for fd in list(rank.pipes):
            for _ in range(_READS_SO_FAR):
                if fd not in rank.pipes or not _readable_now(fd):
                    break
                self._on_output(run, rank, fd)
        for stream in STREAMS:
            self._send_output(run, rank, rank.output.flush(stream))

    def _send_output(self, run: LauncherRun, rank: RankProcess, pieces: list[tuple[str, str]]) -> None:
        for stream, text in pieces:
            self._send(Output(run.run_id, rank.spec.rank, stream, text))

    def _close_pipe(self, rank: RankProcess, fd: int) -> None:
        self.selector.unregister(fd)
        os.close(fd)
        del rank.pipes[fd]

    def _on_exit(self, run: LauncherRun, rank: RankProcess) -> None:
        # Kill the rank's group while its leader is still an unreaped zombie: the group id
        # cannot have been reused yet, and stray DataLoader workers go with it.
        signal_groups([rank], signal.SIGKILL)
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
        while standby.registered(self.selector, rank.channel) and _readable_now(rank.channel):
            self._on_rank_event(run, rank)
        # Rank 0 holding a result the kernel has not taken yet has not finished its part.
        reported = (rank.done and not (rank.spec.rank == 0 and run.state is RunPhase.OFFERING)) or rank.failed
        if not reported:
            self._stopped_from_outside(run)
        ours = our_signal(run, signal_number)
        exited = RankExited(
            run.run_id, rank.spec.rank, exit_code, signal_number, reported,
            # A signal we did not send (an OOM kill, a segfault) is the rank's own death even
            # when it is reaped after the stop began: its peers' errors race ahead of it.
            stopped=stop_began(run) and (signal_number is None or ours),
            collectives=stalls.last_calls(run) if not reported and not ours else (),
        )
        self._send(exited)
        if not reported and run.ending.outcome in (None, events.FINISHED):
            if run.failure is None:
                run.failure = exited
            run.lifecycle.learn(outcome=None)  # a rank died after the others finished: still a failure
            self._stop(run, events.FAILED)
        elif not reported and not ours and run.ending.outcome == events.FAILED and isinstance(run.failure, RankFailed):
            # A rank that dies hard (OOM kill, segfault, os._exit) closes its sockets before
            # its pidfd fires, so a peer blocked in a collective can report the broken
            # connection first. Unless this death is our own stop signal, it is the cause
            # and the peer's error its consequence.
            run.failure = exited
            self._unhold(run)
        self._drain_if_gone(run)

    def _drain_if_gone(self, run: LauncherRun) -> None:
        """Every rank exited (or is held for a post-mortem): read what is left in its pipes, then finish."""
        if run.state in CAN_DRAIN and all(r.exited or r.held for r in run.ranks):
            run.move(RunPhase.DRAINING)

    # -- stopping and finishing --------------------------------------------------------
    def _stopped_from_outside(self, run: LauncherRun) -> bool:
        """Whether the run was stopped from the browser (the server extension signals the
        ranks itself after leaving a stop request): it then ends as stopped, not failed.
        While the ranks go to a stop step nobody signals them: a rank that fails then fails."""
        if run.state in STOPPABLE and run.graceful is None and self.board.stop_requested(run.run_id):
            self._stop_asked_outside(run)
        return run.ending.outcome == events.STOPPED

    def _stop_asked_outside(self, run: LauncherRun) -> None:
        """Stop a run asked to stop through the registry, without asking for stack dumps: the
        server signals every rank itself as it asks, so a rank still alive is already dying
        and would only be reported as one that "did not answer in time"."""
        if run.state not in STOPPABLE or run.graceful is not None:
            return
        if self._stop_gracefully(run, events.STOPPED):
            return  # the record says so (stop_at_step): the server leaves the ranks to this launcher
        run.move(RunPhase.STOPPING_OUTSIDE, outcome=events.STOPPED)  # its SIGKILLs count as ours (launched.our_signal)
        self._stop_now(run)

    def _stop(self, run: LauncherRun, state: str, **ending: object) -> None:
        """End the run as ``state``: after each rank's stack dump for a stop or a timeout; ``ending``: why."""
        if run.state not in STOPPABLE:
            return  # stopping already
        if state in (events.STOPPED, events.TIMED_OUT) and stackdumps.request_dumps(run):
            run.move(RunPhase.DUMPING_STACKS, outcome=state, **ending)  # _tick stops the ranks once their dumps are in
            return
        self._stop_now(run, outcome=state, **ending)

    def _stop_now(self, run: LauncherRun, **ending: object) -> None:
        run.move(RunPhase.TERMINATING, **ending)
        self.board.update(run.run_id, state="stopping")
        signal_groups([rank for rank in run.ranks if not rank.exited and not rank.held], signal.SIGTERM)

    def _tick(self, now: float) -> None:
        self.standby.tick(now)
        for run_id in self.board.tick(now):  # stop requests, looked for about once a second
            run = self.runs.get(run_id)
            if run is not None and run.state in ACTIVE:
                self._stop_asked_outside(run)
        for run in list(self.runs.values()):
            timed_out = run.deadline is not None and now > run.deadline and run.state is RunPhase.RUNNING
            timed_out = timed_out and not run.debugging  # a rank at a pdb prompt: the clock waits
            if timed_out and not self._stop_gracefully(run, events.TIMED_OUT):
                self._stop(run, events.TIMED_OUT)
            self._follow_graceful(run, now)
            self._note_steps(run)
            for notice in (uneven.look(run, now), stalls.notice(run, now)):
                if notice is not None:
                    self._send(notice)
            self._tick_stop(run, now)
            self._sample_memory(run, now)
            for rank in run.ranks:
                for stream in STREAMS:  # a line in progress: a prompt, a progress bar redrawn with "\r"
                    self._send_output(run, rank, rank.output.flush(stream))
            self._report_skipped(run, now)
            if run.state is RunPhase.DRAINING:
                drained = not any(rank.pipes for rank in run.ranks if not rank.held)
                if drained or now - run.lifecycle.since > DRAIN_SECONDS:
                    self._finish(run)

    def _tick_stop(self, run: LauncherRun, now: float) -> None:
        """Stop the ranks once their stack dumps are in, or once rank 0's error came (or its grace passed);
        SIGKILL them after the grace, drain them once gone."""
        waited = now - run.lifecycle.since
        if run.state is RunPhase.AWAITING_RANK_ZERO and (
            waited > RANK_ZERO_GRACE_SECONDS or not awaits_rank_zero(run)
        ):
            self._stop_now(run)
        if run.state is RunPhase.DUMPING_STACKS and (
            waited > stackdumps.STACK_WAIT_SECONDS or stackdumps.dumps_in(run, now)
        ):
            self._stop_now(run)
        if run.state is RunPhase.TERMINATING and now - run.lifecycle.since > STOP_GRACE_SECONDS:
            run.move(RunPhase.KILLED)
            signal_groups([rank for rank in run.ranks if not rank.exited and not rank.held], signal.SIGKILL)
        self._drain_if_gone(run)  # also covers a run whose ranks could not all start

    def _report_skipped(self, run: LauncherRun, now: float) -> None:
        """Twice a second, tell the live view about lines the cell does not show (a flood)."""
        if now - run.last_skipped_report < MEMORY_SAMPLE_SECONDS:
            return
        run.last_skipped_report = now
        for rank in run.ranks:
            skipped = rank.output.skipped()
            if skipped is not None:
                self._send(OutputSkipped(run.run_id, rank.spec.rank, *skipped))

    def _sample_memory(self, run: LauncherRun, now: float) -> None:
        if now - run.last_memory_sample < MEMORY_SAMPLE_SECONDS:
            return
        run.last_memory_sample = now
        for rank in run.ranks:
            if not rank.exited:
                rss = processes.resident_bytes(rank.pid)
                if rss is not None:
                    self._send(MemorySample(run.run_id, rank.spec.rank, rss, time=time.time()))

    def _finish(self, run: LauncherRun) -> None:
        cleared = stalls.on_end(run)
        if cleared is not None:
            self._send(cleared)
        for rank in run.ranks:
            # What a held rank prints from now on (in pdb, its relay) is not the run's.
            for fd in list(rank.pipes):
                self._close_pipe(rank, fd)
            self._send_output(run, rank, rank.output.finish())  # the note, and the last lines held back
            stackdumps.close_dump(self.selector, rank)
            if rank.held and not rank.exited:
                self.held_ranks.keep(run, rank)  # the root cause lives on, paused in its frames, until released
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(rank.channel)
            rank.channel.close()
            # Its pipes are drained, so every process that held them (workers too) is gone.
            processes.remove_torch_shared_memory({rank.pid, *rank.members})
        del self.runs[run.run_id]
        if run.log is not None:
            run.log.close()
        note = stackdumps.laggards(run) if run.ending.late else run.ending.note  # the dumps now show who waited
        if run.board is not None:
            run.board.close()
        state = run.ending.outcome or events.FAILED
        run.move(RunPhase.ENDED, note=note)
        kept = kept_step(run)
        if kept is not None:
            self.board.update(run.run_id, stopped_at=kept)
        self.board.end(run.run_id, state, run.held_text)
        if (state == events.FINISHED or kept is not None) and run.failure is None:
            fds = () if run.result_fd is None else (run.result_fd,)
            self._send(RunEnded(run.run_id, state, run.result, run.result_fd is not None, stopped_at=kept), fds)
        else:
            dumps = stackdumps.dumps_of(run)
            failed = RunEnded(run.run_id, state, failure=run.failure, detail=run.detail, stacks=dumps)
            failed, state_fds = self._with_failed_state(run, failed) if state == events.FAILED else (failed, ())
            self._send(dataclasses.replace(failed, stop_note=run.ending.note), state_fds)
        for kept_fd in (run.result_fd, *(state_fd for _, state_fd in run.failed_states.values())):
            if kept_fd is not None:
                os.close(kept_fd)
        self._standby_after(run, state)

    def _with_failed_state(self, run: LauncherRun, ended: RunEnded) -> tuple[RunEnded, tuple[int, ...]]:
        """A failed cell's RunEnded with the state one rank held at its raise (launched.failed_state), and its file."""
        kept, note = failed_state(run)
        if kept is None:
            return dataclasses.replace(ended, failed_state_note=note), ()
        message, fd = run.failed_states[kept]
        with_state = dataclasses.replace(
            ended, result=message.state, has_tensor_file=fd is not None, failed_state_rank=kept
        )
        return with_state, () if fd is None else (fd,)

    # -- the debugger relay and the held rank (nbtrain.rank.machinery.debugger) ----------------------
    def _on_debug_event(self, run: LauncherRun, rank: RankProcess, message: Any) -> None:
        """pdb's output and prompts go to the kernel; while a rank sits at a prompt the
        run's timeout waits (the user is reading, not the rank hanging)."""
        now = time.monotonic()
        if isinstance(message, DebugQuit):  # `q`: the user ended the run
            if run.state in ACTIVE:
                run.detail = f"the run was stopped by `q` in rank {message.rank}'s debugger; every rank is gone."
                self._stop_now(run, outcome=events.STOPPED)
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

    def _unhold(self, run: LauncherRun) -> None:
        """A hard death turned out to be the cause: the rank held for it is stopped as the rest."""
        for rank in run.ranks:
            if rank.held and not rank.exited:
                rank.held = False
                if run.lifecycle.has_been(RunPhase.TERMINATING):
                    signal_groups([rank], signal.SIGTERM)

    def _shutdown(self) -> None:
        self.standby.release(time.monotonic() + 2.0)
        self.board.close()
        held = self.held_ranks.kill_all()
        for run in self.runs.values():
            signal_groups([rank for rank in run.ranks if not rank.exited], signal.SIGKILL)
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


@contextlib.contextmanager
def _as_the_kernel(context: events.NotebookModules) -> Iterator[None]:
    """The kernel's environment, working directory and sys.path, for the time of an import here."""
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    os.environ.clear()
    os.environ.update(context.environ or {})
    sys.path[:] = list(context.sys_path)
    with contextlib.suppress(OSError):  # gone since: the imports find what they find from here
        os.chdir(context.cwd)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        os.chdir(cwd)


def _say(text: str) -> None:
    # The kernel shows the launcher's last lines when it is gone (LauncherClient.exit_detail).
    # A kernel that died has closed the pipe's other end: the shutdown must go on all the same.
    with contextlib.suppress(OSError):
        print(f"nbtrain launcher: {text}", file=sys.stderr, flush=True)


# Reads of a pipe (64 KiB each) before a rank's display is sent: what it printed before it.
_READS_SO_FAR = 16


def _readable_now(sock: socket.socket | int) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def preload() -> tuple[str, ...]:
    """Import PRELOAD's modules (those that exist) and the patch table's factories: the names imported.

    First installs what every rank forked from here has, here once rather than in each rank
    just forked (0.15 ms there), and before anything imports the modules it changes:
    tqdm.notebook's bars printing as text, IPython's display showing in the cell (the patch
    table's ``notebook only``).
    """

    patches.install_for_process("notebook only")
    loaded = []
    for module in dict.fromkeys([*PRELOAD, *patches.factory_modules()]):
        with contextlib.suppress(Exception):  # a missing optional module only costs speed
            __import__(module)
            loaded.append(module)
    return tuple(loaded)


def main() -> None:
    """``python -m nbtrain.launch_server``: serve the kernel on the channel it passed, then exit."""
    control = socket.socket(fileno=int(os.environ.pop(processes.CONTROL_FD_VARIABLE)))
    processes.ignore_interrupts()
    processes.become_subreaper()
    parent_pid = os.getppid()
    gc.disable()  # as the template's start: nothing made while torch imports is ever freed
    loaded = preload()
    gc.freeze()
    gc.enable()
    privatenet.namespaces()  # ~10 ms, while the kernel waits for the launcher anyway, not on a run's way
    wire.send(control, events.LauncherReady(os.getpid(), loaded, logsetup.capture()))
    if processes.thread_count() != 1:
        print(f"nbtrain launcher: {processes.thread_count()} threads after preload; fork is unsafe", file=sys.stderr)
    Launcher(control, parent_pid).serve()
    # Every rank is gone and nothing here needs flushing. Interpreter teardown with torch
    # loaded takes about a second (several on a loaded machine), and the kernel waits for
    # it when it closes: past stop_launcher's grace the launcher would be killed instead.
    processes.exit_now(0)
