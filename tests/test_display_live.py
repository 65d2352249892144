"""The live view (nbtrain.kernel.display.live) in a real Jupyter kernel, a terminal and plain python.

Kernels are started by nbclient / jupyter_client and shut down through them; every wait
has a bound. The drawing itself is checked directly on views fed with event records.
"""

from __future__ import annotations

import base64
import json
import math
import queue
import re
import subprocess
import sys
import time

import nbformat
import psutil
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from nbtrain import livestate
from nbtrain.kernel import display
from nbtrain.kernel.display import LiveView
from nbtrain.messages import events

KERNEL_START_SECONDS = 60
RUN = 1
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TRAIN_SOURCE = """
import nbtrain
from nbtrain.kernel.display import watch

def train(steps):
    import time
    for step in range(steps):
        nbtrain.log(loss=1.0 / (step + 1) + 0.01 * nbtrain.rank(), lr=0.1)
        if step % 20 == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.05)
    return "done"
"""
# The charts' modules imported before the run: a cold import of matplotlib in the kernel takes
# seconds on a loaded machine and holds the first frame with a chart, which the frame-pace and
# progress tests below (runs of a few seconds) would count against the live view.
WARM_CHARTS = "\nimport matplotlib.figure, matplotlib.backends.backend_agg\n"


class RecordingClient(NotebookClient):
    """nbclient, also noting each iopub message's type, display id and kernel-side time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages: list[tuple[str, str | None, float, dict]] = []
        self.by_cell: dict[int, list[tuple[str, str | None, float, dict]]] = {}

    def process_message(self, msg, cell, cell_index):
        transient = msg["content"].get("transient") or {}
        sent_at = msg["header"]["date"].timestamp()
        # Before nbclient handles it: it renames update_display_data in place.
        record = (msg["msg_type"], transient.get("display_id"), sent_at, msg["content"])
        self.messages.append(record)
        self.by_cell.setdefault(cell_index, []).append(record)
        return super().process_message(msg, cell, cell_index)

    def view_frames(self, cell_index: int) -> list[dict]:
        """The data of each frame of the live view a cell showed, in order: first display, then updates."""
        messages = self.by_cell.get(cell_index, [])
        views = [
            (display_id, content)
            for kind, display_id, _, content in messages
            if kind == "display_data" and content["data"].get("text/plain", "").startswith("nbtrain · ")
        ]
        assert len(views) == 1 and views[0][0], f"cell {cell_index} shows one live view with a display id"
        view_id = views[0][0]
        updates = [c["data"] for kind, did, _, c in messages if kind == "update_display_data" and did == view_id]
        return [views[0][1]["data"], *updates]


def frame_png(html: str) -> bytes:
    match = re.search(r'<img src="data:image/png;base64,([^"]+)"', html)
    assert match, "the frame has no PNG"
    return base64.b64decode(match.group(1))


# --- in a Jupyter kernel -----------------------------------------------------------------


def test_kernel_view_updates_by_display_id_and_keeps_the_final_frame(tmp_path):
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(TRAIN_SOURCE + WARM_CHARTS),
            nbformat.v4.new_code_cell(
                'watch(nbtrain.start(train, (100,), devices=2, accelerator="cpu"), total_steps=100)'
            ),
        ]
    )
    client = RecordingClient(notebook, timeout=120, startup_timeout=KERNEL_START_SECONDS, kernel_name="python3")
    client.execute(cwd=str(tmp_path))  # starts the kernel and shuts it down, also on failure

    kinds = [kind for kind, *_ in client.messages]
    assert "clear_output" not in kinds and not any(kind.startswith("comm") for kind in kinds)
    shown = [(display_id, t) for kind, display_id, t, _ in client.messages if kind == "display_data"]
    assert len(shown) == 1 and shown[0][0], "one display, with a display id"
    display_id, first_shown_at = shown[0]
    updates = [
        (t, content) for kind, did, t, content in client.messages if kind == "update_display_data" and did == display_id
    ]
    assert len(updates) >= 5
    span = updates[-1][0] - first_shown_at
    rate = len(updates) / span
    assert 1.0 <= rate <= 5.0, f"{len(updates)} updates in {span:.1f} s"
    states_seen = {
        re.search(r"· (starting|running|finished) ·", frame["data"]["text/plain"]).group(1) for _, frame in updates
    }
    assert states_seen >= {"running", "finished"}

    (frame, result) = notebook.cells[1].outputs
    assert result["data"]["text/plain"] == "'done'"
    text, html = frame["data"]["text/plain"], frame["data"]["text/html"]
    assert "finished" in text.splitlines()[0] and "2 ranks" in text
    assert "step 100/100" in text and "loss  rank 0: 0.01  rank 1: 0.02  mean: 0.015" in text
    assert "memory (host RSS)  rank 0:" in text
    assert ">finished</b>" in html and "rank 1 output: 5 lines" in html and "step 80" in html
    assert frame_png(html).startswith(PNG_MAGIC)
    saved = nbformat.writes(notebook)
    assert len(saved) < 200_000  # the last frame only: no history of updates piles up


# 200 samples on 2 ranks: 100 a rank, 7 batches of 16 (len(loader) in the kernel is 13).
PROGRESS_SETUP = """
%load_ext nbtrain
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(200, 8)
loader = DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=16, shuffle=True)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.MSELoss()
epochs = 3
""" + WARM_CHARTS
PROGRESS_CELL = """%%distributed --devices 2 --accelerator cpu
import time
for epoch in range(epochs):
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.15)  # a few seconds of training, so the frames show it under way
"""
EXPECTED_TOTAL = 3 * 7
# The same training, but a break the code cannot rule out: the total is not certain.
UNCERTAIN_CELL = PROGRESS_CELL.replace(
    "        time.sleep", "        if loss.item() < 0:\n            break\n        time.sleep"
)
PROGRESS_LINE = re.compile(r"^step (\d+)/(\d+) \[[#-]{20}\] (\d+)%(?: · ETA (\S+ ?s|[\d:]+))?$")


@pytest.fixture(scope="module")
def progress_notebook(tmp_path_factory):
    """One kernel runs the setup, a cell whose total is known, and one whose total is not."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in (PROGRESS_SETUP, PROGRESS_CELL, UNCERTAIN_CELL)]
    )
    client = RecordingClient(notebook, timeout=120, startup_timeout=KERNEL_START_SECONDS, kernel_name="python3")
    client.execute(cwd=str(tmp_path_factory.mktemp("progress")))  # starts the kernel and shuts it down
    for index, cell in enumerate(notebook.cells):
        errors = [o for o in cell.outputs if o["output_type"] == "error"]
        assert not errors, f"cell {index} failed: {errors}"
    return client


