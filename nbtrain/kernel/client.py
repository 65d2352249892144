"""The caller's side of a launch: ``nbtrain.launch`` / ``nbtrain.start`` and the run handle.

The kernel keeps one warm launcher (started by ``nbtrain.prewarm()`` or the first run) and talks to it over a
private socket. A reader thread takes every message off that socket and files it under its
run, so the thread that waits for a run (the cell's own thread, for a blocking launch)
only ever reads a queue with a bounded timeout and can always be interrupted.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import linecache
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeAlias

from nbtrain import config as config_module
from nbtrain import events as messages  # not `events`: Run.events() is a method here
from nbtrain import processes, wire
from nbtrain.errors import (
    LauncherError,
    NodeLostError,
    RankDiedError,
    RankError,
    RankStartError,
    RunFailedError,
    RunNotEndedError,
    RunStoppedError,
    RunTimeoutError,
)
from nbtrain.kernel import compat, gcpause, warm
from nbtrain.records import CopiedResult

# A run's messages from the launcher (or a cluster's agents), each with the file
# descriptors that came with it.
Inbox: TypeAlias = "queue.Queue[tuple[Any, list[int]]]"

# "file": rank 0 sends its result's tensors in a shared-memory file instead of the kernel
# reading them out of its memory (which is automatic where a sandbox forbids the read).
RESULT_TRANSFER_VARIABLE = "NBTRAIN_RESULT_TRANSFER"
LOG_DIR_VARIABLE = "NBTRAIN_LOG_DIR"  # where runs' log files go (default ~/.cache/nbtrain/logs)
LOGS_KEPT = 50  # older run logs in that directory are removed when a run starts
# Rank output waiting in a run's inbox for the cell to show it: past this, lines are
# dropped (and counted in a note) instead of growing the kernel. The launcher already
# sends at most a few thousand lines per rank, so only a stalled reader gets here.
PENDING_OUTPUT_CHARS = 8_000_000
INTERRUPT_GRACE_SECONDS = 5.0  # how long a stop may take before the launcher is replaced
GRACEFUL_CHOICE_SECONDS = 2.0  # a graceful stop's step is chosen within a launcher tick; this is the bound
POLL_SECONDS = 0.25
# While a stop at a step is under way the caller polls this often: a second interrupt, which only sets a
# flag in the main thread, is acted on within it.
STOPPING_POLL_SECONDS = 0.02
_SOURCE_LINES_LIMIT = 4 << 20  # bytes of notebook source sent for tracebacks


class _LauncherGone:
    """Filed under every open run when the launcher's channel closes."""

    def __init__(self, detail: str):
        self.detail = detail


