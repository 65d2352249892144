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


# -- output with bounds ---------------------------------------------------------------------

FLOOD_LINES = 100_000
LONG_LINE = 10_000_000


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from kernel_helpers import NotebookKernel

    logs = tmp_path_factory.mktemp("logs")
    k = NotebookKernel(env={"NBTRAIN_LOG_DIR": str(logs)})
    try:
        k.run_ok("%load_ext nbtrain\nimport nbtrain.kernel.cellrun as cellrun")
        yield k
    finally:
        k.shutdown()


def test_a_flood_of_output_is_bounded_in_the_cell_and_whole_in_the_log(kernel):
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "import sys\n"
        f"sys.stdout.write('x' * {LONG_LINE} + '\\n')\n"
        f"for i in range({FLOOD_LINES}):\n"
        "    print(f'line {i}')\n"
    )
    assert len(out.stdout) + len(out.stderr) < 1_000_000  # 20 MB of output became this
    assert out.stdout.count(" … [9,990,000 more characters cut from this line; all of it is in ") == 2
    log = kernel.value("cellrun.last_run.log_path")
    assert f"Full output: {log}" in out.stdout
    for rank in (0, 1):
        assert f"nbtrain: rank {rank} printed more than the cell shows (4,000 lines" in out.stderr
        assert f"nbtrain: 95,001 lines of rank {rank} (1015 KB) are not shown; its last 1,000 follow." in out.stderr
        assert f"[rank {rank}] line 3998\n" in out.stdout and f"[rank {rank}] line 3999\n" not in out.stdout
        assert f"[rank {rank}] line 98999\n" not in out.stdout
        assert f"[rank {rank}] line 99000\n" in out.stdout and f"[rank {rank}] line 99999\n" in out.stdout
    with open(log, "rb") as f:
        lines = f.read().split(b"\n")
    for rank in (0, 1):
        tag = f"[rank {rank}] ".encode()
        assert tag + b"x" * LONG_LINE in lines
        printed = [line for line in lines if line.startswith(tag + b"line ")]
        assert printed == [tag + f"line {i}".encode() for i in range(FLOOD_LINES)]
    assert kernel.value("cellrun.last_run.state") == "finished"


def test_output_modes_and_the_live_view_work_through_a_flood(kernel):
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu --output rank0\n"
        "for i in range(6000):\n"
        "    print(f'line {i}')\n"
    )
    assert "line 5999" in out.stdout and "[rank" not in out.stdout  # rank 0's, untagged
    assert "rank 1" not in out.stdout
    assert out.live_view  # the view's last frame is there


def kernel_rss(kernel) -> int:
    import psutil

    return psutil.Process(kernel.pid).memory_info().rss


def test_a_flood_cannot_outlast_its_timeout_nor_grow_the_kernel(kernel):
    kernel.run_ok("%%distributed --devices 2 --accelerator cpu\nprint('warm')\n")  # the first run's imports
    before = kernel_rss(kernel)
    out = kernel.run(
        "%%distributed --devices 2 --accelerator cpu --timeout 8\n"
        "while True:\n"
        "    print('flood ' * 20)\n"
    )
    after = kernel_rss(kernel)
    assert out.error is not None and out.error["ename"] == "RunTimeoutError", out.text
    seconds = kernel.value("cellrun.last_run.seconds")
    # The ranks are stopped at 8 s (SIGKILL half a second later); the cell ends with them.
    assert seconds < 8 + 5, seconds  # a ceiling under load; measured: 8.9 s with the machine idle enough
    assert after - before < 100 << 20, (before, after)
    print(f"flood cell: {seconds:.2f} s; kernel RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")


def test_interrupting_a_flood_ends_the_cell_at_once(kernel):
    import time

    msg_id = kernel.start_cell("%%distributed --devices 2 --accelerator cpu\nwhile True:\n    print('flood ' * 20)\n")
    kernel.wait_for_stream(msg_id, ["printed more than the cell shows"])  # deep in the flood
    before = kernel_rss(kernel)
    interrupted = time.monotonic()
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    seconds = time.monotonic() - interrupted
    assert reply["status"] == "error" and out.error["ename"] == "RunInterrupted", out.text
    # The stop takes SIGTERM, SIGKILL half a second later, then the last lines: about a second.
    assert seconds < 4, seconds
    assert kernel_rss(kernel) - before < 100 << 20
    print(f"interrupted flood: cell ended {seconds:.2f} s after the interrupt")
