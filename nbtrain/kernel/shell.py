"""The IPython shell nbtrain runs in: the one module of the kernel side that asks IPython for it.

The magic, the namespace analysis, background runs, the launcher form and the live view
ask here for what they need of the shell: whether there is one (:func:`get_shell`), the
running cell's number, the user's namespace, the kernel's main-thread event loop, and a
block that a kernel interrupt must not cut in two (:func:`interrupts_deferred`). Cell file
names are :mod:`nbtrain.kernel.cellnames`'. Nothing here imports IPython unless the process already
has: plain ``python`` using ``nbtrain.launch`` never pays for it.

>>> get_shell() is None or hasattr(get_shell(), "user_ns")
True
>>> is_notebook(None), current_cell_number(None), kernel_loop(None)
(False, None, None)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from nbtrain.system import processes


def get_shell() -> Any:
    """The running IPython shell, or None (a terminal Python, a script, a rank)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None  # never imported IPython: certainly no shell
    return ipython.get_ipython()


def is_notebook(shell: Any) -> bool:
    """True for a Jupyter kernel's shell (it can show HTML, images and widgets)."""
    return shell is not None and any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__)


def current_cell_number(shell: Any) -> int | None:
    """N of the running cell's ``In[N]`` (None without a shell).

    Not ``shell.execution_count``: recent IPython raises it before running a cell. The
    cell's input is stored in the history before it runs, in every version.
    """
    if shell is None:
        return None
    history = getattr(getattr(shell, "history_manager", None), "input_hist_parsed", None)
    if history:
        return len(history) - 1
    count: int | None = shell.execution_count
    return count


def execution_count() -> int | None:
    """The running shell's execution counter (None without a shell)."""
    shell = get_shell()
    return None if shell is None else shell.execution_count


def user_namespace(shell: Any) -> dict[str, Any]:
    """The user's globals: what a cell reads and what its results are written into."""
    names: dict[str, Any] = shell.user_ns
    return names


def hidden_names(shell: Any) -> dict[str, Any]:
    """Names IPython put in the user's namespace itself (not the user's variables)."""
    names: dict[str, Any] = shell.user_ns_hidden
    return names


def kernel_loop(shell: Any) -> Any:
    """The event loop of a Jupyter kernel's main thread (None in a terminal or plain python)."""
    kernel = getattr(shell, "kernel", None)
    loop = getattr(kernel, "io_loop", None)
    return loop if loop is not None and hasattr(loop, "add_callback") else None


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a kernel interrupt while the block writes the user's namespace, then deliver it.

    All of an update or, if interrupted before, none of it. Inside a section that already
    holds interrupts (a blocking cell), that section acts. The signal itself is handled
    where processes and signals live (:func:`nbtrain.system.processes.interrupts_held`).
    """
    with processes.interrupts_held() as held:
        yield
    if held.received:
        raise KeyboardInterrupt
