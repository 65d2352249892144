"""The warm launcher (nbtrain.launch_server.server), driven record by record over its channel.

Each test talks to a launcher of its own, started as the kernel starts one, with the
records the kernel sends, and reads what comes back: the protocol without the kernel's
client in between. Rank functions are nested so that they travel by value.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from helpers import procs
from nbtrain import patches
from nbtrain.kernel import client
from nbtrain.messages import codepickle, events, wire
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan
from nbtrain.system import processes

READY_SECONDS = 120.0  # the launcher imports torch first
RUN_SECONDS = 60.0
GONE_SECONDS = 10.0


class Channel:
    """The kernel's end of one launcher's channel, and the ranks that launcher started."""

    def __init__(self, launcher: processes.LauncherProcess) -> None:
        self.launcher = launcher
        self.rank_pids: list[int] = []
        self.ready: events.LauncherReady | None = None

    def send(self, message: Any) -> None:
        wire.send(self.launcher.channel, message)

    def receive(self, timeout: float) -> Any:
        self.launcher.channel.settimeout(timeout)
        message, fds = wire.receive(self.launcher.channel)
        for fd in fds:
            os.close(fd)
        if isinstance(message, events.RankStarted):
            self.rank_pids.append(message.pid)
        elif isinstance(message, events.LauncherReady):
            self.ready = message
        return message

    def until_ended(self, timeout: float = RUN_SECONDS) -> list[Any]:
        """Every record up to the run's RunEnded (answering a ResultOffer as the kernel would)."""
        deadline = time.monotonic() + timeout
        seen: list[Any] = []
        while not seen or not isinstance(seen[-1], events.RunEnded):
            seen.append(self.receive(max(0.1, deadline - time.monotonic())))
            if isinstance(seen[-1], events.ResultOffer):
                self.send(events.ReleaseResult(seen[-1].run_id, send_file=True))
        return seen


def start_launcher() -> Channel:
    channel = Channel(processes.start_launcher())
    try:
        ready = channel.receive(READY_SECONDS)
    except BaseException:
        close(channel)
        raise
    assert isinstance(ready, events.LauncherReady) and ready.pid == channel.launcher.pid
    return channel


def close(channel: Channel) -> None:
    processes.stop_launcher(channel.launcher, grace=GONE_SECONDS)
    left = procs.wait_gone(channel.rank_pids, GONE_SECONDS, reaped=False)
    procs.kill_pids(left)
    assert left == [], f"ranks outlived their launcher: {left}"


@pytest.fixture(scope="module")
def shared() -> Iterator[Channel]:
    """One launcher for the tests that each run their own runs on it (it takes seconds to start)."""
    channel = start_launcher()
    try:
        yield channel
    finally:
        close(channel)


@pytest.fixture
def channel(shared: Channel) -> Iterator[Channel]:
    yield shared
    # Each test's runs ended, and their ranks with them: the next test starts from nothing.
    assert procs.wait_gone(shared.rank_pids, GONE_SECONDS, reaped=False) == []
    assert processes.children(shared.launcher.pid) == []


_run_ids = iter(range(1, 1000))


def start_run(
    run_id: int, fn: Callable[[], Any], devices: int = 2, timeout: float | None = None, standby: float | None = None
) -> events.StartRun:
    """As the kernel would send it; ``standby``: seconds standby ranks wait after it (None: none, so that
    each test here ends with no launcher child; tests/test_standby.py tests them)."""
    cfg = config.make_config(DevicePlan("cpu", tuple(range(devices))), strategy="ddp_notebook", timeout=timeout)
    payload = codepickle.dumps_keeping_filenames((fn, (), {}))  # as the kernel pickles it
    start = client._StartMessage(cfg, payload, has_tensor_file=False, with_log=False)(run_id)
    return dataclasses.replace(start, standby_seconds=standby)


def of_type(seen: list[Any], kind: type) -> list[Any]:
    return [m for m in seen if isinstance(m, kind)]


