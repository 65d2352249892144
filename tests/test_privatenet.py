"""The process group's sockets in a private network, the rank's own network unchanged.

Real namespaces (skipped where the OS refuses them), real forked ranks forming a gloo group;
the fallback faked at its one boundary, ``privatenet.make_namespaces``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import textwrap

import pytest

from nbtrain.messages.events import RankSettings, RankSpec, StartRun
from nbtrain.system import privatenet

SPECS = (RankSpec(0, 0, 2, "cpu", None), RankSpec(1, 1, 2, "cpu", None))
GLOO = StartRun(1, b"", SPECS, "fork", {}, "/", (), {}, None)

# Two forked ranks as the launcher forks them: the launcher's namespaces made first, each rank
# joins the user namespace, then its group from the private network. Each prints where gloo's
# listener is (host: in the main thread's network; private: only in another thread's) and
# whether its main thread reaches the parent's server on the host's 127.0.0.1.
GROUP = textwrap.dedent(
    """
    import os, socket, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from helpers import listeners
    from nbtrain.system import privatenet, rendezvous
    from nbtrain.messages.events import RankSettings, RankSpec, StartRun
    start = StartRun(1, b"", (RankSpec(0, 0, 2, "cpu", None),), "fork", {}, "/", (), {}, None)
    made = privatenet.namespaces()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    fd = rendezvous.store_file()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            server.close()
            privatenet.enter(start)
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            privatenet.in_private_network(
                lambda: dist.init_process_group("gloo", store=rendezvous.open_store(fd, 2), rank=rank, world_size=2)
            )
            total = torch.tensor([rank + 1.0])
            dist.all_reduce(total)
            host = {line.split()[9] for line in open("/proc/self/net/tcp").read().splitlines()[1:]}
            mine = listeners.listeners_of(os.getpid())
            in_host = [found.port for found in mine if found.kind == "tcp"]
            reached = socket.create_connection(("127.0.0.1", port), timeout=10).recv(5).decode()
            fields = (rank, total.item(), len(mine), all(str(p) not in host for p in in_host), reached)
            os.write(1, (" ".join(map(str, fields)) + "\\n").encode())  # one write: the ranks' lines never mix
            os._exit(0)
        pids.append(pid)
    for _ in range(2):
        conn, _ = server.accept()
        conn.sendall(b"hello")
        conn.close()
    for pid in pids:
        os.waitpid(pid, 0)
    """
)


def test_a_groups_listeners_are_in_the_private_network_and_the_rank_still_reaches_the_host():
    if privatenet.probe() is not None:
        # Only the OS refusing them skips: nbtrain failing to make them (a maker that dies) fails.
        assert privatenet.probe().startswith("this machine refuses"), privatenet.probe()
        pytest.skip(f"no namespaces here: {privatenet.probe()}")
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", GROUP, tests], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.split("\n")[:2])
    # Each rank: the sum over both, one gloo listener found, none in the host's network, the host reached.
    assert lines == ["0 3.0 1 True hello", "1 3.0 1 True hello"], done.stdout + done.stderr


def test_the_namespaces_are_this_users_own_with_loopback_up():
    if privatenet.probe() is not None:
        # Only the OS refusing them skips: nbtrain failing to make them (a maker that dies) fails.
        assert privatenet.probe().startswith("this machine refuses"), privatenet.probe()
        pytest.skip(f"no namespaces here: {privatenet.probe()}")
    made = privatenet.make_namespaces()
    try:
        assert os.readlink(f"/proc/self/fd/{made.net}") != os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/self/fd/{made.user}") != os.readlink("/proc/self/ns/user")
    finally:
        os.close(made.user)
        os.close(made.net)


def refuse() -> privatenet.Namespaces:
    raise OSError(errno.EPERM, "unshare(CLONE_NEWUSER|CLONE_NEWNET): Operation not permitted")


def test_where_the_os_refuses_a_rank_joins_its_group_in_the_hosts_network(monkeypatch):
    monkeypatch.setattr(privatenet, "make_namespaces", refuse)
    monkeypatch.setattr(privatenet, "_made", None)
    monkeypatch.setattr(privatenet, "_refused", None)
    monkeypatch.setattr(privatenet, "_joined", None)
    monkeypatch.setattr(privatenet, "_probed", [])
    assert privatenet.namespaces() is None
    assert "refuses unprivileged user namespaces" in (privatenet.refused() or "")
    assert privatenet.probe() == privatenet.refused()
    assert privatenet.inherited_fds() == set()
    privatenet.enter(GLOO)  # nothing to join
    assert privatenet.in_private_network(lambda: threading_name()) == "MainThread"
    assert privatenet.uncovered(GLOO, privatenet.refused()) == privatenet.refused()


def threading_name() -> str:
    import threading

    return threading.current_thread().name


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"rank_settings": RankSettings(backend="nccl")}, "the nccl backend is not covered"),
        ({"start_method": "spawn"}, "ddp_spawn"),
        ({"environ": {"NBTRAIN_PRIVATE_NETWORK": "0"}}, "NBTRAIN_PRIVATE_NETWORK=0"),
        ({"environ": {"TORCH_GLOO_LAZY_INIT": "1"}}, "TORCH_GLOO_LAZY_INIT"),
    ],
)
def test_what_is_not_covered_says_why(change, why):
    assert why in (privatenet.uncovered(dataclasses.replace(GLOO, **change), None) or "")
    assert privatenet.uncovered(GLOO, None) is None
