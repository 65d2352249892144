#!/usr/bin/env python
"""Many kernels in sequence: is each first cell warm, and where it is not, does it say why?

Run from the repository root::

    .venv/bin/python benchmarks/first_cells.py              # 3 rounds of 6 kernels: about 6 min on 2 loaded cores
    .venv/bin/python benchmarks/first_cells.py --rounds 1   # one of each case

Real kernels (``tests/kernel_helpers.NotebookKernel``), 2 CPU ranks, one template per
environment in a private directory of this script's (``$NBTRAIN_TEMPLATE_DIR``, idle time
``--idle`` s), every template killed by PID at the end. Each kernel loads nbtrain and at once
runs its first cell; the figure is the cell sent -> its last rank's first line. Before each
kernel, one of (in this order, each round):

- ``ended``: the template is killed (SIGKILL, by PID): this kernel starts a new one (in round 1
  there is none yet: the very first kernel).
- ``next``: nothing: the kernel after the one that started it.
- ``idle gap``: a pause of ``--idle`` + 1 s: the template leaves, idle; this kernel starts one.
- ``warm``: nothing.
- ``other env``: a kernel of another environment (``$NBTRAIN_TEMPLATE_TAG``: its own template,
  started and used) runs a first cell first.
- ``warm again``: nothing.

Per kernel: the time, and the line the cell showed about the template (none: it was warm).
The summary: per case the median and range, and how many first cells were slow (past
``--slow`` s) without a line saying why (the goal: none).
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

from helpers import procs
from kernel_helpers import NotebookKernel
from nbtrain.messages import templatesocket as naming

FIRST_LINE_CELL = "%%distributed --devices 2 --accelerator cpu\nimport time\nprint('FIRST', repr(time.time()))\n"
CASES = ("ended", "next", "idle gap", "warm", "other env", "warm again")


def first_cell(env: dict[str, str]) -> tuple[float, str]:
    """A fresh kernel: ``%load_ext nbtrain``, at once the first cell: (sent -> last rank's first line, its note)."""
    with NotebookKernel(env=env) as kernel:
        kernel.run_ok("%load_ext nbtrain")
        sent = time.time()
        out = kernel.run_ok(FIRST_LINE_CELL)
    stamps = [float(line.split()[-1]) for line in out.stdout.splitlines() if "FIRST" in line]
    assert len(stamps) == 2, out.text
    notes = [line for line in out.text.splitlines() if line.startswith("nbtrain:") and "template" in line]
    return max(stamps) - sent, notes[0] if notes else ""


def before(case: str, env: dict[str, str], idle: float) -> None:
    """What happens before this case's kernel starts."""
    folder = env[naming.DIRECTORY_VARIABLE]
    if case == "ended":
        found = procs.template_pids(folder)
        procs.kill_pids(found)
        procs.wait_gone(found, 30.0, reaped=False)
    elif case == "idle gap":
        time.sleep(idle + 1.0)  # the scenario itself: no kernel for longer than the template stays
    elif case == "other env":
        first_cell({**env, naming.TAG_VARIABLE: "another-environment"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    # Not the tests' 3 s: on a loaded 2-core machine a kernel's start alone can take that long, and
    # every kernel would then find the template gone (the notes say so: "left after 3 s").
    parser.add_argument("--idle", type=float, default=15.0, help="the template's idle seconds")
    parser.add_argument("--slow", type=float, default=0.5, help="a first cell past this is not warm")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="nbtrain-bench-first-")
    os.chmod(folder, 0o700)
    env = {naming.ENABLED_VARIABLE: "1", naming.DIRECTORY_VARIABLE: folder, naming.IDLE_VARIABLE: f"{args.idle:g}"}
    figures: dict[str, list[float]] = {case: [] for case in CASES}
    silent = 0
    try:
        for number in range(args.rounds):
            for case in CASES:
                before(case, env, args.idle)
                seconds, note = first_cell(env)
                figures[case].append(seconds)
                silent += seconds > args.slow and not note
                print(f"round {number + 1} {case:10s} {seconds:6.3f} s  {note or '(no note)'}", flush=True)
    finally:
        found = procs.template_pids(folder)
        procs.kill_pids(found)
        procs.wait_gone(found, 30.0, reaped=False)
        shutil.rmtree(folder, ignore_errors=True)
    print("\nFirst cell sent -> last rank's first line, right after %load_ext nbtrain:")
    for case, values in figures.items():
        if values:
            shown = ", ".join(f"{value:.3f}" for value in values)
            print(f"  {case:10s} median {statistics.median(values):.3f} s  [{shown}]")
    print(f"first cells slower than {args.slow:g} s without a line saying why: {silent}")


if __name__ == "__main__":
    main()
