"""What a cell writes as text (nbtrain.kernel.display.owntext): the summary, nbtrain's lines, the view's place.

The cell's output in a real Jupyter kernel (ipykernel, nbclient); the writers directly, on
this process's stdout and stderr. (Rank output: tests/test_display_rankoutput.py.)
"""

from __future__ import annotations

import types

import pytest

from nbtrain.kernel.cellrun import LastRun
from nbtrain.kernel.display import owntext
from nbtrain.messages import events

pytestmark = pytest.mark.timeout(240)


def test_output_modes_and_shell_magics_inside_the_cell(kernel):
    out = kernel.run_ok("%%distributed --devices 2 --output rank0\n%time z = 6 * 7\n!echo from-the-shell\nz + 1\n")
    assert out.stdout.count("from-the-shell") == 1 and "[rank" not in out.stdout and "Wall time" in out.stdout
    assert out.results == ["43"] and kernel.value("z") == 42
    quiet = kernel.run_ok("%%distributed --devices 2 --output none\nprint('hidden')\nq = 1\n")
    assert quiet.stdout == "" and kernel.value("q") == 1


def test_a_finished_cell_ends_with_its_summary_and_each_rank_tagged(kernel):
    cell = "%%distributed --devices 2 --accelerator cpu\nimport nbtrain\nprint('hi', nbtrain.rank())\nw = 1\n"
    out = kernel.run_ok(cell)
    assert "[rank 0] hi 0\n" in out.stdout and "[rank 1] hi 1\n" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("nbtrain: 2 ranks (cpu, ddp_notebook) finished in ")
    assert "Updated in the kernel: nbtrain, w." in out.stdout  # the names the cell bound


def test_nbtrains_own_lines_go_to_the_stream_they_name(capsys):
    owntext.print_line("nbtrain: a line")
    owntext.print_warning("nbtrain warning: a warning")
    owntext.write_text("(Pdb) ")
    assert capsys.readouterr() == ("nbtrain: a line\n(Pdb) ", "nbtrain warning: a warning\n")


def test_the_summary_says_what_ran_what_was_prepared_and_what_came_back():
    record = LastRun(state="finished", world_size=2, strategy="ddp_notebook", accelerator="cpu", seconds=3.04)
    record.prepared = [("model", "DistributedDataParallel"), ("opt", "bound"), ("loader", "sharded")]
    record.loaders = [("loader", "sharded over 2 ranks")]
    record.updated = ["model", "opt", "history"]
    assert owntext.summary(record) == (
        "nbtrain: 2 ranks (cpu, ddp_notebook) finished in 3.0 s. Auto-prepared: model (DistributedDataParallel). "
        "loader: sharded over 2 ranks. Updated in the kernel: model, opt, history."
    )
    record.stopped_at, record.state, record.log_path = 412, "stopped", "/logs/run.log"
    assert owntext.summary(record).startswith("nbtrain: 2 ranks (cpu, ddp_notebook) stopped at step 412 in 3.0 s.")
    assert owntext.summary(record).endswith(" Full output: /logs/run.log")


def test_the_first_frame_waits_until_the_ranks_run(capsys):
    """Drawn at the launch it took a core from ranks just starting; the first event past their start draws it."""
    view = owntext.CellView(types.SimpleNamespace(config=None, result_arrived=False))
    view.show(events.RankStarted(1, 0, 101))
    view.show(events.RankStarted(1, 1, 102))
    assert view.view.frames == 0 and capsys.readouterr().out == ""
    view.show(events.Output(1, 0, "stdout", "first line\n"))
    assert view.view.frames == 1 and "nbtrain" in capsys.readouterr().out


def test_the_step_total_is_read_once_just_before_the_first_frame(capsys):
    """Reading the cell's loops and loaders (about 1 ms) waits until the ranks have started."""
    counted: list[int] = []
    view = owntext.CellView(types.SimpleNamespace(config=None, result_arrived=False), lambda: counted.append(40) or 40)
    view.show(events.RankStarted(1, 0, 101))
    assert counted == [] and view.view.state.total_steps is None
    view.show(events.Output(1, 0, "stdout", "first line\n"))
    view.show(None)
    view.finish("finished")
    assert counted == [40] and view.view.state.total_steps == 40
    assert "/40" in capsys.readouterr().out


def test_the_last_frames_chart_is_drawn_once_every_rank_is_done_not_after_their_exits(capsys):
    run = types.SimpleNamespace(config=None, result_arrived=False)
    view = owntext.CellView(run)
    view.view.rich = True  # a notebook's frontend; the charts are drawn only there
    view.show(events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}),)))
    assert view.view.chart_renders == 0  # a run's first second shows no chart
    run.result_arrived = True  # rank 0's result is in the kernel: the ranks exit now
    view.show(None)
    assert view.view.chart_renders == 1
    view.show(events.RankExited(1, 0, 0, None, reported=True))
    view.finish("finished")
    assert view.view.chart_renders == 1


def test_the_live_view_stays_above_the_ranks_first_line(kernel):
    kernel.run_ok("%%distributed --devices 2 --accelerator cpu\nprint('first line')\n")
    outputs = kernel.notebook.cells[-1].outputs
    view = [i for i, o in enumerate(outputs) if o.get("data", {}).get("text/plain", "").startswith("nbtrain · ")]
    printed = [i for i, o in enumerate(outputs) if o["output_type"] == "stream" and "first line" in o["text"]]
    assert view and printed and view[0] < printed[0], [o["output_type"] for o in outputs]
