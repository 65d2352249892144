"""The kernel's connection to its warm launcher: :class:`LauncherClient` and the one per process.

The kernel keeps one warm launcher (started by ``nbtrain.prewarm()`` or the first run) and talks to it over a
private socket. A reader thread takes every message off that socket and files it under its
run, so the thread that waits for a run (the cell's own thread, for a blocking launch)
only ever reads a queue with a bounded timeout and can always be interrupted. What a run
does with its messages is :class:`nbtrain.kernel.run_handle.Run`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib
import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

from nbtrain.errors import LauncherError
from nbtrain.kernel import warm
from nbtrain.messages import events, logsetup, wire
from nbtrain.messages.records import CopiedResult
from nbtrain.system import processes

# A run's messages from the launcher (or a cluster's agents), each with the file
# descriptors that came with it.
Inbox: TypeAlias = "queue.Queue[tuple[Any, list[int]]]"

# "file": rank 0 sends its result's tensors in a shared-memory file instead of the kernel
# reading them out of its memory (which is automatic where a sandbox forbids the read).
RESULT_TRANSFER_VARIABLE = "NBTRAIN_RESULT_TRANSFER"
# Rank output waiting in a run's inbox for the cell to show it: past this, lines are
# dropped (and counted in a note) instead of growing the kernel. The launcher already
# sends at most a few thousand lines per rank, so only a stalled reader gets here.
PENDING_OUTPUT_CHARS = 8_000_000
# Waiting for a launcher the template forked (nbtrain.kernel.warm) to be taken or given up:
# its own bound, and the kernel's own launcher's start (a Popen) after it.
DECIDED_SECONDS = warm.READY_SECONDS + 30.0
STDERR_SECONDS = 1.0  # how long a gone launcher's error waits for the last of its stderr


class LauncherGone:
    """Filed under every open run when the launcher's channel closes; ``detail`` says how it ended."""

    def __init__(self, detail: str):
        self.detail = detail


