"""A rank's output in the cell (nbtrain.kernel.display.rankoutput): tagged lines, progress bars, modes.

The printer directly, on this process's stdout and stderr; two ranks' tqdm bars in a real
Jupyter kernel (ipykernel, nbclient).
"""

from __future__ import annotations

import pytest

from nbtrain.kernel.display import rankoutput
from nbtrain.messages import events

pytestmark = pytest.mark.timeout(240)


def test_each_output_mode_shows_whose_lines_it_says(capsys):
    streams = ("stdout", "stderr")
    lines = [events.Output(1, rank, stream, f"{stream} of {rank}\n") for rank in (0, 1) for stream in streams]
    for mode in ("all", "rank0", "none"):
        printer = rankoutput.OutputPrinter(mode, world_size=2)
        for line in [*lines, events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}),))]:
            printer(line)
    out, err = capsys.readouterr()
    assert out == "[rank 0] stdout of 0\n[rank 1] stdout of 1\nstdout of 0\n"
    assert err == "[rank 0] stderr of 0\n[rank 1] stderr of 1\nstderr of 0\n"
    rankoutput.OutputPrinter("all", world_size=1)(lines[0])  # one rank: nothing to tell apart
    assert capsys.readouterr().out == "stdout of 0\n"


def test_progress_bars_of_two_ranks_keep_to_their_own_lines(capsys):
    printer = rankoutput.OutputPrinter("all", world_size=2)
    bars = [(0, "\rbar 1/3"), (1, "\rbar 1/3"), (0, "\rbar 2/3"), (1, "\rbar 2"), (1, "/3"), (0, "\rbar 3/3\n"),
            (1, "\rbar 3/3\n"), (1, "\rleft at 1/2")]
    for rank, text in bars:
        printer(events.Output(1, rank, "stderr", text))
    assert capsys.readouterr().err == "[rank 0] bar 1/3\r[rank 0] bar 2/3\r[rank 0] bar 3/3\n[rank 1] bar 3/3\n"
    printer.finish()  # the run ended with rank 1's bar mid-line: its last state shows
    assert capsys.readouterr().err == "[rank 1] left at 1/2\n"


def test_a_line_another_rank_left_open_is_ended_before_a_rank_writes(capsys):
    printer = rankoutput.OutputPrinter("all", world_size=2)
    for rank, text in ((1, "loading..."), (0, "step 1\n"), (1, "\n"), (1, "done\n"), (0, "a\r\nb\n")):
        printer(events.Output(1, rank, "stdout", text))
    assert capsys.readouterr().out == "[rank 1] loading...\n[rank 0] step 1\n[rank 1] done\n[rank 0] a\r\n[rank 0] b\n"


def test_a_bar_whose_line_another_rank_ended_is_not_shown_twice_at_its_close(capsys):
    """Rank 0's bar reached 40/40 and rank 1's ended line cut it: tqdm's close redraws the same
    state (another rate), which is not shown again; a bar cut part-way shows its end below."""
    printer = rankoutput.OutputPrinter("all", world_size=2)
    for rank, text in (
        (0, "\repoch 0: 50%| 20/40 [00:00<00:00, 9.0it/s]"),
        (0, "\repoch 0: 100%| 40/40 [00:00<00:00, 10.0it/s]"),
        (1, "\repoch 0: 100%| 40/40 [00:00<00:00, 8.0it/s]\n"),
        (0, "\repoch 0: 100%| 40/40 [00:01<00:00, 9.5it/s]"),
        (0, "\n"),
        (0, "\repoch 1: 50%| 20/40 [00:00<00:00, 9.0it/s]"),
        (1, "\repoch 1: 100%| 40/40 [00:00<00:00, 8.0it/s]\n"),
        (0, "\repoch 1: 100%| 40/40 [00:01<00:00, 9.5it/s]\n"),
    ):
        printer(events.Output(1, rank, "stderr", text))
    assert capsys.readouterr().err == (
        "[rank 0] epoch 0: 50%| 20/40 [00:00<00:00, 9.0it/s]\r[rank 0] epoch 0: 100%| 40/40 [00:00<00:00, 10.0it/s]\n"
        "[rank 1] epoch 0: 100%| 40/40 [00:00<00:00, 8.0it/s]\n"
        "[rank 0] epoch 1: 50%| 20/40 [00:00<00:00, 9.0it/s]\n"
        "[rank 1] epoch 1: 100%| 40/40 [00:00<00:00, 8.0it/s]\n"
        "[rank 0] epoch 1: 100%| 40/40 [00:01<00:00, 9.5it/s]\n"
    )


def test_a_bar_that_clears_itself_at_its_close_leaves_no_tag_behind(capsys):
    """tqdm's ``leave=False``: its close redraws the line with spaces, then returns to its start.
    In the kernel nothing is left; here neither a lone ``[rank 0]`` nor an empty line."""
    printer = rankoutput.OutputPrinter("all", world_size=2)
    close = "\r" + " " * 12 + "\r"
    for rank, text in ((0, "\rbar 1/2"), (0, "\rbar 2/2"), (0, close), (0, "epoch 0\n"), (0, "\rbar 1/2"), (0, close),
                       (1, "rank 1 here\n"), (0, "\rbar 2/2"), (0, close)):
        printer(events.Output(1, rank, "stderr", text))
    printer.finish()
    blank = "\r" + " " * len("[rank 0] bar 2/2") + "\r"
    blank_first = "\r" + " " * len("[rank 0] bar 1/2") + "\r"
    assert capsys.readouterr().err == (
        "[rank 0] bar 1/2\r[rank 0] bar 2/2" + blank + "[rank 0] epoch 0\n"
        "[rank 0] bar 1/2" + blank_first + "[rank 1] rank 1 here\n[rank 0] bar 2/2" + blank
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_end_of_a_run_ends_a_line_a_rank_left_open(capsys, world_size):
    printer = rankoutput.OutputPrinter("all", world_size)
    printer(events.Output(1, 0, "stdout", "a\nleft open"))
    printer(events.Output(1, 0, "stderr", "\rbar 3/3"))
    printer.finish()
    printer.finish()  # once: a second call has nothing left to end
    tag = "[rank 0] " if world_size > 1 else ""
    assert capsys.readouterr() == (f"{tag}a\n{tag}left open\n", f"{tag}bar 3/3\n" if tag else "\rbar 3/3\n")


def test_two_ranks_tqdm_bars_in_a_real_cell_show_each_rank_on_its_own_lines(kernel):
    pytest.importorskip("tqdm")  # in the test extra; not among the Colab stack's pins (.ci/colab-test)
    cell = (
        "%%distributed --devices 2 --accelerator cpu\n"
        "from tqdm import tqdm\n"
        "for epoch in range(2):\n"
        "    for _ in tqdm(range(40), desc=f'epoch {epoch}', mininterval=0):\n"
        "        pass\n"
    )
    err = kernel.run_ok(cell).stderr
    shown = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]  # what a frontend shows of each line
    assert all(line.count("[rank") <= 1 for line in shown), shown
    for rank in (0, 1):
        ends = [line for line in shown if line.startswith(f"[rank {rank}] epoch") and "40/40" in line]
        assert [line.split(":")[0] for line in ends] == [f"[rank {rank}] epoch 0", f"[rank {rank}] epoch 1"], shown
    assert err.count("[rank 1]") == 2, err  # rank 1's redraws: only each bar's end
