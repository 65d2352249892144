"""What a rank shows with IPython's display, in a real kernel: figures, tables, redraws.

Outside a kernel, ``display`` prints and ``clear_output`` prints terminal escapes; on a rank
(nbtrain.rank.machinery.rankdisplay) they reach the cell as the kernel's own would. Checked through the
cell's saved outputs (nbclient applies display updates to them as a frontend does).
"""

from __future__ import annotations

import base64

import pytest

from helpers import procs
from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _outputs(kernel: NotebookKernel, cell: str) -> list[dict]:
    out = kernel.run(cell)
    assert out.error is None, out.text
    return [dict(output) for output in kernel.notebook.cells[-1].outputs]


def _figures(outputs: list[dict]) -> list[bytes]:
    shown = [output["data"]["image/png"] for output in outputs if "image/png" in output.get("data", {})]
    return [base64.b64decode(png) for png in shown]


def _stdout(outputs: list[dict]) -> str:
    return "".join(output["text"] for output in outputs if output.get("name") == "stdout")


def test_plt_show_on_each_rank_shows_its_figure_under_its_rank(kernel):
    outputs = _outputs(
        kernel,
        "%%distributed --devices 2 --accelerator cpu\n"
        "import matplotlib.pyplot as plt, nbtrain\n"
        "print('before', nbtrain.rank())\n"
        "plt.plot([1, 2, 3], [3, 1, 2 + nbtrain.rank()])\n"
        "plt.show()\n",
    )
    figures = _figures(outputs)
    assert len(figures) == 2 and all(png.startswith(PNG) for png in figures), outputs
    assert figures[0] != figures[1]  # each rank's own plot
    text = _stdout(outputs)
    assert "Figure(" not in text and "[rank 0] Figure:" in text and "[rank 1] Figure:" in text
    # What a rank printed before its display comes before it in the cell.
    for rank in (0, 1):
        before = next(i for i, o in enumerate(outputs) if f"[rank {rank}] before" in o.get("text", ""))
        label = next(i for i, o in enumerate(outputs) if f"[rank {rank}] Figure:" in o.get("text", ""))
        assert before <= label, outputs


def test_a_figure_left_open_is_shown_at_the_cells_end_and_rank0_mode_shows_only_rank_0s(kernel):
    outputs = _outputs(
        kernel,
        "%%distributed --devices 2 --accelerator cpu --output rank0\n"
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\n"
        "ax.plot([0, 1], [1, 0])\n",
    )
    assert len(_figures(outputs)) == 1 and "[rank" not in _stdout(outputs), outputs
    assert kernel.value("plt.get_fignums()") == []  # the ranks' figures are theirs: none open in the kernel


def test_a_loop_that_clears_and_redraws_shows_one_display_per_rank_holding_the_last(kernel):
    outputs = _outputs(
        kernel,
        "%%distributed --devices 2 --accelerator cpu\n"
        "from IPython.display import clear_output, display, HTML\n"
        "import nbtrain\n"
        "for epoch in range(5):\n"
        "    clear_output(wait=True)\n"
        "    display(HTML(f'<b>epoch {epoch} of rank {nbtrain.rank()}</b>'))\n",
    )
    html = [output["data"]["text/html"] for output in outputs if "text/html" in output.get("data", {})]
    shown = [text for text in html if "nbtrain-live" not in text]  # not the run's live view
    assert sorted(shown) == ["<b>epoch 4 of rank 0</b>", "<b>epoch 4 of rank 1</b>"], outputs
    assert "\x1b" not in _stdout(outputs)  # no terminal escapes
    # The cell bound display and clear_output: the kernel has IPython's own back.
    assert kernel.value("display.__module__.startswith('IPython') and clear_output.__module__.startswith('IPython')")
    assert kernel.value("type(display).__name__ == 'function' and not hasattr(display, '_nbtrain')")


