"""What differs between the Jupyter stacks nbtrain runs on, owned here and nowhere else.

Colab and Kaggle pin an older stack (IPython 7.34, ipykernel 6.17, ipywidgets 7.7, see
docs/colab-kaggle.md); a current Jupyter has IPython 8/9, ipykernel 7 and ipywidgets 8.
The rest of nbtrain calls the functions below and never asks which version it runs with:

- a widget's display data (:func:`widget_bundle`, :func:`widget_shown`): ipywidgets 8 gives it
  as ``_repr_mimebundle_``; ipywidgets 7 only displays itself (``_ipython_display_``), so the
  same bundle is built here from the widget's model id;
- Colab's widget manager (:func:`needs_colab_widget_manager`): Colab renders ipywidgets 7 by
  itself and ipywidgets 8 only after ``enable_custom_widget_manager()``;
- the cells' file names for tracebacks (:func:`cache_source`, :func:`cell_filenames`):
  IPython 8 remembers which file name each cell was compiled under; IPython 7 keeps no such
  record, so it is rebuilt from the shell's history and the compiler's own naming;
- which of linecache's entries are cells, whose lines travel to the ranks for their
  tracebacks (:func:`only_in_memory`).

Everything else nbtrain uses of these packages (display ids, ``magic_arguments``, the
kernel's SIGINT interrupts, the history of cell inputs) behaves the same on both
generations; ``tests/`` runs on both (``.ci/test``, the Colab environment of ``.ci/colab-env``).

>>> class Old:  # an ipywidgets 7 widget has no _repr_mimebundle_
...     _view_name = "ButtonView"
...     _model_id = "abc"
>>> widget_bundle(Old())["application/vnd.jupyter.widget-view+json"]["model_id"]
'abc'
>>> cell_filenames(None)
{}
"""

from __future__ import annotations

import linecache
import sys
from typing import Any

WIDGET_VIEW_MIMETYPE = "application/vnd.jupyter.widget-view+json"

# Cell file names nbtrain registered itself, where the compiler keeps no map (IPython 7).
_registered_cells: dict[str, int] = {}


def widget_bundle(widget: Any) -> dict[str, Any]:
    """The display data of an ipywidget: its repr as text/plain and, if it has a view, the view's reference."""
    make = getattr(widget, "_repr_mimebundle_", None)
    if callable(make):  # ipywidgets 8
        return dict(make() or {})
    # ipywidgets 7: the bundle its _ipython_display_ would send (the same view format, 2.0).
    bundle: dict[str, Any] = {"text/plain": repr(widget)}
    if getattr(widget, "_view_name", None) is not None:
        bundle[WIDGET_VIEW_MIMETYPE] = {"version_major": 2, "version_minor": 0, "model_id": widget._model_id}
    return bundle


def widget_shown(widget: Any) -> None:
    """Tell a widget it was displayed: ipywidgets 7 runs its ``on_displayed`` callbacks only from its own display."""
    if callable(getattr(widget, "_repr_mimebundle_", None)):
        return  # ipywidgets 8 has no such callbacks to run
    handle = getattr(widget, "_handle_displayed", None)
    if callable(handle):
        handle()


def needs_colab_widget_manager() -> bool:
    """True where Colab can show nbtrain's widgets only after ``enable_custom_widget_manager()`` (ipywidgets 8)."""
    ipywidgets = sys.modules.get("ipywidgets")  # imported by whoever made the widget to show
    widget = getattr(ipywidgets, "Widget", None)
    return callable(getattr(widget, "_repr_mimebundle_", None))


def cache_source(shell: Any, source: str, number: int | None, raw_code: str) -> str | None:
    """Cache ``source`` in the shell's compiler under a file name of its own; that name (None without a compiler).

    The name is remembered as cell ``number``'s, for :func:`cell_filenames`.
    """
    compiler = getattr(shell, "compile", None)
    if compiler is None or not hasattr(compiler, "cache"):
        return None
    filename: str = compiler.cache(source, number, raw_code=raw_code)
    if number is not None and not hasattr(compiler, "_filename_map"):
        _registered_cells[filename] = number  # IPython 7 remembers nothing of it
    return filename


def cell_filenames(shell: Any) -> dict[str, int]:
    """{compiled file name: cell number} of the cells the shell ran (and nbtrain cached)."""
    compiler = getattr(shell, "compile", None)
    if compiler is None:
        return {}
    known: dict[str, int] | None = getattr(compiler, "_filename_map", None)
    # IPython 8 and later keep the map themselves.
    return known if known is not None else {**_history_filenames(shell, compiler), **_registered_cells}


def only_in_memory(filename: str, entry: tuple[Any, ...]) -> bool:
    """Whether ``linecache``'s ``entry`` for ``filename`` is code that exists only in this process (a cell).

    IPython 8 caches cells without a modification time; IPython 7 gives them one and keeps
    them in a cache of its own beside linecache's (``linecache._ipython_cache``).
    """
    return entry[1] is None or filename in getattr(linecache, "_ipython_cache", {})


def _history_filenames(shell: Any, compiler: Any) -> dict[str, int]:
    """IPython 7: each past cell's file name, as its compiler named it when the cell ran."""
    history = getattr(shell, "history_manager", None)
    raw = getattr(history, "input_hist_raw", None) or []
    parsed = getattr(history, "input_hist_parsed", None) or []
    name_of = getattr(compiler, "get_code_name", None)
    if not callable(name_of):
        return {}
    cells = enumerate(zip(raw, parsed, strict=False))
    return {name_of(raw_cell, cell, number): number for number, (raw_cell, cell) in cells if number and raw_cell}
