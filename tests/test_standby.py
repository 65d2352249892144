"""Standby ranks (nbtrain.launch_server.standby): the next run's ranks, waiting after a run.

Cells run in a real kernel: a matching cell takes the waiting ranks (their pids, started
before the cell was sent; a cell that changes only its precision too, with its own settings),
a changed plan, environment variable or sys.path discards them,
``nbtrain.release()`` and the idle limit end them, one killed while waiting is replaced
without the next cell noticing, and no cell sees what an earlier one left in its ranks.
The re-run soak launches from this process, where its descriptors and memory can be read.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import nbtrain
from helpers import procs
from kernel_helpers import LAUNCHER_PID, NotebookKernel, wait_gone
from nbtrain.kernel import launcher_connection
from nbtrain.messages import events

GONE_SECONDS = 10.0
STANDBY_SECONDS = 60.0  # a loaded 2-core machine: the ranks fork and join their group after the run

# In the kernel: wait (bounded) until standby ranks are waiting, all joined, none of ``old``;
# their [pid, start time] pairs.
WAIT_FOR_STANDBY = """
import time as _time, psutil as _psutil, nbtrain as _nbtrain

def _standby(old=(), timeout=60.0):
    deadline = _time.monotonic() + timeout
    while _time.monotonic() < deadline:
        waiting = [r for r in _nbtrain.runs() if r.state == "standby" and r.ready]
        if waiting and not {r.pid for r in waiting[0].ranks} & set(old):
            return [[r.pid, _psutil.Process(r.pid).create_time()] for r in waiting[0].ranks]
        _time.sleep(0.02)
    raise AssertionError(f"no standby ranks within {timeout} s: {_nbtrain.runs()}")
"""

TWO_RANKS = "%%distributed --devices 2 --accelerator cpu\n"
GATHER_PIDS = (
    "import os\nimport torch.distributed as dist\n"
    "pids = [None] * dist.get_world_size()\ndist.all_gather_object(pids, os.getpid())\n"
)


@pytest.fixture(scope="module")
def kernel() -> Iterator[NotebookKernel]:
    with NotebookKernel() as k:
        k.run_ok("%load_ext nbtrain\nimport nbtrain")
        k.run_ok(WAIT_FOR_STANDBY)
        yield k


def standby(kernel: NotebookKernel, old: list[int] = ()) -> dict[int, float]:  # type: ignore[assignment]
    """The waiting ranks' pid -> start time, once they are all in their group."""
    return {pid: started for pid, started in kernel.value(f"_standby({list(old)!r}, {STANDBY_SECONDS})")}


def run_two(kernel: NotebookKernel) -> list[int]:
    kernel.run_ok(TWO_RANKS + GATHER_PIDS)
    return list(kernel.value("pids"))


def test_a_matching_cell_takes_the_ranks_started_before_it_was_sent(kernel):
    run_two(kernel)
    waiting = standby(kernel)
    sent = time.time()
    pids = run_two(kernel)
    assert sorted(pids) == sorted(waiting)
    assert all(started < sent for started in waiting.values()), (waiting, sent)


@pytest.mark.parametrize(
    ("change", "undo", "line"),
    [
        ("import os; os.environ['NBTRAIN_TEST_CHANGED'] = '1'", "del os.environ['NBTRAIN_TEST_CHANGED']", TWO_RANKS),
        ("import sys; sys.path.append('/nbtrain-test-changed')", "sys.path.remove('/nbtrain-test-changed')", TWO_RANKS),
        ("", "", "%%distributed --devices 1 --accelerator cpu\n"),
    ],
    ids=["environment variable", "sys.path", "plan"],
)
def test_a_changed_environment_sys_path_or_plan_discards_them(kernel, change, undo, line):
    run_two(kernel)
    waiting = list(standby(kernel))
    kernel.run_ok(change)
    try:
        kernel.run_ok(line + GATHER_PIDS)
        pids = kernel.value("pids")
    finally:
        kernel.run_ok(undo)
    assert not set(pids) & set(waiting)  # fresh ranks, forked for this cell
    assert wait_gone(waiting, GONE_SECONDS) == []


