"""Background runs (``%%distributed --background``, ``launch(background=True)``) in a real kernel.

CPU + gloo, 2 ranks. The cells are sent with jupyter_client directly (not nbclient, which
drops the messages of cells other than the one it runs), and every iopub message is kept,
so a test can see the live view's display updates that arrive after the cell that
started the run has finished. Every wait is bounded; rank processes are checked gone by PID.
"""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import pytest
from nbclient.util import run_sync

from kernel_helpers import NotebookKernel, strip_ansi, wait_gone

pytestmark = pytest.mark.timeout(180)

CELL_SECONDS = 60.0
STOP_SECONDS = 10.0

SETUP = """
%load_ext nbtrain
import nbtrain, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(128, 8)
Y = X @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(X, Y), batch_size=16)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loss_fn = nn.MSELoss()
history = []

def last_background():
    # nbtrain.runs() also lists the standby ranks the launcher forked after a run ("standby"): not runs.
    return [r for r in nbtrain.runs() if r.state != "standby"][-1]
"""


@dataclass
class Cell:
    msg_id: str
    stdout: str = ""
    stderr: str = ""
    displays: list[dict] = field(default_factory=list)  # display_data contents
    results: list[str] = field(default_factory=list)
    error: dict | None = None
    seconds: float = 0.0

    @property
    def text(self) -> str:
        error = "\n".join(self.error["traceback"]) if self.error else ""
        return "\n".join(p for p in (self.stdout, self.stderr, *self.results, error) if p)


class Session:
    """A kernel whose iopub messages are all kept, in order, whichever cell they belong to."""

    def __init__(self, kernel: NotebookKernel):
        self.kernel = kernel
        self.kc = kernel.client.kc
        self.messages: list[dict] = []

    def _pump(self, timeout: float) -> bool:
        try:
            message = run_sync(self.kc.get_iopub_msg)(timeout=timeout)
        except Empty:
            return False
        self.messages.append(message)
        return True

    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            found = condition()
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{what}: not within {timeout} s")
            self._pump(min(left, 0.2))

    def run(self, source: str, timeout: float = CELL_SECONDS) -> Cell:
        started = time.monotonic()
        # Not stop_on_error: ipykernel 6.17 (Colab's) aborts requests that arrive just after a failed
        # cell's idle status, so the next value asked for came back without its user_expressions.
        msg_id = self.kc.execute(source, stop_on_error=False)
        self.wait_for(lambda: self._idle(msg_id), timeout, f"the cell {source[:60]!r} to finish")
        cell = self.cell(msg_id)
        cell.seconds = time.monotonic() - started
        return cell

    def run_ok(self, source: str, timeout: float = CELL_SECONDS) -> Cell:
        cell = self.run(source, timeout)
        assert cell.error is None, f"cell failed:\n{source}\n---\n{cell.text}"
        return cell

    def value(self, expression: str) -> Any:
        """The JSON value of ``expression``, read from the execute reply's ``user_expressions``.

        The reply comes on the shell channel: under ipykernel 6.17 (Colab's) a printed line was
        sometimes not in by the cell's idle status while a background run's thread published.
        """
        dumped = f"__import__('json').dumps({expression})"
        msg_id = self.kc.execute("", store_history=False, user_expressions={"v": dumped})
        reply = self.wait_for(lambda: self._reply(msg_id), CELL_SECONDS, f"the value of {expression}")
        result = reply["user_expressions"]["v"]
        assert result["status"] == "ok", f"{expression} failed in the kernel: {result}"
        return json.loads(ast.literal_eval(result["data"]["text/plain"]))

    def _reply(self, msg_id: str) -> dict | None:
        """The execute reply to ``msg_id`` once it came (replies to earlier cells are passed over)."""
        try:
            message = run_sync(self.kc.get_shell_msg)(timeout=0.05)
        except Empty:
            return None
        return message["content"] if message["parent_header"].get("msg_id") == msg_id else None

    def _idle(self, msg_id: str) -> bool:
        return any(
            m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
            and m["parent_header"].get("msg_id") == msg_id
            for m in self.messages
        )

    def cell(self, msg_id: str) -> Cell:
        cell = Cell(msg_id)
        for m in self.messages:
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = m["msg_type"], m["content"]
            if kind == "stream":
                setattr(cell, content["name"], getattr(cell, content["name"]) + content["text"])
            elif kind == "display_data":
                cell.displays.append(content)
            elif kind == "execute_result":
                cell.results.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                cell.error = {**content, "traceback": [strip_ansi(line) for line in content["traceback"]]}
        return cell

    def view_id(self, cell: Cell) -> str:
        """The display id of the live view a cell showed."""
        return self._display_id(cell, "nbtrain · ")

    def handle_id(self, cell: Cell) -> str:
        """The display id of the background handle a cell showed as its value."""
        return self._display_id(cell, "<BackgroundRun")

    @staticmethod
    def _display_id(cell: Cell, text_start: str) -> str:
        ids = [
            d["transient"]["display_id"]
            for d in cell.displays
            if d.get("transient", {}).get("display_id") and d["data"].get("text/plain", "").startswith(text_start)
        ]
        assert len(ids) == 1, cell.displays
        return ids[0]

    def shown_text(self, cell: Cell, display_id: str) -> str:
        """What a display of the cell shows now: its first text/plain, or that of its last update."""
        (first,) = [d for d in cell.displays if d.get("transient", {}).get("display_id") == display_id]
        updates = self.view_updates(display_id)
        return updates[-1][1] if updates else first["data"]["text/plain"]

    def view_updates(self, display_id: str) -> list[tuple[int, str, str]]:
        """(message index, text/plain, text/html) of each update of that display."""
        return [
            (i, m["content"]["data"].get("text/plain", ""), m["content"]["data"].get("text/html", ""))
            for i, m in enumerate(self.messages)
            if m["msg_type"] == "update_display_data"
            and m["content"].get("transient", {}).get("display_id") == display_id
        ]

    def wait_view(self, display_id: str, needle: str, timeout: float = CELL_SECONDS) -> tuple[int, str, str]:
        def found() -> Any:
            hits = [u for u in self.view_updates(display_id) if needle in u[1] or needle in u[2]]
            return hits[0] if hits else None

        return self.wait_for(found, timeout, f"the live view to show {needle!r}")

    def idle_index(self, msg_id: str) -> int:
        return next(
            i
            for i, m in enumerate(self.messages)
            if m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
            and m["parent_header"].get("msg_id") == msg_id
        )


