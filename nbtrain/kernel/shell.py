"""The IPython shell nbtrain runs in: the one module of the kernel side that asks IPython for it.

The magic, the namespace analysis, background runs, the launcher form and the live view
ask here for what they need of the shell: whether there is one (:func:`get_shell`), the
running cell's number, the user's namespace, the kernel's main-thread event loop, a
block that a kernel interrupt must not cut in two (:func:`interrupts_deferred`), and which
cell magic is nbtrain's in this kernel (:func:`magic_name`: ``%%distributed``, or
``%%nbtrain`` where another package holds ``%%distributed``). Cell file
names are :mod:`nbtrain.kernel.cellnames`'. Nothing here imports IPython unless the process already
has: plain ``python`` using ``nbtrain.launch`` never pays for it.

>>> get_shell() is None or hasattr(get_shell(), "user_ns")
True
>>> is_notebook(None), current_cell_number(None), kernel_loop(None)
(False, None, None)
>>> magic_for("nbtrain.kernel.magic"), magic_for("nbdistributed.magic")
('%%distributed', '%%nbtrain')
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from nbtrain.system import processes

# The cell magic nbtrain registers where no other package holds it (nbdistributed and
# torch-distdev register one of that name too), and the one only nbtrain registers.
SHARED_MAGIC = "distributed"
OWN_MAGIC = "nbtrain"
MAGICS_MODULE = "nbtrain.kernel.magic"  # where the class whose methods are nbtrain's magics lives


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


def cell_magic_owner(shell: Any, name: str) -> str | None:
    """The module of whoever holds cell magic ``%%name`` in ``shell`` (None: no one, or no shell).

    A ``Magics`` method's owner is its instance's class, wherever the method was written; a
    function registered on its own is its own module's. Asked of what is registered, not of
    which packages are installed or imported: only the registration says who has the name now.
    """
    held = None if shell is None else shell.magics_manager.magics["cell"].get(name)
    if held is None:
        return None
    owner = getattr(held, "__self__", None)
    module = type(owner).__module__ if owner is not None else getattr(held, "__module__", None)
    return module or "another package"


def magic_for(owner: str | None) -> str:
    """nbtrain's cell magic as a user types it, given the module holding ``%%distributed`` (None: no one).

    >>> magic_for(None), magic_for("torch_distdev.magics")
    ('%%distributed', '%%nbtrain')
    """
    return f"%%{SHARED_MAGIC}" if owner in (None, MAGICS_MODULE) else f"%%{OWN_MAGIC}"


def magic_name() -> str:
    """The cell magic that is nbtrain's in this kernel: ``%%distributed``, or ``%%nbtrain`` where another holds that.

    What nbtrain's help, messages, launcher form and generated cells write; ``%%nbtrain``
    itself works wherever nbtrain is loaded.

    >>> magic_name()  # no shell here; in one, no other package holding %%distributed gives the same
    '%%distributed'
    """
    return magic_for(cell_magic_owner(get_shell(), SHARED_MAGIC))


def is_nbtrain_cell(cell: str) -> bool:
    """Whether ``cell`` (its raw text) runs on nbtrain's ranks: ``%%nbtrain``, or ``%%distributed`` where nbtrain's.

    >>> is_nbtrain_cell("%%nbtrain --devices 2\\nx = 1"), is_nbtrain_cell("x = 1")
    (True, False)
    """
    words = cell.split(None, 1)
    return bool(words) and words[0] in (f"%%{OWN_MAGIC}", magic_name())


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
