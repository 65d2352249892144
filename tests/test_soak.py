"""The fault soak and the launch series (benchmarks/soak.py), run as tests.

Both drive real Jupyter kernels: 40 random faulted runs with a fixed seed (each checked for
its bound, its blame, a usable kernel and a working next run; no growth of the kernel's
processes, fds, threads, memfds, listening ports or /dev/shm entries across them), and
100 launches of one cell (flat processes, fds, threads and RSS; no drift in launch time
beyond what the same load does to a fresh kernel). The script prints its tables and exits
non-zero on any failed check; its output is the assertion message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # the script bounds itself at 1200 s
SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def run_soak(*args: str, timeout: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SOAK), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Its kernels, launchers and ranks too, by PID: nothing outlives the test.
        left = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        procs.kill_and_wait([proc.pid, *left], 10.0, reaped=False)
        stdout, stderr = proc.communicate()
        pytest.fail(f"soak.py {' '.join(args)} did not end within {timeout} s:\n{stdout}\n{stderr[-4000:]}")
    tail = "\n".join(line for line in stderr.splitlines() if "WARNING" not in line)[-4000:]
    assert proc.returncode == 0, f"soak.py {' '.join(args)} failed:\n{stdout}\n--- stderr ---\n{tail}"
    assert "result: PASS" in stdout


def test_a_40_run_fault_soak_passes_every_check():
    run_soak("--runs", "40", "--seed", "12", timeout=1200)


def test_100_launches_from_one_kernel_leak_nothing_and_do_not_slow_down():
    run_soak("--launches", "100", timeout=1200)
