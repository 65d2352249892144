"""IPython's ``display`` on a rank: what a rank shows appears in the cell, as in the kernel.

Outside a kernel, ``display(obj)`` prints ``obj`` and ``clear_output()`` prints terminal
escapes: a rank's ``plt.show()`` printed ``Figure(640x480)``, a DataFrame its text, and a
loop redrawing its plot with ``clear_output(wait=True)`` printed garbage. Here, when a rank
imports IPython's display functions, they send what they show to the cell instead:

- ``display(obj)`` formats ``obj`` as the kernel would (a figure as PNG, a DataFrame as
  HTML) and sends it as an :class:`~nbtrain.messages.events.Display`, after whatever the rank printed
  before it; ``display_id`` handles and ``update_display`` update it in place;
- ``clear_output()`` clears what *this rank* showed since its last clear: its next displays
  replace those in place, one for one (the cell's other output, the live view and the
  other ranks' displays stay). So a loop that clears and redraws its plot shows one plot
  per rank, redrawn; printed lines are not cleared (the cell keeps every rank's lines);
- at the end of a cell, figures pyplot still has open are shown, as the kernel's inline
  backend shows them (:func:`show_open_figures`); ``%matplotlib`` in a cell selects that
  backend on the ranks (:func:`shell_class`).

A rank shows at most ``DISPLAYS_PER_RUN`` new displays (updates are not counted); past that
each one's text is printed. The functions keep IPython's names, so a cell that binds
``display`` gives the kernel back its own. Outside a run they are IPython's.

Example (outside a rank nothing is changed):
    >>> from nbtrain import patches
    >>> "notebook only" in patches._for_the_process  # installed by the launcher and a rank
    False
"""

from __future__ import annotations

import base64
import functools
import itertools
import os
import sys
from collections.abc import Callable
from typing import Any

from nbtrain.messages import events
from nbtrain.rank import api

DISPLAYS_PER_RUN = 200
# A bundle larger than this is shown as its text (a frontend slows down on such outputs).
BUNDLE_BYTES = 16 << 20


def show_open_figures() -> None:
    """Show the figures pyplot has open with the inline backend, as the kernel does at a cell's end."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or api.current_context() is None or not pyplot.get_fignums():
        return
    if "inline" in str(sys.modules["matplotlib"].get_backend()):  # module://matplotlib_inline.backend_inline
        pyplot.show()  # the inline backend's show: each figure displayed, then closed


@functools.lru_cache(maxsize=1)
def shell_class() -> Any:
    """The IPython shell a rank gives a cell that calls ``get_ipython()`` (``%time``, ``%matplotlib``).

    IPython's base shell has no event loop (its ``enable_gui`` raises), and a rank has no
    frontend for one: ``%matplotlib`` (any backend) selects the inline backend, whose
    figures this module sends to the cell as images.
    """
    # deferred: start-up time (IPython)
    from IPython.core.interactiveshell import InteractiveShell

    class RankShell(InteractiveShell):
        def enable_gui(self, gui: Any = None) -> None:
            """Nothing: a rank runs no GUI event loop."""

        def enable_matplotlib(self, gui: Any = None) -> Any:
            if gui not in (None, "auto", "inline") and api.rank() == 0:
                note = f"nbtrain: the ranks show figures as images in the cell (inline), not with %matplotlib {gui}"
                print(note, file=sys.stderr)
            return super().enable_matplotlib("inline")  # type: ignore[no-untyped-call]

    return RankShell


def in_the_cell(original: Callable[..., Any]) -> Callable[..., Any]:
    """IPython's ``display`` or ``clear_output`` on a rank (the patch table's): to the cell in a
    run, IPython's own elsewhere. IPython 8's ``core.display`` binds ``display_functions``' as it
    is imported, changed already: that one is kept; IPython 9's has none: nothing is added."""
    if original is None or getattr(original, "__code__", None) is _CHOSEN:
        return original
    if original.__name__ == "clear_output":
        return _outside_a_run(original, _clear_output)
    handle_class = getattr(sys.modules[original.__module__], "DisplayHandle", None)
    return _outside_a_run(original, functools.partial(_display, handle_class))


def _outside_a_run(original: Callable[..., Any], on_a_rank: Callable[..., Any]) -> Callable[..., Any]:
    """``on_a_rank`` in a run, ``original`` elsewhere; named as ``original``, so it pickles as IPython's."""

    @functools.wraps(original)
    def chosen(*args: Any, **kwargs: Any) -> Any:
        context = api.current_context()
        if context is None or context.pid != os.getpid():  # a DataLoader worker must not write the rank's channel
            return original(*args, **kwargs)
        return on_a_rank(context, *args, **kwargs)

    return chosen


_CHOSEN = _outside_a_run(print, print).__code__  # what a function of _outside_a_run's runs


