"""Isolation: process-group sockets stay on loopback, and nothing a rank starts outlives its run.

The loopback test needs root (a private network, mount and UTS namespace, made with
``unshare``): the host name there resolves to a routable-looking address, as it does in
containers, Colab and Kaggle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
        # rank 0: the store and gloo; every rank: gloo's listener
        assert len(listening) >= (2 if rank == 0 else 1), f"rank {rank}: {seen['sockets']}"
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
