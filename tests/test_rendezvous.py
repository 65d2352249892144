"""A single-machine run's store: torch's FileStore on a nameless file its ranks inherit.

Real processes: two forked ranks meet through the store and form a gloo group; another OS
user cannot open the store through /proc; the file is nowhere on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import osusers
from nbtrain.system import rendezvous

GROUP = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from nbtrain.system import rendezvous
    fd = int(sys.argv[1])
    pid = os.fork()
    rank = 1 if pid == 0 else 0
    dist.init_process_group("gloo", store=rendezvous.open_store(fd, 2), rank=rank, world_size=2)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    if rank == 1:
        os._exit(0 if total.item() == 3.0 else 1)
    _, status = os.waitpid(pid, 0)
    print(total.item(), os.waitstatus_to_exitcode(status), flush=True)
    os._exit(0)
    """
)


def test_two_ranks_form_a_group_through_the_store_file_and_nothing_is_on_disk():
    fd = rendezvous.store_file()
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:nbtrain-store")
        command = [sys.executable, "-c", GROUP, str(fd)]
        done = subprocess.run(command, pass_fds=(fd,), capture_output=True, text=True, timeout=120, check=False)
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3.0", "0"]


ASK = """
import sys
try:
    open(sys.argv[1], "rb").read()
    print("opened")
except OSError as error:
    print(type(error).__name__)
"""


def test_another_user_cannot_open_the_store():
    with osusers.made_user("store") as other:
        fd = rendezvous.store_file()
        try:
            path = f"/proc/{os.getpid()}/fd/{fd}"
            command = [*osusers.as_user(other), "/usr/bin/python3", "-c", ASK, path]
            asked = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        finally:
            os.close(fd)
    assert asked.stdout.strip() == "PermissionError", asked.stdout + asked.stderr


def test_the_store_file_is_closed_on_exec_unless_given():
    fd = rendezvous.store_file()
    try:
        assert os.get_inheritable(fd) is False
        assert rendezvous.store_path(fd) == f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_store_answers_with_a_timeout_set(world_size):
    fd = rendezvous.store_file()
    try:
        store = rendezvous.open_store(fd, world_size)
        assert store.timeout == rendezvous.STORE_TIMEOUT
    finally:
        os.close(fd)
