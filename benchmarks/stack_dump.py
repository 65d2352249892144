"""What being ready to say where each rank is stuck costs a healthy run.

Every rank registers a faulthandler stack dump on a spare signal at start
(``nbtrain.rank.machinery.runtime.register_stack_dump``); nothing runs per step. This measures:

1. the registration itself, in this process (one ``faulthandler.register`` on a pipe);
2. the steady-state step time of a DDP MLP on 2 CPU ranks with the dump registered and
   with it disabled (``NBTRAIN_STACK_DUMP=0``), alternated over rounds (which goes first
   alternates too) so that load drifting between rounds cancels out. A step's time is the
   slower rank's; a round's figure is the median step; the headline is the median of the
   per-round ratios, with their spread as the noise.

    .venv/bin/python benchmarks/stack_dump.py             # about 1 min on a quiet 2-core machine
    .venv/bin/python benchmarks/stack_dump.py --rounds 12 --steps 200
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys
import time

from launch import steady_job  # benchmarks/launch.py, beside this script

import nbtrain
from nbtrain.messages import stacktext

SIZES = (784, 512, 512, 10)
BATCH = 32


def job(steps: int) -> tuple[list, bool]:
    """steady_job, plus whether this rank has the dump registered (its SigCgt mask)."""
    import os

    from nbtrain.messages import stacktext
    from nbtrain.system import processes

    registered = processes.catches(os.getpid(), stacktext.DUMP_SIGNAL)
    return steady_job(sizes=SIZES, batch=BATCH, warmup=10, steps=steps), registered


def registration_seconds() -> float:
    """One first registration, as a rank makes it (a fresh process has none yet)."""
    read, write = os.pipe()
    try:
        started = time.perf_counter()
        faulthandler.register(stacktext.DUMP_SIGNAL, file=write, all_threads=True, chain=False)
        return time.perf_counter() - started
    finally:
        faulthandler.unregister(stacktext.DUMP_SIGNAL)
        os.close(read)
        os.close(write)


def step_figures(dump_on: bool, steps: int) -> dict[str, float]:
    """The median and the fastest step (the slower rank's wall time), and the median CPU time."""
    if dump_on:
        os.environ.pop(stacktext.DISABLE_VARIABLE, None)
    else:
        os.environ[stacktext.DISABLE_VARIABLE] = "0"
    gathered, registered = nbtrain.launch(job, steps, devices=2, accelerator="cpu", timeout=600)
    if registered != dump_on:
        raise SystemExit(f"rank 0 registered={registered}, expected {dump_on}: the switch did not work")
    slower = [max(pair) for pair in zip(*(rank["times"] for rank in gathered), strict=False)]
    cpu = [sum(pair) for pair in zip(*(rank["cpu"] for rank in gathered), strict=False)]
    return {"median": statistics.median(slower), "fastest": min(slower), "cpu": statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    register = registration_seconds()
    step_figures(True, 5)  # warm: the launcher, the first DDP construction
    rounds: list[dict[bool, dict[str, float]]] = []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        rounds.append({flag: step_figures(flag, args.steps) for flag in order})
        print(f"round {index + 1}: " + ", ".join(
            f"{'with' if flag else 'without'} {rounds[-1][flag]['median'] * 1e3:.2f} ms" for flag in (True, False)
        ), file=sys.stderr)
    report(register, rounds, args)


def report(register: float, rounds: list, args: argparse.Namespace) -> None:
    print("\nstack-dump readiness, cost to a healthy run (2 CPU ranks, DDP MLP "
          f"{'-'.join(map(str, SIZES))}, batch {BATCH}, {args.steps} steps x {args.rounds} rounds)\n")
    print(f"registration, once per rank at start: {register * 1e6:.1f} us\n")
    rows = []
    figures = (
        ("median", "median step, wall"), ("fastest", "fastest step, wall"), ("cpu", "median step, CPU (both ranks)")
    )
    for key, label in figures:
        on = statistics.median(r[True][key] for r in rounds)
        off = statistics.median(r[False][key] for r in rounds)
        ratios = [r[True][key] / r[False][key] for r in rounds]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        rows.append((label, f"{on * 1e3:.3f}", f"{off * 1e3:.3f}", f"{statistics.median(ratios):.3f}", spread))
    header = ("figure", "with dump, ms", "without, ms", "ratio (median of rounds)", "ratio range (noise)")
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=False)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip())


if __name__ == "__main__":
    main()
