"""A failed cell's error as the notebook shows it: tracebacks naming cells, and one message each.

A rank's traceback names the notebook's cells ``Cell In[N]`` (:func:`cell_traceback`), a
cell that does not compile fails at its own line (:class:`CellSyntaxError`), and a run's
failure ends with what it means for the kernel's objects (:func:`explain_failure`,
:func:`unchanged_note`) and, for the commonest CUDA mistake, what to do (:func:`device_hint`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import traceback
from typing import Any

from nbtrain.errors import NbtrainError, RankError, RunFailedError
from nbtrain.kernel import cellnames


def plain_error(error: BaseException) -> BaseException:
    """Make IPython show ``error`` as its one message, without our frames."""
    if not hasattr(error, "_render_traceback_"):
        message = f"{type(error).__name__}: {error}"
        error._render_traceback_ = lambda: [message]  # type: ignore[attr-defined]  # IPython's hook, on any error
    return error


def unchanged_note(shipped: dict[str, Any]) -> str:
    """What a run that ended without a result says of the kernel's objects it shipped.

    >>> unchanged_note({"model": object(), "steps": 3})
    'Nothing in the kernel was changed: model, steps are as they were before the cell.'
    """
    names = [n for n, v in shipped.items() if not callable(v) or hasattr(v, "state_dict")]
    names = [n for n in names if type(shipped[n]).__name__ != "module"]
    if not names:
        return "Nothing in the kernel was changed."
    listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    verb = "is as it was" if len(names) == 1 else "are as they were"
    return f"Nothing in the kernel was changed: {listed} {verb} before the cell."


def explain_failure(error: RunFailedError, shell: Any, note: str) -> BaseException:
    """The run's failure as the notebook shows it: rank tracebacks name cells, plus ``note``."""
    if isinstance(error, RankError):
        text = cell_traceback(error.remote_traceback, shell)
        note = " ".join(part for part in (device_hint(error.exc_message), note) if part)
        note += f"\n{error.note}" if error.note else ""  # the held rank's %nbtrain_debug
        message = cell_traceback(error.exc_message, shell)  # a message may name a line too (a collective's mismatch)
        return RankError(error.rank, error.exc_type, message, text, note, node=error.node)
    where = getattr(error, "where", "")
    message = f"{error.headline or error} {note}" + (f"\n{where}" if where else "")
    error.args = (message,)  # RunFailedError._render_traceback_ shows it
    return error


_DEVICE_MISMATCH = ("Expected all tensors to be on the same device", "found at least two devices")


def device_hint(message: str) -> str:
    """What to do when a rank mixed devices: the commonest first error of a CUDA cell.

    >>> device_hint("Expected all tensors to be on the same device, but found at least two devices")[:40]
    'Each rank computes on its own device (nb'
    >>> device_hint("bad batch")
    ''
    """
    if not any(marker in message for marker in _DEVICE_MISMATCH):
        return ""
    return (
        "Each rank computes on its own device (nbtrain.device()): auto mode moved the model there, and "
        "what is passed to it, but other tensors made in the kernel (a target, say) stay where they were "
        "made. Move them with `.to(nbtrain.device())`, or iterate a DataLoader, whose batches auto mode "
        "moves for you."
    )


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def cell_traceback(text: str, shell: Any) -> str:
    """Name notebook cells as IPython does: ``File "/tmp/ipykernel_1/23.py", line 4`` -> ``Cell In[7], line 4``."""
    namer = cellnames.cell_namer(shell)

    def rename(match: re.Match[str]) -> str:
        name = namer(match.group(1))
        return match.group(0) if name is None else f"{name}, line {match.group(2)}"

    return _FRAME.sub(rename, text)


def check_syntax(code: str, filename: str, shell: Any) -> None:
    """Raise :class:`CellSyntaxError` when ``code`` does not compile, at the cell's own line."""

    with contextlib.suppress(SyntaxError):
        _compiles(code)
        return
    try:
        compile(code, filename, "exec")  # again, for the message at the cell's own file and line
    except SyntaxError as error:
        text = cell_traceback("".join(traceback.format_exception_only(type(error), error)), shell)
        raise CellSyntaxError(text) from None


@functools.lru_cache(maxsize=32)
def _compiles(code: str) -> bool:
    """True, or SyntaxError: remembered for the code that compiled, so a re-run cell is not compiled twice."""
    compile(code, "<cell>", "exec")
    return True


class CellSyntaxError(NbtrainError):
    """The cell does not compile: shown as Python shows a SyntaxError, at the cell's own line.

    Not a SyntaxError subclass: IPython would show one with nbtrain's frames around it.
    """

    def __init__(self, text: str):
        Exception.__init__(self, text)

    def _render_traceback_(self) -> list[str]:
        return str(self).rstrip().splitlines()
