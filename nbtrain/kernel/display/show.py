"""The small pieces a cell shows: text written to its streams, text updated in place, a
widget with a saved-notebook fallback, a Stop button.

Everything here goes through IPython's ``display`` (imported when first used, so a plain
``python`` caller never imports IPython's display machinery) and the shell module
(:mod:`nbtrain.kernel.shell`), the one owner of the IPython shell.

Example (outside a kernel, such as these doctests, nothing can show HTML or images):
    >>> frontend_is_rich()
    False
"""

from __future__ import annotations

import contextlib
import html
import sys
from typing import Any

from nbtrain.kernel import compat
from nbtrain.kernel import shell as kernel_shell


def frontend_is_rich() -> bool:
    """True inside a Jupyter kernel (it can show HTML and images); False in a terminal or plain python."""
    return kernel_shell.is_notebook(kernel_shell.get_shell())


def write_stream(stream_name: str, text: str) -> None:
    """Write ``text`` as it is to the cell's ``"stdout"`` or ``"stderr"``, at once (nothing for no text)."""
    if text:
        stream = sys.stderr if stream_name == "stderr" else sys.stdout
        stream.write(text)
        stream.flush()


def show_text(text: str, updatable: bool = False) -> Any:
    """Show ``text`` as the cell's display data; with ``updatable``, its handle for :func:`update_text`."""
    # deferred: start-up time (IPython)
    from IPython.display import display

    return display({"text/plain": text}, raw=True, display_id=updatable or None)


def update_text(shown: Any, text: str) -> None:
    """Replace what :func:`show_text` showed, wherever the display is (from any thread)."""
    with contextlib.suppress(Exception):  # the frontend is gone; the caller still knows the text
        shown.update({"text/plain": text}, raw=True)


def show_bundle(data: Any, metadata: Any, display_id: str, update: bool = False) -> None:
    """Show a formatted bundle (a rank's figure, a table) as display data.

    ``update``: replace the display shown with ``display_id`` instead.
    """
    # deferred: start-up time (IPython)
    from IPython.display import display

    with contextlib.suppress(Exception):  # the frontend is gone; the run goes on
        display(dict(data), raw=True, metadata=dict(metadata), display_id=display_id, update=update)


def enable_colab_widgets() -> None:
    """In Colab, turn on the widget manager that ipywidgets 8 needs there (elsewhere, and for ipywidgets 7: nothing)."""
    if "google.colab" not in sys.modules or not compat.needs_colab_widget_manager():
        return
    with contextlib.suppress(Exception):  # an older Colab: its own manager may still show core widgets
        from google.colab import output  # only exists in Colab

        output.enable_custom_widget_manager()


def stop_button(tooltip: str, summary: str, on_stop: Any) -> Any:
    """Show a Stop button (a core ``ipywidgets.Button``) calling ``on_stop()`` once; None without ipywidgets.

    ``summary`` is what a saved notebook shows in its place (see :func:`show_widget`).
    """
    try:
        # deferred: start-up time (ipywidgets)
        import ipywidgets
    except ImportError:
        return None
    button = ipywidgets.Button(description="Stop", button_style="danger", icon="stop", tooltip=tooltip)

    def on_click(_button: Any) -> None:
        _button.disabled = True
        _button.description = "Stopping…"
        on_stop()

    button.on_click(on_click)
    enable_colab_widgets()
    show_widget(button, summary)
    return button


def show_widget(widget: Any, summary: str) -> Any:
    """Display an ipywidget so that a frontend without its state shows ``summary``, not its repr.

    A live notebook renders the widget (its view mimetype ranks first); nbconvert, GitHub and
    nbviewer have no widget state and fall back to the bundle's text/html or text/plain,
    which ipywidgets fills with the Python repr (``VBox(children=(HTML(value=...``). Here
    that fallback is one line saying what was there.

    Example (outside a notebook IPython prints the bundle; a notebook shows the button):
        >>> import ipywidgets
        >>> show_widget(ipywidgets.Button(description="Stop"), "nbtrain: Stop button")  # doctest: +ELLIPSIS
        {'text/plain': 'nbtrain: Stop button', 'application/vnd.jupyter.widget-view+json': {...}, 'text/html': ...}
    """
    # deferred: start-up time (IPython)
    from IPython.display import display

    bundle = compat.widget_bundle(widget)
    bundle["text/plain"] = summary
    bundle["text/html"] = (
        '<div class="nbtrain-static" style="font-family:var(--jp-code-font-family,monospace);font-size:12px">'
        f"{html.escape(summary)}</div>"
    )
    shown = display(bundle, raw=True)
    compat.widget_shown(widget)
    return shown
