"""A rank's output with bounds: what the cell gets, and the run's log file that gets all of it.

The launcher reads each rank's stdout and stderr pipes as fast as they fill and passes the
bytes here. Two things come out:

- for the cell, lines with bounds: a line longer than ``LINE_CHARS`` is cut, with a marker
  saying how much was dropped; per rank the first ``HEAD_LINES`` lines go out as they come,
  then only the last ``TAIL_LINES`` are kept, and sent when the rank's output ends, after a
  note saying how many were left out. So however much a rank prints, the kernel receives a
  bounded amount, and a stopped or timed-out flood ends as soon as the ranks do;
- for the log file (:class:`RunLog`), every byte, each line tagged with its rank.

No threads, no processes: the launcher's selector loop calls in. Example:

    >>> out = RankOutput(0, None, OutputLimits(line_chars=5, head_lines=2, tail_lines=1))
    >>> shown = out.feed("stdout", b"one\\ntwo\\nthree\\nfour\\nfive is long\\n")
    >>> shown[0], shown[1][1][:53]
    (('stdout', 'one\\ntwo\\n'), 'nbtrain: rank 0 printed more than the cell shows (2 l')
    >>> out.finish()[-1]
    ('stdout', 'five  … [7 more characters cut from this line]\\n')
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class OutputLimits:
    """How much of a rank's output the cell gets (characters, lines)."""

    line_chars: int = 10_000
    head_lines: int = 4_000
    head_chars: int = 2_000_000
    tail_lines: int = 1_000
    tail_chars: int = 500_000


# A line is held whole for the log up to this size; a longer one is written in pieces of it.
LOG_LINE_BYTES = 16 << 20
# A run's log stops here, with a last line saying so: a rank printing forever must not fill the disk.
LOG_BYTES = 4 << 30
# Run logs kept in their directory: older ones are removed as a run's log closes (by the
# launcher, once the run is over: a file system's unlink took ~1 ms off a re-run's start).
LOGS_KEPT = 50


def prune_logs(directory: str, kept: int) -> None:
    """Remove the oldest run logs of ``directory`` beyond the newest ``kept``; other files stay."""
    try:
        names = os.listdir(directory)
    except OSError:
        return  # the directory is gone: nothing to keep tidy
    logs = sorted(name for name in names if name.startswith("run-") and name.endswith(".log"))
    for name in logs[: max(0, len(logs) - kept)]:
        with contextlib.suppress(OSError):  # another launcher removed it first
            os.unlink(os.path.join(directory, name))


class RunLog:
    """The log file of one run: every line of every rank, tagged ``[rank N]`` (``[rank N stderr]``).

    Opened at the first write, so a run that prints nothing leaves no file. A file that
    cannot be written is given up on quietly: the run matters more than its log.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._failed = False
        self._written = 0
        self._pending: dict[tuple[int, str], bytearray] = {}

    def write(self, rank: int, stream: str, data: bytes) -> None:
        """Add a rank's bytes to the log; whole lines are written as they complete."""
        pending = self._pending.setdefault((rank, stream), bytearray())
        pending += data
        end = pending.rfind(b"\n")
        if end >= 0:
            self._lines(rank, stream, bytes(pending[: end + 1]))
            del pending[: end + 1]
        if len(pending) >= LOG_LINE_BYTES:
            self._lines(rank, stream, bytes(pending) + b"\n")
            pending.clear()

    def flush(self, rank: int, stream: str) -> None:
        """The rank's stream ended: write what it left without a newline."""
        pending = self._pending.pop((rank, stream), None)
        if pending:
            self._lines(rank, stream, bytes(pending) + b"\n")

    def close(self) -> None:
        """Write what is pending of every rank and close the file; the directory keeps the last LOGS_KEPT logs."""
        for rank, stream in list(self._pending):
            self.flush(rank, stream)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            prune_logs(os.path.dirname(self.path), LOGS_KEPT)

    def _lines(self, rank: int, stream: str, text: bytes) -> None:
        tag = f"[rank {rank}] " if stream == "stdout" else f"[rank {rank} stderr] "
        lines = text[:-1].split(b"\n")
        self._write(b"".join(tag.encode() + line + b"\n" for line in lines))

    def _write(self, data: bytes) -> None:
        if self._failed or self._written >= LOG_BYTES:
            return
        try:
            if self._fd is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            if self._written + len(data) >= LOG_BYTES:
                data = b"[nbtrain] the log stops here: it reached its limit of %d GiB\n" % (LOG_BYTES >> 30)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self._written += len(data)
        except OSError:
            self._failed = True  # a full or read-only disk: the run goes on without its log

    @property
    def exists(self) -> bool:
        """Whether the log file was created (something was written)."""
        return self._fd is not None or self._written > 0


@dataclass
class _Stream:
    """One stream's line in progress: text not sent yet, characters sent and cut from it."""

    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    partial: str = ""
    sent: int = 0  # characters of the current line already sent (a progress bar's redraws)
    cut: int = 0  # characters of the current line dropped beyond the limit


