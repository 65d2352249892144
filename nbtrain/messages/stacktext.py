"""Where each rank was when a run was stopped: its Python stack, in the notebook's terms.

Each rank registers :mod:`faulthandler` at start on :data:`DUMP_SIGNAL`, writing to a pipe
the launcher reads. Before stopping a run that timed out or was stopped (an interrupt, a
Stop button), the launcher sends that signal and collects the dumps. faulthandler writes
from its C signal handler, so a rank blocked inside a C++ collective (gloo's
``all_reduce``) answers too; a Python-level handler would only run once the call returned,
which for a deadlock is never. Registration is the only cost a healthy run pays.

This module is pure: it parses the dumps and words them, given a function that names the
notebook's cells (the kernel knows ``Cell In[N]``; a rank does not).

Example:
    >>> dump = '''Current thread 0x00007f (most recent call first):
    ...   File "/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
    ...   File "/tmp/ipykernel_1/2.py", line 12 in <module>
    ...   File "/x/nbtrain/rank/machinery/runtime.py", line 60 in run_rank
    ... '''
    >>> stack = RankStack(0, parse_dump(dump))
    >>> stack.summary(lambda f: "Cell In[5]" if f.endswith("2.py") else None, lambda f, n: "")
    'rank 0: waiting in all_reduce, Cell In[5], line 12'
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nbtrain.system import processes

DUMP_SIGNAL = processes.DUMP_SIGNAL  # the signal's owner, with every other signal nbtrain touches
DISABLE_VARIABLE = "NBTRAIN_STACK_DUMP"  # "0": ranks do not register (the signal is then free)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # nbtrain/
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+|\?\?\?) in (.*)$')
_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*:$")
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
# nbtrain's own frames a rank can wait in after the user's code, and what they mean.
_NBTRAIN_PLACES = {
    "_wait_for_release": "finished its work, waiting for the other ranks",
    "_join_process_group": "joining the process group",
    "loads": "loading the cell's data",
}

# Where a rank's own stack begins: a fresh rank's runtime, or a standby rank's (forked before its run).
_ENTRIES = ("run_rank", "run_standby")

Namer = Callable[[str], "str | None"]  # a filename -> "Cell In[N]" for notebook cells, else None
LineSource = Callable[[str, int], str]  # (filename, line) -> the source line, or ""


@dataclass(frozen=True)
class Frame:
    """One frame of a rank's stack dump: file, line, function."""

    filename: str
    line: int
    function: str

    @property
    def in_nbtrain(self) -> bool:
        """The frame is nbtrain's own code (left out of what the user is shown)."""
        return self.filename.startswith(_PACKAGE_DIR)

    @property
    def in_library(self) -> bool:
        """The frame is an installed library's or the standard library's, not the user's code."""
        return "-packages" + os.sep in self.filename or self.filename.startswith(_STDLIB)


_STDLIB = os.path.dirname(os.__file__) + os.sep


@dataclass(frozen=True)
class RankStack:
    """One rank's main-thread stack, outermost frame first (empty: the rank did not answer)."""

    rank: int
    frames: tuple[Frame, ...]

    def summary(self, namer: Namer, source: LineSource) -> str:
        """``rank 0: waiting in all_reduce, Cell In[5], line 12``: what it was doing, and where."""
        ours = self._visible()
        user = [f for f in ours if not f.in_library]
        if not ours:
            places = (_NBTRAIN_PLACES[f.function] for f in reversed(self.frames) if f.function in _NBTRAIN_PLACES)
            place = next(places, None)
            return f"rank {self.rank}: {place or 'no stack (it did not answer in time)'}"
        where = _location(user[-1], namer) if user else _location(ours[-1], namer)
        innermost = ours[-1]
        if innermost.in_library:
            verb = "waiting in" if f"{os.sep}distributed{os.sep}" in innermost.filename else "in"
            return f"rank {self.rank}: {verb} {innermost.function}, {where}"
        call = _CALL.search(source(innermost.filename, innermost.line))
        return f"rank {self.rank}: {'in ' + call.group(1) + ', ' if call else 'at '}{where}"

    def render(self, namer: Namer, source: LineSource, limit: int = 8) -> list[str]:
        """The stack as a traceback shows it (most recent call last), without nbtrain's frames."""
        frames = self._visible()[-limit:]
        lines = [f"rank {self.rank} (most recent call last):"]
        for frame in frames:
            lines.append(f"  {_location(frame, namer)}, in {frame.function}")
            text = source(frame.filename, frame.line).strip()
            if text:
                lines.append(f"    {text}")
        return lines


    def _visible(self) -> list[Frame]:
        """The frames that are the user's business: not nbtrain's, nor what nbtrain called."""
        frames = list(self.frames)
        for i in range(len(frames) - 1, -1, -1):
            if frames[i].in_nbtrain:
                frames = frames[: i + 1]  # only libraries below: nbtrain's own wait (a socket read)
                break
            if not frames[i].in_library:
                break
        return [f for f in frames if not f.in_nbtrain]


