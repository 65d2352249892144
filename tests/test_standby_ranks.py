"""The kernel's view of its standby ranks (nbtrain.kernel.standby_ranks), on real processes.

What the launcher keeps waiting, and when, is tests/test_standby.py; here the listing reads
real processes' memory and ``wait_gone`` waits for real processes to end.
"""

from __future__ import annotations

import os
import subprocess
import sys

from nbtrain import events
from nbtrain.kernel import standby_ranks

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_nothing_waits_when_the_launcher_reported_none():
    assert standby_ranks.listed(None) == []
    assert standby_ranks.listed(events.StandbyChanged(ranks=())) == []


def test_the_waiting_ranks_are_listed_with_the_memory_they_hold_now():
    changed = events.StandbyChanged(ranks=((0, os.getpid()),), plan="1 cpu rank, gloo", ready=True)
    (listed,) = standby_ranks.listed(changed)
    assert (listed.state, listed.plan, listed.ready) == ("standby", "1 cpu rank, gloo", True)
    (rank,) = listed.ranks
    assert (rank.rank, rank.pid, rank.gpu_bytes) == (0, os.getpid(), None)  # no GPU held: none asked
    assert rank.rss_bytes is not None and rank.rss_bytes > 10 << 20  # this interpreter, torch or not
    assert repr(listed).startswith(f"<standby ranks: 1 cpu rank, gloo; rank 0 pid {os.getpid()}: ")
    assert repr(listed).endswith("; nbtrain.release() ends them>")


def test_wait_gone_returns_once_the_processes_ended_and_gives_up_at_its_bound():
    child = subprocess.Popen(SLEEPER)
    try:
        assert standby_ranks.wait_gone([child.pid], timeout=0.2) is False  # still running
    finally:
        child.kill()
        child.wait(timeout=10)
    assert standby_ranks.wait_gone([child.pid], timeout=5.0) is True