class RankOutput:
    """What of one rank's output goes to the cell, and all of it to the log."""

    def __init__(self, rank: int, log: RunLog | None, limits: OutputLimits = OutputLimits()):
        self.rank = rank
        self.log = log
        self.limits = limits
        self.streams = {stream: _Stream() for stream in STREAMS}
        self.lines_shown = 0
        self.chars_shown = 0
        self.tail: collections.deque[tuple[str, str]] = collections.deque()
        self.tail_chars = 0
        self.omitted_lines = 0  # lines neither shown nor kept in the tail
        self.omitted_chars = 0
        self.unreported = 0  # lines held back since the last skipped() call
        self.noted = False  # the note that lines are being held back was sent

    @property
    def holding_back(self) -> bool:
        """The head is used up: lines now go to the tail, not to the cell."""
        return self.lines_shown >= self.limits.head_lines or self.chars_shown >= self.limits.head_chars

    def feed(self, stream: str, data: bytes) -> list[tuple[str, str]]:
        """Take bytes a rank wrote; the (stream, text) pieces to send to the cell now."""
        if self.log is not None:
            self.log.write(self.rank, stream, data)
        state = self.streams[stream]
        pieces = state.decoder.decode(data).split("\n")
        lines = []
        for piece in pieces[:-1]:
            self._extend(state, piece)
            lines.append(self._end_line(state) + "\n")
        self._extend(state, pieces[-1])
        return self._route(stream, lines)

    def flush(self, stream: str, final: bool = False) -> list[tuple[str, str]]:
        """Send the line in progress (a prompt, a progress bar); at the end, whatever is left."""
        state = self.streams[stream]
        if final:
            self._extend(state, state.decoder.decode(b"", final=True))
            if self.log is not None:
                self.log.flush(self.rank, stream)
            if state.partial or state.cut:
                return self._route(stream, [self._end_line(state)])
            return []
        if not state.partial or state.cut:
            return []  # an overlong line waits for its end, so its marker says how much was cut
        text, state.partial = state.partial, ""
        state.sent += len(text)
        return self._route(stream, [text])

    def skipped(self) -> tuple[int, tuple[tuple[str, str], ...]] | None:
        """For the live view, if lines were held back since the last call: how many lines
        the rank wrote, but for those still held back (they are sent at the end), and the
        latest few. None otherwise."""
        if not self.unreported:
            return None
        self.unreported = 0
        latest = tuple(reversed(list(itertools.islice(reversed(self.tail), 5))))
        return self.lines_shown + self.omitted_lines, latest

    def finish(self) -> list[tuple[str, str]]:
        """After the rank's pipes closed: the note and the last lines held back."""
        out: list[tuple[str, str]] = []
        for stream in STREAMS:
            out += self.flush(stream, final=True)
        if not self.tail:
            return out
        where = f" Every line is in {self.log.path}." if self.log is not None else ""
        if self.omitted_lines:
            note = (
                f"nbtrain: {self.omitted_lines:,} lines of rank {self.rank} ({_size(self.omitted_chars)}) "
                f"are not shown; its last {len(self.tail):,} follow.{where}\n"
            )
        else:
            note = f"nbtrain: the last {len(self.tail):,} lines of rank {self.rank} follow.{where}\n"
        out.append(("stderr", note))
        out += _grouped(self.tail)
        self.tail.clear()
        return out

    def _extend(self, state: _Stream, text: str) -> None:
        room = max(0, self.limits.line_chars - state.sent - len(state.partial))
        if len(text) > room:
            state.cut += len(text) - room
            text = text[:room]
        state.partial += text

    def _end_line(self, state: _Stream) -> str:
        line = state.partial
        if state.cut:
            line += f" … [{state.cut:,} more characters cut from this line"
            line += f"; all of it is in {self.log.path}]" if self.log is not None else "]"
        state.partial, state.sent, state.cut = "", 0, 0
        return line

    def _route(self, stream: str, lines: list[str]) -> list[tuple[str, str]]:
        shown: list[str] = []
        out: list[tuple[str, str]] = []
        for position, line in enumerate(lines):
            if self.holding_back:
                if shown:
                    out.append((stream, "".join(shown)))
                if not self.noted:
                    out.append(("stderr", self._holding_note()))
                    self.noted = True
                self._hold(stream, lines[position:])
                return out
            shown.append(line)
            self.lines_shown += 1
            self.chars_shown += len(line)
        if shown:
            out.append((stream, "".join(shown)))
        return out

    def _holding_note(self) -> str:
        where = f" Every line is in {self.log.path}." if self.log is not None else ""
        return (
            f"nbtrain: rank {self.rank} printed more than the cell shows ({self.lines_shown:,} lines, "
            f"{_size(self.chars_shown)}): the rest is not shown as it comes; when the rank ends, "
            f"its last {self.limits.tail_lines:,} lines follow.{where}\n"
        )

    def _hold(self, stream: str, lines: list[str]) -> None:
        self.unreported += len(lines)
        limits = self.limits
        if len(lines) > limits.tail_lines:  # a flood: only the last ones can stay
            dropped = lines[: -limits.tail_lines]
            self.omitted_lines += len(dropped) + len(self.tail)
            self.omitted_chars += sum(map(len, dropped)) + self.tail_chars
            self.tail.clear()
            self.tail_chars = 0
            lines = lines[-limits.tail_lines :]
        for line in lines:
            self.tail.append((stream, line))
            self.tail_chars += len(line)
        while len(self.tail) > limits.tail_lines or self.tail_chars > limits.tail_chars:
            _, old = self.tail.popleft()
            self.tail_chars -= len(old)
            self.omitted_lines += 1
            self.omitted_chars += len(old)


def _grouped(lines: collections.deque[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive lines of one stream as one piece."""
    runs = itertools.groupby(lines, lambda pair: pair[0])
    return [(stream, "".join(line for _, line in run)) for stream, run in runs]


def _size(chars: int) -> str:
    if chars >= 1 << 20:
        return f"{chars / (1 << 20):.1f} MB"
    if chars >= 1 << 10:
        return f"{chars / (1 << 10):.0f} KB"
    return f"{chars} characters"