def test_the_launcher_says_it_is_ready_with_torch_preloaded_and_no_threads(channel):
    with open(f"/proc/{channel.launcher.pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    assert threads == 1  # it forks ranks: no other thread may hold a lock then
    assert channel.ready is not None and {"torch", "torch.distributed", "nbtrain.rank.machinery.runtime"} <= set(
        channel.ready.preloaded
    )
    # A rank installing a group of patches finds their factories imported, not on its run's way.
    assert set(patches.factory_modules()) - set(channel.ready.preloaded) == set()


def test_a_run_starts_every_rank_and_ends_with_rank_0s_result(channel):
    def work() -> Any:
        import nbtrain

        print(f"hello from {nbtrain.rank()}")
        return ("done", nbtrain.world_size())

    channel.send(start_run(next(_run_ids), work))
    seen = channel.until_ended()
    started = of_type(seen, events.RankStarted)
    assert sorted(m.rank for m in started) == [0, 1] and all(m.run_id == 1 for m in seen if hasattr(m, "run_id"))
    ended = seen[-1]
    assert ended.state == events.FINISHED and ended.failure is None
    assert pickle.loads(ended.result) == ("done", 2)
    printed = {(m.rank, m.text) for m in of_type(seen, events.Output)}
    assert printed == {(0, "hello from 0\n"), (1, "hello from 1\n")}


def test_a_rank_that_raises_fails_the_run_and_names_the_cause(channel):
    def fail_on_rank_1() -> None:
        import time

        import nbtrain

        if nbtrain.rank() == 1:
            raise ValueError("bad batch")
        time.sleep(60)  # rank 0 is stopped when rank 1 fails

    channel.send(start_run(next(_run_ids), fail_on_rank_1))
    ended = channel.until_ended()[-1]
    assert ended.state == events.FAILED and isinstance(ended.failure, events.RankFailed)
    assert (ended.failure.rank, ended.failure.exc_type, ended.failure.message) == (1, "ValueError", "bad batch")
    assert "raise ValueError" in ended.failure.traceback


def test_a_rank_that_dies_fails_the_run_with_its_signal(channel):
    def die_on_rank_0() -> None:
        import os
        import signal
        import time

        import nbtrain

        if nbtrain.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    channel.send(start_run(next(_run_ids), die_on_rank_0))
    ended = channel.until_ended()[-1]
    assert ended.state == events.FAILED and isinstance(ended.failure, events.RankExited)
    assert (ended.failure.rank, ended.failure.signal_number, ended.failure.reported) == (0, 9, False)


def test_stop_run_stops_every_rank_and_says_where_each_was(channel):
    def wait_forever() -> None:
        import time

        print("in the function", flush=True)
        while True:
            time.sleep(0.05)

    start = start_run(next(_run_ids), wait_forever)
    channel.send(start)
    outputs = 0
    while outputs < 2:  # both ranks are in the function, not still joining the process group
        outputs += isinstance(channel.receive(RUN_SECONDS), events.Output)
    channel.send(events.StopRun(start.run_id, "stopped with the Stop button"))
    ended = channel.until_ended()[-1]
    assert ended.state == events.STOPPED
    assert sorted(rank for rank, _ in ended.stacks) == [0, 1]
    assert all("wait_forever" in text for _, text in ended.stacks)  # each rank's stack at the stop
    assert procs.wait_gone(channel.rank_pids, GONE_SECONDS, reaped=False) == []


def test_a_run_past_its_timeout_is_stopped_as_timed_out(channel):
    def too_slow() -> None:
        import time

        time.sleep(60)

    channel.send(start_run(next(_run_ids), too_slow, devices=1, timeout=1))
    ended = channel.until_ended()[-1]
    assert ended.state == events.TIMED_OUT and ended.failure is None


def test_runs_are_independent_and_identified_by_their_id(channel):
    first, second = (
        start_run(next(_run_ids), lambda: "first", devices=1),
        start_run(next(_run_ids), lambda: "second", devices=1),
    )
    channel.send(first)
    channel.send(second)
    ended: dict[int, Any] = {}
    deadline = time.monotonic() + RUN_SECONDS
    while len(ended) < 2:
        message = channel.receive(max(0.1, deadline - time.monotonic()))
        if isinstance(message, events.RunEnded):
            ended[message.run_id] = pickle.loads(message.result)
    assert ended == {first.run_id: "first", second.run_id: "second"}


# --- the lifecycle of a real run -----------------------------------------------------------

# The launcher as python -m nbtrain.launch_server runs it, with its lifecycle's debug records
# written to a file: nothing else differs.
LOGGING_LAUNCHER = """
import logging, sys
handler = logging.FileHandler(sys.argv[1])
handler.setFormatter(logging.Formatter("%(message)s"))
lifecycle = logging.getLogger("nbtrain.launch_server.lifecycle")
lifecycle.addHandler(handler)
lifecycle.setLevel(logging.DEBUG)
from nbtrain.launch_server.server import main
main()
"""


def start_logging_launcher(log_path: str) -> Channel:
    kernel_end, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**os.environ, processes.CONTROL_FD_VARIABLE: str(launcher_end.fileno())}
    env[processes.ROLE_VARIABLE], env["OPENBLAS_NUM_THREADS"] = "launcher", "1"  # as processes.start_launcher
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", LOGGING_LAUNCHER, log_path],
            pass_fds=[launcher_end.fileno()],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
    finally:
        launcher_end.close()
    channel = Channel(processes.LauncherProcess(popen, kernel_end))
    try:
        assert isinstance(channel.receive(READY_SECONDS), events.LauncherReady)
    except BaseException:
        close(channel)
        raise
    return channel


