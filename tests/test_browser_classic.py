"""nbtrain's widgets in classic Notebook 6.5 with ipywidgets 7.7, seen by a real browser.

Colab and Kaggle pin that widget generation (ipywidgets 7.7.1, widgetsnbextension 3.6.10,
notebook 6.5.7); their own front ends cannot run here, and classic Notebook is the open
front end closest to them. The test starts ``jupyter notebook`` (Notebook 6) of the Colab
environment that ``.ci/colab-env`` builds, opens a notebook in Debian's Chromium through
Playwright (never a downloaded browser) and, as a user would:

- shows the launcher form, moves its processes slider from 2 to 3 with the keyboard, and
  runs a ``%%distributed`` cell without flags: it runs on 3 ranks;
- starts a ``--background`` run and clicks its Stop button: the view says "stopped at step N" and
  the ranks are gone.

Screenshots go to ``test-artifacts/browser/widgets_in_classic_notebook-classic/``. Runs
where Notebook 6 is installed (``.venv-colab``; ``.ci/test`` runs it there); in an
environment with Notebook 7 it is skipped, saying so.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

import browser_helpers as bh
from browser_helpers import KERNEL_READY_MS, RUN_MS, UI_TIMEOUT_MS, Session

try:
    import notebook.notebookapp  # noqa: F401 - Notebook 6 only (Notebook 7 has no such module)
except ImportError:
    pytest.skip(
        "classic Notebook 6.5 is not installed here: this test runs in the Colab environment "
        "(bash .ci/colab-env builds .venv-colab; .ci/test runs the test there)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANKS_GONE_SECONDS = 10.0
SETUP_CELL = "%load_ext nbtrain\nimport sys, nbtrain\nprint(sys.executable)"
FORM_CELL = 'form = nbtrain.launcher()\nform.accelerator.value = "cpu"'
WORLD_CELL = "%%distributed\nimport torch.distributed as dist\nprint('world size', dist.get_world_size())"
STOPPED_AT_A_STEP = re.compile(r"^stopped at step \d+$")  # the status line's state after the Stop button
BACKGROUND_CELL = """%%distributed --devices 2 --accelerator cpu --background
import time
import torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8)
for step in range(6000):  # ten minutes: still running when Stop is clicked
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.1)
"""


def _run_cell(session: Session, cell: Any) -> None:
    """Select the cell and press Shift+Enter, as a user runs one cell."""
    cell.locator(".input_area").click()
    session.page.keyboard.press("Shift+Enter")


def _output(cell: Any) -> Any:
    return cell.locator(".output_area").first


@pytest.mark.parametrize("session", ["classic"], indirect=True)
def test_widgets_in_classic_notebook(session: Session) -> None:
    notebook = session.open_notebook("colab.ipynb", [SETUP_CELL, FORM_CELL, WORLD_CELL, BACKGROUND_CELL])
    cells = notebook.locator(".cell")
    setup, form_cell, world, train = (cells.nth(index) for index in range(4))
    _run_cell(session, setup)
    _output(setup).wait_for(timeout=KERNEL_READY_MS)
    assert str(Path(sys.executable).parent) in _output(setup).inner_text(), "the kernel is not this venv's python"

    # The form renders as widgets (not their repr), on 2 processes.
    _run_cell(session, form_cell)
    form = form_cell.locator(".widget-vbox").first
    form.wait_for(timeout=RUN_MS)
    form.get_by_text("nbtrain launcher").wait_for()
    form.get_by_text("--devices 2 --accelerator cpu").wait_for()
    assert "VBox(" not in form_cell.inner_text(), form_cell.inner_text()
    form_cell.scroll_into_view_if_needed()
    session.screenshot("01-form.png")

    # One step of the slider with the keyboard: 3 processes, shown at once in the form's line.
    form.locator(".ui-slider-handle").first.focus()
    session.page.keyboard.press("ArrowRight")
    form.get_by_text("%%distributed --devices 3 --accelerator cpu").wait_for()
    session.screenshot("02-form-set.png")

    # The next cell, without flags, runs on what the form set.
    _run_cell(session, world)
    world.get_by_text("[rank 2] world size 3").wait_for(timeout=RUN_MS)
    world.get_by_text("nbtrain: 3 ranks (cpu, ddp_notebook) finished in").wait_for(timeout=RUN_MS)
    session.wait_idle(RUN_MS)
    world.scroll_into_view_if_needed()
    session.screenshot("03-next-cell.png")

    _stop_a_background_run(session, train)


def _stop_a_background_run(session: Session, train: Any) -> None:
    _run_cell(session, train)
    live = train.locator(".nbtrain-live")
    live.get_by_text("running", exact=True).wait_for(timeout=RUN_MS)
    session.wait_idle(UI_TIMEOUT_MS)  # the cell returned at once; the run goes on
    stop = train.get_by_role("button", name="Stop")
    stop.wait_for(state="visible")
    ranks = session.ranks()
    assert len(ranks) == 2, f"expected the 2 ranks of the run under the kernel's launcher, found {ranks}"
    session.lab.remember_tree()
    train.scroll_into_view_if_needed()
    session.screenshot("04-background-running.png")

    stop.click()  # every rank ends at one optimizer step and the kernel gets the state there
    live.get_by_text(STOPPED_AT_A_STEP).wait_for(timeout=RUN_MS)
    stop.wait_for(state="hidden")  # the button goes once the run ended
    session.screenshot("05-stopped.png")
    status = re.compile(r"nbtrain · ddp_notebook · cpu · 2 ranks · stopped at step \d+ · ")
    assert status.search(live.inner_text()), live.inner_text()
    left = bh.wait_gone(ranks, RANKS_GONE_SECONDS)
    assert not left, f"ranks still alive after the view said stopped: {[bh.describe(pid) for pid in left]}"
