"""pdb in a rank, from the notebook: real kernels whose stdin requests the test answers.

nbclient does not answer input requests, so these tests drive the kernel's channels
themselves (jupyter_client through nbclient's kernel client): each ``(Pdb) [rank N]``
prompt is an ``input_request`` on the stdin channel, and the test's reply is the command.
Every wait is bounded; no sleep stands in for synchronisation.
"""

from __future__ import annotations

import time
from queue import Empty
from typing import Any

import psutil
import pytest
from nbclient.util import run_sync

from helpers import procs
from kernel_helpers import NotebookKernel, strip_ansi, wait_gone
from nbtrain.system import registry

pytestmark = pytest.mark.timeout(600)

STEP_SECONDS = 60.0  # one relayed command's answer, on a loaded 2-core machine
GONE_SECONDS = 1.0  # the bound: a released rank's process is gone within it
FLAGS = "--devices 2 --accelerator cpu"


class Prompting:
    """A cell sent with stdin allowed; the test reads its output and answers its prompts."""

    def __init__(self, kernel: NotebookKernel, code: str):
        self.kc = kernel.client.kc
        self.msg_id = self.kc.execute(code, allow_stdin=True, stop_on_error=False)
        self.output = ""  # everything the cell printed so far (stdout, stderr, its error)
        self.read = 0  # how much of it the last expect() consumed
        self.prompts: list[str] = []
        self.reply: dict[str, Any] | None = None
        self.reply_at = 0.0  # when the reply came (monotonic)

    def _pump(self, timeout: float) -> None:
        try:
            message = run_sync(self.kc.get_iopub_msg)(timeout=timeout)
        except Empty:
            message = None
        if message is not None and message["parent_header"].get("msg_id") == self.msg_id:
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                self.output += content["text"]
            elif kind == "error":
                self.output += strip_ansi("\n".join(content["traceback"]))
        try:
            request = run_sync(self.kc.get_stdin_msg)(timeout=0.01)
        except Empty:
            request = None
        if request is not None and request["msg_type"] == "input_request":
            self.prompts.append(request["content"]["prompt"])
        if self.reply is None:
            try:
                shell = run_sync(self.kc.get_shell_msg)(timeout=0.01)
            except Empty:
                shell = None
            if shell is not None and shell["parent_header"].get("msg_id") == self.msg_id:
                self.reply, self.reply_at = shell["content"], time.monotonic()

    def prompt(self, timeout: float = STEP_SECONDS) -> str:
        """Wait for the next input request; its prompt."""
        deadline = time.monotonic() + timeout
        while not self.prompts:
            assert time.monotonic() < deadline, f"no prompt within {timeout} s; output:\n{self.output}"
            self._pump(0.05)
        return self.prompts.pop(0)

    def expect(self, *needles: str, timeout: float = STEP_SECONDS) -> str:
        """Wait until every needle is in the output printed since the last expect; that output."""
        deadline = time.monotonic() + timeout
        while not all(needle in self.output[self.read :] for needle in needles):
            assert time.monotonic() < deadline, f"{needles!r} not printed within {timeout} s:\n{self.output}"
            self._pump(0.05)
        seen, self.read = self.output[self.read :], len(self.output)
        return seen

    def send(self, line: str) -> None:
        self.kc.input(line)

    def finish(self, timeout: float = STEP_SECONDS) -> dict[str, Any]:
        """Wait for the cell's reply and its last output; the reply."""
        deadline = time.monotonic() + timeout
        while self.reply is None:
            assert time.monotonic() < deadline, f"no reply within {timeout} s; output:\n{self.output}"
            self._pump(0.05)
        # Output sent before the reply may still be on its way: read until the kernel is idle.
        idle_by = time.monotonic() + 5.0
        while time.monotonic() < idle_by:
            try:
                message = run_sync(self.kc.get_iopub_msg)(timeout=0.1)
            except Empty:
                continue
            if message["parent_header"].get("msg_id") != self.msg_id:
                continue
            if message["msg_type"] == "stream":
                self.output += message["content"]["text"]
            elif message["msg_type"] == "error":
                self.output += strip_ansi("\n".join(message["content"]["traceback"]))
            elif message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
        return self.reply


def _rank_pids(kernel: NotebookKernel) -> list[int]:
    """The ranks: the children of the kernel's launcher (forked ranks share its command line)."""
    pids = []
    for child in kernel.children():
        try:
            if "nbtrain.launch_server" in " ".join(child.cmdline()):
                pids += [rank.pid for rank in child.children()]
        except psutil.Error:
            continue
    return pids


@pytest.fixture(scope="module")
def kernel():
    k = NotebookKernel()
    try:
        k.run_ok("%load_ext nbtrain\nimport torch, nbtrain\n")
        k.run_ok(f"%%distributed {FLAGS}\nwarm = 1")  # the launcher is warm
        yield k
    finally:
        k.shutdown()