@pytest.fixture(scope="module")
def session():
    kernel = NotebookKernel()
    try:
        s = Session(kernel)
        s.run_ok(SETUP)
        yield s
    finally:
        kernel.shutdown()


def _widget_views(cell: Cell) -> list[str]:
    return [d["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for d in cell.displays
            if "application/vnd.jupyter.widget-view+json" in d["data"]]


def test_a_background_cell_returns_at_once_updates_live_and_then_updates_the_kernel(session, tmp_path):
    go = tmp_path / "go"
    session.run_ok("w0 = [p.detach().clone() for p in model.parameters()]\nmodel_id = id(model)")
    started = session.run_ok(
        "%%distributed --devices 2 --background\n"
        "import os, time\n"
        "for epoch in range(2):\n"
        "    for x, y in loader:\n"
        "        loss = loss_fn(model(x), y)\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    history.append(loss.item())\n"
        "print('trained', nbtrain.rank(), flush=True)\n"
        "# finish only after the test's other cell ran (bounded: 60 s)\n"
        f"deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    assert started.seconds < 10, started.seconds
    view = session.view_id(started)
    assert len(_widget_views(started)) == 1  # the Stop button
    assert started.results == []  # the handle is shown as a display that follows the run, not as a fixed Out
    handle = session.handle_id(started)
    assert "<BackgroundRun 1: " in session.shown_text(started, handle) and "; running, " in session.shown_text(
        started, handle
    )
    after_start = session.idle_index(started.msg_id)

    # The view moves on after the cell that started the run has finished: metrics arrive.
    index, text, html = session.wait_view(view, "loss ")
    assert index > after_start and "running" in text
    session.wait_view(view, "trained 1")  # the ranks' output, in the view's log panel

    # Another cell runs while the run goes on; its objects are still the old ones.
    other = session.run_ok(
        "h = last_background()\n"
        "same = all(torch.equal(p, q) for p, q in zip(model.parameters(), w0))\n"
        "print(h.state, h.world_size, h.strategy, h.devices, same)\n"
        f"open({str(go)!r}, 'w').close()\n"
    )
    assert other.stdout.strip() == "running 2 ddp_notebook (0, 1) True"
    # The run ends; with no cell running, the kernel applies its results at once, and says so.
    index, text, html = session.wait_view(view, "finished — kernel updated: model, history")
    assert "finished" in text.splitlines()[0] and "kernel updated: model, history" in html
    log = session.value("nbtrain.kernel.cellrun.last_run.log_path")  # the ranks printed: their full output
    assert log and f"Full output: {log}" in text
    assert session.value(
        "[id(model) == model_id, any(not torch.equal(p, q) for p, q in zip(model.parameters(), w0)), len(history)]"
    ) == [True, True, 2]
    assert session.value("[h.state, h.result, h.updated[:2]]") == ["finished", None, ["model", "history"]]
    shown = session.shown_text(started, handle)  # the cell's own output no longer claims it is running
    assert "; finished, " in shown and "updated in the kernel: model, history" in shown and "running" not in shown
    assert session.value("nbtrain.kernel.cellrun.last_run.state") == "finished"
    assert session.value("len(nbtrain.kernel.cellrun.last_run.metrics[0])") == 2 * 128 // 2 // 16


def test_results_reach_the_kernel_between_cells_not_in_the_middle_of_one(session):
    session.run_ok("marker = 'old'")
    started = session.run_ok("%%distributed --devices 2 --background\nmarker = 'new'\n")
    view = session.view_id(started)
    # This cell outlives the run; the run's results wait until it has ended.
    during = session.run_ok(
        "import time\n"
        "h = last_background()\n"
        "deadline = time.monotonic() + 30\n"
        "while h.run.state == 'running' and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(h.run.state, marker)\n"
    )
    assert during.stdout.strip() == "finished old"
    session.wait_view(view, "finished — kernel updated: marker")  # applied once the kernel was free
    assert session.value("[marker, last_background().state]") == ["new", "finished"]
    # The handle under the view went the same way: ended (results waiting), then finished.
    handle = session.handle_id(started)
    session.wait_view(handle, "; finished, ")
    shown = [text for _, text, _ in session.view_updates(handle)]
    assert "; ended, its results reach the kernel when the kernel is free, " in shown[0]
    assert "; finished, " in shown[-1] and "updated in the kernel: marker" in shown[-1]


LOOP_CELL = (
    "%%distributed --devices 2 --background\n"
    "import time\n"
    "print('looping', nbtrain.rank(), flush=True)\n"
    "deadline = time.monotonic() + 120  # the test stops it long before\n"
    "while time.monotonic() < deadline:\n"
    "    time.sleep(0.01)\n"
)


def _start_looping(session: Session) -> Cell:
    started = session.run_ok(LOOP_CELL)
    view = session.view_id(started)
    session.wait_view(view, "looping 0")
    session.wait_view(view, "looping 1")
    return started


def _stopped(session: Session, started: Cell, stop_code: str) -> None:
    view, handle = session.view_id(started), session.handle_id(started)
    assert "; running, " in session.shown_text(started, handle)
    cell = session.run_ok(
        "h = last_background()\n"
        "pids = sorted(h.run.pids.values())\n"
        f"{stop_code}\n"
        "try:\n"
        "    h.wait(timeout=5)\n"
        "except Exception as error:\n"
        "    raised = type(error).__name__\n"
        "print(json.dumps([h.state, raised, pids, h.stop_button.layout.display, repr(h)]))\n"
    )
    state, raised, pids, button, text = json.loads(cell.stdout.strip().splitlines()[-1])
    assert cell.seconds < 8, cell.seconds
    assert (state, raised, button, len(pids)) == ("stopped", "RunStoppedError", "none", 2)
    assert "; stopped, " in text  # repr() in code tells the state too
    assert wait_gone(pids, 5.0) == []
    _, text, html = session.wait_view(view, "stopped — every rank is gone")
    assert "· stopped ·" in text and "Nothing in the kernel was changed" in html
    # What the starting cell shows under the view says so too: it no longer claims "running".
    session.wait_view(handle, "; stopped, ")
    shown = session.shown_text(started, handle)
    assert "; stopped, " in shown and "running" not in shown


def test_handle_stop_stops_every_rank_and_the_view_says_stopped(session):
    session.run_ok("import json")
    started = _start_looping(session)
    _stopped(session, started, "h.stop()")


def test_the_stop_buttons_click_stops_the_run(session):
    started = _start_looping(session)
    # button.click() runs the handler the frontend's click runs (through the comm, on the main thread)
    _stopped(session, started, "h.stop_button.click()")


def test_a_blocking_cell_runs_while_a_background_run_goes_on_and_exit_stops_it(session):
    _start_looping(session)
    out = session.run_ok("%%distributed --devices 2\nprint('blocking', nbtrain.world_size())\n")
    assert "[rank 1] blocking 2" in out.stdout
    cell = session.run_ok(
        "h = last_background()\n"
        "pids = sorted(h.run.pids.values())\n"
        "before = h.state\n"
        "nbtrain.kernel.background._stop_all_at_exit()  # what atexit runs when the kernel shuts down\n"
        "print(json.dumps([before, h.state, pids]))\n"
    )
    before, after, pids = json.loads(cell.stdout.strip().splitlines()[-1])
    assert (before, after) == ("running", "stopped")
    assert wait_gone(pids, 5.0) == []


def test_a_failing_background_cell_shows_failed_and_wait_raises_naming_the_rank(session):
    number = session.value("len(In)")  # the next cell's In[N]
    started = session.run_ok(
        "%%distributed --devices 2 --background\n"
        "value = 1\n"
        "if nbtrain.rank() == 1:\n"
        "    raise ValueError('only rank 1 fails')\n"
    )
    view = session.view_id(started)
    _, text, html = session.wait_view(view, "handle.wait() raises the error")
    assert "· failed ·" in text and "rank 1 raised ValueError: only rank 1 fails" in text
    assert "; failed, " in session.wait_view(session.handle_id(started), "; failed, ")[1]
    assert f"Cell In[{number}], line 4" in html
    out = session.run("last_background().wait(timeout=30)")
    assert out.error is not None
    traceback = "\n".join(out.error["traceback"])
    assert traceback.startswith("RankError: rank 1 raised ValueError: only rank 1 fails")
    assert f"Cell In[{number}], line 4" in traceback
    # Rank 0 had finished: the kernel holds what rank 1 held at its raise, as a blocking cell's would.
    assert traceback.endswith(
        f"The kernel holds rank 1's state at the failing line (Cell In[{number}], line 4), as one process would: "
        "value as the cell had set it."
    ), traceback
    assert session.value("[last_background().state, value]") == ["failed", 1]


def test_a_background_cell_failing_part_way_leaves_the_state_at_the_raise_once_the_kernel_is_free(session):
    """As a blocking cell's (tests/test_cellrun.py): the model and optimizer trained up to the failing step
    and the names bound before it go into the kernel's own objects, on its main thread between cells; every
    rank raised at the same line, so the state is rank 0's, and handle.wait() raises the error saying so."""
    session.run_ok(
        "bg_net = nn.Linear(8, 1)\nbg_opt = torch.optim.SGD(bg_net.parameters(), lr=0.05, momentum=0.9)\n"
        "bg_before = bg_net.weight.detach().clone()\nbg_ids = [id(bg_net), id(bg_opt)]"
    )
    number = session.value("len(In)")  # the next cell's In[N]
    started = session.run_ok(
        "%%distributed --devices 2 --background\n"
        "for i, (x, y) in enumerate(loader):\n"
        "    loss = loss_fn(bg_net(x), y)\n"
        "    bg_opt.zero_grad(); loss.backward(); bg_opt.step()\n"
        "    bg_seen = i + 1\n"
        "    if i == 2:\n"
        "        raise RuntimeError('the cell fails at its third step')\n"
    )
    # This cell outlives the run; the state at the raise waits until it has ended.
    during = session.run_ok(
        "import time\n"
        "h = last_background()\n"
        "deadline = time.monotonic() + 30\n"
        "while h.run.state == 'running' and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(h.run.state, 'bg_seen' in globals())\n"
    )
    assert during.stdout.strip() == "failed False"
    view = session.view_id(started)
    session.wait_view(view, "failed — rank 0's state at the failing line goes into the kernel as soon as the kernel")
    kept = f"The kernel holds rank 0's state at the failing line (Cell In[{number}], line 7), as one process would: "
    _, text, _ = session.wait_view(view, "handle.wait() raises the error")
    assert "· failed ·" in text and kept in text, text
    out = session.run("last_background().wait(timeout=30)")
    assert out.error is not None
    traceback = "\n".join(out.error["traceback"])
    assert traceback.startswith("RankError: rank 0 raised RuntimeError: the cell fails at its third step"), traceback
    assert kept + "bg_net and bg_opt as they were there, and " in traceback and "bg_seen" in traceback, traceback
    state = session.value(
        "[last_background().state, bg_seen, i, [id(bg_net), id(bg_opt)] == bg_ids, "
        "not torch.equal(bg_net.weight, bg_before), len(bg_opt.state), sorted(last_background().updated)]"
    )
    assert state[:6] == ["failed", 3, 2, True, True, 2]  # three steps trained, in the kernel's own objects
    assert {"bg_net", "bg_opt", "bg_seen", "i", "loss"} <= set(state[6])


def test_a_background_run_whose_ranks_wait_for_a_finished_rank_says_so_under_its_view(session):
    from nbtrain.launch_server.uneven import UNEVEN_SECONDS

    started = session.run_ok(
        "%%distributed --devices 2 --background\n"
        "for i, (x, y) in enumerate(loader):\n"
        "    if nbtrain.rank() == 0 and i == 2:\n"
        "        break\n"
        "    loss = loss_fn(model(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    view = session.view_id(started)
    _, text, _ = session.wait_view(view, "begun no optimizer step since", timeout=UNEVEN_SECONDS + CELL_SECONDS)
    assert "rank 0 finished the cell" in text and "(interrupt the kernel; a background run: its Stop)" in text
    assert session.value("last_background().state") == "running"  # said while the run goes on
    session.run_ok("last_background().stop()")
    assert session.value("last_background().state") == "stopped"


def test_launch_in_the_background_returns_a_handle_and_its_value(session):
    cell = session.run_ok(
        "def add(a, b):\n"
        "    nbtrain.log(loss=1.0)\n"
        "    return a + b + nbtrain.world_size()\n"
        "h = nbtrain.launch(add, 1, 2, devices=2, accelerator='cpu', background=True)\n"
        "print(h.kind, h.name)\n"
    )
    assert cell.stdout.strip() == "function add"
    view = session.view_id(cell)
    assert session.value("last_background().wait(timeout=30)") == 5
    _, _text, _ = session.wait_view(view, "finished — the result is in handle.result")
    assert session.value("[r.state for r in nbtrain.runs()]")[-1] == "finished"


EXITING_SCRIPT = """
import json, time
import nbtrain

def loop():
    import time
    print('looping', nbtrain.rank(), flush=True)
    deadline = time.monotonic() + 120  # atexit stops it long before
    while time.monotonic() < deadline:
        time.sleep(0.01)

h = nbtrain.launch(loop, devices=2, accelerator='cpu', background=True)
deadline = time.monotonic() + 60
while len(h.run.pids) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps(sorted(h.run.pids.values())), flush=True)
"""


def test_exit_stops_a_background_run_of_a_plain_python_script(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exiting.py"
    script.write_text(EXITING_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    pids = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("[") and "rank" not in line))
    assert len(pids) == 2
    assert wait_gone(pids, 5.0) == []
    assert "[nbtrain] background run 1 (loop) stopped — every rank is gone" in out.stderr
