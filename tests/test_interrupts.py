"""Interrupts in a real Jupyter kernel: they stay interrupts, and they free what the run brought.

An interrupted ``%%distributed`` cell raises ``RunInterrupted`` (a KeyboardInterrupt that
carries nbtrain's message), the Python API re-raises KeyboardInterrupt, and none of them is
an Exception: ``except Exception`` around the call does not swallow the user's interrupt.
"""

from __future__ import annotations

import time

import psutil
import pytest

from kernel_helpers import OUR_FILES, NotebookKernel, wait_gone

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
END_BOUND = 10.0  # seconds from the interrupt to the cell's reply (a stop takes about 1 s)

SPIN = """
import nbtrain, time
def spin():
    print("running", nbtrain.rank(), flush=True)
    while True:
        time.sleep(0.01)
"""

# Each call runs until interrupted; the cell reports which handler saw the interrupt.
CALLS = {
    "cell": 'get_ipython().run_cell_magic("distributed", "--devices 2 --accelerator cpu", '
    '"import nbtrain, time\\nprint(\\"running\\", nbtrain.rank(), flush=True)\\n'
    'while True:\\n    time.sleep(0.01)\\n")',
    "launch": 'nbtrain.launch(spin, devices=2, accelerator="cpu")',
    "start-wait": (
        'nbtrain.start(spin, devices=2, accelerator="cpu")'
        '.wait(on_event=nbtrain.kernel.display.OutputPrinter("all", 2))'
    ),
}
EXPECTED = {"cell": "RunInterrupted", "launch": "KeyboardInterrupt", "start-wait": "KeyboardInterrupt"}

GUARDED = """
try:
    {call}
except Exception as error:
    print("swallowed by except Exception:", type(error).__name__)
except KeyboardInterrupt as error:
    print("a KeyboardInterrupt:", type(error).__name__, flush=True)
    raise
"""


@pytest.fixture(scope="module")
def kernel():
    k = NotebookKernel()
    try:
        # Standby ranks off: these tests count a run's own ranks among the launcher's children
        # (tests/test_standby.py stops and fails runs on standby ranks).
        k.run_ok(
            "%load_ext nbtrain\nimport torch, nbtrain.kernel.client\nnbtrain.set_defaults(standby_idle=None)\n" + SPIN
        )
        k.run_ok("%%distributed --devices 2 --accelerator cpu\nwarm = 1")  # the launcher is warm
        yield k
    finally:
        k.shutdown()


def _rank_pids(kernel: NotebookKernel) -> list[int]:
    launchers = [p for p in kernel.children() if "nbtrain.launch_server" in " ".join(p.cmdline())]
    assert len(launchers) == 1, launchers
    return [p.pid for p in launchers[0].children(recursive=True)]


@pytest.mark.parametrize("form", list(CALLS))
def test_an_interrupt_is_not_swallowed_by_except_exception(kernel, form):
    msg_id = kernel.start_cell(GUARDED.format(call=CALLS[form]))
    kernel.wait_for_stream(msg_id, ["running 0", "running 1"], timeout=60)
    ranks = _rank_pids(kernel)
    assert len(ranks) == 2, ranks
    started = time.monotonic()
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    elapsed = time.monotonic() - started

    assert "swallowed" not in out.stdout, out.stdout
    assert f"a KeyboardInterrupt: {EXPECTED[form]}" in out.stdout, out.text
    assert reply["status"] == "error" and reply["ename"] == EXPECTED[form], reply
    if form == "cell":
        text = "\n".join(out.error["traceback"])
        assert text.startswith("KeyboardInterrupt: the cell was interrupted and every rank was stopped."), text
        assert "The kernel is ready." in text and OUR_FILES not in text
    assert elapsed < END_BOUND, f"the cell ended {elapsed:.2f} s after the interrupt"
    assert wait_gone(ranks, 10.0) == []
    assert kernel.value("1 + 1") == 2


def test_an_interrupted_background_wait_raises_keyboard_interrupt_and_the_run_goes_on(kernel):
    kernel.run_ok('handle = nbtrain.launch(spin, devices=2, accelerator="cpu", background=True)')
    msg_id = kernel.start_cell(GUARDED.format(call='print("waiting", flush=True); handle.wait()'))
    kernel.wait_for_stream(msg_id, ["waiting"], timeout=60)
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    try:
        assert "swallowed" not in out.stdout, out.stdout
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        assert kernel.value("handle.state") == "running"  # by design: interrupts leave background runs alone
    finally:
        kernel.run_ok("handle.stop()")
    assert kernel.value("handle.state") == "stopped"


