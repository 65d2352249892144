"""What a cell writes as text: rank output, the run's summary, nbtrain's notes and warnings.

The kernel side writes to the cell's stdout and stderr only through here (the live view
and widgets are :mod:`~nbtrain.kernel.display.live` and its siblings): a rank's lines and
displays as ``--output`` chose (:class:`OutputPrinter`), the summary a finished cell ends with
(:func:`summary`), a line of nbtrain's own (:func:`print_line`, :func:`print_warning`) and
a debugger's output as it comes (:func:`write_text`).

Example:
    >>> OutputPrinter("all", 2)(events.Output(1, 1, "stdout", "hello\\n"))
    [rank 1] hello
    >>> print_line("nbtrain: done.")
    nbtrain: done.
"""

from __future__ import annotations

import re
import sys
import uuid
from collections.abc import Callable
from typing import Any

from nbtrain import events, runstate
from nbtrain.kernel.display import live, show


def write_text(text: str, stderr: bool = False) -> None:
    """Write ``text`` as it is to the cell's stdout (or stderr), at once (pdb's output, a prompt's lines)."""
    stream = sys.stderr if stderr else sys.stdout
    stream.write(text)
    stream.flush()


def print_line(text: str) -> None:
    """One line of nbtrain's own in the cell's output (a summary, a help text, a debugger's end)."""
    write_text(text + "\n")


def print_warning(text: str) -> None:
    """One line of nbtrain's own on the cell's stderr: a warning or a note the user should see."""
    write_text(text + "\n", stderr=True)


def show_summary(record: Any) -> None:
    """Print :func:`summary` of ``record`` in the cell."""
    print_line(summary(record))


# A rank's text in pieces: each ends a line ("\n") or is followed by a carriage return that
# redraws one (a progress bar's "\r" not part of a "\r\n").
_PIECES = re.compile(r"(?<=\n)|(?=\r(?!\n))")


class OutputPrinter:
    r"""Shows rank output in the cell as it arrives, as ``--output`` chose (all, rank0, none).

    A rank's :class:`~nbtrain.events.Display` (a figure, a table) is shown as display data,
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
        self._cut: set[tuple[int, str]] = set()  # (rank, stream) whose open line another rank's ended
        self._ids = f"nbtrain-{uuid.uuid4().hex[:12]}"  # its displays' ids: another cell's never match

    def __call__(self, event: Any) -> None:
        """Write ``event``'s lines, or show its display, if it is a rank's output this mode shows (else nothing)."""
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
        _write(event.stream, text)

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
                _write("stdout", self._line(event.rank, "stdout", f"{event.tag} {event.label or 'display'}:\n", False))
            self._end_open_lines()  # the display starts below any line a rank left open
        show.show_bundle(data, event.metadata, f"{self._ids}-{event.rank}-{event.slot}", event.update)

    def finish(self) -> None:
        """Show each line a rank other than 0 left mid-redraw (a progress bar the run ended in); end open lines."""
        for (rank, stream), (tag, line) in list(self._redrawn.items()):
            del self._redrawn[rank, stream]
            if line.strip():
                _write(stream, self._line(rank, stream, f"{tag} {line}\n", redraw=True))
        self._end_open_lines()  # "print(x, end='')" last: the summary gets a line of its own

    def _end_open_lines(self) -> None:
        for stream in list(self._open):
            _write(stream, self._ended(self._open[stream], stream, "\n"))

    def _tagged(self, rank: int, tag: str, stream: str, piece: str) -> str:
        if not piece:
            return ""
        redraw, key = piece.startswith("\r"), (rank, stream)
        if key in self._cut:  # its line was ended for it: its own end adds no empty line
            self._cut.discard(key)
            if piece == "\n":
                return ""
        if rank != 0 and (redraw or key in self._redrawn):
            line = piece[1:] if redraw else self._redrawn[key][1] + piece
            if not line.endswith("\n"):
                self._redrawn[key] = (tag, line)  # shown once its line ends
                return ""
            self._redrawn.pop(key, None)
            return self._line(rank, stream, f"{tag} {line}", redraw=True)
        if redraw:
            return self._line(rank, stream, f"{tag} {piece[1:]}", redraw=True)
        if self._open.get(stream) == rank:  # the rest of its own open line
            return self._ended(rank, stream, piece)
        return self._line(rank, stream, f"{tag} {piece}", redraw=False)

    def _line(self, rank: int, stream: str, text: str, redraw: bool) -> str:
        """Tagged ``text`` at the end of ``stream``: over the rank's open line if it redraws it, else on a new one."""
        opened = self._open.get(stream)
        if opened is not None:
            text = ("\r" if opened == rank and redraw else "\n") + text
            if opened != rank:
                self._cut.add((opened, stream))
        return self._ended(rank, stream, text)

    def _ended(self, rank: int, stream: str, text: str) -> str:
        if text.endswith("\n"):
            self._open.pop(stream, None)
        else:
            self._open[stream] = rank
        return text


