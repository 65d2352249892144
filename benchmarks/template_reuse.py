#!/usr/bin/env python
"""Does a second kernel always get its launcher from the warm template? Count the times it does not.

Run from the repository root::

    .venv/bin/python benchmarks/template_reuse.py             # 12 rounds: about 6 min on 2 loaded cores
    .venv/bin/python benchmarks/template_reuse.py --rounds 3  # fewer

Real kernels (``tests/kernel_helpers.NotebookKernel``), 2 CPU ranks, one template in a private
directory of this script's (``$NBTRAIN_TEMPLATE_DIR``, idle time 3 s as in the tests), killed by
PID at the end. Each round: ``--others`` kernels load nbtrain, run a cell and leave (other
kernels come and go); then a first kernel loads nbtrain, waits for its launcher and asks its pid at once; then a
second kernel loads nbtrain and at once runs its first cell. Per round it prints: the second
cell's time from sent to its last rank's first line, whether each kernel's launcher is a
child of a template (else: the kernel started its own, the template bypassed), and the lines
the kernel's log (its stderr) holds about the template. The summary counts the bypasses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' kernel driver

import psutil

from helpers import procs
from kernel_helpers import LAUNCHER_PID, NotebookKernel
from nbtrain.messages import templatesocket as naming

FIRST_LINE_CELL = "%%distributed --devices 2 --accelerator cpu\nimport time\nprint('FIRST', repr(time.time()))\n"
WAIT_READY = "__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().ready.wait(180)"
FALLBACKS = "getattr(__import__('nbtrain.kernel.warm', fromlist=['x']), 'fallbacks', list)()"


def parent_of(pid: int) -> int:
    return psutil.Process(pid).ppid()


def first_line_seconds(kernel: NotebookKernel) -> float:
    """Cell sent -> its last rank's first line (one clock, one machine)."""
    sent = time.time()
    out = kernel.run_ok(FIRST_LINE_CELL)
    stamps = [float(line.split()[-1]) for line in out.stdout.splitlines() if "FIRST" in line]
    assert len(stamps) == 2, out.text
    return max(stamps) - sent


def round_once(env: dict[str, str], others: int) -> tuple[float, bool, bool, list[str]]:
    """(seconds, first kernel's launcher from a template, second's, the second kernel's fallbacks)."""
    for _ in range(others):
        with NotebookKernel(env=env) as other:
            other.run_ok("%load_ext nbtrain")
            first_line_seconds(other)
    folder = env[naming.DIRECTORY_VARIABLE]
    with NotebookKernel(env=env) as first:
        first.run_ok("%load_ext nbtrain")
        # Its launcher's pid asked as soon as it is ready, in the same cell, as a test reads it.
        assert first.value(f"({WAIT_READY}, {LAUNCHER_PID})")[0] is True
        first_forked = parent_of(first.value(LAUNCHER_PID)) in procs.template_pids(folder)
        with NotebookKernel(env=env) as second:
            second.run_ok("%load_ext nbtrain")
            seconds = first_line_seconds(second)
            second_forked = parent_of(second.value(LAUNCHER_PID)) in procs.template_pids(folder)
            said = second.value(FALLBACKS)
    return seconds, first_forked, second_forked, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--others", type=int, default=1, help="kernels that come and go before each round")
    parser.add_argument("--idle", default="3", help="the template's idle seconds ($NBTRAIN_TEMPLATE_IDLE_SECONDS)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="nbtrain-bench-reuse-")
    os.chmod(folder, 0o700)
    env = {naming.ENABLED_VARIABLE: "1", naming.DIRECTORY_VARIABLE: folder, naming.IDLE_VARIABLE: args.idle}
    times, bypassed, failed = [], 0, 0
    try:
        for number in range(args.rounds):
            try:
                seconds, first_forked, second_forked, said = round_once(env, args.others)
            except AssertionError as error:  # a kernel's cell failed (asking its launcher's pid, say)
                failed += 1
                print(f"round {number + 1}: failed: {str(error).strip().splitlines()[-1]}", flush=True)
                continue
            times.append(seconds)
            bypassed += (not first_forked) + (not second_forked)
            print(
                f"round {number + 1}: second kernel's first cell -> last rank's first line {seconds:.3f} s; "
                f"launchers from the template: first {first_forked}, second {second_forked}; "
                f"its log on the template: {said or 'nothing'}",
                flush=True,
            )
    finally:
        found = procs.template_pids(folder)
        procs.kill_pids(found)
        procs.wait_gone(found, 30.0, reaped=False)
        shutil.rmtree(folder, ignore_errors=True)
    shown = ", ".join(f"{value:.3f}" for value in times)
    if times:
        median = statistics.median(times)
        print(f"\nsecond kernel's first line: median {median:.3f} s, max {max(times):.3f} s [{shown}]")
    print(f"kernels whose launcher was not the template's: {bypassed} of {2 * len(times)}; rounds failed: {failed}")


if __name__ == "__main__":
    main()
