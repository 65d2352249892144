"""pdb inside a rank, driven from the notebook's cell over the run's own channels.

``breakpoint()``, ``pdb.set_trace()`` and ``nbtrain.set_trace()`` in a rank open a pdb
whose input and output are a :class:`RelayFile`: what pdb writes goes to the kernel as
:class:`~nbtrain.messages.events.DebugOutput`, and when it reads a command the rank sends a
:class:`~nbtrain.messages.events.DebugPrompt` and waits on its socketpair to the launcher for the
line the kernel's input box gave (:class:`~nbtrain.messages.events.DebugInput`). No port, no
terminal: the rank's channel to its launcher, and the launcher's to its kernel, are the
only way in.

After a failure a rank may be held (:func:`hold_for_post_mortem`): it waits, paused in
its exception's frames, until the kernel asks for pdb's post-mortem there or it is
released.

Example (outside a rank, the selection alone):
    >>> selected(0, rank=0), selected(1, rank=0), selected(1, rank="all"), selected(2, rank=[1, 2])
    (True, False, True, True)
"""

from __future__ import annotations

import bdb
import contextlib
import io
import os
import pdb  # noqa: T100 - relaying pdb is this module's purpose
import socket
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, cast

from nbtrain import patches
from nbtrain.messages import wire
from nbtrain.messages.events import AttachHeld, DebugEnded, DebugInput, DebugOutput, DebugPrompt, Release

HOOK = "nbtrain.rank.machinery.debugger.breakpointhook"  # PYTHONBREAKPOINT in a rank
Ranks = int | str | Iterable[int]
END_OF_INPUT = ("^D", "\x04")  # typed at a prompt: end of input (leaves `interact`)


@dataclass(frozen=True)
class _Place:
    channel: socket.socket
    run_id: int
    rank: int
    pid: int  # a process forked by the rank (a DataLoader worker) must not use its channel
    interactive: bool  # False: a background or cluster run, whose prompts nobody could answer


_place: _Place | None = None


