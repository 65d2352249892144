"""A rank's output as the cell shows it: its lines tagged ``[rank N]`` and its displays.

:class:`OutputPrinter` is the one place rank output reaches the cell's streams (a
``%%distributed`` cell's, ``launch``'s, a background run's without a view, ``watch()``'s):
several ranks share the cell's two streams, where a carriage return redraws whatever line
is last, and a rank's :class:`~nbtrain.messages.events.Display` becomes display data there.

Example:
    >>> OutputPrinter("all", 2)(events.Output(1, 1, "stdout", "hello\\n"))
    [rank 1] hello
"""

from __future__ import annotations

import linecache
import re
import uuid
from typing import Any

from nbtrain.kernel import cellnames
from nbtrain.kernel import shell as kernel_shell
from nbtrain.kernel.display import show
from nbtrain.messages import events, stacktext

# A rank's text in pieces: each ends a line ("\n") or is followed by a carriage return that
# redraws one (a progress bar's "\r" not part of a "\r\n").
_PIECES = re.compile(r"(?<=\n)|(?=\r(?!\n))")
_LINE_BREAKS = re.compile(r"[\r\n]")
_TIMING = re.compile(r"\s*\[[^\]]*\]\s*$")  # a bar's last "[elapsed<left, rate]", as tqdm draws it
_KEPT = 1024  # characters of an open line kept to compare a redraw with (a bar is shorter)


def _untimed(line: str) -> str:
    """``line`` without its trailing newline and a progress bar's timing: two draws of one state compare equal.

    >>> _untimed("[rank 0] epoch 0: 100%|##| 40/40 [00:01<00:00, 38.2it/s]\\n")
    '[rank 0] epoch 0: 100%|##| 40/40'
    """
    return _TIMING.sub("", line.rstrip("\n"))