class LauncherClient:
    """The kernel's connection to its warm launcher."""

    def __init__(self) -> None:
        # Forked from the user's warm template where one can be used; else our own, as before.
        forked = warm.forked_launcher()
        self.process = forked or processes.start_launcher()
        # Shown by the first run if it must wait for this launcher (nbtrain.kernel.warm.cold_note).
        self.cold_note = warm.cold_note(own_launcher=forked is None)
        # A forked launcher is ours once it said it is ready; until a run was sent to it, one
        # that cannot serve (refused, gone, too late) is replaced by our own (_fall_back).
        self._committed = forked is None
        self._settled = threading.Event()  # the forked launcher said it is ready, or its channel closed
        self._forked_gone = threading.Event()
        self._decided = threading.Event()  # the forked launcher was taken or replaced
        self.ready = threading.Event()
        # What the launcher's libraries set up on import, its ranks have it: runs send the rest.
        self.libraries_logging: logsetup.LoggingSetup | None = None
        self.alive = True
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self._queues: dict[int, Inbox] = {}
        self._stopping: set[int] = set()  # runs asked to stop: their results are not copied
        self._lock = threading.Lock()
        self._pending_output: dict[int, _PendingOutput] = {}
        self._run_ids = itertools.count(1)
        # Notebook cells whose lines this launcher was sent: it keeps them (its forks inherit
        # them), so each cell's lines go to it once (nbtrain.kernel.client._StartMessage).
        self.sources_sent: set[str] = set()
        # The notebook's imports this launcher was sent (it keeps them): each goes to it once.
        self.modules_sent: set[str] = set()
        # The rank of a failed run kept for a post-mortem, and what it and its debugger send
        # once its run is over (nbtrain.kernel.pdb_relay).
        self.held: events.RankHeld | None = None
        self.debug_messages: queue.Queue[Any] = queue.Queue()
        self.standby: events.StandbyChanged | None = None  # the launcher's last word on them
        self._released: queue.Queue[tuple[int, ...]] = queue.Queue()  # its answers to ReleaseStandby
        self._start_readers(self.process)
        if forked is None:
            self._decided.set()
        else:
            threading.Thread(target=self._check_forked, args=(forked,), name="nbtrain-template", daemon=True).start()

    def _start_readers(self, process: processes.LauncherProcess) -> None:
        stderr_read = threading.Event()  # the process's stderr reached EOF: its last words are in
        args = (process, stderr_read)
        threading.Thread(target=self._read_events, args=args, name="nbtrain-events", daemon=True).start()
        threading.Thread(target=self._read_stderr, args=args, name="nbtrain-launcher-stderr", daemon=True).start()

    def _check_forked(self, forked: processes.LauncherProcess) -> None:
        """Take the forked launcher once it said it is ready; our own instead if it cannot be."""
        try:
            self._settled.wait(warm.READY_SECONDS)
            why = self._why_unusable(forked)
            with self._lock:  # decided under the lock: the reader's end of it reads _decided
                if self.alive and self.process is forked and why:
                    self._fall_back(forked, why)
                self._decided.set()
        finally:
            self._decided.set()

    def _why_unusable(self, forked: processes.LauncherProcess) -> str:
        """Why the template's launcher cannot serve ("" where it can); asked once it settled or timed out."""
        handle = forked.popen
        if not self.ready.is_set():
            if not self._forked_gone.is_set():
                return f"its launcher did not say it was ready within {warm.READY_SECONDS:g} s"
            told = handle.answered_pid() if isinstance(handle, processes.ForkedLauncher) else None
            said = handle.why_none if isinstance(handle, processes.ForkedLauncher) and told is None else ""
            return "its launcher's channel closed before it was ready" + (f" ({said})" if said else "")
        # Ready, the template has forked it and its reply is on the way: a launcher whose pid
        # we were never told could not be waited for or killed.
        if handle.pid <= 0:
            said = handle.why_none if isinstance(handle, processes.ForkedLauncher) else ""
            return said or "the template did not say which process its launcher is"
        if self._forked_gone.is_set():
            return "its launcher ended before the first run was sent to it"
        return ""

    def _fall_back(self, forked: processes.LauncherProcess, why: str) -> None:
        """Replace the forked launcher (no run was sent to it) by our own, saying ``why`` in the log; under the lock."""
        warm.note_fallback(why)
        self.cold_note = warm.cold_note(own_launcher=True)
        self.ready.clear()
        self.stderr_tail.clear()
        try:
            self.process = processes.start_launcher()
        except OSError:
            self.alive = False  # the first run says so, as it would have before the template
            return
        finally:
            self._committed = True
            warm.abandon(forked)
        self._start_readers(self.process)

    def wait_usable(self) -> None:
        """Wait (bounded) until a launcher forked by the template said it is ready or was replaced by our own.

        A first run that finds the launcher not ready says why in its cell, once (the template was not warm).
        """
        if self.cold_note and not self.ready.is_set():
            warm.say_cold(self.cold_note)
        self.cold_note = ""  # said once, or not needed: the launcher was warm by the first run
        self._decided.wait(DECIDED_SECONDS)

    def submit(self, start_run: Callable[[int], events.StartRun], tensor_fd: int | None) -> tuple[int, Inbox]:
        """Send a new run to the launcher (with its tensors' memfd, if any); its id and the inbox it is filed in."""
        self.wait_usable()  # no run goes to a forked launcher before it said it is ready
        with self._lock:
            self._committed = True  # from here on, the launcher's death is the run's error
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
            self.sources_sent.update(message.source_lines)
            self.modules_sent.update(message.notebook_modules)
        return run_id, inbox

    def send_notebook_modules(self, modules: tuple[str, ...]) -> None:
        """Modules a cell imported, for the launcher's list and its standby ranks (nbtrain.kernel.importedmodules)."""
        # As a run would be: the launcher imports the libraries among them as the kernel did (environment, cwd, path).
        environ, where = processes.inherited_environment(os.environ), os.getcwd()
        with self._lock, contextlib.suppress(OSError):  # not sent: the next run sends them
            wire.send(self.process.channel, events.NotebookModules(modules, environ, where, tuple(sys.path)))
            self.modules_sent.update(modules)

    def stop(self, run_id: int, reason: str, graceful: bool = False) -> None:
        """Ask the launcher to stop a run (``graceful``: every rank at one step, rank 0's result kept)."""
        with self._lock:
            if not graceful:  # a graceful stop wants rank 0's result at the stop step
                self._stopping.add(run_id)
            with contextlib.suppress(OSError):  # a dead launcher's ranks die with it (PDEATHSIG)
                wire.send(self.process.channel, events.StopRun(run_id, reason, graceful))

    def send_debug(self, message: Any) -> None:
        """A line for a rank's pdb, an attach to the held rank or its release: to the launcher."""
        # A launcher gone is not an error here: its ranks went with it, and the waiting side hears of it.
        with self._lock, contextlib.suppress(OSError):
            wire.send(self.process.channel, message)

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
                wire.send(self.process.channel, events.ReleaseStandby())
            except OSError:
                return []  # a dead launcher's ranks die with it
        try:
            return list(self._released.get(timeout=timeout))
        except queue.Empty:
            return []  # a launcher that does not answer: its ranks die with it when it is replaced

    def forget(self, run_id: int) -> None:
        """The run has ended: drop its inbox and its output bookkeeping."""
        with self._lock:
            self._queues.pop(run_id, None)
            self._pending_output.pop(run_id, None)
            self._stopping.discard(run_id)

    def output_taken(self, run_id: int, chars: int) -> None:
        """The reader took ``chars`` characters of the run's output: room for more before lines are dropped."""
        pending = self._pending_output.get(run_id)
        if pending is not None:
            pending.taken(chars)

    def close(self) -> None:
        """Stop the launcher (its ranks die with it); the next launch starts a new one."""
        with self._lock:  # so a forked launcher given up meanwhile is not replaced after this
            self.alive = False
        processes.stop_launcher(self.process)

    def exit_detail(self) -> str:
        """Why the launcher is gone (or not answering), with its last output: for the error that says so."""
        code = self.process.popen.poll()
        tail = "".join(self.stderr_tail).strip()
        text = (
            "the nbtrain launcher process has exited" if code is not None else "the nbtrain launcher stopped answering"
        )
        if code is not None and code < 0 and code != processes.UNKNOWN_EXIT:
            text += f" (killed by {_signal_name(-code)})"
        elif code is not None and code != processes.UNKNOWN_EXIT:
            text += f" (exit code {code})"
        return text + (f"; its last output:\n{tail}" if tail else ". The next launch starts a new one.")

    def _read_events(self, process: processes.LauncherProcess, stderr_read: threading.Event) -> None:
        channel = process.channel
        while True:
            try:
                message, fds = wire.receive(channel)
            except (wire.ChannelClosed, OSError):
                break
            if isinstance(message, events.LauncherReady):
                self.libraries_logging = message.libraries_logging
                self.ready.set()
                self._settled.set()
                continue
            if isinstance(message, events.StandbyChanged):
                self.standby = message
                if message.released is not None:
                    self._released.put(message.released)
                continue
            inbox = self._queues.get(getattr(message, "run_id", -1))
            self._note_held(message)
            if inbox is None and isinstance(message, _AFTER_THE_RUN):
                self.debug_messages.put(message)
            elif isinstance(message, events.ResultOffer):
                # Taken here, not by whoever waits for the run: rank 0 (and its memory,
                # GPU included) is held until this answer, even if nobody ever waits.
                self._take_result(message, inbox)
            elif inbox is None:
                for fd in fds:
                    os.close(fd)
            else:
                self._file(message, fds, inbox)
        self._forked_gone.set()
        self._settled.set()
        with self._lock:
            if process is not self.process:
                return  # a forked launcher given up for our own
            if not self._committed:
                if self._decided.is_set() and self.alive:  # it was ready, and died before its first run
                    self._fall_back(process, "its launcher ended before the first run was sent to it")
                return  # else _check_forked replaces it
            self.alive = False
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: the detail says so
                self.process.popen.wait(timeout=1.0)
            # Its last words (a traceback, a fatal signal's note) are what the error shows.
            stderr_read.wait(STDERR_SECONDS)
            gone = LauncherGone(self.exit_detail())
            for inbox in self._queues.values():
                inbox.put((gone, []))
            self.held = None  # its ranks died with it
            self.debug_messages.put(gone)

    def _note_held(self, message: Any) -> None:
        if isinstance(message, events.RankHeld):
            self.held = message
        elif isinstance(message, events.HeldReleased) and getattr(self.held, "run_id", None) == message.run_id:
            self.held = None

    def _file(self, message: Any, fds: list[int], inbox: Inbox) -> None:
        pending = self._pending_output.get(message.run_id)
        if pending is not None and isinstance(message, (events.Output, events.RunEnded)):
            if isinstance(message, events.Output) and not pending.admit(message):
                return  # dropped, and counted for the note
            for note in pending.notes(message.run_id):
                inbox.put((note, []))
        inbox.put((message, fds))

    def _take_result(self, offer: events.ResultOffer, inbox: Inbox | None) -> None:
        copied = None
        # A run being stopped gives up its result (the launcher stops rank 0 too): no copy.
        wanted = inbox is not None and offer.run_id not in self._stopping
        if wanted and os.environ.get(RESULT_TRANSFER_VARIABLE) != "file":
            # deferred: start-up time (cloudpickle, torch)
            from nbtrain.messages import sharedtensors

            # Forbidden here (a sandbox), or no memory: this thread must live on, and rank 0
            # sends a file instead.
            with contextlib.suppress(Exception):
                copied = CopiedResult(
                    offer.result, sharedtensors.read_from_process(offer.pid, offer.regions, offer.total_bytes)
                )
        answer = events.ReleaseResult(offer.run_id, send_file=wanted and copied is None)
        with self._lock, contextlib.suppress(OSError):  # the launcher is gone; the run's inbox hears of it
            wire.send(self.process.channel, answer)
        # Then the cell's thread hears of it: it draws the last frame's chart (nbtrain.kernel.display.owntext),
        # which would hold this thread's release back on the interpreter lock.
        if copied is not None and inbox is not None:  # copied only when wanted, so for an inbox
            inbox.put((copied, []))

    def _read_stderr(self, process: processes.LauncherProcess, stderr_read: threading.Event) -> None:
        stream = process.popen.stderr
        if stream is None:
            stderr_read.set()  # nothing to wait for
            return
        for line in iter(stream.readline, b""):
            if process is self.process:
                self.stderr_tail.append(line.decode(errors="replace"))
        stderr_read.set()
        if process is not self.process:  # a forked launcher given up: nobody else closes it
            with contextlib.suppress(OSError):
                stream.close()