def install_breakpoint_hook(channel: socket.socket, run_id: int, rank: int, interactive: bool) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` in this rank open the relayed pdb."""
    global _place
    _place = _Place(channel, run_id, rank, os.getpid(), interactive)
    patches.install_for_process("debugger")  # sys.breakpointhook and pdb.set_trace, relayed
    # Also for code that puts back sys.__breakpointhook__, which reads the variable.
    os.environ["PYTHONBREAKPOINT"] = HOOK


def relayed_hook(_original: Any) -> Any:
    """A rank's ``sys.breakpointhook`` (the patch table's): :func:`breakpointhook`."""
    return breakpointhook


def relayed_set_trace(_original: Any) -> Any:
    """A rank's ``pdb.set_trace`` (the patch table's): the same call, relayed."""
    return _pdb_set_trace


def the_relay(_original: Any) -> Any:
    """``sys.stdin`` and ``sys.stdout`` while a rank's pdb prompts (the patch table's): its relay."""
    return _prompting[-1]


_prompting: list[Any] = []  # the relays of the prompts open now, innermost last


def selected(this_rank: int, rank: Ranks) -> bool:
    """Whether ``this_rank`` stops for ``set_trace(rank=...)``: an index, ``"all"`` or several."""
    if isinstance(rank, str):
        if rank.strip().lower() != "all":
            raise ValueError(f"set_trace(rank={rank!r}): pass a rank number, a list of them, or 'all'.")
        return True
    return this_rank == rank if isinstance(rank, int) else this_rank in set(rank)


def set_trace(*, rank: Ranks = 0) -> None:
    """Stop this rank in pdb here, prompting in the notebook cell (``rank``: which ranks stop).

    By default rank 0 stops and the others pass (they wait for it in their next collective);
    ``rank=1`` stops rank 1, ``rank="all"`` every rank, one prompt after another. Outside a
    rank it is :func:`pdb.set_trace`.
    """
    stop_at(sys._getframe().f_back, rank)


def breakpointhook(*_args: Any, **_kwargs: Any) -> None:
    """``sys.breakpointhook`` in a rank: ``breakpoint()`` stops rank 0 in the relayed pdb."""
    stop_at(sys._getframe().f_back, 0)


def _pdb_set_trace(*, header: str | None = None) -> None:
    stop_at(sys._getframe().f_back, 0, header)


def stop_at(frame: FrameType | None, rank: Ranks, header: str | None = None) -> None:
    """Open the relayed pdb at ``frame`` if this rank is one of ``rank``."""
    place = _place
    if place is None or place.pid != os.getpid():
        pdb.Pdb().set_trace(frame)  # not a rank (or a process it forked): plain pdb
        return
    if not selected(place.rank, rank):
        return
    if not place.interactive:
        where = "" if frame is None else f" at line {frame.f_lineno} of {frame.f_code.co_filename}"
        sys.stderr.write(
            f"nbtrain: a breakpoint on rank {place.rank}{where} was passed: this run cannot prompt "
            "(a background run, or a cluster's). Run it as a %%distributed cell on this machine to stop there.\n"
        )
        return
    debugger = RankPdb(RelayFile(place.channel, place.run_id, place.rank))
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


class RelayFile(io.TextIOBase):
    """pdb's stdin and stdout in a rank: output goes to the kernel, ``readline`` asks it for a line."""

    def __init__(self, channel: socket.socket, run_id: int, rank: int, post_mortem: bool = False) -> None:
        super().__init__()
        self.channel, self.run_id, self.rank, self.post_mortem = channel, run_id, rank, post_mortem
        self.active = False  # a session the kernel has seen a prompt of and no DebugEnded yet
        self._pending: list[str] = []

    def readable(self) -> bool:
        """Always: pdb reads its commands here."""
        return True

    def writable(self) -> bool:
        """Always: pdb writes its output here."""
        return True

    def write(self, text: str) -> int:
        """Keep ``text`` until :meth:`flush` sends complete lines."""
        self._pending.append(text)
        return len(text)

    def flush(self) -> None:
        """Send the complete lines; a line in progress (pdb's prompt) waits for ``readline``."""
        text = "".join(self._pending)
        head, newline, tail = text.rpartition("\n")
        self._pending = [tail] if tail else []
        if head or newline:
            self._send(DebugOutput(self.run_id, self.rank, head + newline))

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]  # a text file's
        """Show the prompt in the cell and wait for the line typed there (end of input as an empty string)."""
        self.flush()
        prompt = "".join(self._pending)
        self._pending = []
        self.active = True
        self._send(DebugPrompt(self.run_id, self.rank, prompt, self.post_mortem))
        answer = self._answer()
        # An input box cannot send end-of-input, which is how `interact` returns to pdb: ^D typed as text does.
        return "" if answer.eof or answer.line.strip() in END_OF_INPUT else answer.line + "\n"

    def end(self) -> None:
        """The session is over (``c``, ``q``, the end of a post-mortem): tell the kernel."""
        self.flush()
        rest = "".join(self._pending)
        self._pending = []
        if rest:
            self._send(DebugOutput(self.run_id, self.rank, rest + "\n"))
        if self.active:
            self.active = False
            self._send(DebugEnded(self.run_id, self.rank))

    def _answer(self) -> DebugInput:
        while True:
            try:
                message, fds = wire.receive(self.channel)
            except (wire.ChannelClosed, OSError):
                return DebugInput(self.run_id, self.rank, "", eof=True)  # the launcher is gone
            for fd in fds:
                os.close(fd)
            if isinstance(message, DebugInput):
                return message
            if isinstance(message, Release):  # a held rank released while its pdb waited
                return DebugInput(self.run_id, self.rank, "", eof=True)

    def _send(self, message: Any) -> None:
        with contextlib.suppress(OSError):  # the launcher is gone; the next read says end of input
            wire.send(self.channel, message)


class RankPdb(pdb.Pdb):
    """pdb on a :class:`RelayFile`; ``interact`` and ``input()`` read the same relay."""

    def __init__(self, relay: RelayFile) -> None:
        super().__init__(stdin=cast(Any, relay), stdout=cast(Any, relay), nosigint=True, readrc=False)
        self.relay = relay

    def interaction(self, frame: FrameType | None, traceback: TracebackType | None) -> None:
        """pdb's prompt loop, with ``sys.stdin``/``sys.stdout`` on the relay meanwhile (for ``interact``)."""
        _prompting.append(self.relay)
        try:
            with contextlib.ExitStack() as stack:
                patches.install("pdb prompt", stack)  # for interact (code.interact reads input())
                super().interaction(frame, traceback)
        finally:
            _prompting.pop()
            self.relay.flush()

    def set_continue(self) -> None:
        """``c``: continue, and tell the kernel the session ended."""
        super().set_continue()
        self.relay.end()

    def set_quit(self) -> None:
        """``q``: quit, and tell the kernel the session ended."""
        super().set_quit()
        self.relay.end()


LOCALS_SHOWN = 20  # names a locals summary lists
REPR_CHARS = 120  # of each value's repr


def locals_summary(traceback: TracebackType | None) -> str:
    """The failing frame's local variables, one ``name = repr`` a line (where no debugger can go).

    >>> def fail(batch):
    ...     shifted = [b - 1 for b in batch]
    ...     raise ValueError("bad")
    >>> try:
    ...     fail([1, 2])
    ... except ValueError as error:
    ...     print(locals_summary(error.__traceback__), end="")
    Locals of the failing frame (fail):
      batch = [1, 2]
      shifted = [0, 1]
    """
    if traceback is None:
        return ""
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    frame = traceback.tb_frame
    lines = [f"Locals of the failing frame ({frame.f_code.co_name}):"]
    shown = [  # a cell's frame is its module's: its imports, functions and classes are not the clue
        (name, value)
        for name, value in sorted(frame.f_locals.items())
        if not name.startswith("__") and not isinstance(value, (types.ModuleType, types.FunctionType, type))
    ]
    for name, value in shown[:LOCALS_SHOWN]:
        try:
            text = repr(value)
        except Exception as error:  # noqa: BLE001 - a broken __repr__ must not hide the failure
            text = f"<repr failed: {type(error).__name__}>"
        text = text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."
        lines.append(f"  {name} = " + text.replace("\n", " "))
    if len(shown) > LOCALS_SHOWN:
        lines.append(f"  ... and {len(shown) - LOCALS_SHOWN} more")
    return "\n".join(lines) + "\n"


def hold_for_post_mortem(
    channel: socket.socket, run_id: int, rank: int, traceback: TracebackType | None, header: str = ""
) -> None:
    """Wait, paused in ``traceback``'s frames, for pdb's post-mortem or the launcher's release.

    Returns when the post-mortem ends or the rank is released (or the launcher is gone);
    the caller exits then. The launcher signals a rank it does not hold, which ends it here.
    """
    while True:
        try:
            message, fds = wire.receive(channel)
        except (wire.ChannelClosed, OSError):
            return
        for fd in fds:
            os.close(fd)
        if isinstance(message, Release):
            return
        if isinstance(message, AttachHeld):
            relay = RelayFile(channel, run_id, rank, post_mortem=True)
            debugger = RankPdb(relay)
            debugger.reset()
            if header:
                debugger.message(header.rstrip())  # the exception, as the cell's error showed it
            with contextlib.suppress(bdb.BdbQuit):
                debugger.interaction(None, traceback)
            relay.active = True  # the kernel waits for this end even when no prompt came
            relay.end()
            return