class LauncherClient:
    """The kernel's connection to its warm launcher."""

    def __init__(self) -> None:
        # Forked from the user's warm template where one can be used; else our own, as before.
        self.process = warm.launcher() or processes.start_launcher()
        self.ready = threading.Event()
        self.alive = True
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self._queues: dict[int, Inbox] = {}
        self._stopping: set[int] = set()  # runs asked to stop: their results are not copied
        self._lock = threading.Lock()
        self._pending_output: dict[int, _PendingOutput] = {}
        self._run_ids = itertools.count(1)
        # The rank of a failed run kept for a post-mortem, and what it and its debugger send
        # once its run is over (nbtrain.kernel.debugger).
        self.held: messages.RankHeld | None = None
        self.debug_messages: queue.Queue[Any] = queue.Queue()
        self.standby: messages.StandbyChanged | None = None  # the launcher's last word on them
        self._released: queue.Queue[tuple[int, ...]] = queue.Queue()  # its answers to ReleaseStandby
        threading.Thread(target=self._read_events, name="nbtrain-events", daemon=True).start()
        threading.Thread(target=self._read_stderr, name="nbtrain-launcher-stderr", daemon=True).start()

    def submit(self, start_run: Callable[[int], messages.StartRun], tensor_fd: int | None) -> tuple[int, Inbox]:
        with self._lock:
            if not self.alive:
                raise LauncherError(self.exit_detail())
            run_id = next(self._run_ids)
            inbox: Inbox = queue.Queue()
            self._queues[run_id] = inbox
            message = start_run(run_id)
            self._pending_output[run_id] = _PendingOutput(message.log_path)
            fds = () if tensor_fd is None else (tensor_fd,)
            try:
                wire.send(self.process.channel, message, fds)
            except OSError as error:
                del self._queues[run_id]
                self._pending_output.pop(run_id, None)
                raise LauncherError(f"could not reach the nbtrain launcher: {error}. {self.exit_detail()}") from error
        return run_id, inbox

    def stop(self, run_id: int, reason: str, graceful: bool = False) -> None:
        with self._lock:
            if not graceful:  # a graceful stop wants rank 0's result at the stop step
                self._stopping.add(run_id)
            try:
                wire.send(self.process.channel, messages.StopRun(run_id, reason, graceful))
            except OSError:
                pass  # a dead launcher's ranks die with it (PDEATHSIG)

    def send_debug(self, message: Any) -> None:
        """A line for a rank's pdb, an attach to the held rank or its release: to the launcher."""
        with self._lock:
            try:
                wire.send(self.process.channel, message)
            except OSError:
                pass  # the launcher is gone, its ranks with it; the waiting side hears of it

    def take_debug_messages(self) -> list[Any]:
        """What is waiting from an ended run's rank (a previous post-mortem's end, say)."""
        taken = []
        while True:
            try:
                taken.append(self.debug_messages.get_nowait())
            except queue.Empty:
                return taken

    def release_standby(self, timeout: float = 5.0) -> list[int]:
        """End the standby ranks (nbtrain.launch_server.standby); the pids the launcher ended."""
        with self._lock:
            try:
                wire.send(self.process.channel, messages.ReleaseStandby())
            except OSError:
                return []  # a dead launcher's ranks die with it
        try:
            return list(self._released.get(timeout=timeout))
        except queue.Empty:
            return []  # a launcher that does not answer: its ranks die with it when it is replaced

    def forget(self, run_id: int) -> None:
        with self._lock:
            self._queues.pop(run_id, None)
            self._pending_output.pop(run_id, None)
            self._stopping.discard(run_id)

    def output_taken(self, run_id: int, chars: int) -> None:
        pending = self._pending_output.get(run_id)
        if pending is not None:
            pending.taken(chars)

    def close(self) -> None:
        self.alive = False
        processes.stop_launcher(self.process)

    def exit_detail(self) -> str:
        code = self.process.popen.poll()
        tail = "".join(self.stderr_tail).strip()
        text = (
            "the nbtrain launcher process has exited" if code is not None else "the nbtrain launcher stopped answering"
        )
        if code is not None and code != processes.UNKNOWN_EXIT:
            text += f" (exit code {code})"
        return text + (f"; its last output:\n{tail}" if tail else ". The next launch starts a new one.")

    def _read_events(self) -> None:
        channel = self.process.channel
        while True:
            try:
                message, fds = wire.receive(channel)
            except (wire.ChannelClosed, OSError):
                break
            if isinstance(message, messages.LauncherReady):
                self.ready.set()
                continue
            if isinstance(message, messages.StandbyChanged):
                self.standby = message
                if message.released is not None:
                    self._released.put(message.released)
                continue
            inbox = self._queues.get(getattr(message, "run_id", -1))
            self._note_held(message)
            if inbox is None and isinstance(message, _AFTER_THE_RUN):
                self.debug_messages.put(message)
            elif isinstance(message, messages.ResultOffer):
                # Taken here, not by whoever waits for the run: rank 0 (and its memory,
                # GPU included) is held until this answer, even if nobody ever waits.
                self._take_result(message, inbox)
            elif inbox is None:
                for fd in fds:
                    os.close(fd)
            else:
                self._file(message, fds, inbox)
        with self._lock:
            self.alive = False
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: the detail says so
                self.process.popen.wait(timeout=1.0)
            gone = _LauncherGone(self.exit_detail())
            for inbox in self._queues.values():
                inbox.put((gone, []))
            self.held = None  # its ranks died with it
            self.debug_messages.put(gone)

    def _note_held(self, message: Any) -> None:
        if isinstance(message, messages.RankHeld):
            self.held = message
        elif isinstance(message, messages.HeldReleased) and getattr(self.held, "run_id", None) == message.run_id:
            self.held = None

    def _file(self, message: Any, fds: list[int], inbox: Inbox) -> None:
        pending = self._pending_output.get(message.run_id)
        if pending is not None and isinstance(message, (messages.Output, messages.RunEnded)):
            if isinstance(message, messages.Output) and not pending.admit(message):
                return  # dropped, and counted for the note
            for note in pending.notes(message.run_id):
                inbox.put((note, []))
        inbox.put((message, fds))

    def _take_result(self, offer: messages.ResultOffer, inbox: Inbox | None) -> None:
        copied = None
        # A run being stopped gives up its result (the launcher stops rank 0 too): no copy.
        wanted = inbox is not None and offer.run_id not in self._stopping
        if wanted and os.environ.get(RESULT_TRANSFER_VARIABLE) != "file":
            from nbtrain import sharedtensors

            # Forbidden here (a sandbox), or no memory: this thread must live on, and rank 0
            # sends a file instead.
            with contextlib.suppress(Exception):
                copied = CopiedResult(
                    offer.result, sharedtensors.read_from_process(offer.pid, offer.regions, offer.total_bytes)
                )
        if copied is not None and inbox is not None:  # copied only when wanted, so for an inbox
            inbox.put((copied, []))
        answer = messages.ReleaseResult(offer.run_id, send_file=wanted and copied is None)
        with self._lock:
            try:
                wire.send(self.process.channel, answer)
            except OSError:
                pass  # the launcher is gone; the run's inbox hears of it

    def _read_stderr(self) -> None:
        stream = self.process.popen.stderr
        if stream is None:
            return
        for line in iter(stream.readline, b""):
            self.stderr_tail.append(line.decode(errors="replace"))


# What a held rank sends after its run ended: the post-mortem's relay reads it.
_AFTER_THE_RUN = (
    messages.DebugOutput, messages.DebugPrompt, messages.DebugEnded, messages.HeldReleased, messages.RankHeld,
)