def parse_dump(text: str) -> tuple[Frame, ...]:
    """The main thread's frames in a faulthandler dump, outermost first.

    The main thread is the one running nbtrain's rank runtime (``run_rank``, ``run_standby``); a dump cut
    short, or one without it, falls back to the thread that handled the signal.
    """
    threads: list[tuple[bool, list[Frame]]] = []
    for raw in text.splitlines():
        if _HEADER.match(raw.strip()):
            threads.append((raw.startswith("Current"), []))
            continue
        match = _FRAME.match(raw)
        if match and threads:
            line = int(match.group(2)) if match.group(2).isdigit() else 0
            threads[-1][1].append(Frame(match.group(1), line, match.group(3)))
    main = next((fs for _, fs in threads if any(_is_entry(f) for f in fs)), None)
    if main is None:
        main = next((fs for current, fs in threads if current), [])
    # The collective ledger's wrapper (nbtrain.rank.machinery.collectives) stands between the user's
    # call and torch's collective: a stack reads as the call did without it.
    frames = [frame for frame in reversed(main) if not frame.filename.endswith(_LEDGER_FILE)]
    # What ran before the rank runtime (the launcher's loop, the fork) is not the rank's.
    entry = next((i for i, f in enumerate(frames) if _is_entry(f)), 0)
    return tuple(frames[entry:])


def waits_on_peers(frames: tuple[Frame, ...]) -> bool:
    """Whether a rank's stack shows it blocked on the other ranks: in a collective, in a backward pass
    (where DDP all-reduces the gradients) or in DDP's forward (which syncs buffers and buckets with
    the others). A rank asleep or computing on its own is not.

    >>> waits_on_peers((Frame("/x/site-packages/torch/autograd/graph.py", 1, "_engine_run_backward"),))
    True
    >>> waits_on_peers((Frame("/home/me/train.py", 3, "<module>"),))
    False
    """
    return _peer_wait(frames) is not None


def _peer_wait(frames: tuple[Frame, ...]) -> str | None:
    """What a rank waits on its peers in, in words ("a backward (DDP's gradient all-reduce)"), or None."""
    for frame in reversed(frames):
        if not frame.in_library:
            continue
        if frame.function == "_engine_run_backward":
            return "a backward (DDP's gradient all-reduce)"
        if frame.filename.endswith(_DDP_FILE):
            return "DDP's forward (it syncs with the other ranks)"
        if f"{os.sep}distributed{os.sep}" in frame.filename:
            return frame.function
    return None


_DDP_FILE = os.path.join("nn", "parallel", "distributed.py")
_LEDGER_FILE = os.path.join("nbtrain", "rank", "machinery", "collectives.py")


def waiting_note(
    finished: Iterable[int], seconds: float, waiting: Iterable[RankStack], namer: Namer,
    counts: Iterable[tuple[int, int]] = (),
) -> str:
    """What the cell says when ranks wait for ranks that finished (:class:`nbtrain.messages.events.RanksWaiting`).

    ``counts``: (rank, collectives it began, by its ledger), for every rank: when they differ, the
    note says how, and so which rank skipped one (a step's forward and backward, a collective).

    >>> stack = RankStack(1, (Frame("/x/site-packages/torch/autograd/graph.py", 1, "_engine_run_backward"),))
    >>> print(waiting_note([0], 10.2, [stack], lambda f: None))  # doctest: +ELLIPSIS
    nbtrain: rank 0 finished the cell 10 s ago, and rank 1 has begun no optimizer step since: it waits in a backward ...
    """
    stacks = sorted(waiting, key=lambda s: s.rank)
    many = len(stacks) > 1
    places = " · ".join(_waits(stack, f"rank {stack.rank}" if many else "it", namer) for stack in stacks)
    return (
        f"nbtrain: {_ranks(finished)} finished the cell {seconds:.0f} s ago, and {_ranks(s.rank for s in stacks)} "
        f"{'have' if many else 'has'} begun no optimizer step since: {places}"
        ". A rank that finished joins no collective again, so this waits until the run's timeout (with none, "
        "for ever): the ranks ran different steps (a `break`, or an `if` on nbtrain.rank() that only some "
        "take). Stop the run (interrupt the kernel; a background run: its Stop), and make every rank run "
        f"the same steps.{_counted(counts)}"
    )


def _counted(counts: Iterable[tuple[int, int]]) -> str:
    """`` Collectives begun (DDP's steps among them): rank 0 8, rank 1 7.`` where the ranks' counts differ.

    >>> _counted([(0, 8), (1, 7)])
    " Collectives begun (DDP's gradient all-reduces among them): rank 0 8, rank 1 7."
    >>> _counted([(0, 8), (1, 8)])
    ''
    """
    listed = sorted(counts)
    if len({count for _, count in listed}) < 2:
        return ""
    each = ", ".join(f"rank {rank} {count}" for rank, count in listed)
    return f" Collectives begun (DDP's gradient all-reduces among them): {each}."