BREAK_CELL = f"""%%distributed {FLAGS}
x = torch.ones(3, 4) * (nbtrain.rank() + 1)
breakpoint()
y = x.sum().item()
total = nbtrain.all_reduce(torch.tensor(y)).item()
"""


def test_breakpoint_prompts_in_the_cell_and_runs_on(kernel: NotebookKernel) -> None:
    cell = Prompting(kernel, BREAK_CELL)
    assert cell.prompt() == "(Pdb) [rank 0] "
    cell.expect("-> y = x.sum().item()")
    cell.send("p x.shape")
    assert cell.prompt() == "(Pdb) [rank 0] "
    cell.expect("torch.Size([3, 4])")
    cell.send("l")
    cell.prompt()
    listing = cell.expect("breakpoint()")
    assert "x = torch.ones(3, 4)" in listing and "->" in listing, listing  # the cell's own lines
    cell.send("n")
    cell.prompt()
    cell.expect("-> total = nbtrain.all_reduce")
    cell.send("c")
    reply = cell.finish()
    assert reply["status"] == "ok", cell.output
    # rank 0 summed 12 ones, rank 1 twelve twos: the peers waited for rank 0's collective.
    assert kernel.value("total") == 36


def test_rank_one_and_all(kernel: NotebookKernel) -> None:
    code = f"%%distributed {FLAGS}\nr = nbtrain.rank()\nnbtrain.set_trace(rank=1)\ndone = r\n"
    cell = Prompting(kernel, code)
    assert cell.prompt() == "(Pdb) [rank 1] "
    cell.send("p r")
    cell.prompt()
    cell.expect("1")
    cell.send("c")
    assert cell.finish()["status"] == "ok", cell.output

    code = f'%%distributed {FLAGS}\nr = nbtrain.rank()\nnbtrain.set_trace(rank="all")\ndone = r\n'
    cell = Prompting(kernel, code)
    first = cell.prompt()
    cell.send("c")
    second = cell.prompt()
    assert sorted([first, second]) == ["(Pdb) [rank 0] ", "(Pdb) [rank 1] "]
    cell.send("c")
    assert cell.finish()["status"] == "ok", cell.output


def test_quit_ends_the_run_as_a_stop(kernel: NotebookKernel) -> None:
    cell = Prompting(kernel, BREAK_CELL.replace("total = ", "stopped_total = "))
    cell.prompt()
    cell.send("q")
    reply = cell.finish()
    assert reply["status"] == "error" and reply["ename"] == "RunStoppedError", cell.output
    assert "stopped by `q` in rank 0's debugger" in cell.output, cell.output
    assert kernel.value("'stopped_total' in globals()") is False


FAIL_CELL = f"""%%distributed {FLAGS}
def scale(batch, factor):
    shifted = batch - factor
    return shifted / (1 if nbtrain.rank() == 0 else shifted.sum().item() * 0 + undefined_name)

batch = torch.arange(6.0)
out = scale(batch, 2)
"""


def _released(kernel: NotebookKernel, timeout: float = 10.0) -> bool:
    """Whether the kernel heard, within ``timeout``, that no rank is held any more.

    The launcher reaps the rank, then tells the kernel, whose reader thread files it: the
    test polls that flag in the kernel, bounded.
    """
    code = (
        "import time as _t\n_c = nbtrain.kernel.launcher_connection.current_client()\n_end = _t.monotonic() + "
        f"{timeout}\nwhile _c.held is not None and _t.monotonic() < _end:\n    _t.sleep(0.02)\n"
        "print(_c.held is None)"
    )
    return kernel.run_ok(code).stdout.strip() == "True"


def _fail_and_hold(kernel: NotebookKernel) -> tuple[str, int]:
    """Run the failing cell; its output and the pid of the rank held for the post-mortem."""
    out = kernel.run(FAIL_CELL)
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    text = out.text
    assert "%nbtrain_debug opens the debugger in rank 1's frames (held for 10 min" in text, text
    pid = kernel.value("nbtrain.kernel.launcher_connection.current_client().held.pid")
    assert psutil.pid_exists(pid)
    return text, pid


def test_post_mortem_in_the_failed_rank(kernel: NotebookKernel) -> None:
    _text, pid = _fail_and_hold(kernel)
    cell = Prompting(kernel, "%nbtrain_debug")
    assert cell.prompt() == "(Pdb) [rank 1] "
    cell.expect("NameError", "-> return shifted / ")
    cell.send("p shifted")
    cell.prompt()
    cell.expect("tensor([-2., -1.,  0.,  1.,  2.,  3.])")
    cell.send("up")
    cell.prompt()
    cell.expect("-> out = scale(batch, 2)")
    cell.send("p batch.shape")
    cell.prompt()
    cell.expect("torch.Size([6])")
    cell.send("q")
    assert cell.finish()["status"] == "ok", cell.output
    assert "rank 1 is released" in cell.output, cell.output
    assert wait_gone([pid], GONE_SECONDS) == [], "the held rank outlived its debugger"
    assert _released(kernel)


