"""The small pieces a cell shows (nbtrain.kernel.display.show): rich or not, text updated in place,
a widget with its saved-notebook text, rank output lines.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-c"], "False None"),
        # No terminal title: IPython 7 writes its escape sequence on stdout even with -c.
        (["-m", "IPython", "--no-banner", "--no-term-title", "-c"], "False TerminalInteractiveShell"),
    ],
    ids=["python", "terminal-ipython"],
)
def test_plain_frontends_are_not_rich(argv, expected):
    code = (
        "import IPython; from nbtrain.kernel.display import frontend_is_rich; "
        "print(frontend_is_rich(), type(IPython.get_ipython()).__name__ if IPython.get_ipython() else None)"
    )
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    done = subprocess.run(
        [sys.executable, *argv, code], check=False, capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected


def test_in_a_kernel_text_is_updated_in_place_and_a_widget_saves_its_summary():
    with NotebookKernel() as kernel:
        assert kernel.value("__import__('nbtrain.kernel.display.show').kernel.display.show.frontend_is_rich()")
        out = kernel.run_ok(
            "from nbtrain.kernel.display import show\n"
            "shown = show.show_text('step 1', updatable=True)\nshow.update_text(shown, 'step 2')"
        )
        assert out.results == ["step 2"]  # one display, its text replaced
        widget = kernel.run_ok("import ipywidgets\nshow.show_widget(ipywidgets.Button(), 'nbtrain: a button')")
        assert widget.results == ["nbtrain: a button"]  # what a saved notebook shows, not the widget's repr
