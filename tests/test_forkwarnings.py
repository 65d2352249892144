"""No fork of nbtrain's warns (Python 3.12 and later): the template, the launcher and the ranks fork single-threaded.

From 3.12 on, Python warns ("This process is multi-threaded, use of fork() may lead to
deadlocks in the child") when a process with threads forks. nbtrain forks in two places: the
warm template forks each kernel's launcher, and a launcher forks the ranks (and the standby
ranks of the next run). A real kernel on a template of its own, with ``PYTHONWARNINGS=default``:
no cell shows the warning, the kernel's log (where a launcher writes) has none, and the template
and the launcher each run one thread between forks. Before 3.12 Python has no such warning.
"""

from __future__ import annotations

import sys

import psutil
import pytest

from helpers import procs
from kernel_helpers import LAUNCHER_PID, NotebookKernel
from nbtrain.messages import templatesocket as naming

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.version_info < (3, 12), reason="Python warns of a fork with threads from 3.12 on"),
]

WARNING = "is multi-threaded, use of fork()"


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("Threads:")))


def test_no_fork_warns_and_the_processes_that_fork_have_one_thread(tmp_path):
    log = tmp_path / "kernel.log"
    folder = tmp_path / "template"  # a template of this test's own, killed by PID after
    folder.mkdir(mode=0o700)
    env = {"PYTHONWARNINGS": "default", naming.ENABLED_VARIABLE: "1", naming.DIRECTORY_VARIABLE: str(folder)}
    try:
        with NotebookKernel(env=env, log=str(log)) as kernel:
            kernel.run_ok("%load_ext nbtrain\nimport torch, nbtrain")
            cell = "%%distributed --devices 2 --accelerator cpu\nx{} = torch.ones(2) * nbtrain.rank()"
            # The first forks fresh ranks, the others take standby ranks forked meanwhile.
            cells = [kernel.run_ok(cell.format(i)).text for i in range(3)]
            launcher = kernel.value(LAUNCHER_PID)
            assert psutil.Process(launcher).ppid() in procs.template_pids(str(folder))  # forked by the template
            template = psutil.Process(launcher).ppid()
            assert (_threads(template), _threads(launcher)) == (1, 1)
    finally:
        found = procs.template_pids(str(folder))
        procs.kill_pids(found)
        procs.wait_gone(found, 30, reaped=False)
    assert not [text for text in cells if WARNING in text], cells
    assert WARNING not in log.read_text()