def test_a_distributed_cell_shows_its_total_and_eta_inferred_from_the_loops(progress_notebook):
    frames = progress_notebook.view_frames(1)
    progress = [frame["text/plain"].splitlines()[1] for frame in frames]
    running = [
        PROGRESS_LINE.match(line)
        for frame, line in zip(frames, progress, strict=False)
        if "· running ·" in frame["text/plain"].splitlines()[0]
    ]
    under_way = [m for m in running if m and m.group(4) and 0 < int(m.group(1)) < EXPECTED_TOTAL]
    assert under_way, f"no running frame with a step, the total and an ETA: {progress}"
    assert all(int(m.group(2)) == EXPECTED_TOTAL for m in running if m)
    assert all(0 <= int(m.group(3)) <= 100 for m in running if m)
    final = frames[-1]
    assert "· finished ·" in final["text/plain"].splitlines()[0]
    assert progress[-1] == f"step {EXPECTED_TOTAL}/{EXPECTED_TOTAL} [####################] 100%"
    assert f"step {EXPECTED_TOTAL} / {EXPECTED_TOTAL} (100%)" in final["text/html"]


def test_a_distributed_cell_whose_total_is_uncertain_shows_steps_without_a_total(progress_notebook):
    frames = progress_notebook.view_frames(2)
    progress = [frame["text/plain"].splitlines()[1] for frame in frames]
    assert any(re.fullmatch(r"step \d+", line) for line in progress[:-1]), progress  # counted while running
    assert not any("/" in line or "ETA" in line or "%" in line for line in progress), progress
    assert "· finished ·" in frames[-1]["text/plain"].splitlines()[0]
    assert progress[-1] == f"step {EXPECTED_TOTAL}"  # it never broke out: every step still counted
    html = re.sub(r"base64,[^\"]+", "base64,", frames[-1]["text/html"])  # "ETA" may occur in the PNG's base64
    assert f"step {EXPECTED_TOTAL}" in html and "%)" not in html and "ETA" not in html  # no bar drawn