def test_a_cell_that_changes_only_what_the_ranks_are_told_takes_them_with_its_own_settings(kernel):
    run_two(kernel)
    waiting = standby(kernel)
    told = (
        "from nbtrain.rank.machinery import settings\n"
        "print('told', settings.current().precision, settings.current().sync_batchnorm)\n"
    )
    out = kernel.run_ok(TWO_RANKS.rstrip() + " --precision bf16-mixed --sync-batchnorm\n" + GATHER_PIDS + told)
    assert sorted(kernel.value("pids")) == sorted(waiting)  # the ranks forked after a 32-true run
    assert "[rank 1] told bf16-mixed True" in out.stdout, out.text  # ... read this run's settings


def test_release_ends_them_and_the_next_run_starts_fresh_ones(kernel):
    run_two(kernel)
    waiting = list(standby(kernel))
    assert kernel.value("nbtrain.release()") == 2
    assert wait_gone(waiting, GONE_SECONDS) == []
    assert kernel.value("[r.state for r in nbtrain.runs()]") == []
    pids = run_two(kernel)
    assert not set(pids) & set(waiting)
    assert len(standby(kernel)) == 2  # after that run, new ones wait again


def test_they_end_after_the_idle_limit(kernel):
    kernel.run_ok("nbtrain.set_defaults(standby_idle=5)")
    try:
        run_two(kernel)
        waiting = list(standby(kernel))
        assert wait_gone(waiting, GONE_SECONDS + 5) == []
        # The kernel hears of their end from the launcher, just after they are gone: bounded.
        procs.wait_for(lambda: kernel.value("[r.state for r in nbtrain.runs()]") == [], 5.0, "standby still listed")
    finally:
        kernel.run_ok("nbtrain.reset_defaults()")


def test_one_killed_while_waiting_is_replaced_and_the_next_cell_never_hears_of_it(kernel):
    run_two(kernel)
    waiting = list(standby(kernel))
    os.kill(waiting[1], signal.SIGKILL)
    replaced = standby(kernel, waiting)
    out = kernel.run_ok(TWO_RANKS + GATHER_PIDS)
    assert sorted(kernel.value("pids")) == sorted(replaced)
    assert "exited" not in out.text and "killed" not in out.text.lower()
    assert wait_gone(waiting, GONE_SECONDS) == []


def test_deaths_the_launcher_hears_of_in_one_batch_leave_it_serving(kernel):
    """Both waiting ranks die while the launcher is stopped, so it hears of every exit and EOF
    in one select batch, and handling the first death discards the other rank's registrations
    (a stale event of that batch must then be passed over, not read)."""
    run_two(kernel)
    waiting = list(standby(kernel))
    launcher = kernel.value(LAUNCHER_PID)
    os.kill(launcher, signal.SIGSTOP)
    try:
        for pid in waiting:  # one after the other: the first one's exit is ahead of the second's EOF
            os.kill(pid, signal.SIGKILL)
            procs.wait_for(lambda pid=pid: procs.is_zombie(pid), GONE_SECONDS, f"rank {pid} did not exit")
    finally:
        os.kill(launcher, signal.SIGCONT)
    replaced = standby(kernel, waiting)
    kernel.run_ok(TWO_RANKS + GATHER_PIDS)
    assert sorted(kernel.value("pids")) == sorted(replaced)
    assert kernel.value(LAUNCHER_PID) == launcher  # the same launcher: it did not fall over


def test_a_cell_never_sees_what_an_earlier_cell_left(kernel):
    kernel.run_ok(
        TWO_RANKS + "import builtins, json, sys, types, torch\n"
        "json.nbtrain_leftover = 1\n"
        "builtins.nbtrain_leftover = 1\n"
        "sys.modules['nbtrain_leftover'] = types.ModuleType('nbtrain_leftover')\n"
        "torch.set_default_dtype(torch.float64)\n"
    )
    waiting = standby(kernel)
    kernel.run_ok(
        TWO_RANKS + "import builtins, json, os, sys, torch\n"
        "seen = [hasattr(json, 'nbtrain_leftover'), hasattr(builtins, 'nbtrain_leftover'),\n"
        "        'nbtrain_leftover' in sys.modules, torch.cuda.is_initialized(),\n"
        "        torch.get_default_dtype() == torch.float64,\n"
        "        os.getpid()]\n"
    )
    seen = kernel.value("seen")
    assert seen[:5] == [False] * 5
    assert seen[5] in waiting  # the cell ran on ranks that were waiting


