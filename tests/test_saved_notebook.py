"""A saved notebook, read where widgets cannot run (nbconvert, GitHub, nbviewer).

A real kernel executes a notebook with the launcher form and a background run (nbclient,
without storing widget state, as JupyterLab saves by default); nbconvert then renders it
to HTML. Where a widget stood, the page must say what it was in one line, never show its
Python repr (``VBox(children=(HTML(value=...``, ``Button(button_style='danger', ...``).
"""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from kernel_helpers import STARTUP_SECONDS

pytestmark = pytest.mark.timeout(240)

CELLS = [
    "%load_ext nbtrain\nimport nbtrain\nnbtrain.set_defaults(devices=2, accelerator='cpu')",
    "nbtrain.launcher()",
    ("%%distributed --background\nimport time\nfor step in range(20):\n    nbtrain.log(loss=1 / (step + 1))\n"
    "    time.sleep(0.05)\n"),
    "print(nbtrain.runs()[-1].wait(timeout=120) is None)",
]


def test_nbconvert_html_shows_a_line_for_each_widget_and_no_widget_code(tmp_path):
    from nbconvert import HTMLExporter

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(
        notebook, timeout=120, startup_timeout=int(STARTUP_SECONDS), kernel_name="python3", store_widget_state=False
    )
    client.execute(cwd=str(tmp_path))  # starts the kernel and shuts it down
    errors = [o for cell in notebook.cells for o in cell.outputs if o["output_type"] == "error"]
    assert not errors, errors
    assert "widgets" not in notebook.metadata  # no widget state: what GitHub and nbviewer get

    page, _ = HTMLExporter().from_notebook_node(notebook)
    (tmp_path / "saved.html").write_text(page)
    for repr_text in ("VBox(", "HBox(", "Button(", "Dropdown(", "IntSlider("):
        assert repr_text not in page, f"{repr_text!r} (a widget's repr) is in the saved page"
    assert "nbtrain launcher: 2 x cpu, ddp_notebook, no timeout" in page
    assert "the Stop button of background run" in page
    assert "finished" in page  # the background run's final frame stayed in the notebook
