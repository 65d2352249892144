"""A real Jupyter kernel for tests, driven through nbclient.

:class:`NotebookKernel` starts ipykernel with this venv's python (nbclient's
KernelManager replaces the kernelspec's ``python`` with ``sys.executable``; the tests
check it), runs cells into a notebook, and shuts the kernel down. Shutdown ends every
process the kernel started (its warm launcher and any rank) by PID: those found before
shutdown are waited for, and killed if still present after a bounded wait.

Every wait has a deadline; nothing sleeps to let something happen.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import nbformat
import psutil
from nbclient import NotebookClient
from nbclient.util import run_sync
from typing_extensions import Self  # typing.Self is 3.11+; torch requires typing_extensions

import nbtrain
from helpers import procs

STARTUP_SECONDS = 60.0
CELL_SECONDS = 120.0
GONE_SECONDS = 10.0
POLL = 0.02
# nbtrain's own files, as a traceback names them: what a user's traceback must not show (a test
# of "nbtrain/" alone would also find the checkout's name, or its .venv, in a library's frame).
OUR_FILES = os.path.join(os.path.dirname(os.path.abspath(nbtrain.__file__)), "")

# The kernel's expression for its launcher's pid (kernel.value(LAUNCHER_PID)).
LAUNCHER_PID = "__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().process.pid"


@dataclass
class CellOutput:
    """What a cell showed: its text (stdout, stderr, results) and its error, if any."""

    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)  # text/plain of execute_result/display_data
    live_view: str = ""  # text/plain of the run's live view (the display with a display id)
    error: dict[str, Any] | None = None  # {"ename", "evalue", "traceback"} (ANSI stripped)

    @property
    def text(self) -> str:
        error = "\n".join(self.error["traceback"]) if self.error else ""
        return "\n".join(part for part in (self.stdout, self.stderr, *self.results, error) if part)


class NotebookKernel:
    """A started kernel plus the notebook its cells go into.

    nbclient's kernel manager and client are asynchronous; ``run_sync`` drives them here.

    Example::

        with NotebookKernel() as kernel:
            kernel.run_ok("x = 1")
            assert kernel.value("x + 1") == 2
    """

    def __init__(self, cwd: str | None = None, env: dict[str, str] | None = None, log: str | None = None):
        """``log``: a file that takes the kernel's own stderr (its log: what Jupyter's server shows)."""
        self.notebook = nbformat.v4.new_notebook()
        self.notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        self.client = NotebookClient(
            self.notebook,
            timeout=int(CELL_SECONDS),  # an Integer trait in nbclient under traitlets 5.7 (Colab's)
            startup_timeout=int(STARTUP_SECONDS),
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": cwd or os.getcwd()}},
        )
        self.client.km = self.client.create_kernel_manager()
        kwargs: dict[str, Any] = {"env": {**os.environ, **(env or {})}} if env else {}
        if log is not None:
            with open(log, "ab") as stderr:  # the kernel holds its own copy
                self.client.start_new_kernel(**kwargs, stderr=stderr)
        else:
            self.client.start_new_kernel(**kwargs)
        self.client.start_new_kernel_client()
        self.pid = self.client.km.provisioner.pid

    # -- running cells -------------------------------------------------------------------
    def run(self, source: str) -> CellOutput:
        """Execute one cell (added to the notebook) and return what it showed."""
        cell = nbformat.v4.new_code_cell(source)
        self.notebook.cells.append(cell)
        self.client.execute_cell(cell, len(self.notebook.cells) - 1)
        return outputs_of(cell)

    def run_ok(self, source: str) -> CellOutput:
        """Execute a cell that must not fail; its output on failure."""
        out = self.run(source)
        assert out.error is None, f"cell failed:\n{source}\n---\n{out.text}"
        return out

    def value(self, expression: str) -> Any:
        """The JSON value of ``expression`` evaluated in the kernel.

        Under ipykernel 6.17 (Colab's) a cell's printed line was once not in by its idle
        status (after an interrupt): the value is then read from an execute reply's
        ``user_expressions``, which comes on the shell channel, not as printed output.
        """
        out = self.run_ok(f"import json as _json\nprint(_json.dumps({expression}))")
        lines = out.stdout.strip().splitlines()
        if lines:
            return json.loads(lines[-1])
        return self._expression_value(f"__import__('json').dumps({expression})")

    def _expression_value(self, expression: str) -> Any:
        msg_id = self.client.kc.execute("", store_history=False, user_expressions={"v": expression})
        reply, _ = self.wait_for_reply(msg_id, timeout=CELL_SECONDS)
        result = reply["user_expressions"]["v"]
        assert result["status"] == "ok", f"{expression} failed in the kernel: {result}"
        return json.loads(ast.literal_eval(result["data"]["text/plain"]))

    def start_cell(self, source: str) -> str:
        """Send a cell without waiting for it (for interrupt tests); returns its msg_id."""
        return self.client.kc.execute(source, stop_on_error=False)  # as nbclient's allow_errors cells

    def wait_for_stream(
        self, msg_id: str, needles: list[str], timeout: float = CELL_SECONDS, displays: bool = False
    ) -> str:
        """Read the cell's output until every needle has appeared; the text read so far.

        ``displays``: the text of its displays (shown or updated in place) counts too."""
        deadline = time.monotonic() + timeout
        seen = ""
        while not all(needle in seen for needle in needles):
            left = deadline - time.monotonic()
            assert left > 0, f"{needles!r} did not all appear within {timeout} s; output so far:\n{seen}"
            try:
                message = run_sync(self.client.kc.get_iopub_msg)(timeout=min(left, 1.0))
            except Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            content = message["content"]
            if message["msg_type"] == "stream":
                seen += content["text"]
            elif displays and message["msg_type"] in ("display_data", "update_display_data"):
                seen += content.get("data", {}).get("text/plain", "") + "\n"
            elif message["msg_type"] == "error":
                raise AssertionError("the cell failed:\n" + strip_ansi("\n".join(content["traceback"])))
        return seen

    def wait_for_reply(self, msg_id: str, timeout: float) -> tuple[dict, CellOutput]:
        """The cell's execute_reply content and the output it still produced, within ``timeout``."""
        deadline = time.monotonic() + timeout
        out = CellOutput()
        reply = None
        idle = False
        while reply is None or not idle:
            left = deadline - time.monotonic()
            assert left > 0, f"no reply within {timeout} s; output:\n{out.text}"
            if reply is None:
                try:
                    message = run_sync(self.client.kc.get_shell_msg)(timeout=min(left, 0.1))
                    if message["parent_header"].get("msg_id") == msg_id:
                        reply = message["content"]
                except Empty:
                    pass
            try:
                message = run_sync(self.client.kc.get_iopub_msg)(timeout=min(max(left, 0.01), 0.1))
            except Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                setattr(out, content["name"], getattr(out, content["name"]) + content["text"])
            elif kind == "error":
                out.error = {**content, "traceback": [strip_ansi(line) for line in content["traceback"]]}
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return reply, out

    def interrupt(self) -> None:
        run_sync(self.client.km.interrupt_kernel)()

    # -- processes -----------------------------------------------------------------------
    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []

    def shutdown(self) -> None:
        """Shut the kernel down and make sure every process it started is gone (by PID)."""
        pids = [self.pid, *(p.pid for p in self.descendants())]
        try:
            self.client.kc.stop_channels()
            run_sync(self.client.km.shutdown_kernel)(now=False)
        finally:
            procs.kill_and_wait(pids, GONE_SECONDS, reaped=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def nbtrain_kernel(*cells: str) -> Iterator[NotebookKernel]:
    """A kernel of this venv's python with nbtrain loaded and ``cells`` run; shut down after (a fixture's body)."""
    kernel = NotebookKernel()
    try:
        assert kernel.value("__import__('sys').executable") == sys.executable  # the venv's python
        kernel.run_ok("%load_ext nbtrain")
        for cell in cells:
            kernel.run_ok(cell)
        yield kernel
    finally:
        kernel.shutdown()


def outputs_of(cell: Any) -> CellOutput:
    out = CellOutput()
    for output in cell.get("outputs", []):
        kind = output["output_type"]
        if kind == "stream":
            setattr(out, output["name"], getattr(out, output["name"]) + output["text"])
        elif kind == "display_data" and output.get("data", {}).get("text/plain", "").startswith("nbtrain · "):
            out.live_view = output["data"]["text/plain"]
        elif kind in ("execute_result", "display_data"):
            out.results.append(output.get("data", {}).get("text/plain", ""))
        elif kind == "error":
            out.error = {
                "ename": output["ename"],
                "evalue": output["evalue"],
                "traceback": [strip_ansi(line) for line in output["traceback"]],
            }
    return out


# A small regression problem for kernel tests of training cells: X -> Y = X @ w, a shuffled loader, MSE.
REGRESSION_SETUP = """
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(256, 8)
Y = X @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
loss_fn = nn.MSELoss()
"""

# In the kernel, between cells: until the standby ranks forked after the last run are ready
# (every one joined its process group), at most ``bound`` seconds; [seconds waited, ready].
WAIT_FOR_STANDBY = """
import time as _time, nbtrain as _nbtrain
def _standby_ready():
    return any(getattr(entry, "state", "") == "standby" and entry.ready for entry in _nbtrain.runs())
_began = _time.monotonic()
while not _standby_ready() and _time.monotonic() - _began < {bound}:
    _time.sleep(0.02)
standby_wait = [_time.monotonic() - _began, _standby_ready()]
"""


def wait_for_standby(kernel: NotebookKernel, bound: float) -> tuple[float, bool]:
    """Wait in the kernel, as a user's pause between cells would, until its standby ranks are ready (bounded)."""
    kernel.run_ok(WAIT_FOR_STANDBY.format(bound=bound))
    waited, ready = kernel.value("standby_wait")
    return waited, ready


def strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until each pid has exited (a zombie of a foreign parent counts as gone)."""
    return procs.wait_gone(pids, timeout, reaped=False)