def stall_note(
    seconds: float, calls: Iterable[tuple[int, str, int, bool]], ranks: Iterable[RankStack], namer: Namer,
    source: LineSource, node: str = "",
) -> str:
    """What the cell says while no rank moves and some wait on the others (:class:`~.events.RanksStalled`).

    ``calls``: (rank, its last collective in words, its number, whether it waits in it now); ``node``:
    on a cluster, the node whose ranks these are (each node watches its own).

    >>> busy = RankStack(1, (Frame("/home/me/train.py", 7, "<module>"),))
    >>> print(stall_note(31, [(0, "all_reduce of 4 float32 elements", 8, True)], [busy], lambda f: None,
    ...                  lambda f, n: ""))  # doctest: +ELLIPSIS
    nbtrain: no rank has moved for 31 s. Waiting for the others: rank 0 in all_reduce of 4 float32 elements ...
    """
    ledger = {rank: (what, number, inside) for rank, what, number, inside in calls}
    stacks = {stack.rank: stack for stack in ranks}
    waiting, others = [], []
    for stack in (stacks.get(rank, RankStack(rank, ())) for rank in sorted({*ledger, *stacks})):
        what, number, inside = ledger.get(stack.rank, ("", 0, False))
        where = _where_user(stack, namer)
        if inside:
            waiting.append(f"rank {stack.rank} in {what} (its {ordinal(number)} collective){where}")
        elif waits_on_peers(stack.frames):
            waiting.append(f"rank {stack.rank} in {_peer_wait(stack.frames)}{where}")
        else:
            last = f" (its last collective, the {ordinal(number)}, returned)" if number else " (no collective yet)"
            others.append((stack, f"{stack.summary(namer, source)}{last}"))
    lines = [
        f"nbtrain: no rank{f' on {node}' if node else ''} has moved for {seconds:.0f} s. "
        f"Waiting for the others: {'; '.join(waiting)}."
        + (f" Not there: {'; '.join(text for _, text in others)}." if others else "")
    ]
    for stack, _ in others:
        lines += stack.render(namer, source, limit=4)
    lines.append(
        "The run goes on (a slow step is not a hang): this note clears when the ranks move again. If they do "
        "not, stop the run (interrupt the kernel; a background run: its Stop) and look at what each rank runs "
        "there: a rank busy or blocked on its own, or ranks calling different collectives (docs/failures.md)."
    )
    return "\n".join(lines)


def _where_user(stack: RankStack, namer: Namer) -> str:
    user = [f for f in stack.frames if not f.in_library and not f.in_nbtrain]
    return f", {_location(user[-1], namer)}" if user else ""


def ordinal(number: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``8th``, ``11th``, ``22nd``.

    >>> [ordinal(n) for n in (1, 2, 3, 8, 11, 12, 13, 22)]
    ['1st', '2nd', '3rd', '8th', '11th', '12th', '13th', '22nd']
    """
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def _waits(stack: RankStack, subject: str, namer: Namer) -> str:
    """``it waits in a backward (DDP's gradient all-reduce), Cell In[3], line 5``."""
    return f"{subject} waits in {_peer_wait(stack.frames) or 'a collective'}{_where_user(stack, namer)}"


def _ranks(ranks: Iterable[int]) -> str:
    *rest, last = sorted(ranks)
    return f"ranks {', '.join(map(str, rest))} and {last}" if rest else f"rank {last}"


def in_backward(frames: tuple[Frame, ...]) -> bool:
    """Whether a rank's stack shows it in a backward pass (DDP all-reduces the gradients there: every rank's step).

    >>> in_backward((Frame("/x/site-packages/torch/autograd/graph.py", 1, "_engine_run_backward"),))
    True
    """
    return any(frame.function == "_engine_run_backward" for frame in frames if frame.in_library)


def _is_entry(frame: Frame) -> bool:
    return frame.function in _ENTRIES and frame.in_nbtrain


def where_each_rank_was(stacks: Iterable[RankStack], namer: Namer, source: LineSource) -> str:
    """One line per run, then each rank's stack: the text a stopped run's error carries."""
    stacks = sorted(stacks, key=lambda s: s.rank)
    if not stacks:
        return ""
    lines = ["Where each rank was: " + " · ".join(s.summary(namer, source) for s in stacks)]
    for stack in stacks:
        if stack._visible():
            lines += stack.render(namer, source)
    return "\n".join(lines)


def _location(frame: Frame, namer: Namer) -> str:
    cell = namer(frame.filename)
    return f'File "{frame.filename}", line {frame.line}' if cell is None else f"{cell}, line {frame.line}"