def test_an_interrupted_runs_1_gib_result_is_freed_at_once(kernel):
    kernel.run_ok("import gc; gc.collect()")
    process = psutil.Process(kernel.pid)
    before = process.memory_info().rss
    msg_id = kernel.start_cell("%%distributed --devices 1 --accelerator cpu\nbig = torch.ones(256 * 1024 * 1024)\n")
    # Interrupt once the kernel is copying rank 0's 1 GiB result out of rank 0's memory.
    deadline = time.monotonic() + 120
    while process.memory_info().rss < before + 128 * MIB:
        assert time.monotonic() < deadline, "the kernel never started copying the result"
        time.sleep(0.005)
    started = time.monotonic()
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    elapsed = time.monotonic() - started
    after = process.memory_info().rss

    assert reply["status"] == "error" and reply["ename"] == "RunInterrupted", (reply, out.text)
    assert after - before < 200 * MIB, f"kernel RSS {before / MIB:.0f} MiB before, {after / MIB:.0f} MiB after"
    assert elapsed < END_BOUND, f"the cell ended {elapsed:.2f} s after the interrupt"
    assert kernel.value("'big' in globals()") is False
    print(f"\ninterrupt -> reply {elapsed:.2f} s; kernel RSS {before / MIB:.0f} -> {after / MIB:.0f} MiB")


# An interrupt injected at the N-th line the launch sequence executes: a trace function
# counts the lines of these functions and sends the kernel SIGINT at the chosen one, so
# the signal arrives exactly as Jupyter's "interrupt kernel" would, at that instant.
INJECTOR = """
import linecache, os, signal, sys
import nbtrain.kernel.magic
from nbtrain.kernel import cellrun as _cellrun, client as _client, launcher_connection as _connection
from nbtrain.kernel import run_handle as _run_handle
_TARGETS = {f.__code__ for f in (
    _cellrun.run_distributed_cell, _cellrun._run_cell, _cellrun._launch_and_follow, _cellrun._follow,
    _cellrun.start_cell, _client.start, _connection.LauncherClient.submit, _run_handle.Run.__init__,
    _run_handle.Run.events,
)}


class _Injector:
    def __init__(self, at):
        self.at, self.count, self.fired = at, 0, False

    def __call__(self, frame, event, arg):
        return self.line if frame.f_code in _TARGETS else None

    def line(self, frame, event, arg):
        # A `try:` line is a no-op where no signal is ever taken: raised there by this
        # function, an interrupt would seem to land outside the try it opens.
        if event == "line" and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() != "try:":
            self.count += 1
            if self.count == self.at:
                self.fired = True
                os.kill(os.getpid(), signal.SIGINT)
        return self.line


_injected = []


def _inject(at):
    injector = _Injector(at)
    sys.settrace(injector)
    try:
        get_ipython().run_cell_magic("distributed", "--devices 1 --accelerator cpu", "x = nbtrain.rank() + 1\\n")
    finally:
        sys.settrace(None)
        _injected.append({"count": injector.count, "fired": injector.fired})
"""
FINAL_STATES = {"finished", "failed", "stopped", "timed out"}


def _launcher_children(kernel: NotebookKernel) -> list[int]:
    return [p.pid for p in kernel.descendants() if "nbtrain.launch_server" not in " ".join(p.cmdline())]


@pytest.mark.slow
def test_an_interrupt_at_every_line_of_the_launch_prevents_or_stops_the_run(kernel):
    kernel.run_ok(INJECTOR + "x = 0\n_inject(0)")  # counting only: no interrupt
    total = kernel.value("_injected[-1]['count']")
    assert kernel.value("x") == 1 and total > 20, total
    outcomes: dict[str, int] = {}
    for at in range(1, total + 1):
        out = kernel.run(f"x = 0\n_inject({at})")
        seen = kernel.value("[_injected[-1], nbtrain.kernel.cellrun.last_run.state, x]")
        injected, state, x = seen
        where = f"interrupt at line {at} of {total}: {out.text[-600:]}"
        assert state in FINAL_STATES, where
        if not injected["fired"]:  # the run ended in fewer lines this time
            assert out.error is None and x == 1 and state == "finished", where
            outcomes["ended first"] = outcomes.get("ended first", 0) + 1
            continue
        assert out.error is not None and out.error["ename"] == "RunInterrupted", where
        message = out.error["evalue"]
        assert message.startswith("the cell was interrupted"), where
        assert OUR_FILES not in "\n".join(out.error["traceback"]), where
        late = "its results are in the kernel" in message
        assert x == (1 if late else 0), where  # all of the results, or none of them
        kind = "after the results" if late else "before the start" if "before it started" in message else "stopped"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        left = wait_gone(_launcher_children(kernel), 10.0)
        assert not left, f"ranks left running: {left}; {where}"
    assert outcomes.get("stopped", 0) > 0 and outcomes.get("before the start", 0) > 0, outcomes
    kernel.run_ok("x = 0")
    kernel.run_ok("%%distributed --devices 2 --accelerator cpu\nx = nbtrain.rank() + 1")
    assert kernel.value("x") == 1  # the kernel and its launcher work as before
    print(f"\n{total} lines, outcomes: {outcomes}")
