"""Isolation: process-group sockets stay on loopback, and nothing a rank starts outlives its run.

The loopback test needs root (a private network, mount and UTS namespace, made with
``unshare``): the host name there resolves to a routable-looking address, as it does in
containers, Colab and Kaggle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import nbtrain
from helpers import procs

HELPERS = Path(__file__).parent / "helpers"
ELSEWHERE = "192.0.2.2"  # TEST-NET-1: what the host name resolves to in the namespace
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1")

# In the namespace: loopback up with a second address, a host name of our own that the
# hosts file (bind-mounted over /etc/hosts, for this namespace only) maps to that address.
_NAMESPACE_SCRIPT = """
set -e
ip link set lo up
ip addr add {address}/32 dev lo
hostname nbtrain-isolated
printf '127.0.0.1 localhost\\n{address} nbtrain-isolated\\n' > {hosts}
mount --bind {hosts} /etc/hosts
cd {cwd}
# The process group in the host's network, as where no private one can be made
# (nbtrain.system.privatenet): there the interface settings alone keep it on loopback.
export NBTRAIN_PRIVATE_NETWORK=0
exec {python} {caller}
"""


def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, unshare and ip to make a private network")
def test_process_group_listens_on_loopback_when_the_host_name_resolves_elsewhere(tmp_path):
    script = _NAMESPACE_SCRIPT.format(
        address=ELSEWHERE,
        hosts=tmp_path / "hosts",
        cwd=HELPERS.parent,
        python=sys.executable,
        caller=HELPERS / "socket_caller.py",
    )
    proc = subprocess.Popen(
        ["unshare", "--net", "--mount", "--uts", "bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    report: dict = {}
    try:
        report = procs.read_json_line(proc, timeout=180)
        out, err = procs.rest_of_output(proc, timeout=60)
        assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{err}"
    finally:
        ranks = [rank["pid"] for rank in report.get("ranks", [])]
        procs.cleanup_caller(proc, [report.get("launcher_pid"), *ranks])

    # The trap is set: the host name resolves to the other address.
    assert report["resolves_to"] == ELSEWHERE, report
    assert [rank["sum"] for rank in report["ranks"]] == [2.0, 2.0], "the process group did not work"
    for rank, seen in enumerate(report["ranks"]):
        listening = [(ip, port) for status, ip, port in seen["sockets"] if status == "LISTEN"]
        # every rank: gloo's listener (the store is a file: nbtrain.system.rendezvous)
        assert len(listening) >= 1, f"rank {rank}: {seen['sockets']}"
        assert all(ip == "127.0.0.1" for ip, _ in listening), f"rank {rank} listens off loopback: {listening}"
        assert all(ip in LOOPBACK for _, ip, _ in seen["sockets"]), f"rank {rank}: {seen['sockets']}"
    assert all(ip in LOOPBACK for _, ip, _ in report["launcher"]), report["launcher"]


def test_a_callers_interface_settings_give_way_to_loopback(launcher, monkeypatch):
    # A multi-machine setting left in the kernel's environment would put a single-machine
    # run's listeners on that interface.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")

    def settings():
        import torch.distributed as dist

        dist.barrier()  # gloo connected on the interface it was given
        return os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]

    assert procs.finish(nbtrain.start(settings, devices=2, accelerator="cpu")) == ("lo", "lo")


def _start_escapees() -> dict:
    """On a rank: start two processes that leave its process group, holding its stdout.

    One is a child in a session of its own; the other is double-forked (its parent exits at
    once, so it is nobody's child) and also in a session of its own. Neither is reached by
    a signal to the rank's process group.
    """
    import subprocess as sp
    import time as clock

    session = sp.Popen(["sleep", "600"], start_new_session=True)
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(read_end)
            os.write(write_end, str(os.getpid()).encode())
            os.close(write_end)
            while True:
                clock.sleep(60)
        os._exit(0)
    os.close(write_end)
    orphan = int(os.read(read_end, 32))
    os.close(read_end)
    os.waitpid(middle, 0)
    return {"session": session.pid, "orphan": orphan}


@pytest.mark.parametrize("ending", ["finished", "failed", "stopped"])
def test_a_ranks_own_sessions_and_double_forks_die_with_the_run(launcher, leak_guard, tmp_path, ending):
    report = tmp_path / "escapees.json"

    def escape():
        import json

        started = _start_escapees()
        report.write_text(json.dumps(started))
        if ending == "failed":
            raise RuntimeError("the rank fails with its escapees running")
        if ending == "stopped":
            threading.Event().wait()  # until the stop
        return started

    run = nbtrain.start(escape, devices=1, accelerator="cpu")
    if ending == "stopped":
        procs.wait_for(report.exists, procs.RUN_TIMEOUT, f"rank 0 never wrote {report}")
        run.stop()
    _, error, _ = procs.collect(run)
    escapees = json.loads(report.read_text())
    pids = [escapees["session"], escapees["orphan"]]
    # When the run has ended they are killed already (dying, or dead and not yet reaped): both
    # held the rank's stdout, so the run's end did not wait for that pipe (benchmarks/cleanup.py
    # measures how long the end takes). A killed process closes its files before it is a zombie.
    living = [pid for pid in pids if procs.alive(pid) and not procs.is_zombie(pid) and not procs.dying(pid)]
    try:
        assert (error is None) == (ending == "finished"), error
        assert not living, f"still running when their run ended: {living}"
        left = procs.wait_gone(pids, 5.0)
        assert not left, f"not reaped after their run ended: {left}"
    finally:
        procs.kill_and_wait(pids, 5.0)