def _display(  # IPython's display(), its parameters included
    handle_class: Any, context: api.RankContext, *objs: Any, include: Any = None, exclude: Any = None,
    metadata: dict[str, Any] | None = None, transient: Any = None, display_id: Any = None, raw: bool = False,
    clear: bool = False, **kwargs: Any,
) -> Any:
    """IPython's ``display``, sending each object's bundle to the cell."""
    if display_id is True:
        display_id = _new_id()
    if not objs and display_id:  # an empty display, to be updated later
        objs, raw = ({},), True
    if clear:
        _clear_output(context, wait=True)
    for obj in objs:
        data, meta = (dict(obj), dict(metadata or {})) if raw else _formatted(obj, include, exclude, metadata)
        if data:
            _SHOWN.send(context, data, meta, display_id, bool(kwargs.get("update")), "" if raw else type(obj).__name__)
    return handle_class(display_id) if display_id and handle_class is not None else None


def _clear_output(context: api.RankContext, wait: bool = False) -> None:
    """IPython's ``clear_output``, for what this rank showed: its next displays replace those."""
    _SHOWN.clear(context, wait)


def _formatted(obj: Any, include: Any, exclude: Any, metadata: dict[str, Any] | None) -> tuple[dict[str, Any], ...]:
    data, meta = _formatter().format(obj, include=include, exclude=exclude)
    if metadata:
        meta = {**meta, **metadata}
    # A notebook stores images as base64 text; the formatters give bytes.
    return {key: _text(value) for key, value in data.items()}, meta


def _text(value: Any) -> Any:
    return base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value


@functools.lru_cache(maxsize=1)
def _own_formatter() -> Any:
    # deferred: start-up time (IPython)
    from IPython.core.formatters import DisplayFormatter

    return DisplayFormatter()


def _formatter() -> Any:
    """The rank's shell's formatter where a cell started one (``%time``), else one of our own; figures as PNG."""
    # deferred: start-up time (IPython)
    from IPython.core.interactiveshell import InteractiveShell

    shell: Any = InteractiveShell.instance() if InteractiveShell.initialized() else None
    formatter = shell.display_formatter if shell is not None else _own_formatter()
    png = formatter.formatters["image/png"]
    if not getattr(png, "_nbtrain_figures", False):
        png.for_type_by_name("matplotlib.figure", "Figure", _figure_png)
        png._nbtrain_figures = True
    return formatter


def _figure_png(figure: Any) -> bytes | None:
    # deferred: start-up time (IPython)
    from IPython.core.pylabtools import print_figure

    return print_figure(figure, "png", bbox_inches="tight")  # type: ignore[no-any-return]  # None: nothing drawn


_ids = itertools.count()


def _new_id() -> str:
    return f"auto-{next(_ids)}"


class _Shown:
    """What this rank showed: new displays counted, and those a clear lets the next ones replace."""

    def __init__(self) -> None:
        self.count = 0
        self.since_clear: list[str] = []  # slots shown since the last clear
        self.replaceable: list[str] = []  # slots shown before it, in order: the next displays update them
        self.noted: set[str] = set()  # why displays were printed as text, each said once

    def send(self, context: api.RankContext, data: dict[str, Any], meta: dict[str, Any], display_id: Any, update: bool,
             label: str) -> None:
        if display_id:
            slot = f"id-{display_id}"
        elif self.replaceable:
            slot, update = self.replaceable.pop(0), True
        else:
            slot, update = _new_id(), False
        if _size(data) > BUNDLE_BYTES:
            self._as_text(context, data, f"a display over {BUNDLE_BYTES >> 20} MiB is printed as its text")
            return
        if not update and self.count >= DISPLAYS_PER_RUN:
            self._as_text(
                context, data,
                f"showed {DISPLAYS_PER_RUN} displays in this run; the rest are printed as text. To redraw one "
                "display instead, call clear_output(wait=True) before each, or update a display(..., display_id=True)",
            )
            return
        self.count += not update
        if not display_id:
            self.since_clear.append(slot)
        _flush_streams()  # what the rank printed before it is shown before it, and nothing after it
        send = context.send_in_order or context.send
        send(events.Display(context.run_id, context.rank, data, meta, slot, update, label))

    def clear(self, context: api.RankContext, wait: bool) -> None:
        left, self.replaceable, self.since_clear = self.replaceable, self.since_clear, []
        for slot in left if wait else [*left, *self.replaceable]:  # wait=False: cleared now, not when replaced
            context.send(events.Display(context.run_id, context.rank, {"text/plain": ""}, {}, slot, update=True))

    def _as_text(self, context: api.RankContext, data: dict[str, Any], why: str) -> None:
        if why not in self.noted:
            self.noted.add(why)
            print(f"nbtrain: rank {context.rank}: {why}.", file=sys.stderr)
        print(data.get("text/plain", ""))


def _size(data: dict[str, Any]) -> int:
    return sum(len(value) for value in data.values() if isinstance(value, str))


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


_SHOWN = _Shown()