def test_interrupt_stops_the_ranks_shows_stopped_and_raises_keyboard_interrupt():
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel()
    kernel = manager.client()
    kernel.start_channels()
    try:
        kernel.wait_for_ready(timeout=KERNEL_START_SECONDS)
        execute(kernel, TRAIN_SOURCE, timeout=60)
        msg_id = kernel.execute('watch(nbtrain.start(train, (100_000,), devices=2, accelerator="cpu"))')
        first = next_message(
            kernel, msg_id, 60, lambda m: is_update(m) and "step " in m["content"]["data"]["text/plain"]
        )
        display_id = first["content"]["transient"]["display_id"]
        launcher = psutil.Process(manager.provisioner.process.pid).children()[0]
        assert len(launcher.children()) == 2, "both ranks run"

        manager.interrupt_kernel()
        replies = []
        while not replies or not is_idle(replies[-1]):
            replies.append(next_message(kernel, msg_id, 30, lambda m: is_update(m) or is_idle(m) or is_error(m)))
        (error,) = [m for m in replies if is_error(m)]
        frames_before_error = [m for m in replies[: replies.index(error)] if is_update(m)]
        assert frames_before_error, "the view shows its last frame before the interrupt propagates"
        last_frame = frames_before_error[-1]
        assert not any(is_update(m) for m in replies[replies.index(error):])
        assert error["content"]["ename"] == "KeyboardInterrupt"
        assert last_frame["content"]["transient"]["display_id"] == display_id
        assert "· stopped ·" in last_frame["content"]["data"]["text/plain"]
        assert ">stopped</b>" in last_frame["content"]["data"]["text/html"]
        assert launcher.children() == [], "no rank outlives the interrupt"
    finally:
        kernel.stop_channels()
        manager.shutdown_kernel(now=False)


def execute(kernel, code: str, timeout: float) -> None:
    msg_id = kernel.execute(code)
    deadline = time.monotonic() + timeout
    while True:  # other replies (kernel_info from the client's start-up) may come first
        reply = kernel.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert reply["content"]["status"] == "ok", reply["content"]


def is_update(message) -> bool:
    return message["msg_type"] == "update_display_data"


def is_error(message) -> bool:
    return message["msg_type"] == "error"


def is_idle(message) -> bool:
    return message["msg_type"] == "status" and message["content"]["execution_state"] == "idle"