def test_after_every_rank_raised_at_the_same_line_the_post_mortem_is_rank_0s(kernel: NotebookKernel) -> None:
    """Both ranks leave the same all-reduce and raise the same error: the launcher waits for rank 0's
    own (another rank's may come first), so rank 0 is the one held, and its frames are the ones opened."""
    out = kernel.run(
        f"%%distributed {FLAGS}\nmine = nbtrain.all_reduce(nbtrain.rank() + 1)\n"
        "raise RuntimeError(f'{mine} on every rank')\n"
    )
    assert out.error is not None and "RankError: rank 0 raised RuntimeError: 3 on every rank" in out.text, out.text
    assert "%nbtrain_debug opens the debugger in rank 0's frames (held for 10 min" in out.text, out.text
    pid = kernel.value("nbtrain.kernel.launcher_connection.current_client().held.pid")
    cell = Prompting(kernel, "%nbtrain_debug")
    assert cell.prompt() == "(Pdb) [rank 0] "
    cell.send("p nbtrain.rank(), mine")
    cell.prompt()
    cell.expect("(0, 3)")
    cell.send("q")
    assert cell.finish()["status"] == "ok", cell.output
    assert wait_gone([pid], GONE_SECONDS) == [], "the held rank outlived its debugger"
    assert _released(kernel)


def _held_in_registry(pid: int) -> list[str | None]:
    """What the run registry (the sidebar's runs listing) says each record with ``pid`` holds."""
    return [record.held for record in registry.read_all() if pid in record.pids]


def test_the_next_launch_releases_the_held_rank(kernel: NotebookKernel) -> None:
    _text, pid = _fail_and_hold(kernel)
    listed = _held_in_registry(pid)
    assert len(listed) == 1 and listed[0] is not None, listed
    assert listed[0].startswith(f"rank 1 (pid {pid}) kept for %nbtrain_debug, holding "), listed
    assert "MiB of host memory" in listed[0], listed
    out = kernel.run_ok(f"%%distributed {FLAGS}\nafter = nbtrain.rank()")
    assert "held for %nbtrain_debug, is released: this launch needs its devices" in out.text, out.text
    assert wait_gone([pid], 5.0) == []
    procs.wait_for(lambda: _held_in_registry(pid) == [None], 5.0, "the registry to list the rank as released")
    missing = kernel.run("%nbtrain_debug")
    assert "UsageError: %nbtrain_debug: no rank is held for a post-mortem" in missing.text, missing.text


def test_the_hold_ends_after_its_idle_time(kernel: NotebookKernel) -> None:
    kernel.run_ok("_previous = nbtrain.get_defaults()\nnbtrain.set_defaults(debug_hold=2)")
    try:
        out = kernel.run(FAIL_CELL)
        assert "(held for 2 s" in out.text, out.text
        pid = kernel.value("nbtrain.kernel.launcher_connection.current_client().held.pid")
        assert wait_gone([pid], 10.0) == [], "the held rank outlived its hold time"
        assert _released(kernel)
    finally:
        kernel.run_ok("nbtrain.set_defaults(**_previous.as_dict())")


def test_holding_off(kernel: NotebookKernel) -> None:
    kernel.run_ok("_previous = nbtrain.get_defaults()\nnbtrain.set_defaults(debug_hold='none')")
    try:
        out = kernel.run(FAIL_CELL)
        assert out.error is not None and "%nbtrain_debug" not in out.text, out.text
        assert _released(kernel)
    finally:
        kernel.run_ok("nbtrain.set_defaults(**_previous.as_dict())")


def test_a_rank_that_calls_sys_exit_is_not_held(kernel: NotebookKernel) -> None:
    """``sys.exit()`` ends a rank's cell as it ends a notebook cell (an error), but there is
    nothing to debug in it: its memory is not kept for a post-mortem."""
    out = kernel.run(f"%%distributed {FLAGS}\nimport sys\nif nbtrain.rank() == 1:\n    sys.exit(0)\n")
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    assert "rank 1 raised SystemExit: 0" in out.text and "%nbtrain_debug" not in out.text, out.text
    assert _released(kernel)


