"""The rank a failed run keeps for a post-mortem (nbtrain.launch_server.heldranks), as a real process.

A forked child stands in for the root-cause rank; HeldRanks keeps it, routes the kernel's
debugger messages to it, ends it when its hold time passes idle, and says why it went.
The whole path through a kernel (``%nbtrain_debug``) is in tests/test_debugger.py.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nbtrain.launch_server import heldranks, registryentries
from nbtrain.launch_server.launched import LauncherRun, RankProcess
from nbtrain.launch_server.lifecycle import Lifecycle
from nbtrain.launch_server.rankpipes import RankOutput
from nbtrain.messages import events, wire
from nbtrain.system import processes

GONE_SECONDS = 10.0


@pytest.fixture
def held() -> Iterator[tuple[heldranks.HeldRanks, list[Any], LauncherRun, RankProcess, socket.socket]]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            os.setpgid(0, 0)  # a rank leads its own group: HeldRanks signals the group
            signal.pause()
        finally:
            os._exit(0)
    try:
        os.setpgid(pid, pid)
    except PermissionError:
        pass  # the child got there first
    spec = events.RankSpec(1, 1, 2, "cpu", None)
    rank = RankProcess(spec, pid, processes.open_pidfd(pid), ours, {}, RankOutput(1, None), held=True)
    run = LauncherRun(7, [rank], None, Lifecycle(7, now=0.0), debug_hold=30.0)
    selector = selectors.DefaultSelector()
    selector.register(rank.pidfd, selectors.EVENT_READ)
    selector.register(rank.channel, selectors.EVENT_READ)
    sent: list[Any] = []
    board = registryentries.Board(registryentries.find_owner(os.getpid()))
    try:
        yield heldranks.HeldRanks(selector, sent.append, board), sent, run, rank, theirs
    finally:
        if not rank.exited:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(rank.pidfd)
            ours.close()
        theirs.close()
        selector.close()


def test_a_held_rank_is_reported_relayed_to_and_ended_when_its_hold_time_passes_idle(held):
    ranks, sent, run, rank, rank_end = held
    ranks.keep(run, rank)
    assert isinstance(sent[-1], events.RankHeld) and (sent[-1].rank, sent[-1].pid) == (1, rank.pid)
    assert run.held_text is not None and run.held_text.startswith(f"rank 1 (pid {rank.pid}) kept for %nbtrain_debug")
    assert ranks and ranks.pids() == {rank.pid} and ranks.get(7, 1) is rank and ranks.get(7, 0) is None
    ranks.relay(events.DebugInput(7, 1, "p x"), {})  # the kernel's input reaches the held rank
    rank_end.settimeout(GONE_SECONDS)
    assert wire.receive(rank_end)[0] == events.DebugInput(7, 1, "p x")
    ranks.tick(time.monotonic() + 31.0)  # its 30 s passed with no post-mortem open
    assert ranks.selector.select(GONE_SECONDS)  # its pidfd fires
    ranks.on_exit(run, rank)
    assert rank.exited and not ranks and ranks.get(7, 1) is None
    assert sent[-1] == events.HeldReleased(7, 1, "it was held idle for its whole hold time")


def test_attaching_to_a_rank_no_longer_held_says_so(held):
    ranks, sent, _run, _rank, _ = held
    ranks.relay(events.AttachHeld(9, 0), {})
    assert sent == [events.HeldReleased(9, 0, "it was no longer held")]
