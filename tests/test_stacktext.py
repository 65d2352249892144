"""A stuck run says where each rank was: faulthandler dumps, collected before the stop.

The dumps come from real ranks blocked in a real gloo all_reduce (a C++ wait no Python
handler could interrupt), through the launcher, into the error a caller or a cell sees.
"""

from __future__ import annotations

import inspect
import os
import re
import textwrap
import time

import pytest

import nbtrain
from helpers.procs import collect
from nbtrain.errors import RunStoppedError, RunTimeoutError
from nbtrain.messages import events, stacktext

STOP_BOUND = 5.0  # a stop with stack collection: at most 1 s for the dumps, then the usual stop

DUMP = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{site}/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "{site}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/ipykernel_7/123.py", line 12 in <module>
  File "{pkg}/rank/cell.py", line 120 in _execute
  File "{pkg}/rank/machinery/runtime.py", line 62 in run_rank
  File "{pkg}/launch_server/server.py", line 470 in _rank_main
  File "<frozen runpy>", line 88 in _run_code
"""
PKG = os.path.dirname(os.path.dirname(stacktext.__file__))
SITE = "/venv/lib/python3.11/site-packages"


def cells(filename: str) -> str | None:
    return "Cell In[5]" if filename == "/tmp/ipykernel_7/123.py" else None


def no_source(filename: str, line: int) -> str:
    return ""


def test_a_dump_parses_to_the_rank_runtime_s_frames_innermost_last():
    frames = stacktext.parse_dump(DUMP.format(site=SITE, pkg=PKG))
    assert [f.function for f in frames] == ["run_rank", "_execute", "<module>", "wrapper", "all_reduce"]
    assert frames[2] == stacktext.Frame("/tmp/ipykernel_7/123.py", 12, "<module>")


def test_a_standby_rank_s_dump_parses_from_its_own_runtime_and_says_it_finished():
    # A standby rank runs its cell under run_standby, not run_rank (nbtrain.launch_server.standby).
    dump = DUMP.replace(" in run_rank", " in run_standby").replace(
        'File "{site}/torch/distributed/distributed_c10d.py", line 2800 in all_reduce\n'
        '  File "{site}/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
        '  File "/tmp/ipykernel_7/123.py", line 12 in <module>\n'
        '  File "{pkg}/rank/cell.py", line 120 in _execute',
        'File "{pkg}/rank/machinery/runtime.py", line 390 in _wait_for_release',
    )
    frames = stacktext.parse_dump(dump.format(site=SITE, pkg=PKG))
    assert [f.function for f in frames] == ["run_standby", "_wait_for_release"]
    summary = stacktext.RankStack(0, frames).summary(cells, no_source)
    assert summary == "rank 0: finished its work, waiting for the other ranks"


def test_a_summary_names_the_collective_and_the_cell_line():
    stack = stacktext.RankStack(0, stacktext.parse_dump(DUMP.format(site=SITE, pkg=PKG)))
    assert stack.summary(cells, no_source) == "rank 0: waiting in all_reduce, Cell In[5], line 12"


def test_a_summary_names_the_call_on_the_cell_line_when_it_is_native_code():
    frames = (
        stacktext.Frame(f"{PKG}/rank/machinery/runtime.py", 62, "run_rank"),
        stacktext.Frame("/tmp/ipykernel_7/123.py", 7, "<module>"),
    )
    source = lambda filename, line: "    time.sleep(600)  # stuck\n"
    assert stacktext.RankStack(1, frames).summary(cells, source) == "rank 1: in time.sleep, Cell In[5], line 7"


def test_a_rank_that_finished_or_did_not_answer_says_so():
    done = (
        stacktext.Frame(f"{PKG}/rank/machinery/runtime.py", 62, "run_rank"),
        stacktext.Frame(f"{PKG}/rank/machinery/runtime.py", 230, "_wait_for_release"),
    )
    summary = stacktext.RankStack(1, done).summary(cells, no_source)
    assert summary == "rank 1: finished its work, waiting for the other ranks"
    assert stacktext.RankStack(2, ()).summary(cells, no_source) == "rank 2: no stack (it did not answer in time)"


def test_describe_lists_every_rank_then_each_stack_without_nbtrain_frames():
    stack = stacktext.RankStack(0, stacktext.parse_dump(DUMP.format(site=SITE, pkg=PKG)))
    text = stacktext.where_each_rank_was([stack, stacktext.RankStack(1, ())], cells, no_source)
    first, *rest = text.splitlines()
    assert first == (
        "Where each rank was: rank 0: waiting in all_reduce, Cell In[5], line 12 · "
        "rank 1: no stack (it did not answer in time)"
    )
    assert rest[0] == "rank 0 (most recent call last):"
    assert rest[1] == "  Cell In[5], line 12, in <module>"
    assert not any("nbtrain" in line or "runpy" in line for line in rest)


def _line_of(fn, needle: str) -> int:
    source, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(source) if needle in line)


def _wait_until_printed(run, needle: str, ranks: set[int], timeout: float = 60.0) -> list:
    seen, printed = [], set()
    deadline = time.monotonic() + timeout
    for event in run.events(poll=0.1):
        if event is not None:
            seen.append(event)
        if isinstance(event, events.Output) and needle in event.text:
            printed.add(event.rank)
        if printed >= ranks:
            return seen
        assert time.monotonic() < deadline, f"{needle!r} not printed by {ranks} within {timeout} s: {seen}"
        assert not isinstance(event, events.RunEnded), f"the run ended early: {event}"
    raise AssertionError("the run ended early")


def _wait_until_blocked(pid: int, wchan: str, timeout: float = 60.0) -> None:
    """Return once ``pid`` sits blocked in the kernel function ``wchan`` names, within ``timeout``.

    A rank's line can arrive before its print returned, and a rank can be between its print
    and its collective: blocked means the main thread sleeps in ``wchan`` and the process
    used no CPU time across three looks 50 ms apart.
    """
    deadline = time.monotonic() + timeout
    seen: list[tuple[str, int]] = []
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/wchan") as f:
            where = f.read()
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        seen = [*seen[-2:], (where, int(fields[11]) + int(fields[12]))]  # utime + stime
        if len(seen) == 3 and all(wchan in w and t == seen[0][1] for w, t in seen):
            return
        time.sleep(0.05)
    raise AssertionError(f"rank process {pid} not blocked in {wchan} within {timeout} s: {seen}")


def deadlocked():
    import torch
    import torch.distributed as dist

    print("entering", flush=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))  # rank 1 never joins: STUCK-ALLREDUCE
    else:
        time.sleep(600)  # STUCK-SLEEP


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn"])
def test_stopping_a_deadlocked_run_says_where_each_rank_was(launcher, strategy):
    run = nbtrain.start(deadlocked, devices=2, accelerator="cpu", strategy=strategy)
    _wait_until_printed(run, "entering", {0, 1})
    _wait_until_blocked(run.pids[0], "futex")  # in all_reduce, not on its way there
    _wait_until_blocked(run.pids[1], "nanosleep")  # in time.sleep, not still in print
    started = time.monotonic()
    run.stop()
    assert time.monotonic() - started < STOP_BOUND
    with pytest.raises(RunStoppedError) as caught:
        run.result()
    here = inspect.getsourcefile(deadlocked)
    assert caught.value.where.splitlines()[0] == (
        "Where each rank was: rank 0: waiting in all_reduce, "
        f'File "{here}", line {_line_of(deadlocked, "STUCK-ALLREDUCE")}'
        f' · rank 1: in time.sleep, File "{here}", line {_line_of(deadlocked, "STUCK-SLEEP")}'
    )
    assert "dist.all_reduce(torch.ones(4))" in str(caught.value)


def test_a_timeout_carries_the_stacks_and_a_healthy_rank_s_place(launcher):
    def one_rank_skips_the_collective():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(4))

    run = nbtrain.start(one_rank_skips_the_collective, devices=2, accelerator="cpu", timeout=8)
    _, error, _ = collect(run)
    assert isinstance(error, RunTimeoutError), error
    summary = error.where.splitlines()[0]
    assert "rank 0: waiting in all_reduce" in summary, summary
    assert "rank 1: finished its work, waiting for the other ranks" in summary, summary


def test_a_run_without_stack_dumps_stops_as_before(launcher, monkeypatch):
    monkeypatch.setenv(stacktext.DISABLE_VARIABLE, "0")
    run = nbtrain.start(deadlocked, devices=2, accelerator="cpu")
    _wait_until_printed(run, "entering", {0, 1})
    run.stop()
    with pytest.raises(RunStoppedError) as caught:
        run.result()
    assert caught.value.where == ""


def test_a_deadlocked_cell_names_each_rank_s_cell_and_line():
    from kernel_helpers import NotebookKernel

    cell = textwrap.dedent(
        """\
        %%distributed --devices 2 --accelerator cpu --timeout 20
        import torch, torch.distributed as dist
        t = torch.ones(3)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            time.sleep(600)
        """
    )
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport time")
        out = kernel.run(cell)
        number = kernel.value("len(get_ipython().history_manager.input_hist_parsed) - 2")
        assert out.error is not None and out.error["ename"] == "RunTimeoutError", out.text
        text = "\n".join(out.error["traceback"])
        assert (
            f"Where each rank was: rank 0: waiting in all_reduce, Cell In[{number}], line 5"
            f" · rank 1: in time.sleep, Cell In[{number}], line 7"
        ) in text, text
        assert "    dist.all_reduce(t)" in text and "    time.sleep(600)" in text, text
        kernel.run_ok("%%distributed --devices 2 --accelerator cpu\nok = 1")


def test_the_live_view_names_the_rank_that_stopped_stepping_before_the_timeout():
    from kernel_helpers import NotebookKernel

    cell = textwrap.dedent(
        """\
        %%distributed --devices 2 --accelerator cpu --timeout 10 --stall-warning 2
        import time, nbtrain
        for step in range(100000):
            if nbtrain.rank() == 1 and step == 3:
                time.sleep(600)
            nbtrain.log(value=step)  # no collective: rank 0 goes on stepping
            time.sleep(0.05)
        """
    )
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain")
        out = kernel.run(cell)
        assert out.error is not None and out.error["ename"] == "RunTimeoutError", out.text
        assert re.search(r"no step from rank 1 for \d+ s", out.live_view), out.live_view
        assert "no step from rank 0" not in out.live_view, out.live_view
        bad = kernel.run("%%distributed --devices 2 --accelerator cpu --stall-warning 0\nx = 1")
        assert "--stall-warning 0 is not a positive number of seconds; give one, or none for no warning." in bad.text
        line = kernel.value("__import__('nbtrain').set_defaults(stall_warning=None).magic_line()")
        assert line.endswith("--stall-warning none"), line