class _PendingOutput:
    """Characters of a run's output filed but not yet taken, and lines dropped per rank."""

    def __init__(self, log_path: str | None):
        self.log_path = log_path
        self.chars = 0
        self.dropped: dict[int, int] = {}
        self._lock = threading.Lock()

    def admit(self, output: messages.Output) -> bool:
        with self._lock:
            if self.chars > PENDING_OUTPUT_CHARS:
                self.dropped[output.rank] = self.dropped.get(output.rank, 0) + output.text.count("\n")
                return False
            self.chars += len(output.text)
            return True

    def taken(self, chars: int) -> None:
        with self._lock:
            self.chars -= chars

    def notes(self, run_id: int) -> list[messages.Output]:
        """Once the reader caught up (or the run ended): say what was dropped."""
        with self._lock:
            if not self.dropped or (self.chars > PENDING_OUTPUT_CHARS / 2):
                return []
            dropped, self.dropped = self.dropped, {}
        where = f" Every line is in {self.log_path}." if self.log_path else ""
        return [
            messages.Output(
                run_id,
                rank,
                "stderr",
                f"nbtrain: {count:,} lines of rank {rank} were not shown: the notebook could not keep up.{where}\n",
            )
            for rank, count in sorted(dropped.items())
        ]


_client: LauncherClient | None = None
_client_lock = threading.Lock()
_hooks_registered = False


def get_client() -> LauncherClient:
    """The warm launcher of this process, started (or restarted) on demand."""
    global _client
    with _client_lock:
        if _client is None or not _client.alive:
            _register_hooks()
            _client = LauncherClient()
        return _client


def current_client() -> LauncherClient | None:
    """This process's launcher, if one runs; never starts one."""
    client = _client
    return client if client is not None and client.alive else None


def _register_hooks() -> None:
    """Close the launcher at exit, and forget it in forked children: once, with the first launcher."""
    global _hooks_registered
    if not _hooks_registered:
        from nbtrain import hardware

        hardware.standby_pids = standby_pids
        atexit.register(_close_client)
        os.register_at_fork(after_in_child=_forget_client_in_child)
        _hooks_registered = True


def prewarm() -> None:
    """Start the launcher now so it has imported torch by the time the first run comes.

    ``%load_ext nbtrain`` calls it; importing nbtrain does not. Safe to call again. It also
    imports what the first launch needs in this process (the pickler, the admission check,
    the displays: ~20 ms here), so the first run's ranks do not wait for those imports.
    """
    try:
        get_client()
    except OSError:
        pass  # the first launch will report it
    _import_launch_modules()


def _import_launch_modules() -> None:
    import importlib

    names = ["nbtrain.admission", "nbtrain.codepickle", "nbtrain.kernel.display"]
    if "torch" in sys.modules:  # never imported here on the caller's behalf: it may not need it
        names.append("nbtrain.sharedtensors")
    for name in names:
        importlib.import_module(name)


def _close_client() -> None:
    if _client is not None:
        _client.close()


def _forget_client_in_child() -> None:
    # A process forked from the kernel (a DataLoader worker, say) must not keep the
    # launcher's socket open: the launcher would then outlive the kernel.
    global _client
    if _client is not None:
        try:
            os.close(_client.process.channel.detach())
        except OSError:
            pass
    _client = None


class Engine(Protocol):
    """What a :class:`Run` asks of the engine that runs its ranks: this machine's launcher
    (:class:`LauncherClient`) or a cluster's agents (:class:`nbtrain.cluster.engine.ClusterClient`).

    ``submit`` returns the run's id and the queue its records arrive on, as
    ``(record, fds)``; the magic and the live view read only those records.
    """

    def submit(
        self, start_run: Callable[[int], messages.StartRun], tensor_fd: int | None
    ) -> tuple[int, Inbox]: ...
    def stop(self, run_id: int, reason: str, graceful: bool = False) -> None: ...
    def forget(self, run_id: int) -> None: ...
    def output_taken(self, run_id: int, chars: int) -> None: ...
    def close(self) -> None: ...


