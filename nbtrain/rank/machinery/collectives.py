"""The collective ledger: each collective a rank calls, written on the run's board and checked against its peers'.

Every ``torch.distributed`` collective a cell calls (``all_reduce``, ``broadcast``, ``barrier``,
the object collectives...) goes through :func:`ledgered` (the ``collectives`` rows of
:mod:`nbtrain.patches`). Before it joins, the rank writes on its slot of the run's
:class:`~nbtrain.system.stepboard.StepBoard`: the group, the call's number in that group, the
operation, its elements and dtype, and the line of the user's code that led to it; while it
waits inside, the time it entered. The launcher reads the board to name a stall while it
happens (:mod:`nbtrain.launch_server.stalls`).

Mismatches end the run at once. Ranks at the same call of a group with different operations
(or, where torch needs them equal, different sizes or dtypes) would wait for ever, or abort
inside gloo or NCCL with an assertion of their own ("op.preamble.length <= op.nbytes"). The
last rank to arrive finds the others' entries on the board before it joins, and raises
:class:`~nbtrain.errors.CollectiveMismatchError` naming each rank's call: the run ends as for
any exception, with the usual state back.

The collectives torch calls inside one (an object collective's ``all_gather``) are part of
it, not calls of their own. Outside a run, or without a board (a spawned rank), a call costs
one Python call more; with a board, a few microseconds (``benchmarks/ledger.py``).

Example (a board of one rank, this process its rank 0)::

    >>> import torch
    >>> from nbtrain.system import stepboard
    >>> board = stepboard.StepBoard.create(1)
    >>> attach_ledger(board, 0)
    >>> def all_reduce(tensor, op=None, group=None, async_op=False):
    ...     return board.collective(0).describe()
    >>> ledgered(all_reduce)(torch.zeros(4))
    'all_reduce of 4 float32 elements'
    >>> attach_ledger(None, 0)
"""

from __future__ import annotations

import functools
import inspect
import linecache
import sys
import time
import types
import zlib
from collections.abc import Callable
from typing import Any

from nbtrain.errors import CollectiveMismatchError
from nbtrain.messages import stacktext
from nbtrain.system import stepboard

# operation -> (the argument whose size the ledger writes, whether torch needs it equal on every
# rank). Uneven all_gather, gather, scatter and all_to_all are allowed: only their operation is compared.
_SIZED: dict[str, tuple[str | None, bool]] = {
    "all_reduce": ("tensor", True),
    "broadcast": ("tensor", True),
    "reduce": ("tensor", True),
    "all_gather": ("tensor", False),
    "all_gather_into_tensor": ("input_tensor", True),
    "reduce_scatter": ("output", False),
    "reduce_scatter_tensor": ("input", True),
    "all_to_all": ("input_tensor_list", False),
    "all_to_all_single": ("input", False),
    "gather": ("tensor", False),
    "scatter": ("tensor", False),
    "barrier": (None, True),
    "all_gather_object": ("object_list", False),
    "broadcast_object_list": ("object_list", False),
    "gather_object": ("obj", False),
    "scatter_object_list": ("scatter_object_output_list", False),
    "monitored_barrier": (None, True),
    "all_gather_single": ("input_tensor", True),
    "reduce_scatter_single": ("input", True),
}
assert tuple(_SIZED) == stepboard.COLLECTIVES  # one list of what the patch table wraps: the board's


class _Ledger:
    """This rank's slot on the run's board, and its numbering of each group's calls."""

    def __init__(self, board: stepboard.StepBoard, slot: int) -> None:
        self.board = board
        self.slot = slot
        self.depth = 0  # inside a collective: torch's own calls are part of it
        self.group_calls: dict[int, int] = {}  # group number -> its calls so far
        self.groups: dict[int, int] = {}  # id(a group) -> its number

    def enter(self, operation: int, equal: bool, sized: Any, group: Any, caller: types.FrameType | None) -> None:
        """Write the call on the board; raise CollectiveMismatchError if a peer is in another at the same call."""
        __tracebackhide__ = True
        number = 0 if group is None else self._group_number(group)
        call = self.group_calls.get(number, 0) + 1
        self.group_calls[number] = call
        elements, dtype = _size(sized)
        file, line = users_line(caller)
        entry = (number, call, operation, elements, dtype, file, line)
        self.board.enter_collective(self.slot, entry)
        if self.board.differs(self.slot, entry, equal):
            entries = _arrivals(self.board, self.board.collective(self.slot))
            self.board.leave_collective(self.slot)
            raise CollectiveMismatchError(mismatch_text(entries, _filenames(), _first_rank(self.slot)))

    def note_torch_collective(self, operation: int) -> None:
        """Count a collective torch makes itself in C++ (no wait is seen): in the numbering of STEP_GROUP."""
        call = self.group_calls.get(STEP_GROUP, 0) + 1
        self.group_calls[STEP_GROUP] = call
        self.board.enter_collective(self.slot, (STEP_GROUP, call, operation, 0, 0, 0, 0))
        self.board.leave_collective(self.slot)

    def _group_number(self, group: Any) -> int:
        number = self.groups.get(id(group))
        if number is None:
            number = self.groups[id(group)] = _numbered(group)
        return number


