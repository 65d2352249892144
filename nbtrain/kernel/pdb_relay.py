"""The kernel's side of the debugger relay: a rank's pdb, prompting in the notebook's cell.

A rank stopped at ``breakpoint()`` (or held after a failure, see
:mod:`nbtrain.rank.machinery.debugger`) sends pdb's output and prompts to its launcher, which sends
them here on the kernel's private socket. Each prompt becomes the front end's input box
(``input()``, the kernel's stdin request: what IPython's ``%debug`` uses), labelled with
the rank; the line typed goes back the same way. Waiting on the user has no deadline; an
interrupt at the prompt ends the debugger and the run.

One rank's session at a time: another rank's prompts wait for the first one's ``DebugEnded``.
The launcher pauses the ``--timeout`` clock while a rank is at a prompt, and the live view its
stall clock; ``q`` ends the run as stopped. A caller that cannot prompt (a background run,
``run.wait()``) has the breakpoint passed, with a note.

Example:
    >>> from nbtrain.messages import events
    >>> prompt_text(events.DebugPrompt(run_id=1, rank=1, prompt="(Pdb) "))
    '(Pdb) [rank 1] '
    >>> held_note(events.RankHeld(1, 1, 4242, 300 << 20, None, 600.0, "cpu"))
    "%nbtrain_debug opens the debugger in rank 1's frames (held for 10 min; it holds 300 MiB of host memory)."
"""

from __future__ import annotations

import queue
import time
from typing import Any

from nbtrain.errors import NbtrainError
from nbtrain.kernel import cellnames
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display import owntext
from nbtrain.messages import events
from nbtrain.system import processes

ATTACH_SECONDS = 10.0  # a held rank answers %nbtrain_debug with its first prompt within this
RELEASE_SECONDS = 5.0  # a held rank whose post-mortem ended is reported gone within this
POLL_SECONDS = 0.25
RELAYED = (events.DebugOutput, events.DebugPrompt, events.DebugEnded)


class NoRankHeldError(NbtrainError):
    """``%nbtrain_debug`` with no failed rank held for it."""


def prompt_text(prompt: events.DebugPrompt) -> str:
    """The input box's label: pdb's prompt, and which rank asks."""
    return f"{prompt.prompt.rstrip()} [rank {prompt.rank}] "


def held_note(held: events.RankHeld) -> str:
    """The last line of a failed cell whose root-cause rank is kept for a post-mortem."""
    what = [f"{_size(held.rss_bytes)} of host memory"] if held.rss_bytes else []
    what += [f"{_size(held.cuda_bytes)} on {held.device}"] if held.cuda_bytes else []
    holds = f"; it holds {' and '.join(what)}" if what else ""
    seconds = held.hold_seconds
    held_for = f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
    return f"%nbtrain_debug opens the debugger in rank {held.rank}'s frames (held for {held_for}{holds})."


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


def ask(prompt: events.DebugPrompt) -> str | None:
    """The line the user typed at ``prompt``; None when an interrupt came instead."""
    # deferred: start-up time (IPython)
    from IPython.core.error import StdinNotImplementedError

    with processes.interrupts_raised():
        try:
            return input(prompt_text(prompt))
        except KeyboardInterrupt:
            return None
        except StdinNotImplementedError:
            owntext.print_warning(f"nbtrain: this front end cannot answer input; rank {prompt.rank} continues.")
            return "c"
        except EOFError:
            return "c"


def show(text: str) -> None:
    """pdb's output in the cell, its notebook cells named as IPython names them (``Cell In[7]``)."""

    owntext.write_text(cellnames.name_cells(text, kernel_shell.get_shell()))


class CellRelay:
    """A foreground run's debugger sessions: one rank's at a time; other ranks' prompts wait.

    ``handle`` takes every event of the run and says whether it was the relay's.
    """

    def __init__(self, run: Any, held: processes.HeldInterrupts) -> None:
        self.run = run
        self.held = held
        self.current: int | None = None  # the rank whose session is open
        self.waiting: list[Any] = []  # what other ranks sent meanwhile, in order

    def handle(self, event: Any) -> bool:
        """Relay ``event`` if it is a rank's debugger output, prompt or end; False for any other event."""
        if not isinstance(event, RELAYED):
            return False
        if self.held.received:  # the run is being stopped: nothing more to ask
            return True
        if self.current is not None and event.rank != self.current:
            self.waiting.append(event)
        elif isinstance(event, events.DebugOutput):
            show(event.text)
        elif isinstance(event, events.DebugPrompt):
            self.current = event.rank
            line = ask(event)
            if line is None:
                self.held.received = True  # the cell's loop stops the run, as for any interrupt
            else:
                self.run.debug_input(event.rank, line)
        else:
            self.current = None
            waiting, self.waiting = self.waiting, []
            for later in waiting:
                self.handle(later)
        return True


def post_mortem(client: Any) -> None:
    """Open pdb in the frames of the rank held after the last failure (``%nbtrain_debug``).

    ``client`` is this kernel's launcher client (None when none runs). ``q`` or ``c`` ends
    it and releases the rank (its memory with it); an interrupt does too.
    """
    held = None if client is None else client.held
    if client is None or held is None:
        raise NoRankHeldError(
            "no rank is held for a post-mortem: none failed since, or it was released (by its debugger's end, "
            "a new launch, its idle time, or holding being off). Run the failing cell again, then %nbtrain_debug; "
            "nbtrain.set_defaults(debug_hold=600) holds a failed rank for 10 min."
        )
    client.take_debug_messages()  # what an earlier session left
    client.send_debug(events.AttachHeld(held.run_id, held.rank))
    try:
        _relay_post_mortem(client, held)
    except KeyboardInterrupt:
        client.send_debug(events.ReleaseHeld(held.run_id, "the debugger was interrupted"))
        raise KeyboardInterrupt(f"the debugger was interrupted; rank {held.rank} was released.") from None


def _relay_post_mortem(client: Any, held: events.RankHeld) -> None:
    deadline: float | None = time.monotonic() + ATTACH_SECONDS
    ended = False
    while True:
        try:
            message = client.debug_messages.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if not client.alive:
                raise NoRankHeldError(f"the nbtrain launcher is gone, and rank {held.rank} with it.") from None
            if ended and deadline is not None and time.monotonic() > deadline:
                owntext.print_line(f"nbtrain: the debugger ended; rank {held.rank} is being released.")
                return
            if deadline is not None and time.monotonic() > deadline:
                client.send_debug(events.ReleaseHeld(held.run_id, "it did not answer"))
                raise NoRankHeldError(
                    f"rank {held.rank} did not answer the debugger within {ATTACH_SECONDS:g} s; it was released. "
                    "Run the failing cell again to get a new one."
                ) from None
            continue
        deadline = None
        if isinstance(message, events.HeldReleased):
            owntext.print_line(f"nbtrain: rank {message.rank} is released ({message.reason}); its memory is free.")
            return
        if isinstance(message, events.DebugOutput):
            show(message.text)
        elif isinstance(message, events.DebugPrompt):
            line = ask(message)
            if line is None:
                raise KeyboardInterrupt
            client.send_debug(events.DebugInput(message.run_id, message.rank, line))
        elif isinstance(message, events.DebugEnded):
            ended, deadline = True, time.monotonic() + RELEASE_SECONDS  # it exits next
