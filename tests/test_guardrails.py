"""Guard rails while a run goes on: a fork that fails, and output that floods.

A failed fork (here a process limit, RLIMIT_NPROC, which Linux enforces only for
unprivileged users) must end the run at once with the reason and leave no descriptor in
the launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import procs

pytestmark = pytest.mark.timeout(300)

HELPERS = Path(__file__).parent / "helpers"


def pids_cgroup() -> str | None:
    """A new pids cgroup to limit the launcher in (as root), or None where there is none to make."""
    for parent in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(parent, "cgroup.procs")) and (
            parent.endswith("pids") or "pids" in Path(parent, "cgroup.subtree_control").read_text()
        ):
            try:
                return tempfile.mkdtemp(prefix="nbtrain-test-", dir=parent)
            except OSError:
                return None
    return None


def test_a_failed_fork_ends_the_run_with_the_reason_and_leaves_no_descriptor():
    # Linux ignores RLIMIT_NPROC for root: there a pids cgroup sets the limit instead.
    cgroup = pids_cgroup() if os.geteuid() == 0 else None
    if os.geteuid() == 0 and cgroup is None:
        pytest.skip("running as root without a pids cgroup to create: no way to make fork fail")
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "fork_limit_caller.py"), *([cgroup] if cgroup else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    report: dict = {}
    try:
        report = procs.read_json_line(proc, timeout=240)
        out, err = procs.rest_of_output(proc, timeout=60)
        assert proc.returncode == 0, (out, err)
    finally:
        procs.cleanup_caller(proc, [report.get("launcher"), *report.get("pids", [])])
        if cgroup:
            os.rmdir(cgroup)
    kind, message = report["failure"]
    assert kind == "RankStartError", report["failure"]
    assert message.startswith("could not start rank 1 of 3: creating its process failed with EAGAIN")
    assert "A limit on processes is reached: the user's (ulimit -u, RLIMIT_NPROC)" in message
    assert message.endswith("The run ended; the 1 already started were stopped.")
    assert report["seconds"] < 10, report  # at once: rank 0 stopped, no waiting for a timeout
    assert report["after"] == report["before"]  # no pipe or socket of the failed rank left open
    assert report["children"] == []  # rank 0 stopped and reaped
    assert report["again"] == 2  # the next run works