def next_message(kernel, msg_id: str, timeout: float, wanted):
    """The next iopub message of ``msg_id`` that ``wanted`` accepts, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no such message within {timeout} s")
        try:
            message = kernel.get_iopub_msg(timeout=left)
        except queue.Empty:
            continue
        if message["parent_header"].get("msg_id") == msg_id and wanted(message):
            return message


# --- plain frontends ---------------------------------------------------------------------


def test_plain_python_gets_text_progress():
    code = TRAIN_SOURCE + (
        'print("result:", watch(nbtrain.start(train, (30,), devices=2, accelerator="cpu"), total_steps=30))'
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("[nbtrain] starting · ")
    assert "[rank 0] step 0\n" in out and "[rank 1] step 20\n" in out
    assert re.search(r"^\[nbtrain\] running · .* · step \d+/30 \[[#-]{20}\] \d+%", out, re.MULTILINE)
    assert re.search(r"^nbtrain · ddp_notebook · cpu · 2 ranks · finished · ", out, re.MULTILINE)
    assert "step 30/30 [####################] 100%" in out
    assert re.search(r"^loss  rank 0: 0\.03333  rank 1: 0\.04333  mean: 0\.03833$", out, re.MULTILINE)
    assert re.search(r"^memory \(host RSS\)  rank 0: [\d.]+ MiB \(peak [\d.]+ MiB\)  rank 1: ", out, re.MULTILINE)
    assert out.rstrip().endswith("result: done")
    assert "<" not in out
    progress_lines = [line for line in out.splitlines() if line.startswith("[nbtrain]")]
    assert len(progress_lines) <= 2 + 10  # starting, then at most one a second of a few seconds


def fail_on_rank_one():
    import nbtrain

    nbtrain.log(loss=1.0)
    if nbtrain.rank() == 1:
        raise ValueError("bad batch")
    return "unreachable for rank 1"


def test_watch_shows_failed_then_raises_the_rank_s_error(launcher, capsys):
    import nbtrain

    with pytest.raises(nbtrain.RankError, match="bad batch"):
        display.watch(nbtrain.start(fail_on_rank_one, devices=2, accelerator="cpu"), rich=False)
    out = capsys.readouterr().out
    assert re.search(r"^nbtrain · ddp_notebook · cpu · 2 ranks · failed · ", out, re.MULTILINE)
    assert "rank 1 raised ValueError: bad batch" in out


# --- frames, drawn directly ----------------------------------------------------------------


def fed_view(world_size: int = 2, steps: int = 200, memory: dict | None = None, **hints) -> LiveView:
    view = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=world_size, rich=False, **hints)
    view.state.started_at -= 10.0  # a run ten seconds in: past the first second, which shows no chart
    for rank in range(world_size):
        rows = tuple(
            (step, float(step), {"loss": 2.0 * math.exp(-step / (steps / 3)) + 0.01 * rank, "accuracy": step / steps})
            for step in range(1, steps + 1)
        )
        view.handle(events.Metrics(RUN, rank, rows))
        view.handle(events.MemorySample(RUN, rank, **(memory or {"rss_bytes": (300 + rank) * 2**20})))
    return view


def test_a_frame_past_its_total_shows_the_step_count_without_a_bar():
    view = fed_view(steps=120, total_steps=100)
    bundle = view.mimebundle(now=time.monotonic())
    assert bundle["text/plain"].splitlines()[1] == "step 120"
    html = re.sub(r"base64,[^\"]+", "base64,", bundle["text/html"])  # "ETA" may occur in the PNG's base64
    assert '<div style="color:#555">step 120</div>' in html
    assert "%)" not in html and "ETA" not in html


def test_final_frame_of_a_100k_step_run_is_under_a_megabyte():
    view = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=2, total_steps=100_000, rich=False)
    for batch in range(1000):
        for rank in range(2):
            steps = range(batch * 100 + 1, batch * 100 + 101)
            rows = tuple(
                (s, s / 100, {"loss": 1 / s**0.5 + 0.01 * math.sin(s), "lr": 0.1, "grad_norm": 1 + s % 7})
                for s in steps
            )
            view.handle(events.Metrics(RUN, rank, rows))
            view.handle(events.MemorySample(RUN, rank, (300 + batch) * 2**20))
            view.handle(events.Output(RUN, rank, "stdout", "x" * 5000 + "\n"))  # long lines are cut
    view.finish(events.FINISHED)

    for history in view.state.metrics.values():
        assert all(len(series) <= livestate.MAX_POINTS for series in history.ranks.values())
        assert history.mean.count == 100_000
    bundle = view.mimebundle()
    size = len(json.dumps(bundle))
    assert size < 1_000_000, f"{size} bytes"
    png = frame_png(bundle["text/html"])
    assert png.startswith(PNG_MAGIC) and len(png) < 200_000
    assert "step 100,000 / 100,000 (100%)" in bundle["text/html"]


def test_a_run_shows_no_chart_in_its_first_second_and_its_last_frame_draws_one():
    def started_view() -> LiveView:
        view = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=1, rich=True)
        view.publish = lambda bundle: None  # no cell to show it in
        view.handle(events.Metrics(RUN, 0, ((1, 0.0, {"loss": 1.0}),)))
        view.handle(events.MemorySample(RUN, 0, 300 * 2**20))
        return view

    short = started_view()
    assert "data:image/png" not in short.mimebundle()["text/html"] and short.chart_renders == 0
    short.finish(events.FINISHED)  # a short cell's charts are drawn once, in its last frame
    assert short.chart_renders == 1
    longer = started_view()
    longer.state.started_at -= 1.0  # a second in: its frames have the chart
    assert frame_png(longer.mimebundle()["text/html"]).startswith(PNG_MAGIC) and longer.chart_renders == 1
    text = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=1, rich=False)
    text.handle(events.Metrics(RUN, 0, ((1, 0.0, {"loss": 1.0}),)))
    text.finish(events.FINISHED)  # a text view's last frame draws no chart; shown again, an ended run's has it
    assert frame_png(text.mimebundle()["text/html"]).startswith(PNG_MAGIC)


def test_charts_are_redrawn_only_when_their_data_changed():
    view = fed_view()
    first = view.chart_png_base64()
    view.handle(events.Output(RUN, 0, "stdout", "not a chart change\n"))
    assert view.chart_png_base64(force=True) == first and view.chart_renders == 1
    view.handle(events.Metrics(RUN, 0, ((201, 201.0, {"loss": 5.0}),)))
    view.chart_png_base64(force=True)
    assert view.chart_renders == 2


def test_chart_drawing_rests_in_proportion_to_its_cost():
    view = fed_view()
    view.chart_png_base64()
    view._chart_seconds = 3600.0  # as if drawing took an hour: the next must wait ten
    view.handle(events.Metrics(RUN, 0, ((201, 201.0, {"loss": 5.0}),)))
    view.chart_png_base64()
    assert view.chart_renders == 1
    view.chart_png_base64(force=True)  # the final frame does not wait
    assert view.chart_renders == 2


def test_the_chart_waits_while_the_ranks_go_to_a_stop_step_and_the_last_frame_draws_it():
    view = fed_view()
    view.chart_png_base64()
    view._chart_seconds = 0.0  # no rest: only the stop holds the drawing back
    view.handle(events.StopStep(RUN, 41, 2.0))
    view.handle(events.Metrics(RUN, 0, ((201, 201.0, {"loss": 5.0}),)))
    view.chart_png_base64()
    assert view.chart_renders == 1  # a second interrupt is not held back by a drawing
    figure = view._chart_figure
    view.finish(events.STOPPED)
    view.chart_png_base64(force=True)  # the last frame's chart (what finish() draws in a rich view)
    assert view.chart_renders == 2 and view._chart_figure is figure  # drawn once more, on the same figure


def test_the_next_run_with_the_same_charts_draws_on_the_figure_the_last_one_finished_with():
    # Building a figure costs about a drawing, and a short cell's one drawing is its last frame.
    first = fed_view()
    first.chart_png_base64()
    figure = first._chart_figure
    first.finish(events.FINISHED)
    second = fed_view(steps=50)
    second.chart_png_base64()
    assert second._chart_figure is figure
    other = fed_view(world_size=3)  # other charts (a third rank): a figure of its own
    other.chart_png_base64()
    assert other._chart_figure is not figure


def test_a_stop_wanted_now_ends_on_the_chart_as_drawn_and_a_current_status(capsys):
    view = fed_view()
    view.rich = True  # outside a kernel, display() prints the frame's text
    first = view.chart_png_base64()
    view.handle(events.StopStep(RUN, 41, 2.0))
    view.handle(events.Metrics(RUN, 0, ((201, 201.0, {"loss": 5.0}),)))
    view.finish(events.STOPPED, redraw_chart=False)  # a second interrupt: no drawing before the reply
    assert view.chart_renders == 1 and "stopped" in capsys.readouterr().out
    frame = view.mimebundle()
    assert first in frame["text/html"] and "stopped" in frame["text/plain"]
    assert view.chart_png_base64(force=True) == first and view.chart_renders == 1  # it stays the last frame's


@pytest.mark.parametrize(
    ("world_size", "memory"),
    [
        (1, None),
        (2, {"rss_bytes": None, "cuda_allocated_bytes": 3 * 2**30, "cuda_peak_bytes": 5 * 2**30}),
        (16, None),
    ],
    ids=["one-rank", "gpu-memory", "sixteen-ranks"],
)
def test_frames_render_for_any_number_of_ranks_and_memory_kind(world_size, memory):
    view = fed_view(world_size, memory=memory, total_steps=400, batch_size=8)
    view.handle(events.Output(RUN, 0, "stderr", "<warning> & such\n"))
    bundle = view.mimebundle(force_charts=True)
    assert frame_png(bundle["text/html"]).startswith(PNG_MAGIC)
    assert "&lt;warning&gt; &amp; such" in bundle["text/html"]
    kind = "GPU allocated" if memory else "host RSS"
    assert f"memory ({kind})" in bundle["text/plain"]
    assert "samples/s" in bundle["text/plain"]


def test_a_failed_run_names_its_cause_in_the_frame():
    view = fed_view()
    view.handle(events.RankFailed(RUN, 1, "ValueError", "bad batch", "Traceback ..."))
    view.handle(events.RunEnded(RUN, events.FAILED))
    view.finish(events.FAILED)
    bundle = view.mimebundle()
    assert "rank 1 raised ValueError: bad batch" in bundle["text/plain"]
    assert ">failed</b>" in bundle["text/html"] and "rank 1 raised ValueError: bad batch</div>" in bundle["text/html"]



def test_a_chart_drawn_as_every_rank_is_done_is_the_last_frames_unless_something_new_came():
    # Two ranks, the last step logged by rank 0 only: its mean waits for rank 1 until the ranks are done.
    view = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=2, rich=True)
    for rank, steps in ((0, range(1, 6)), (1, range(1, 5))):
        view.handle(events.Metrics(RUN, rank, tuple((s, s / 10, {"loss": 1.0 / s}) for s in steps)))
    view.draw_chart()  # every rank done: the mean takes step 5 now, as the run's end would
    assert view.state.metrics["loss"].mean.steps()[-1] == 5
    ahead = view.chart_png_base64()
    view.finish(events.FINISHED)
    assert (view.chart_renders, view.chart_png_base64()) == (1, ahead)

    late = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=1, rich=True)
    late.handle(events.Metrics(RUN, 0, ((1, 0.1, {"loss": 1.0}),)))
    late.draw_chart()
    late.handle(events.MemorySample(RUN, 0, 300 * 2**20))  # sampled as the rank exited
    late.finish(events.FINISHED)
    assert late.chart_renders == 2