def moves(log_path: str, run_id: int) -> list[tuple[str, ...]]:
    """The run's moves as the launcher logged them: (from, to) names."""
    with open(log_path) as log:
        lines = [line.split(": ", 1)[1] for line in log if line.startswith(f"run {run_id}: ")]
    return [tuple(line.strip().split(" -> ")) for line in lines]


def test_a_real_run_passes_through_the_lifecycles_states_and_logs_each_move(tmp_path):
    def fail_on_rank_1() -> None:
        import time

        import nbtrain

        if nbtrain.rank() == 1:
            raise ValueError("bad batch")
        time.sleep(60)  # rank 0 is stopped when rank 1 fails

    def wait_forever() -> None:
        import time

        print("in the function", flush=True)
        while True:
            time.sleep(0.05)

    log_path = str(tmp_path / "lifecycle.log")
    channel = start_logging_launcher(log_path)
    try:
        finished = start_run(next(_run_ids), lambda: "done")
        channel.send(finished)
        assert channel.until_ended()[-1].state == events.FINISHED
        stopped = start_run(next(_run_ids), wait_forever)
        channel.send(stopped)
        outputs = 0
        while outputs < 2:  # both ranks are in the function
            outputs += isinstance(channel.receive(RUN_SECONDS), events.Output)
        channel.send(events.StopRun(stopped.run_id, "stopped with the Stop button"))
        assert channel.until_ended()[-1].state == events.STOPPED
        failed = start_run(next(_run_ids), fail_on_rank_1)
        channel.send(failed)
        assert channel.until_ended()[-1].state == events.FAILED
    finally:
        close(channel)
    # A result with no tensors: no offer, the ranks are released at once.
    released = [("RUNNING", "RELEASED"), ("RELEASED", "DRAINING"), ("DRAINING", "ENDED")]
    assert moves(log_path, finished.run_id) == released
    stop = moves(log_path, stopped.run_id)
    assert stop[:2] == [("RUNNING", "DUMPING_STACKS"), ("DUMPING_STACKS", "TERMINATING")]
    assert stop[-2:] == [(stop[-2][0], "DRAINING"), ("DRAINING", "ENDED")] and stop[-2][0] in ("TERMINATING", "KILLED")
    # A failure: no stack dumps, every rank signalled at once (rank 0, asleep, with SIGTERM).
    fail = moves(log_path, failed.run_id)
    assert fail[0] == ("RUNNING", "TERMINATING") and fail[-1] == ("DRAINING", "ENDED")