class Run:
    """A run in progress. ``wait()`` returns rank 0's result or raises the run's failure.

    Example:
        >>> import nbtrain
        >>> run = nbtrain.start(lambda: 6 * 7, devices=2, accelerator="cpu")
        >>> run.wait()
        42
    """

    def __init__(
        self,
        client: Engine,
        run_id: int,
        inbox: Inbox,
        cfg: config_module.LaunchConfig,
        log_path: str | None = None,
    ):
        self.client = client
        self.run_id = run_id
        self.config = cfg
        self.log_path = log_path  # every rank's full output, once a rank printed anything
        self.state = "running"
        self.pids: dict[int, int] = {}
        self._inbox = inbox
        self._ended: messages.RunEnded | None = None
        self._ended_fds: list[int] = []
        self._copied: CopiedResult | None = None
        # What was seen of each rank, for a failure no rank explained: how it exited, and
        # the last output it sent (the message's text, kept by reference: no copy per line).
        self._exits: dict[int, messages.RankExited] = {}
        self._last_output: dict[int, str] = {}
        self._gc_hold: gcpause.Hold | None = None
        self.held: messages.RankHeld | None = None  # its failed rank, kept for %nbtrain_debug
        # Set by a caller that answers pdb's prompts (kernel.debugger.CellRelay); otherwise a
        # rank's breakpoint is answered "continue" and a note says why.
        self.prompts_answered = False
        self.stop_step: messages.StopStep | None = None  # the step a graceful stop chose, once chosen
        self._stop_asked: float | None = None  # when a graceful stop was asked (monotonic)
        self._step_seen_at = 0.0

    def debug_input(self, rank: int, line: str) -> None:
        """Send the line typed at rank ``rank``'s pdb prompt."""
        send = getattr(self.client, "send_debug", None)
        if send is not None:
            send(messages.DebugInput(self.run_id, rank, line))

    def hold_collections_until_started(self, hold: gcpause.Hold) -> None:
        """Keep ``hold`` on the collector while the ranks start; the run's end releases it early."""
        self._gc_hold = hold
        hold.release_later()

    def events(self, poll: float = POLL_SECONDS) -> Iterator[Any]:
        """Yield the run's events as they arrive, ending with its RunEnded.

        Yields None every ``poll`` seconds while nothing arrives, so a caller can redraw.
        KeyboardInterrupt while waiting stops the run (every rank gone, its result
        dropped) and is re-raised.
        """
        while self._ended is None:
            try:
                message, fds = self._inbox.get(timeout=poll if self._stop_asked is None else STOPPING_POLL_SECONDS)
            except queue.Empty:
                yield None
                continue
            except KeyboardInterrupt:
                self.abandon()
                raise
            yield self._take(message, fds)

    def _take(self, message: Any, fds: list[int]) -> Any:
        if isinstance(message, CopiedResult):
            self._copied = message
            return None
        if isinstance(message, (_LauncherGone, messages.RunEnded)) and self._gc_hold is not None:
            self._gc_hold.release()
        if isinstance(message, _LauncherGone):
            self.state = messages.FAILED
            self._copied = None
            self._ended = messages.RunEnded(self.run_id, messages.FAILED, detail=message.detail)
            self.client.forget(self.run_id)
            return self._ended
        if isinstance(message, messages.Output):
            self.client.output_taken(self.run_id, len(message.text))
            # Keep the last lines across events: one print can arrive in several pieces.
            kept = self._last_output.get(message.rank, "") + message.text
            self._last_output[message.rank] = "".join(kept.splitlines(keepends=True)[-_LINES_QUOTED:])
        elif isinstance(message, messages.RankStarted):
            self.pids[message.rank] = message.pid
        elif isinstance(message, messages.RankExited):
            self._exits[message.rank] = message
        elif isinstance(message, messages.RankHeld):
            self.held = message
        elif isinstance(message, messages.DebugPrompt) and not self.prompts_answered:
            return self._cannot_prompt(message)
        elif isinstance(message, messages.StopStep):
            self.stop_step = message
            self._step_seen_at = time.monotonic()
        if isinstance(message, messages.RunEnded):
            self._ended, self._ended_fds = message, fds
            self.state = message.state
            self.client.forget(self.run_id)
            if message.state != messages.FINISHED and message.stopped_at is None:
                self._copied = None  # a failed or stopped run has no result: free its memory now
        return message

    def _cannot_prompt(self, prompt: messages.DebugPrompt) -> messages.Output:
        self.debug_input(prompt.rank, "c")
        return messages.Output(
            self.run_id, prompt.rank, "stderr",
            f"nbtrain: rank {prompt.rank} stopped at a breakpoint, but nothing here answers its prompt "
            "(a background run, run.wait(), watch()); it continues. Run it as a %%distributed cell or "
            "with nbtrain.launch() to debug there.\n",
        )

    @property
    def stopped_at(self) -> int | None:
        """The step every rank stopped at, when a stop kept the state there (None otherwise)."""
        return None if self._ended is None else self._ended.stopped_at

    @property
    def stop_note(self) -> str:
        """Why a stop could not keep the state ("stopped hard (rank 1 did not reach step 412 ...)"), or ""."""
        return "" if self._ended is None else self._ended.stop_note

    def ask_to_stop(self, reason: str = "stopped", graceful: bool = True) -> None:
        """Ask the run to stop and return at once; its events go on until its RunEnded.

        ``graceful``: every rank ends at one optimizer step and rank 0's state there comes back
        (:mod:`nbtrain.stopboard`); a run that cannot (no optimizer step yet) stops at once.
        """
        if self._ended is not None:
            return
        if graceful and self._stop_asked is None:
            self._stop_asked = time.monotonic()
        if graceful:
            self.client.stop(self.run_id, reason, graceful=True)
        else:
            self.client.stop(self.run_id, reason)

    def stop_deadline(self) -> float | None:
        """When waiting for a graceful stop has gone on too long (its grace, then the usual bound), or None."""
        if self._stop_asked is None:
            return None
        if self.stop_step is None:
            return self._stop_asked + GRACEFUL_CHOICE_SECONDS + INTERRUPT_GRACE_SECONDS
        return self._step_seen_at + self.stop_step.grace + INTERRUPT_GRACE_SECONDS

    def stop(self, reason: str = "stopped", graceful: bool = False) -> None:
        """Stop every rank and wait (bounded) until they are gone.

        ``graceful``: every rank first ends at one optimizer step (within the grace period),
        and :meth:`result` then gives rank 0's state there; a second stop, or an interrupt
        while waiting, stops hard at once.
        """
        if self._ended is not None:
            return
        self.ask_to_stop(reason, graceful)
        deadline = self.stop_deadline() if graceful else None
        deadline = deadline or time.monotonic() + INTERRUPT_GRACE_SECONDS
        while self._ended is None and time.monotonic() < deadline:
            try:
                message, fds = self._inbox.get(timeout=min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                if graceful:  # a second interrupt while stopping at a step: stop hard, now
                    graceful = False
                    self.ask_to_stop(reason, graceful=False)
                    deadline = time.monotonic() + INTERRUPT_GRACE_SECONDS
                continue  # a second interrupt while stopping hard: finish stopping first
            self._take(message, fds)
            if graceful and isinstance(message, messages.StopStep):
                deadline = self.stop_deadline() or deadline
        if self._ended is None:  # the launcher did not answer in time: replace it
            self.client.close()
            self._ended = messages.RunEnded(self.run_id, messages.STOPPED)
            self.state = messages.STOPPED

    def abandon(self) -> None:
        """Stop the run for an interrupt (if it still goes) and drop its result.

        Whatever rank 0's result already brought into this process is freed at once: an
        interrupted call's traceback keeps this handle alive for as long as IPython keeps
        the traceback.
        """
        self.stop("interrupted")
        self._drop_result()

    def _drop_result(self) -> None:
        self._copied = None
        for fd in self._ended_fds:
            os.close(fd)
        self._ended_fds = []
        while True:  # what came after the run ended, or before a launcher that never answered
            try:
                _message, fds = self._inbox.get_nowait()
            except queue.Empty:
                return
            for fd in fds:
                os.close(fd)

    def wait(self, on_event: Callable[[Any], None] | None = None) -> Any:
        """Block until the run ends; return rank 0's result or raise its failure.

        KeyboardInterrupt stops every rank, drops the result and is re-raised.
        """
        try:
            for event in self.events():
                if event is not None and on_event is not None:
                    on_event(event)
            return self.result()
        except KeyboardInterrupt:
            pass
        # events() stops the run when the interrupt lands in its own wait; one that lands in
        # on_event (printing a line, say) or in loading the result must stop it too, or the
        # ranks run on. Raised afresh, out here: the interrupted frames, with whatever part
        # of the result they had loaded, are freed instead of living on in the traceback.
        self.abandon()
        where = self.where_ranks_were()
        # A plain KeyboardInterrupt, as Python raises; its text says where each rank was.
        raise KeyboardInterrupt(f"every rank was stopped.\n{where}" if where else "")

    def result(self) -> Any:
        """Rank 0's return value (call after the run ended: after ``wait()``, or once ``events()`` is exhausted)."""
        ended = self._ended
        if ended is None:
            raise RunNotEndedError(
                f"run {self.run_id} has not ended yet, so it has no result (its state: {self.state}). "
                "Call run.wait(), which waits for the end and returns the result, or read run.events() "
                "until it ends, then call run.result()."
            )
        if ended.state == messages.FINISHED or ended.stopped_at is not None:
            return self._load_result(ended)  # a graceful stop's result: the state at the stop step
        raise self._failure(ended)

    def _load_result(self, ended: messages.RunEnded) -> Any:
        fd = self._ended_fds[0] if self._ended_fds else None
        try:
            if self._copied is not None:
                from nbtrain import sharedtensors

                return sharedtensors.loads_mapped(self._copied.data, self._copied.mapping, map_location="cpu")
            if fd is None:  # no tensor storages: plain pickle, and no torch import for it
                import pickle

                return pickle.loads(ended.result or b"")
            from nbtrain import sharedtensors

            return sharedtensors.loads(ended.result or b"", fd, map_location="cpu")
        finally:
            for extra in self._ended_fds:
                os.close(extra)
            self._ended_fds = []

    def where_ranks_were(self) -> str:
        """Where each rank was when a timeout or a stop ended the run, in the notebook's terms.

        Each line names a rank, what it was doing and the cell and line (``rank 0: waiting
        in all_reduce, Cell In[5], line 12``), then each rank's stack; "" when the run did
        not end that way (or the launcher got no dump).
        """
        from nbtrain import stacks

        if self._ended is None or not self._ended.stacks:
            return ""
        parsed = [stacks.RankStack(rank, stacks.parse_dump(text)) for rank, text in self._ended.stacks]
        return stacks.describe(parsed, cell_namer(), _source_line)

    def _failure(self, ended: messages.RunEnded) -> RunFailedError | LauncherError:
        failure = ended.failure
        if isinstance(failure, messages.RankFailed):
            from nbtrain.kernel import debugger

            note = debugger.held_note(self.held) if self.held is not None else ""
            return RankError(
                failure.rank, failure.exc_type, failure.message, failure.traceback, note, node=failure.node
            )
        if isinstance(failure, messages.RankNotStarted):
            return RankStartError(failure.rank, failure.world_size, failure.error_name, failure.reason)
        if isinstance(failure, messages.RankExited):
            return RankDiedError(
                failure.rank, signal_number=failure.signal_number, exit_code=failure.exit_code, node=failure.node
            )
        if isinstance(failure, messages.NodeLost):
            return NodeLostError(failure.node, failure.detail)
        if ended.state == messages.TIMED_OUT:
            timed_out = RunTimeoutError(self.config.timeout or 0.0, self.where_ranks_were())
            if ended.stop_note:  # a stop at a step was tried and could not keep the state: why
                timed_out._set_message(_with_note(timed_out.headline, ended.stop_note), timed_out.where)
            return timed_out
        if ended.state == messages.STOPPED:
            message = _with_note(
                ended.detail or "the run was stopped before it finished; every rank is gone.", ended.stop_note
            )
            return RunStoppedError(message, self.where_ranks_were())
        return LauncherError(ended.detail or unexplained_failure(self._exits, self._last_output, self.log_path))


def _with_note(message: str, note: str) -> str:
    """A stop's message with why it could not keep the state: "stopped hard (...)" leads, a sentence follows."""
    if note.startswith("stopped hard"):
        return f"{note}; {message}"
    return f"{message} {note}" if note else message


def unexplained_failure(
    exits: dict[int, messages.RankExited], last_output: dict[int, str], log_path: str | None
) -> str:
    """What a run that failed without a cause showed: each rank's exit, its last lines, where its log is.

    >>> exits = {1: messages.RankExited(1, 1, exit_code=3, signal_number=None, reported=False)}
    >>> print(unexplained_failure(exits, {1: "step 9\\nsaving\\n"}, None))  # doctest: +NORMALIZE_WHITESPACE
    the run failed, but no rank reported an error and nbtrain saw no cause.
    Seen: rank 1 exited with code 3 before finishing its work.
    Last output of rank 1: step 9 | saving
    This run has no log file (nbtrain could not write one). Run it again; if it fails the same way,
    the launcher's own messages are on the kernel's stderr (the terminal or log that runs Jupyter).
    """
    lines = ["the run failed, but no rank reported an error and nbtrain saw no cause."]
    seen = [_exit_words(exits[rank]) for rank in sorted(exits)]
    lines.append("Seen: " + ("; ".join(seen) if seen else "no rank was seen to exit") + ".")
    for rank in sorted(last_output)[:_RANKS_QUOTED]:
        tail = last_output[rank].splitlines()[-_LINES_QUOTED:]
        lines.append(f"Last output of rank {rank}: " + " | ".join(line.strip() for line in tail))
    if log_path and os.path.exists(log_path):
        where = f"Every rank's full output is in {log_path}."
    elif log_path:
        where = f"No rank printed anything (the log file {log_path} was never written)."
    else:
        where = "This run has no log file (nbtrain could not write one)."
    lines.append(
        f"{where} Run it again; if it fails the same way, the launcher's own messages are on the "
        "kernel's stderr (the terminal or log that runs Jupyter)."
    )
    return "\n".join(lines)


_RANKS_QUOTED = 4  # ranks whose last lines an unexplained failure quotes
_LINES_QUOTED = 3  # lines quoted per rank


def _exit_words(exited: messages.RankExited) -> str:
    who = f"rank {exited.rank}" + (f" on {exited.node}" if exited.node else "")
    if exited.signal_number is not None:
        try:
            name = f" ({signal.Signals(exited.signal_number).name})"
        except ValueError:
            name = ""
        how = f"was killed by signal {exited.signal_number}{name}"
    else:
        how = f"exited with code {exited.exit_code}"
    if exited.reported:
        return f"{who} {how} after finishing its work"
    return f"{who} {how}" + (" when nbtrain stopped it" if exited.stopped else " before finishing its work")


def start(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    devices: Any = "auto",
    accelerator: str = "auto",
    strategy: str = "ddp_notebook",
    timeout: float | None = None,
    backend: str | None = None,
    oversubscribe: bool = False,
    precision: str = "32-true",
    sync_batchnorm: bool = False,
    config: config_module.LaunchConfig | None = None,
    cluster: str | None = None,
    num_nodes: int | None = None,
) -> Run:
    """Start ``fn(*args, **kwargs)`` on every rank and return the :class:`Run` at once.

    Refused before anything starts (ConfigurationError) when the run cannot fit: more CPU
    processes than 4 per core (unless ``oversubscribe=True``), or more memory than is free.
    A caller that already built the launch configuration (the magic, from its flags)
    passes it as ``config``: the devices, accelerator, strategy, timeout, backend and
    oversubscribe arguments are then not read, and the hardware is not probed again.
    ``cluster="ray"`` (or a Ray address) runs on ``num_nodes`` nodes of a Ray cluster with
    ``devices`` ranks on each (:mod:`nbtrain.cluster`); the default runs on this machine.
    """
    with gcpause.held():  # planning too: a collection here would delay every rank the same
        if config is not None and (cluster is None or str(cluster).strip().lower() == "local"):
            client, cfg = get_client(), config
        else:
            client, cfg = _engine(
                cluster, num_nodes, devices, accelerator, strategy, timeout, backend, oversubscribe, precision,
                sync_batchnorm,
            )
        return start_on(client, cfg, fn, args, kwargs)


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
    (:func:`nbtrain.cluster.engine.prepare`, which also gives ``cfg``). ``interactive``
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
            start_message = _StartMessage(cfg, payload, tensor_fd is not None, with_log=local, interactive=interactive)
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
        sys.stderr.write(
            f"nbtrain: rank {held.rank} of the failed run before, held for %nbtrain_debug, is released: "
            "this launch needs its devices and memory.\n"
        )
        sys.stderr.flush()


def _serialise(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[bytes, int | None]:
    """The run's payload (and the memfd of its tensors), or a SerializationError saying what to do."""
    from nbtrain.errors import SerializationError

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
    ) -> None:
        from nbtrain import hardware
        from nbtrain.kernel import defaults
        from nbtrain.kernel import shell as kernel_shell

        self.interactive = interactive and with_log  # a cluster's agents relay no prompt (README)
        # A cluster's ranks cannot be held (README, cluster limits); a background run's failure
        # is read later, and a script (no IPython) has no %nbtrain_debug: they hold none.
        held = self.interactive and kernel_shell.get_shell() is not None
        self.debug_hold = defaults.get_defaults().debug_hold if held else None

        self.cfg = cfg
        self.payload = payload
        self.has_tensor_file = has_tensor_file
        self.with_log = with_log  # a cluster's agents keep their own logs
        self.threads = config_module.threads_per_rank(hardware.cpu_count(), cfg.world_size, os.environ)
        self.log_path: str | None = None

    def __call__(self, run_id: int) -> messages.StartRun:
        cfg = self.cfg
        self.log_path = _log_path(run_id) if self.with_log else None
        return messages.StartRun(
            run_id=run_id,
            payload=self.payload,
            ranks=cfg.rank_specs(),
            start_method=cfg.strategy.start_method,
            backend=cfg.backend,
            # prepare() on a rank wraps models for this strategy and precision (nbtrain.rank.prepare).
            environ={**_caller_environment(), **config_module.rank_environment(cfg)},
            cwd=os.getcwd(),
            sys_path=tuple(sys.path),
            source_lines=_notebook_source_lines(),
            timeout=cfg.timeout,
            threads_per_rank=self.threads,
            has_tensor_file=self.has_tensor_file,
            strategy=cfg.strategy.name,
            log_path=self.log_path,
            debug_hold=self.debug_hold,
            interactive=self.interactive,
            standby_seconds=_standby_seconds(),
            on_stop=cfg.on_stop,
            stop_grace=cfg.stop_grace,
        )


def _standby_seconds() -> float | None:
    from nbtrain.kernel import defaults

    return defaults.get_defaults().standby_idle or None


def standby_pids() -> set[int]:
    """The pids of this kernel's standby ranks (a GPU only they hold counts as free)."""
    standby = _client.standby if _client is not None else None
    return {pid for _, pid in standby.ranks} if standby is not None else set()


def _submit(client: Engine, start_message: _StartMessage, tensor_fd: int | None) -> Run:
    """Send the run to its engine and return its handle; an interrupt meanwhile stops it and is raised after."""
    # Held: an interrupt half way through sending StartRun would garble the channel, and
    # one between the send and the handle would leave a run nobody can stop.
    with processes.interrupts_held() as held:
        run_id, inbox = client.submit(start_message, tensor_fd)
        run = Run(client, run_id, inbox, start_message.cfg, start_message.log_path)
    if held.received:  # the caller was interrupted as the run started: it does not go on
        run.abandon()
        raise KeyboardInterrupt
    return run


def _engine(
    cluster: str | None, num_nodes: int | None, devices: Any, accelerator: str, strategy: str,
    timeout: float | None, backend: str | None, oversubscribe: bool = False, precision: str = "32-true",
    sync_batchnorm: bool = False,
) -> tuple[Any, config_module.LaunchConfig]:
    """The engine that runs the ranks (this machine's launcher, or a cluster's agents) and the plan."""
    if cluster is not None and str(cluster).strip().lower() != "local":
        from nbtrain.cluster import engine

        return engine.prepare(
            cluster, num_nodes, devices, accelerator, strategy, timeout,
            backend=backend, precision=precision, sync_batchnorm=sync_batchnorm,
        )
    if num_nodes not in (None, 1):
        from nbtrain.cluster import nodes

        nodes.validate_num_nodes(num_nodes, cluster)
    from nbtrain import hardware

    plan = hardware.probe_plan(devices, accelerator, oversubscribe)
    cfg = config_module.make_config(
        plan, strategy=strategy, timeout=timeout, backend=backend, precision=precision, sync_batchnorm=sync_batchnorm
    )
    return get_client(), cfg


def launch(
    fn: Callable[..., Any],
    *args: Any,
    devices: Any = "auto",
    accelerator: str = "auto",
    strategy: str = "ddp_notebook",
    timeout: float | None = None,
    background: bool = False,
    oversubscribe: bool = False,
    backend: str | None = None,
    precision: str = "32-true",
    sync_batchnorm: bool = False,
    cluster: str | None = None,
    num_nodes: int | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank; return rank 0's return value.

    ``fn`` may be a lambda, a closure or a function defined in the notebook: it travels
    with cloudpickle. Each rank's prints appear here, tagged with the rank. A failure in
    any rank stops all of them and raises here (:class:`nbtrain.errors.RankError`).

    ``oversubscribe=True`` allows more CPU processes than 4 per core (refused otherwise).
    ``backend``, ``precision`` (Lightning's names: ``"32-true"``, ``"bf16-mixed"``,
    ``"16-mixed"``, ...) and ``sync_batchnorm`` are as for ``%%distributed``; they apply to
    what ``nbtrain.prepare`` does on the ranks.

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
    run = start(
        fn,
        args,
        kwargs,
        devices=devices,
        accelerator=accelerator,
        strategy=strategy,
        timeout=timeout,
        oversubscribe=oversubscribe,
        backend=backend,
        precision=precision,
        sync_batchnorm=sync_batchnorm,
        cluster=cluster,
        num_nodes=num_nodes,
    )
    try:
        if background:
            from nbtrain.kernel import background as _background

            return _background.follow_function(run, fn)
        return run.wait(on_event=_printer_with_debugger(run))
    except KeyboardInterrupt:
        run.abandon()  # wait() did already; not so an interrupt before it, or in follow_function
        raise


def _printer_with_debugger(run: Run) -> Callable[[Any], None]:
    """Print the ranks' output, and answer their pdb prompts in the input box (an interrupt there stops the run)."""
    from nbtrain.kernel import debugger, display

    relay = debugger.CellRelay(run, processes.HeldInterrupts())
    run.prompts_answered = True

    def on_event(event: Any) -> None:
        if not relay.handle(event):
            display.print_output(event)
        if relay.held.received:
            raise KeyboardInterrupt

    return on_event


def _admit(
    cfg: config_module.LaunchConfig, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> None:
    """Refuse a run whose memory cannot fit (ConfigurationError); warn on stderr when it comes close."""
    from nbtrain import admission, hardware

    namespace = getattr(fn, "__globals__", {})
    referenced = [namespace.get(name) for name in getattr(getattr(fn, "__code__", None), "co_names", ())]
    closure = [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _has_contents(cell)]
    need = admission.weigh([*args, *(kwargs or {}).values(), *closure, *referenced])
    gpu_free = None
    if cfg.plan.accelerator == "cuda":
        gpu_free = {gpu.index: gpu.free_bytes for gpu in hardware.detect_gpus() if gpu.index in cfg.plan.device_ids}
        # The run takes the standby ranks or ends them first: their memory is the run's. (gpu_usage
        # numbers GPUs as NVML does, which is torch's numbering only without CUDA_VISIBLE_DEVICES.)
        standby = standby_pids() if "CUDA_VISIBLE_DEVICES" not in os.environ else set()
        for usage in hardware.gpu_usage() if standby else ():
            if usage.index in gpu_free:
                gpu_free[usage.index] += sum(used for pid, used in usage.process_bytes.items() if pid in standby)
    warning = admission.check_memory(
        need,
        world_size=cfg.world_size,
        accelerator=cfg.plan.accelerator,
        sharded=cfg.strategy.model_wrapper in ("fsdp", "fsdp_offload"),
        start_method=cfg.strategy.start_method,
        host_available=hardware.available_memory(),
        gpu_free=gpu_free,
    )
    if warning:
        sys.stderr.write(f"nbtrain warning: {warning}\n")
        sys.stderr.flush()


def _has_contents(cell: Any) -> bool:
    try:
        _ = cell.cell_contents  # raises for an empty cell
    except ValueError:  # a closure variable not bound yet
        return False
    return True


def _log_path(run_id: int) -> str | None:
    """A new run's log file (created by the launcher at its first line); old ones are pruned."""
    directory = os.environ.get(LOG_DIR_VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nbtrain", "logs"
    )
    try:
        os.makedirs(directory, exist_ok=True)
        logs = sorted(name for name in os.listdir(directory) if name.startswith("run-") and name.endswith(".log"))
        for name in logs[: max(0, len(logs) - LOGS_KEPT + 1)]:
            os.unlink(os.path.join(directory, name))
    except OSError:
        return None  # no writable place: the run goes on without a log
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(directory, f"run-{stamp}-{os.getpid()}-{run_id}.log")


def _pickle_payload(payload: Any) -> tuple[bytes, int | None]:
    """cloudpickle, with tensors through shared memory (see :mod:`nbtrain.sharedtensors`).

    A caller that never imported torch cannot be sending a tensor: plain cloudpickle then
    spares its first launch the ~1 s import of torch.
    """
    if "torch" not in sys.modules:
        from nbtrain import codepickle

        return codepickle.dumps(payload), None
    from nbtrain import sharedtensors

    return sharedtensors.dumps(payload)


def _caller_environment() -> dict[str, str]:
    return processes.rank_environment(os.environ)


def cell_namer() -> Callable[[str], str | None]:
    """filename -> ``Cell In[N]`` for the notebook's cells, as IPython names them in tracebacks."""
    from nbtrain.kernel import shell as kernel_shell

    names = kernel_shell.cell_filenames(kernel_shell.get_shell())
    return lambda filename: f"Cell In[{names[filename]}]" if filename in names else None


def _source_line(filename: str, line: int) -> str:
    return linecache.getline(filename, line)


def _notebook_source_lines() -> dict[str, tuple[str, ...]]:
    """Source of code that exists only in this process (notebook cells), for tracebacks."""
    lines: dict[str, tuple[str, ...]] = {}
    size = 0
    for filename, entry in list(linecache.cache.items()):
        if len(entry) == 4 and compat.only_in_memory(filename, entry) and size < _SOURCE_LINES_LIMIT:
            lines[filename] = tuple(entry[2])
            size += entry[0]
    return lines