def test_their_warm_up_leaves_the_cell_no_name_and_no_random_draw(kernel):
    """Before it waits, a standby rank runs a trivial cell of its own (runtime._warm_the_way)."""
    run_two(kernel)
    waiting = standby(kernel)
    kernel.run_ok(
        "import random, torch\nstate = (random.getstate(), torch.get_rng_state())\n"
        "expected = (random.random(), torch.rand(1).item())\n"
        "random.setstate(state[0]); torch.set_rng_state(state[1])\n"
    )
    kernel.run_ok(
        TWO_RANKS + "import os\ndrawn = (random.random(), torch.rand(1).item())\n"
        "try:\n    x\n    leftover = True\nexcept NameError:\n    leftover = False\n"
        "pid = os.getpid()\n"
    )
    assert kernel.value("drawn == expected") and kernel.value("leftover") is False
    assert kernel.value("pid") in waiting  # rank 0 was one of the waiting ranks


def test_they_import_the_libraries_the_last_payload_needed_and_never_the_users_own_modules(kernel, tmp_path):
    """Unpickling a model imports its classes' modules; standby ranks import those of libraries ahead.

    The user's own module, which the kernel imported, each run imports before its payload
    (nbtrain.rank.machinery.reimport) as it is on disk by then: never ahead.
    """
    (tmp_path / "nbtrain_users_module.py").write_text("def double(x):\n    return 2 * x\n")
    kernel.run_ok(f"import sys\nsys.path.append({str(tmp_path)!r})\nimport wave, nbtrain_users_module\n")
    try:
        # The payload carries both functions by reference: each rank imports their modules to load it.
        kernel.run_ok(TWO_RANKS + "used = (wave.open.__module__, nbtrain_users_module.double(2))\n")
        assert kernel.value("used") == ["wave", 4]
        seen = []
        for _ in range(2):  # and again after a run that found them imported already
            waiting = standby(kernel, [pid for pid, _ in seen])
            # Edited while they wait (a new size: no stale bytecode): imported ahead, it would be the old one.
            factor = 3 if not seen else 40
            (tmp_path / "nbtrain_users_module.py").write_text(f"def double(x):\n    return {factor} * x\n")
            kernel.run_ok(
                TWO_RANKS + "import os, sys\n"
                "ahead = ['wave' in sys.modules, sys.modules['nbtrain_users_module'].double(1)]\npid = os.getpid()\n"
            )
            seen.append((kernel.value("pid"), kernel.value("ahead")))
            assert seen[-1][0] in waiting
    finally:
        kernel.run_ok(f"sys.path.remove({str(tmp_path)!r})")
    # The user's module is imported by the run that uses it, as edited by then.
    assert [ahead for _, ahead in seen] == [[True, 3], [True, 40]]


def test_a_failure_and_a_timeout_on_standby_ranks_end_as_on_fresh_ones(kernel):
    run_two(kernel)
    waiting = standby(kernel)
    out = kernel.run(TWO_RANKS + "import nbtrain\nif nbtrain.rank() == 1:\n    raise ValueError('rank 1 fails')\n")
    assert out.error is not None and "rank 1 raised ValueError: rank 1 fails" in out.text, out.text
    # Rank 1, the root cause, is held for %nbtrain_debug; the next launch releases it.
    held = wait_gone(list(waiting), GONE_SECONDS)
    assert len(held) == 1 and "%nbtrain_debug opens the debugger in rank 1's frames" in out.text, out.text
    waiting = standby(kernel)  # a failed run is followed by standby ranks too: the fix is re-run next
    rank_one_sleeps = "import time, nbtrain\nif nbtrain.rank() == 1:\n    time.sleep(60)\n"
    out = kernel.run("%%distributed --devices 2 --accelerator cpu --timeout 2\n" + rank_one_sleeps)
    assert out.error is not None and "RunTimeoutError" in out.text, out.text
    # Where each rank was: their stacks, asked for before the stop, as fresh ranks' would say.
    assert "rank 0: finished its work, waiting for the other ranks" in out.text, out.text
    assert "rank 1: in time.sleep" in out.text and "time.sleep(60)" in out.text, out.text
    assert wait_gone(list(waiting) + held, GONE_SECONDS) == []
    assert kernel.value("[r.state for r in nbtrain.runs()]") == []  # none after a timeout
    assert len(run_two(kernel)) == 2