def _write(stream_name: str, text: str) -> None:
    if text:
        stream = sys.stderr if stream_name == "stderr" else sys.stdout
        stream.write(text)
        stream.flush()


class CellView:
    """The run's live view (status, progress, charts) above the cell's printed output.

    Rank prints are printed by OutputPrinter in every frontend; the text view of a
    terminal would print them again, so it gets every event but those.
    """

    def __init__(
        self,
        run: Any,
        count_steps: Callable[[], int | None] | None = None,
        stall_warning: float | None = runstate.STALL_SECONDS,
    ):
        # The cell's stream lines (OutputPrinter) are where rank output goes: the whole of it,
        # kept in the saved notebook, chosen by --output. The view shows no second copy.
        self.view = live.LiveView(run.config, stall_warning=stall_warning, show_logs=False)
        self.poll_seconds = live.FASTEST_FRAME_SECONDS / 2
        # The first frame waits for the first event past the ranks' start, or the first poll:
        # drawn at once, it took a core from the ranks just as they start (~2 ms on 2 cores).
        # So does reading the cell's step total (count_steps, about 1 ms), needed by that frame.
        self._drawn = False
        self._count_steps = count_steps

    def show(self, event: Any) -> None:
        """Take ``event`` (None: nothing new, a redraw) and redraw when a frame is due.

        Called before the event's output is printed: the first frame stays above it.
        """
        if self.view.rich or not isinstance(event, events.Output):
            self.view.handle(event)
        if not self._drawn and isinstance(event, events.RankStarted):
            return
        self._count()
        # A prompt blocks the cell's thread: "rank 1 in the debugger" must be drawn first.
        forced = not self._drawn or isinstance(event, (events.DebugPrompt, events.DebugEnded))
        self.view.refresh(force=forced)
        self._drawn = True

    def finish(self, state: str, redraw_chart: bool = True) -> None:
        """Draw the run's final state (``redraw_chart`` False: its chart as last drawn, for a stop wanted now)."""
        self._count()
        self.view.finish(state, redraw_chart)

    def _count(self) -> None:
        """Read the step total once, before the first frame that shows it."""
        if self._count_steps is not None:
            count, self._count_steps = self._count_steps, None
            total = count()
            self.view.state.total_steps = total if total is not None and total > 0 else None


def summary(record: Any) -> str:
    """The line a finished (or stopped-at-a-step) cell ends with: ranks, time, what was prepared and updated.

    ``record`` is the cell's :class:`nbtrain.kernel.cellrun.CellRun`.
    """
    ranks = f"{record.world_size} rank{'s' if record.world_size != 1 else ''}"
    ended = "finished" if record.stopped_at is None else f"{record.state} at step {record.stopped_at}"
    text = f"nbtrain: {ranks} ({record.accelerator}, {record.strategy}) {ended} in {record.seconds:.1f} s."
    loaders = dict(record.loaders)
    left = [(name, how) for name, how in record.prepared if how.startswith("not prepared")]
    wrapped = [  # "model (DistributedDataParallel)", or "model: on cuda:0, not wrapped (one rank)"
        f"{name}: {how}" if how.startswith("on ") else f"{name} ({how})"
        for name, how in record.prepared
        if how not in ("moved", "bound") and name not in loaders and (name, how) not in left
    ]
    if wrapped:
        text += f" Auto-prepared: {', '.join(wrapped)}."
    if left:  # e.g. "trainer.models[0]: not prepared (a tuple cannot hold another object; ...)"
        text += " " + "; ".join(f"{name}: {how}" for name, how in left) + "."
    if loaders:  # e.g. "test_loader: evaluated whole on every rank (iterated without gradients)"
        text += " " + "; ".join(f"{name}: {how}" for name, how in loaders.items()) + "."
    if record.updated:
        text += f" Updated in the kernel: {', '.join(record.updated)}."
    for sentence in record.derived:  # "lr_scheduler expects 240 steps; each rank runs 120 (...): ..."
        text += f" {sentence}."
    if record.log_path:
        text += f" Full output: {record.log_path}"
    return text
