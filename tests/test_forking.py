"""Starting a rank (nbtrain.launch_server.forking): its descriptors, and the child's side of the fork.

A run's ranks forked through it are tested end to end in tests/test_launch_server_server.py.
"""

from __future__ import annotations

import json
import os
import signal

from nbtrain.launch_server import forking
from nbtrain.launch_server.launched import RankProcess


def test_a_ranks_descriptors_are_opened_together_and_closed_together():
    before = set(os.listdir("/proc/self/fd"))
    ends = forking.RankEnds.open()
    assert len(set(os.listdir("/proc/self/fd")) - before) == 8  # a socket pair and three pipes
    ends.close_child_side()
    ends.close_all()  # tolerates what close_child_side already closed
    assert set(os.listdir("/proc/self/fd")) == before


def test_a_rank_keeps_its_channel_listen_socket_tensors_and_stack_pipe():
    fds = forking.RankFds(channel=10, out=11, err=12, listen=None, tensor=13, stack=14)
    assert fds.kept == [10, 13, 14]  # stdout and stderr become fds 1 and 2 instead


def test_a_child_keeps_only_the_descriptors_it_is_given():
    keep_read, keep_write = os.pipe()
    other_read, other_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what survives, then leave without running the suite's teardown
        try:
            forking.close_all_but({0, 1, 2, keep_write})
            left = sorted(int(name) for name in os.listdir("/proc/self/fd"))
            os.write(keep_write, json.dumps(left).encode())
        finally:
            os._exit(0)
    os.close(keep_write)
    os.close(other_write)
    try:
        reported = os.read(keep_read, 4096).decode()
    finally:
        os.close(keep_read)
        os.close(other_read)
        os.waitpid(pid, 0)
    left = set(json.loads(reported)) - {0, 1, 2}
    # the listdir's own descriptor is open while it reads /proc/self/fd
    assert keep_write in left and other_read not in left and other_write not in left and len(left) <= 2


def test_signal_groups_signals_each_ranks_group_and_notes_who_was_in_it():
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        signal.pause()
        os._exit(0)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first, the group exists before the signal
    except PermissionError:
        pass  # the child got there first
    rank = RankProcess.__new__(RankProcess)  # signal_groups reads only the pid and writes the members
    rank.pid, rank.members = pid, set()
    try:
        forking.signal_groups([rank], signal.SIGKILL)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert pid in rank.members