def test_the_sidebar_lists_them_with_their_memory_and_dismiss_ends_them(launcher, tmp_path, monkeypatch):
    from nbtrain.serverext import runs, usage
    from nbtrain.system import registry

    monkeypatch.setenv("NBTRAIN_RUNTIME_DIR", str(tmp_path))  # the run's environment names it
    nbtrain.launch(lambda: None, devices=2, accelerator="cpu")
    waiting = _waiting()
    deadline = time.monotonic() + STANDBY_SECONDS
    while not (shown := [r for r in runs.list_runs() if r["state"] == "standby"]):
        assert time.monotonic() < deadline, registry.read_all()
        time.sleep(0.02)
    assert sorted(shown[0]["live_pids"]) == sorted(waiting) and shown[0]["world_size"] == 2
    memory = {rank["pid"]: rank["rss"] for rank in usage.snapshot(usage.HostSampler())["ranks"]}
    assert all(memory.get(pid, 0) > 0 for pid in waiting), memory
    runs.clean(shown[0]["id"])  # the sidebar's Dismiss
    assert procs.wait_gone(waiting, GONE_SECONDS, reaped=False) == []
    deadline = time.monotonic() + GONE_SECONDS
    while (state := launcher_connection.get_client().standby) is not None and state.ranks:  # the launcher saw them die
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    replaced_by = time.monotonic() + 1.0  # a replacement would be forked at once: look for one for 1 s
    while time.monotonic() < replaced_by:
        state = launcher_connection.get_client().standby
        assert state is None or not state.ranks, state
        time.sleep(0.05)
    assert procs.wait_gone([p.pid for p in procs.launcher_children()], GONE_SECONDS, reaped=False) == []


def test_the_next_ranks_are_forked_as_a_finished_runs_ranks_are_released_not_after_their_exits(launcher):
    # On a GPU a rank's exit takes about 0.15 s: a re-run sent as the cell returns waited for it.
    nbtrain.release()
    run = nbtrain.start(lambda: None, devices=2, accelerator="cpu")
    waiting_at_exits = [
        launcher.standby is not None and bool(launcher.standby.ranks)  # set by the reader thread, in order
        for event in run.events()
        if isinstance(event, events.RankExited)
    ]
    assert waiting_at_exits == [True, True]


def test_no_ranks_wait_after_a_cell_an_interrupt_stopped_at_a_step(kernel):
    run_two(kernel)
    standby(kernel)
    msg_id = kernel.start_cell(
        TWO_RANKS + "import time, torch\nmodel = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor step in range(100000):\n"
        "    model(torch.ones(1, 2)).sum().backward()\n    opt.step()\n"
        "    if step == 3:\n        print('training', flush=True)\n    time.sleep(0.01)\n"
    )
    kernel.wait_for_stream(msg_id, ["training"], timeout=120)
    kernel.interrupt()  # every rank stops at one step, and their state there comes back: they are released
    _, out = kernel.wait_for_reply(msg_id, timeout=120)
    assert "stopped at step" in out.text, out.text
    assert kernel.value("[r.state for r in nbtrain.runs()]") == []  # the user wanted things to stop


# --- from this process: the soak ------------------------------------------------------------------


def _waiting(timeout: float = STANDBY_SECONDS) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = launcher_connection.get_client().standby
        if state is not None and state.ready:
            return [pid for _, pid in state.ranks]
        time.sleep(0.02)
    raise AssertionError(f"no standby ranks within {timeout} s")


def _launcher_rss() -> int:
    launcher = procs.current_launcher()
    assert launcher is not None
    return int(launcher.memory_info().rss)


@pytest.mark.slow
def test_a_hundred_re_runs_leave_no_growth_in_processes_descriptors_or_memory(launcher):
    def job() -> Any:
        import os

        return os.getpid()

    for _ in range(5):  # warm: the launcher's and this process's first-run allocations
        nbtrain.launch(job, devices=2, accelerator="cpu")
    _waiting()
    before, rss = procs.snapshot(), _launcher_rss()
    taken = 0
    for _ in range(100):
        waiting = _waiting()
        taken += nbtrain.launch(job, devices=2, accelerator="cpu") in waiting
    _waiting()
    after = procs.snapshot()
    assert taken == 100  # every re-run ran on the ranks waiting for it
    # This process may close descriptors an earlier test left to the collector: no growth is the check.
    assert after.fds <= before.fds, (before, after)
    assert (after.launcher_fds, after.launcher_children, after.threads) == (
        before.launcher_fds,
        before.launcher_children,
        before.threads,
    )
    assert after.shm == before.shm
    assert _launcher_rss() - rss < 8 << 20, "the launcher grew by more than 8 MiB over 100 runs"
    assert psutil.Process().num_fds() <= before.fds