def _signal_name(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


# What a held rank sends after its run ended: the post-mortem's relay reads it.
_AFTER_THE_RUN = (
    events.DebugOutput, events.DebugPrompt, events.DebugEnded, events.HeldReleased, events.RankHeld,
)


class _PendingOutput:
    """Characters of a run's output filed but not yet taken, and lines dropped per rank."""

    def __init__(self, log_path: str | None):
        self.log_path = log_path
        self.chars = 0
        self.dropped: dict[int, int] = {}
        self._lock = threading.Lock()

    def admit(self, output: events.Output) -> bool:
        with self._lock:
            if self.chars > PENDING_OUTPUT_CHARS:
                self.dropped[output.rank] = self.dropped.get(output.rank, 0) + output.text.count("\n")
                return False
            self.chars += len(output.text)
            return True

    def taken(self, chars: int) -> None:
        with self._lock:
            self.chars -= chars

    def notes(self, run_id: int) -> list[events.Output]:
        """Once the reader caught up (or the run ended): say what was dropped."""
        with self._lock:
            if not self.dropped or (self.chars > PENDING_OUTPUT_CHARS / 2):
                return []
            dropped, self.dropped = self.dropped, {}
        where = f" Every line is in {self.log_path}." if self.log_path else ""
        return [
            events.Output(
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
        # deferred: start-up time
        from nbtrain.planning import probe

        probe.standby_pids = standby_pids
        atexit.register(_close_client)
        os.register_at_fork(after_in_child=_forget_client_in_child)
        _hooks_registered = True


def prewarm() -> None:
    """Start the launcher now so it has imported torch by the time the first run comes.

    ``%load_ext nbtrain`` calls it; importing nbtrain does not. Safe to call again. It also
    imports what the first launch needs in this process (the pickler, the admission check,
    the displays: ~20 ms here), so the first run's ranks do not wait for those imports.
    """
    with contextlib.suppress(OSError):  # the first launch will report it
        get_client()
    _import_launch_modules()


def _import_launch_modules() -> None:

    names = ["nbtrain.planning.admission", "nbtrain.messages.codepickle", "nbtrain.kernel.display"]
    if "torch" in sys.modules:  # never imported here on the caller's behalf: it may not need it
        names.append("nbtrain.messages.sharedtensors")
    # What the first cell imports before its ranks can start (~30 ms; more on a loaded machine).
    names += ["nbtrain.rank.cell", "nbtrain.kernel.namespace", "nbtrain.planning.steptotal", "nbtrain.kernel.pdb_relay"]
    names += ["nbtrain.kernel.launchplan"]
    if "numpy" in sys.modules:  # the cell takes the kernel's numpy random state with it
        names.append("numpy.random")
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
        with contextlib.suppress(OSError):
            os.close(_client.process.channel.detach())
    _client = None


def standby_pids() -> set[int]:
    """The pids of this kernel's standby ranks (a GPU only they hold counts as free)."""
    standby = _client.standby if _client is not None else None
    return {pid for _, pid in standby.ranks} if standby is not None else set()