def _numbered(group: Any) -> int:
    """A group's number, the same on each of its members: 0 for the default group, else made of its ranks."""
    import torch.distributed as dist  # imported: a group exists

    if group is dist.GroupMember.WORLD:
        return 0
    try:
        members = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError):  # not a member: its calls return at once, compared with none
        return 1
    return zlib.crc32(repr(sorted(members)).encode()) or 2



# The group number of the collectives torch makes itself (DDP's gradient all-reduce): numbered apart,
# never compared with the user's calls: a forward with gradients on one rank only (an evaluation
# left under grad) must not shift the numbers the user's collectives are compared by.
STEP_GROUP = -1
_DDP_STEP = stepboard.OPERATIONS.index("DDP's gradient all-reduce")

_ledger: _Ledger | None = None  # this rank's (None: outside a run, or no board)


def noting_ddp_steps(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch table's factory: DistributedDataParallel's ``forward``, counting on the ledger each forward
    that syncs (its backward all-reduces the gradients, in C++), so that a rank that skipped a step's
    forward and backward is named by its count. A model auto mode wrapped, one the cell wrapped itself,
    a framework's: all go through it."""
    import torch  # imported: DDP's module is

    # Never traced by torch.compile (a compiled DDP's graph is DDP's own): dynamo breaks the graph here.
    note = torch.compiler.disable(_note_ddp_step)

    @functools.wraps(original)
    def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a rank's traceback reads as DDP's own forward
        note(self)
        return original(self, *inputs, **kwargs)

    return forward


def _note_ddp_step(ddp: Any) -> None:
    ledger = _ledger
    if ledger is not None and ddp.require_backward_grad_sync and _grad_enabled():
        ledger.note_torch_collective(_DDP_STEP)


def _grad_enabled() -> bool:
    import torch  # imported: a DDP runs

    return bool(torch.is_grad_enabled())


def attach_ledger(board: stepboard.StepBoard | None, slot: int) -> None:
    """Called by the launcher in a forked rank: the run's board and this rank's slot on it."""
    global _ledger
    _ledger = None if board is None else _Ledger(board, slot)


def ledgered(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch table's factory: ``original`` (a ``torch.distributed`` collective) written on the ledger."""
    name = original.__name__
    operation = stepboard.OPERATIONS.index(name)
    sized, equal = _SIZED[name]
    parameters = list(inspect.signature(original).parameters)
    sized_at = parameters.index(sized) if sized is not None else -1
    group_at = parameters.index("group")

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a rank's traceback shows the user's call, not this wrapper
        ledger = _ledger
        if ledger is None or ledger.depth:
            return original(*args, **kwargs)
        tensor = _argument(args, kwargs, sized, sized_at) if sized is not None else None
        ledger.enter(operation, equal, tensor, _argument(args, kwargs, "group", group_at), sys._getframe(1))
        ledger.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            ledger.depth -= 1
            ledger.board.leave_collective(ledger.slot)

    return collective


ARRIVAL_SECONDS = 1.0  # a mismatch waits this long for the ranks not yet at the call, to name theirs too


def _arrivals(board: stepboard.StepBoard, mine: stepboard.Collective) -> dict[int, stepboard.Collective]:
    """Every slot's entry once each rank is at ``mine``'s call (or ARRIVAL_SECONDS passed): a rank behind
    the others is named with its own call, not left out."""
    deadline = time.monotonic() + ARRIVAL_SECONDS
    while True:
        entries = {slot: board.collective(slot) for slot in range(board.world_size)}
        arrived = all(_at(entry, mine) for entry in entries.values())
        if arrived or time.monotonic() > deadline:
            return entries
        time.sleep(0.005)


def _at(entry: stepboard.Collective, mine: stepboard.Collective) -> bool:
    return bool(entry.since) and entry.group == mine.group and entry.group_call >= mine.group_call


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int) -> Any:
    return args[at] if len(args) > at else kwargs.get(name)


def _size(sized: Any) -> tuple[int, int]:
    """(elements, dtype index) of a collective's tensor, list of tensors or list of objects."""
    if sized is None:
        return 0, 0
    if isinstance(sized, (list, tuple)):
        if sized and all(hasattr(item, "numel") for item in sized):
            return sum(item.numel() for item in sized), _dtype(sized[0])
        return len(sized), stepboard.DTYPES.index("objects")
    if hasattr(sized, "numel"):
        return int(sized.numel()), _dtype(sized)
    return 1, stepboard.DTYPES.index("objects")  # gather_object's one object


def _dtype(tensor: Any) -> int:
    name = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
    return stepboard.DTYPES.index(name) if name in stepboard.DTYPES else 0


# code object -> (crc32 of its file name, whether it is the user's); filled as calls come.
_CODES: dict[types.CodeType, tuple[int, bool]] = {}
_FILENAMES: dict[int, str] = {}  # crc32 -> file name, of the files the ledger has written


def users_line(frame: types.FrameType | None) -> tuple[int, int]:
    """(crc32 of the file name, line) of the innermost frame of the user's code above ``frame``
    (neither nbtrain's, torch's nor another library's); else of the innermost frame outside nbtrain."""
    fallback = (0, 0)
    while frame is not None:
        code = frame.f_code
        known = _CODES.get(code)
        if known is None:
            where = stacktext.Frame(code.co_filename, 0, code.co_name)
            crc = zlib.crc32(code.co_filename.encode())
            _FILENAMES[crc] = code.co_filename
            known = _CODES[code] = (crc if not where.in_nbtrain else 0, not where.in_library and not where.in_nbtrain)
        if known[1]:
            return known[0], frame.f_lineno
        if known[0] and fallback == (0, 0):
            fallback = (known[0], frame.f_lineno)
        frame = frame.f_back
    return fallback


def _first_rank(slot: int) -> int:
    """The rank of the board's slot 0: this rank's less its slot (a cluster node's first rank); 0 outside a run."""
    from nbtrain.rank import api  # the rank's context, set by its runtime

    context = api.current_context()
    return 0 if context is None else context.rank - slot


def _filenames() -> dict[int, str]:
    """crc32 -> file name, of the files this rank's calls came from and the notebook's cells it knows."""

    known = {zlib.crc32(name.encode()): name for name in list(linecache.cache)}
    return {**known, **_FILENAMES}


def mismatch_text(entries: dict[int, stepboard.Collective], filenames: dict[int, str], first_rank: int = 0) -> str:
    """The error of ranks in different collectives at one call: each rank's call, sizes and line.

    ``entries``: by slot on the board; ``first_rank``: the rank of slot 0 (a cluster node's first).

    >>> a = stepboard.Collective(8, 0, 8, 0, 4, 1, 7, 8, 1.0)
    >>> b = stepboard.Collective(8, 0, 8, 1, 4, 1, 7, 9, 1.0)
    >>> print(mismatch_text({0: a, 1: b}, {7: "/tmp/ipykernel_1/2.py"}))  # doctest: +ELLIPSIS
    The ranks called different collectives as their 8th call of the default group: rank 0 all_reduce of ...
    """
    first = next(entry for entry in entries.values() if entry.since)
    group = "the default group" if first.group == 0 else "their group"
    calls = "; ".join(
        f"rank {slot + first_rank} {entry.describe()} ({_where(entry, filenames)})"
        if _at(entry, first) else f"rank {slot + first_rank} not there yet (its last: {_last(entry, filenames)})"
        for slot, entry in entries.items()
    )
    return (
        f"The ranks called different collectives as their {stacktext.ordinal(first.group_call)} call of {group}: "
        f"{calls}. "
        "Every rank must call the same collectives in the same order, with tensors of the same size and dtype: "
        "gloo and NCCL would wait for ever, or abort the process. Look for a collective under an `if` on the "
        "rank (nbtrain.rank()), or a size that depends on each rank's data (pad it, or all_gather the sizes first)."
    )


def _last(entry: stepboard.Collective, filenames: dict[int, str]) -> str:
    if not entry.calls:
        return "no collective"
    return f"the {stacktext.ordinal(entry.group_call)} call, {entry.describe()}, {_where(entry, filenames)}"


def _where(entry: stepboard.Collective, filenames: dict[int, str]) -> str:
    filename = filenames.get(entry.file)
    return f'File "{filename}", line {entry.line}' if filename else f"line {entry.line}"