def test_a_display_handle_updates_in_place_and_plain_values_read_as_tagged_lines(kernel):
    outputs = _outputs(
        kernel,
        "%%distributed --devices 2 --accelerator cpu\n"
        "from IPython.display import display, Markdown\n"
        "import nbtrain\n"
        "handle = display(Markdown('starting'), display_id=True)\n"
        "display({'rank': nbtrain.rank()})\n"
        "handle.update(Markdown(f'done on {nbtrain.rank()}'))\n",
    )
    markdown = sorted(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    assert markdown == ["done on 0", "done on 1"], outputs
    plain = [output["data"]["text/plain"] for output in outputs if set(output.get("data", {})) == {"text/plain"}]
    assert sorted(plain) == ["[rank 0] {'rank': 0}", "[rank 1] {'rank': 1}"], outputs


def test_one_rank_shows_its_display_untagged_between_what_it_printed(kernel):
    outputs = _outputs(
        kernel,
        "%%distributed --devices 1 --accelerator cpu\n"
        "import matplotlib.pyplot as plt\n"
        "print('first', end='')\n"
        "plt.plot([1, 2])\n"
        "plt.show()\n"
        "print('second')\n",
    )
    kinds = [("png" if "image/png" in o.get("data", {}) else o.get("text", "")) for o in outputs]
    first, figure = kinds.index("first"), kinds.index("png")
    second = next(i for i, kind in enumerate(kinds) if kind.startswith("second"))
    assert first < figure < second, kinds
    assert "".join(kinds[first:figure]) == "first\n"  # the line it left open ends above the figure


def test_a_background_runs_view_shows_a_displays_text(kernel):
    _outputs(
        kernel,
        "%%distributed --devices 2 --accelerator cpu --background\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2])\n"
        "plt.show()\n",
    )
    started = kernel.notebook.cells[-1]
    kernel.run_ok("import nbtrain\nnbtrain.runs()[-1].wait(timeout=120)")  # the view's last update comes before
    shown = [o.get("data", {}) for o in started.outputs]  # as the updates left them
    view = next(data["text/html"] for data in shown if "nbtrain-live" in data.get("text/html", ""))
    assert "&lt;Figure size" in view and "Figure(" not in view, view  # in each rank's log tail


@pytest.mark.parametrize("magic", ["inline", "agg"])
def test_matplotlib_magic_in_a_cell_shows_the_ranks_figures_inline(kernel, magic):
    outputs = _outputs(
        kernel,
        f"%%distributed --devices 2 --accelerator cpu\n%matplotlib {magic}\nimport matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3])\n",
    )
    assert len(_figures(outputs)) == 2, outputs
    noted = "[rank 0] nbtrain: the ranks show figures as images in the cell (inline), not with %matplotlib agg"
    assert (noted in "".join(o.get("text", "") for o in outputs)) == (magic == "agg"), outputs


def test_watch_shows_each_ranks_figure_below_its_view(kernel):
    outputs = _outputs(
        kernel,
        "import nbtrain\nfrom nbtrain.kernel.display import watch\n"
        "def draw():\n    import matplotlib.pyplot as plt\n    plt.plot([1, 2, 1 + nbtrain.rank()])\n    plt.show()\n"
        "watch(nbtrain.start(draw, devices=2, accelerator='cpu'))\n",
    )
    assert len(_figures(outputs)) == 2, outputs


def test_in_plain_python_a_ranks_display_prints_its_text_as_a_tagged_line():
    code = (
        "import nbtrain\nfrom nbtrain.kernel.display import watch\n"
        "def show():\n    from IPython.display import display\n    display({'rank': nbtrain.rank()})\n"
        "watch(nbtrain.start(show, devices=2, accelerator='cpu'))\n"
        "nbtrain.launch(show, devices=2, accelerator='cpu')\n"
    )
    out = procs.python_output(code)
    lines = out.splitlines()
    for rank in (0, 1):
        assert lines.count(f"[rank {rank}] {{'rank': {rank}}}") == 2, out  # watch(), then launch()


def test_past_its_display_limit_a_rank_prints_the_rest_as_text_and_says_so_once(kernel):
    from nbtrain.rank.machinery.rankdisplay import DISPLAYS_PER_RUN

    outputs = _outputs(
        kernel,
        "%%distributed --devices 1 --accelerator cpu\n"
        "from IPython.display import HTML, display\n"
        f"for i in range({DISPLAYS_PER_RUN + 3}):\n"
        "    display(HTML(f'<i>{i}</i>'))\n",
    )
    html = [o["data"]["text/html"] for o in outputs if "<i>" in o.get("data", {}).get("text/html", "")]
    assert html == [f"<i>{i}</i>" for i in range(DISPLAYS_PER_RUN)]
    text = "".join(o.get("text", "") for o in outputs)
    assert text.count(f"showed {DISPLAYS_PER_RUN} displays in this run") == 1, text
    assert text.count("<IPython.core.display.HTML object>") == 3, text


def test_a_display_in_a_dataloader_worker_prints_its_text_and_leaves_the_ranks_channel_alone(kernel):
    outputs = _outputs(
        kernel,
        "%%distributed --devices 2 --accelerator cpu\n"
        "import torch\n"
        "from IPython.display import HTML, display\n"
        "class Shown(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n"
        "        if i == 0:\n            display('from a worker')\n"
        "        return torch.tensor([float(i)])\n"
        "total = sum(float(b.sum()) for b in torch.utils.data.DataLoader(Shown(), batch_size=2, num_workers=1))\n"
        "display(HTML('<b>after the loader</b>'))\n",
    )
    text = _stdout(outputs)
    assert "[rank 0] from a worker" in text and "[rank 1] from a worker" in text, outputs  # printed, as outside a run
    shown = [o["data"]["text/html"] for o in outputs if "after the loader" in o.get("data", {}).get("text/html", "")]
    assert len(shown) == 2, outputs  # each rank's channel still carries its own displays
    assert kernel.value("total") == 6.0