def test_an_interrupt_at_the_prompt_ends_everything() -> None:
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport torch, nbtrain\n")
        cell = Prompting(kernel, BREAK_CELL)
        cell.prompt()
        ranks = _rank_pids(kernel)
        assert ranks, "no rank was found under the kernel"
        interrupted = time.monotonic()
        kernel.interrupt()
        assert wait_gone(ranks, 2.0) == [], "ranks outlived the interrupt by 2 s"
        reply = cell.finish(timeout=10.0)
        took = cell.reply_at - interrupted
        assert reply["status"] == "error" and reply["ename"] == "RunInterrupted", cell.output
        assert took < 2.0, f"the cell ended {took:.1f} s after the interrupt"
        print(f"interrupt at the prompt: cell ended {took:.2f} s later")
        assert kernel.value("1 + 1") == 2  # the kernel is usable


def test_a_killed_kernel_takes_the_held_rank_with_it() -> None:
    kernel = NotebookKernel()
    try:
        kernel.run_ok("%load_ext nbtrain\nimport torch, nbtrain\n")
        _text, pid = _fail_and_hold(kernel)
        everything = [p.pid for p in kernel.descendants()]
        assert pid in everything
        psutil.Process(kernel.pid).kill()
        assert wait_gone(everything, GONE_SECONDS) == [], "processes outlived the killed kernel"
    finally:
        kernel.shutdown()


def test_ipython_debug_after_a_rank_error_opens_the_rank(kernel: NotebookKernel) -> None:
    _text, pid = _fail_and_hold(kernel)
    cell = Prompting(kernel, "%debug")
    assert cell.prompt() == "(Pdb) [rank 1] "  # the rank's frames, not the kernel's
    cell.expect("NameError")
    cell.send("q")
    assert cell.finish()["status"] == "ok", cell.output
    assert wait_gone([pid], GONE_SECONDS) == []


def test_a_rank_at_a_prompt_is_named_and_not_stalled() -> None:
    from nbtrain import livestate
    from nbtrain.kernel.display import livetext
    from nbtrain.messages import events

    state = livestate.LiveState("ddp_notebook", "cpu", 2, stall_seconds=30)
    state.apply(events.RankStarted(1, 0, 10), now=0.0)
    state.apply(events.RankStarted(1, 1, 11), now=0.0)
    state.apply(events.Metrics(1, 0, ((5, 0.0, {"loss": 1.0}),)), now=0.0)
    state.apply(events.DebugPrompt(1, 0, "(Pdb) "), now=1.0)
    assert "rank 0 in the debugger" in livetext.status_line(state, now=100.0)
    assert state.stall(now=100.0) is None  # a minute and a half at the prompt is no stall
    state.apply(events.DebugEnded(1, 0), now=101.0)
    assert "rank 0 in the debugger" not in livetext.status_line(state, now=102.0)
    assert state.stall(now=110.0) is None  # the clock waited while the prompt was open
    assert state.stall(now=140.0) == "no step from any rank for 40 s"


def test_set_trace_names_the_ranks_it_takes() -> None:
    from nbtrain.rank.machinery import debugger

    with pytest.raises(ValueError, match=r"set_trace\(rank='first'\): pass a rank number, a list of them, or 'all'"):
        debugger.selected(0, rank="first")


def test_a_breakpoint_in_a_launched_function(kernel: NotebookKernel) -> None:
    kernel.run_ok("def halves(v):\n    w = v / 2\n    breakpoint()\n    return w + nbtrain.rank()\n")
    cell = Prompting(kernel, 'launched = nbtrain.launch(halves, 8, devices=2, accelerator="cpu")')
    assert cell.prompt() == "(Pdb) [rank 0] "
    cell.send("p w")
    cell.prompt()
    cell.expect("4.0")
    cell.send("c")
    assert cell.finish()["status"] == "ok", cell.output
    assert kernel.value("launched") == 4.0


def test_interact_and_back(kernel: NotebookKernel) -> None:
    cell = Prompting(kernel, BREAK_CELL.replace("total = ", "interact_total = "))
    cell.prompt()
    cell.send("interact")
    assert cell.prompt() == ">>> [rank 0] "
    cell.send("x.sum()")
    assert cell.prompt() == ">>> [rank 0] "
    cell.expect("tensor(12.)")
    cell.send("^D")  # what an input box can send for end-of-input
    assert cell.prompt() == "(Pdb) [rank 0] "
    cell.send("c")
    assert cell.finish()["status"] == "ok", cell.output
    assert kernel.value("interact_total") == 36


def test_a_background_run_passes_its_breakpoint_and_says_so(kernel: NotebookKernel) -> None:
    kernel.run_ok(f"%%distributed {FLAGS} --background\nbreakpoint()\nbackground_value = nbtrain.rank() + 1\n")
    kernel.run_ok("_handle = nbtrain.runs()[-1]\n_handle.wait()")
    assert kernel.value("background_value") == 1  # it ran on past the breakpoint
    log = kernel.value("open(_handle.run.log_path).read()")
    assert "nbtrain: a breakpoint on rank 0" in log and "was passed: this run cannot prompt" in log, log