class OutputPrinter:
    r"""Shows rank output in the cell as it arrives, as ``--output`` chose (all, rank0, none).

    A rank's :class:`~nbtrain.messages.events.Display` (a figure, a table) is shown as display data,
    under a line naming its rank when tagged, and an update replaces it in place; a frontend
    without rich output prints its text.

    Tagged (``all``, several ranks), the ranks share the cell's two streams, where a
    carriage return redraws the last line whoever wrote it: so a line another rank left
    open is ended before a rank writes, each redraw is tagged again after its ``\r``, and
    a line that ranks other than 0 redraw in place (their progress bars) is shown once,
    as it stands when its line ends (rank 0's is drawn live; the run's log keeps every
    redraw). :meth:`finish` shows what such a line was left at when the run ends, and
    ends a line a rank left open, so what the cell prints next starts on its own line.

    Example (two ranks' progress bars: rank 0's redrawn in place, rank 1's shown at its end):
        >>> printer = OutputPrinter("all", 2)
        >>> for rank, text in ((0, "\rstep 1/2"), (1, "\rstep 1/2"), (1, "\rstep 2/2\n"), (0, "\rstep 2/2\n")):
        ...     printer(events.Output(1, rank, "stdout", text))
        [rank 0] step 1/2
        [rank 1] step 2/2
        [rank 0] step 2/2
    """

    def __init__(self, mode: str, world_size: int, rich: bool | None = None):
        self.mode = mode
        self.tagged = mode == "all" and world_size > 1
        self.rich = show.frontend_is_rich() if rich is None else rich  # False: a display shows as its text
        self._open: dict[str, int] = {}  # stream -> the rank whose line is open at its end
        self._redrawn: dict[tuple[int, str], tuple[str, str]] = {}  # (rank, stream) -> (tag, line so far)
        self._cut: dict[tuple[int, str], str] = {}  # (rank, stream) whose open line another rank's ended -> it
        self._open_text: dict[str, str] = {}  # stream -> what its open line shows
        self._ids = f"nbtrain-{uuid.uuid4().hex[:12]}"  # its displays' ids: another cell's never match
        self._stall_notes: dict[str, Any] = {}  # node ("" on one machine) -> its stall's note (show_text's handle)

    def __call__(self, event: Any) -> None:
        """Write ``event``'s lines, or show its display, if it is a rank's output this mode shows (else nothing).

        Ranks left waiting for one that finished (:class:`~nbtrain.messages.events.RanksWaiting`) are
        said whatever the mode: the run looks slow, and this says why.
        """
        if isinstance(event, events.RanksWaiting):
            self._waiting(event)
            return
        if isinstance(event, events.RanksStalled):
            self._stalled(event)
            return
        if not isinstance(event, (events.Output, events.Display)):
            return
        if self.mode == "none" or (self.mode == "rank0" and event.rank != 0):
            return
        if isinstance(event, events.Display):
            self._display(event)
            return
        text = event.text
        if self.tagged:
            pieces = _PIECES.split(text)
            text = "".join(self._tagged(event.rank, event.tag, event.stream, piece) for piece in pieces)
        elif text:
            self._ended(event.rank, event.stream, text)
        show.write_stream(event.stream, text)

    def _display(self, event: events.Display) -> None:
        """A rank's display: shown, or updated in place, named by its rank when tagged; else its text printed."""
        if not self.rich:
            if event.text:
                self(events.Output(event.run_id, event.rank, "stdout", event.text + "\n", event.node))
            return
        data = dict(event.data)
        text_only = set(data) <= {"text/plain"}
        if self.tagged and text_only:  # as a printed line: "[rank 1] {'a': 1}"
            data["text/plain"] = "".join(f"{event.tag} {line}" for line in event.text.splitlines(keepends=True))
        if not event.update:
            if self.tagged and not text_only:  # "[rank 1] Figure:" above the figure
                label = f"{event.tag} {event.label or 'display'}:\n"
                show.write_stream("stdout", self._line(event.rank, "stdout", label, redraw=False))
            self._end_open_lines()  # the display starts below any line a rank left open
        show.show_bundle(data, event.metadata, f"{self._ids}-{event.rank}-{event.slot}", event.update)

    def _waiting(self, event: events.RanksWaiting) -> None:
        self._end_open_lines()
        show.write_stream("stderr", waiting_text(event) + "\n")

    def _stalled(self, event: events.RanksStalled) -> None:
        """A stall's note (one per node on a cluster), shown once and then updated in place: its new picture,
        or that it ended."""
        shown = self._stall_notes.get(event.node)
        if not event.seconds and shown is None:
            return
        where = f" on {event.node}" if event.node else ""
        text = stall_text(event) if event.seconds else f"nbtrain: the ranks{where} moved again; the stall is over."
        if not self.rich:  # a terminal: each picture, and the end, as lines
            show.write_stream("stderr", text + "\n")
            self._stall_notes[event.node] = text if event.seconds else None
        elif shown is None:
            self._end_open_lines()
            self._stall_notes[event.node] = show.show_text(text, updatable=True)
        else:
            show.update_text(shown, text)

    def finish(self) -> None:
        """Show each line a rank other than 0 left mid-redraw (a progress bar the run ended in); end open lines."""
        for (rank, stream), (tag, line) in list(self._redrawn.items()):
            del self._redrawn[rank, stream]
            if line.strip():
                show.write_stream(stream, self._line(rank, stream, f"{tag} {line}\n", redraw=True))
        self._end_open_lines()  # "print(x, end='')" last: the summary gets a line of its own

    def _end_open_lines(self) -> None:
        for stream in list(self._open):
            if self._open_text.get(stream) == "":  # a cleared line: what comes next is written over it
                del self._open[stream], self._open_text[stream]
                continue
            show.write_stream(stream, self._ended(self._open[stream], stream, "\n"))

    def _tagged(self, rank: int, tag: str, stream: str, piece: str) -> str:
        if not piece:
            return ""
        redraw, key = piece.startswith("\r"), (rank, stream)
        if key in self._cut:  # its line was ended for it: its own end adds no empty line
            if piece == "\n" or (redraw and _untimed(f"{tag} {piece[1:]}") == _untimed(self._cut[key])):
                if piece.endswith("\n"):  # the end of the line shown already (a bar's last redraw, its close)
                    del self._cut[key]
                return ""
            del self._cut[key]
        if rank != 0 and (redraw or key in self._redrawn):
            line = piece[1:] if redraw else self._redrawn[key][1] + piece
            if not line.endswith("\n"):
                self._redrawn[key] = (tag, line)  # shown once its line ends
                return ""
            self._redrawn.pop(key, None)
            return self._line(rank, stream, f"{tag} {line}", redraw=True)
        if redraw:
            if not piece[1:].strip():  # a bar that clears itself at its close (tqdm's leave=False)
                return self._blank(rank, stream)
            return self._line(rank, stream, f"{tag} {piece[1:]}", redraw=True)
        if self._open.get(stream) == rank:  # the rest of its own open line (a blank one takes the tag anew)
            return self._ended(rank, stream, piece if self._open_text.get(stream) else f"{tag} {piece}")
        return self._line(rank, stream, f"{tag} {piece}", redraw=False)

    def _blank(self, rank: int, stream: str) -> str:
        """The rank's open line cleared, its tag too, as the kernel would show a redraw to nothing."""
        shown = self._open_text.get(stream)
        if self._open.get(stream) != rank or not shown:
            return ""  # nothing of its own to clear
        return self._ended(rank, stream, "\r" + " " * len(shown) + "\r")

    def _line(self, rank: int, stream: str, text: str, redraw: bool) -> str:
        """Tagged ``text`` at the end of ``stream``: over the rank's open line if it redraws it, else on a new one."""
        opened = self._open.get(stream)
        if opened is not None and self._open_text.get(stream) == "":
            pass  # a cleared line: written over from its start
        elif opened is not None:
            text = ("\r" if opened == rank and redraw else "\n") + text
            if opened != rank:
                self._cut[opened, stream] = self._open_text.get(stream, "")
        return self._ended(rank, stream, text)

    def _ended(self, rank: int, stream: str, text: str) -> str:
        if text.endswith("\n"):
            self._open.pop(stream, None)
            self._open_text.pop(stream, None)
        else:
            self._open[stream] = rank
            *before, last = _LINE_BREAKS.split(text)
            # Its end is enough to tell a bar's redraw; a line printed a dot at a time stays cheap.
            self._open_text[stream] = (last if before else self._open_text.get(stream, "") + last)[-_KEPT:]
        return text


def stall_text(event: events.RanksStalled) -> str:
    """What the cell says of a stall (no rank moving, some waiting on the others), in the notebook's terms."""

    ranks = [stacktext.RankStack(rank, stacktext.parse_dump(text)) for rank, text in event.stacks]
    namer = cellnames.cell_namer(kernel_shell.get_shell())
    return stacktext.stall_note(event.seconds, event.calls, ranks, namer, linecache.getline, event.node)


def waiting_text(event: events.RanksWaiting) -> str:
    """What the cell says of ranks left waiting by ranks that finished, in the notebook's terms."""

    waiting = [stacktext.RankStack(rank, stacktext.parse_dump(text)) for rank, text in event.stacks]
    namer = cellnames.cell_namer(kernel_shell.get_shell())
    return stacktext.waiting_note(event.finished, event.seconds, waiting, namer, event.counts)
