"""Everything a cell shows: the one owner of displays and widgets in the kernel.

- :mod:`~nbtrain.kernel.display.live`: a run's live view (status, progress, charts, log
  tails), ``watch(run)``, and the noted view a background run shows;
- :mod:`~nbtrain.kernel.display.livetext`: the live view's words (status, progress, metric lines);
- :mod:`~nbtrain.kernel.display.chart`: the live view's charts drawn as one PNG (matplotlib),
  as :mod:`~nbtrain.kernel.display.chartlayout` lays them out (without matplotlib);
- :mod:`~nbtrain.kernel.display.form`: the launcher form (``nbtrain.launcher()``, ipywidgets);
- :mod:`~nbtrain.kernel.display.show`: the small pieces: text updated in place, a widget
  with a saved-notebook fallback, a Stop button;
- :mod:`~nbtrain.kernel.display.rankoutput`: a rank's output as the cell shows it, lines and
  displays, as ``--output`` chose (:class:`OutputPrinter`: a ``%%distributed`` cell's,
  ``launch``'s, a background run's, ``watch()``'s);
- :mod:`~nbtrain.kernel.display.owntext`: what a cell writes as text: a cell's live view and
  summary, and every line of nbtrain's own that the kernel side writes (:func:`print_line`,
  :func:`print_warning`, :func:`write_text`).

Other modules ask this package (``from nbtrain.kernel import display``) and never call
IPython's ``display`` themselves, nor write to the cell's stdout or stderr. Importing it
imports neither torch, matplotlib nor ipywidgets: each is imported when first drawn or shown.

Example (in a notebook cell):
    >>> import nbtrain
    >>> from nbtrain.kernel import display
    >>> def train():
    ...     for step in range(100):
    ...         nbtrain.log(loss=1.0 / (step + 1))
    >>> display.watch(nbtrain.start(train, devices=2, accelerator="cpu"), total_steps=100)  # doctest: +ELLIPSIS
    [nbtrain] starting ...
    nbtrain · ddp_notebook · cpu · 2 ranks · finished ...
    step 100/100 [####################] 100%
    ...
"""

from __future__ import annotations

from nbtrain.kernel.display.form import LauncherForm, show_launcher_form
from nbtrain.kernel.display.live import LiveView, NotedLiveView, watch
from nbtrain.kernel.display.owntext import print_line, print_warning, write_text
from nbtrain.kernel.display.rankoutput import OutputPrinter, stall_text, waiting_text
from nbtrain.kernel.display.show import frontend_is_rich, show_text, stop_button, update_text

__all__ = [
    "LauncherForm", "LiveView", "NotedLiveView", "OutputPrinter", "frontend_is_rich", "print_line", "print_warning",
    "show_launcher_form", "show_text", "stall_text", "stop_button", "update_text", "waiting_text", "watch",
    "write_text",
]
