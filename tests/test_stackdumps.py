"""Each rank's stack dump before a stop (nbtrain.launch_server.stackdumps), from a real process.

A forked child registers its faulthandler on a pipe as a rank does (nbtrain.rank.machinery.runtime);
the launcher's functions ask for its dump, read it and parse it. Runs stopped through a
real launcher, with every rank's dump in RunEnded, are in tests/test_launch_server_server.py.
"""

from __future__ import annotations

import faulthandler
import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from nbtrain.launch_server import stackdumps
from nbtrain.launch_server.launched import LauncherRun, RankProcess
from nbtrain.launch_server.lifecycle import Lifecycle, RunPhase
from nbtrain.launch_server.rankpipes import RankOutput
from nbtrain.messages import events, stacktext
from nbtrain.system import processes

DUMP_SECONDS = 10.0


def sleeping_in_a_named_function(ready: int) -> None:
    os.write(ready, b"x")
    while True:
        time.sleep(0.01)


@pytest.fixture
def rank() -> Iterator[RankProcess]:
    """A child that dumps its stack on the rank's signal to the pipe the launcher reads."""
    stack_read, stack_write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            faulthandler.register(stacktext.DUMP_SIGNAL, file=stack_write, all_threads=True, chain=False)
            sleeping_in_a_named_function(ready_write)
        finally:
            os._exit(1)
    os.close(stack_write)
    os.close(ready_write)
    ours, theirs = socket.socketpair()
    theirs.close()
    spec = events.RankSpec(0, 0, 1, "cpu", None)
    process = RankProcess(spec, pid, processes.open_pidfd(pid), ours, {}, RankOutput(0, None))
    process.stack_fd = stack_read
    os.set_blocking(stack_read, False)
    try:
        assert os.read(ready_read, 1) == b"x"  # its handler is registered
        yield process
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (ready_read, process.pidfd, *([] if process.stack_fd is None else [process.stack_fd])):
            os.close(fd)
        ours.close()


def test_a_rank_asked_for_its_dump_writes_it_and_the_launcher_reads_where_it_was(rank):
    run = LauncherRun(1, [rank], None, Lifecycle(1, now=0.0))
    run.move(RunPhase.DUMPING_STACKS, outcome=events.STOPPED)
    selector = selectors.DefaultSelector()
    assert rank.stack_fd is not None
    selector.register(rank.stack_fd, selectors.EVENT_READ)
    try:
        assert stackdumps.request_dumps(run) and rank.stack_asked
        deadline = time.monotonic() + DUMP_SECONDS
        while not stackdumps.dumps_in(run, time.monotonic()) and time.monotonic() < deadline:
            if selector.select(0.05):
                stackdumps.read_dump(selector, rank)
        assert stackdumps.dumps_in(run, time.monotonic())
        assert "sleeping_in_a_named_function" in [frame.function for frame in stackdumps.frames_of(rank)]
        assert [number for number, _ in stackdumps.dumps_of(run)] == [0]
        stackdumps.close_dump(selector, rank)
        assert rank.stack_fd is None and not selector.get_map()
    finally:
        selector.close()


def test_a_run_whose_ranks_cannot_answer_asks_nothing_and_has_no_dumps(rank):
    rank.exited = True  # gone already: nobody to ask
    run = LauncherRun(2, [rank], None, Lifecycle(2, now=0.0))
    run.lifecycle.learn(outcome=events.FINISHED)
    assert not stackdumps.request_dumps(run) and not rank.stack_asked
    assert stackdumps.dumps_in(run, time.monotonic()) and stackdumps.dumps_of(run) == ()
