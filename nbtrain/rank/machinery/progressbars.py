"""Notebook progress bars on a rank: ``tqdm.notebook``'s bars print as text there.

A notebook's ``from tqdm.notebook import tqdm`` draws an ipywidgets bar, which needs a
kernel to send it to the frontend. A rank has no kernel: its widget's text stood at 0%
for the whole loop, printed once. Here, when a rank imports ``tqdm.notebook``, its bar
class becomes tqdm's text bar (what ``tqdm.auto`` picks outside a notebook), which the cell
shows as each rank's line; ``tnrange``/``trange`` use it too. The class keeps its name and
module, so a cell that binds ``tqdm`` gives the kernel back its own notebook class.

Example (outside a rank nothing is changed):
    >>> from nbtrain import patches
    >>> "notebook only" in patches._for_the_process  # installed by the launcher and a rank
    False
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

_MODULE = "tqdm.notebook"


def text_bar(_original: Any) -> type:
    """``tqdm.notebook``'s ``tqdm`` and ``tqdm_notebook`` on a rank (the patch table's): one text bar class."""
    return _text_bar()


@functools.cache
def _text_bar() -> type:
    std: Any = importlib.import_module("tqdm.std")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("display", None)  # the notebook bar's own argument: show it now or later
        std.tqdm.__init__(self, *args, **kwargs)

    # Pickled by reference as the notebook class: the kernel's is what it gets back.
    return type("tqdm_notebook", (std.tqdm,), {"__init__": __init__, "__module__": _MODULE})
