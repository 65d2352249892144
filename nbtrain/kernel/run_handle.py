"""A run in progress, as the kernel sees it: :class:`Run` (public ``nbtrain.Run``) and the :class:`Engine` it runs on.

A run's messages arrive on its inbox (filed there by :mod:`nbtrain.kernel.launcher_connection`,
or by a cluster's agents); the run reads them, keeps what its end needs, and turns a failure
into one error that says what happened (a rank's exception, a rank that died, a timeout, a
stop, or an unexplained end, quoting each rank's last lines).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import pickle
import queue
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

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
from nbtrain.kernel import cellnames, gcpause, launcher_connection
from nbtrain.kernel import shell as kernel_shell
from nbtrain.launch_server.lifecycle import HARD_STOP
from nbtrain.messages.events import (
    FAILED,
    FINISHED,
    STOPPED,
    TIMED_OUT,
    DebugInput,
    DebugPrompt,
    NodeLost,
    Output,
    RankExited,
    RankFailed,
    RankHeld,
    RankNotStarted,
    RankStarted,
    RunEnded,
    StartRun,
    StopStep,
)
from nbtrain.messages.records import CopiedResult
from nbtrain.planning import config as config_module
from nbtrain.system import stepboard

INTERRUPT_GRACE_SECONDS = 5.0  # how long a stop may take before the launcher is replaced
GRACEFUL_CHOICE_SECONDS = 2.0  # a graceful stop's step is chosen within a launcher tick; this is the bound
POLL_SECONDS = 0.25
# While a stop at a step is under way the caller polls this often: a second interrupt, which only sets a
# flag in the main thread, is acted on within it.
STOPPING_POLL_SECONDS = 0.02


class Engine(Protocol):
    """What a :class:`Run` asks of the engine that runs its ranks: this machine's launcher
    (:class:`LauncherClient`) or a cluster's agents (:class:`nbtrain.cluster.engine.ClusterClient`).

    ``submit`` returns the run's id and the queue its records arrive on, as
    ``(record, fds)``; the magic and the live view read only those records.
    """

    def submit(
        self, start_run: Callable[[int], StartRun], tensor_fd: int | None
    ) -> tuple[int, launcher_connection.Inbox]:
        """Send the run (``start_run`` builds its message from the run's id); its id and inbox."""

    def stop(self, run_id: int, reason: str, graceful: bool = False) -> None:
        """Ask every rank of the run to stop (``graceful``: at one optimizer step)."""

    def forget(self, run_id: int) -> None:
        """The run has ended: file nothing more under it."""

    def output_taken(self, run_id: int, chars: int) -> None:
        """The reader took ``chars`` characters of the run's output off its inbox."""

    def close(self) -> None:
        """End the engine (and every rank it runs): a stop it did not answer in time."""


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
        inbox: launcher_connection.Inbox,
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
        self._ended: RunEnded | None = None
        self._ended_fds: list[int] = []
        self._copied: CopiedResult | None = None
        # What was seen of each rank, for a failure no rank explained: how it exited, and
        # the last output it sent (the message's text, kept by reference: no copy per line).
        self._exits: dict[int, RankExited] = {}
        self._last_output: dict[int, str] = {}
        self._gc_hold: gcpause.Hold | None = None
        self.held: RankHeld | None = None  # its failed rank, kept for %nbtrain_debug
        # Set by a caller that answers pdb's prompts (kernel.pdb_relay.CellRelay); otherwise a
        # rank's breakpoint is answered "continue" and a note says why.
        self.prompts_answered = False
        self.stop_step: StopStep | None = None  # the step a graceful stop chose, once chosen
        self._stop_asked: float | None = None  # when a graceful stop was asked (monotonic)
        self._step_seen_at = 0.0

    @property
    def result_arrived(self) -> bool:
        """Rank 0's result is in the kernel's memory, every rank done: the run's end waits for their exits."""
        return self._copied is not None

    def debug_input(self, rank: int, line: str) -> None:
        """Send the line typed at rank ``rank``'s pdb prompt."""
        send = getattr(self.client, "send_debug", None)
        if send is not None:
            send(DebugInput(self.run_id, rank, line))

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
        if isinstance(message, (launcher_connection.LauncherGone, RunEnded)) and self._gc_hold is not None:
            self._gc_hold.release()
        if isinstance(message, launcher_connection.LauncherGone):
            self.state = FAILED
            self._copied = None
            self._ended = RunEnded(self.run_id, FAILED, detail=message.detail)
            self.client.forget(self.run_id)
            return self._ended
        if isinstance(message, Output):
            self.client.output_taken(self.run_id, len(message.text))
            # Keep the last lines across events: one print can arrive in several pieces.
            kept = self._last_output.get(message.rank, "") + message.text
            self._last_output[message.rank] = "".join(kept.splitlines(keepends=True)[-_LINES_QUOTED:])
        elif isinstance(message, RankStarted):
            self.pids[message.rank] = message.pid
        elif isinstance(message, RankExited):
            self._exits[message.rank] = message
        elif isinstance(message, RankHeld):
            self.held = message
        elif isinstance(message, DebugPrompt) and not self.prompts_answered:
            return self._cannot_prompt(message)
        elif isinstance(message, StopStep):
            self.stop_step = message
            self._step_seen_at = time.monotonic()
        if isinstance(message, RunEnded):
            self._ended, self._ended_fds = message, fds
            self.state = message.state
            self.client.forget(self.run_id)
            if message.state != FINISHED and message.stopped_at is None:
                self._copied = None  # a failed or stopped run has no result: free its memory now
        return message

    def _cannot_prompt(self, prompt: DebugPrompt) -> Output:
        self.debug_input(prompt.rank, "c")
        return Output(
            self.run_id, prompt.rank, "stderr",
            f"nbtrain: rank {prompt.rank} stopped at a breakpoint, but nothing here answers its prompt "
            f"(a background run, run.wait(), watch()); it continues. Run it as a {kernel_shell.magic_name()} "
            "cell or with nbtrain.launch() to debug there.\n",
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
        (:mod:`nbtrain.system.stepboard`); a run that cannot (no optimizer step yet) stops at once.
        """
        if self._ended is not None:
            return
        if graceful and self._stop_asked is None:
            self._stop_asked = time.monotonic()
        self.client.stop(self.run_id, reason, graceful=graceful)

    def stop_deadline(self) -> float | None:
        """When waiting for a graceful stop has gone on too long (its grace, then the usual bound), or None."""
        if self._stop_asked is None:
            return None
        if self.stop_step is None:
            return self._stop_asked + GRACEFUL_CHOICE_SECONDS + INTERRUPT_GRACE_SECONDS
        # The launcher gives ranks that reached the step more time to end their cell (stepboard.ENDING_SECONDS).
        return self._step_seen_at + self.stop_step.grace + stepboard.ENDING_SECONDS + INTERRUPT_GRACE_SECONDS

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
            if graceful and isinstance(message, StopStep):
                deadline = self.stop_deadline() or deadline
        if self._ended is None:  # the launcher did not answer in time: replace it
            self.client.close()
            self._ended = RunEnded(self.run_id, STOPPED)
            self.state = STOPPED

    def abandon(self) -> None:
        """Stop the run for an interrupt (if it still goes) and drop its result.

        Whatever rank 0's result already brought into this process is freed at once: an
        interrupted call's traceback keeps this handle alive for as long as IPython keeps
        the traceback.
        """
        self.stop("interrupted")
        self._drop_result()

    def _close_ended_fds(self) -> None:
        # Taken from the run before closing: an interrupt between a close and forgetting the
        # number would have the next caller close it again, when it may be someone else's.
        fds, self._ended_fds = self._ended_fds, []
        for fd in fds:
            os.close(fd)

    def _drop_result(self) -> None:
        self._copied = None
        self._close_ended_fds()
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
        with contextlib.suppress(KeyboardInterrupt):
            for event in self.events():
                if event is not None and on_event is not None:
                    on_event(event)
            return self.result()
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
        if ended.state == FINISHED or ended.stopped_at is not None:
            return self._load_result(ended)  # a graceful stop's result: the state at the stop step
        self._close_ended_fds()  # a failed cell's state at its raise, not taken (state_at_failure): freed
        raise self._failure(ended)

    def state_at_failure(self) -> tuple[int, Any] | None:
        """A failed cell's state at the raise: (the rank that held it, its CellResult), or None.

        The lowest rank that raised the run's error itself sent what it held there (the launcher
        chose it: :func:`nbtrain.launch_server.launched.failed_state`). Call it before
        :meth:`result`, which frees that state as it raises the failure.
        """
        ended = self._ended
        if ended is None or ended.state == FINISHED or ended.failed_state_rank is None or ended.result is None:
            return None
        return ended.failed_state_rank, self._load_result(ended)

    @property
    def no_state_note(self) -> str:
        """Why a failed cell brought no state at its raise back ("": it did, or it had none to bring)."""
        return "" if self._ended is None else self._ended.failed_state_note

    def _load_result(self, ended: RunEnded) -> Any:
        fd = self._ended_fds[0] if self._ended_fds else None
        try:
            if self._copied is None and fd is None:  # no tensor storages: plain pickle, and no torch import for it

                return pickle.loads(ended.result or b"")
            # deferred: start-up time (cloudpickle, torch)
            from nbtrain.messages import sharedtensors

            if self._copied is not None:
                return sharedtensors.loads_mapped(self._copied.data, self._copied.mapping, map_location="cpu")
            return sharedtensors.loads(ended.result or b"", fd, map_location="cpu")
        finally:
            self._close_ended_fds()

    def where_ranks_were(self) -> str:
        """Where each rank was when a timeout or a stop ended the run, in the notebook's terms.

        Each line names a rank, what it was doing and the cell and line (``rank 0: waiting
        in all_reduce, Cell In[5], line 12``), then each rank's stack; "" when the run did
        not end that way (or the launcher got no dump).
        """
        # deferred: start-up time
        from nbtrain.messages import stacktext

        if self._ended is None or not self._ended.stacks:
            return ""
        parsed = [stacktext.RankStack(rank, stacktext.parse_dump(text)) for rank, text in self._ended.stacks]
        return stacktext.where_each_rank_was(parsed, cellnames.cell_namer(kernel_shell.get_shell()), linecache.getline)

    def _failure(self, ended: RunEnded) -> RunFailedError | LauncherError:
        failure = ended.failure
        if isinstance(failure, RankFailed):
            # deferred: start-up time
            from nbtrain.kernel import pdb_relay

            note = pdb_relay.held_note(self.held) if self.held is not None else ""
            return RankError(
                failure.rank, failure.exc_type, failure.message, failure.traceback, note, node=failure.node
            )
        if isinstance(failure, RankNotStarted):
            return RankStartError(failure.rank, failure.world_size, failure.error_name, failure.reason)
        if isinstance(failure, RankExited):
            return RankDiedError(
                failure.rank, signal_number=failure.signal_number, exit_code=failure.exit_code, node=failure.node,
                collectives=failure.collectives,
            )
        if isinstance(failure, NodeLost):
            return NodeLostError(failure.node, failure.detail)
        if ended.state == TIMED_OUT:
            timed_out = RunTimeoutError(self.config.timeout or 0.0, self.where_ranks_were())
            if ended.stop_note:  # a stop at a step was tried and could not keep the state: why
                timed_out._set_message(_with_note(timed_out.headline, ended.stop_note), timed_out.where)
            return timed_out
        if ended.state == STOPPED:
            message = _with_note(
                ended.detail or "the run was stopped before it finished; every rank is gone.", ended.stop_note
            )
            return RunStoppedError(message, self.where_ranks_were())
        return LauncherError(ended.detail or unexplained_failure(self._exits, self._last_output, self.log_path))


def _with_note(message: str, note: str) -> str:
    """A stop's message with why it could not keep the state: "stopped hard (...)" leads, a sentence follows."""
    if note.startswith(HARD_STOP):
        return f"{note}; {message}"
    return f"{message} {note}" if note else message


def unexplained_failure(
    exits: dict[int, RankExited], last_output: dict[int, str], log_path: str | None
) -> str:
    """What a run that failed without a cause showed: each rank's exit, its last lines, where its log is.

    >>> exits = {1: RankExited(1, 1, exit_code=3, signal_number=None, reported=False)}
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


def _exit_words(exited: RankExited) -> str:
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

