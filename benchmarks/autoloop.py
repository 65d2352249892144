#!/usr/bin/env python
"""What auto mode costs a step, and how soon a re-run cell's ranks start, from a real kernel.

Run from the repository root::

    .venv/bin/python benchmarks/autoloop.py           # about 1.5 min on 2 quiet cores
    .venv/bin/python benchmarks/autoloop.py --quick   # fewer rounds: about 40 s

One Jupyter kernel (ipykernel, driven as the tests drive it), CPU ranks, gloo. Everything is
measured in this one run, baselines included:

1. **Steady step of auto mode** (the read-through DDP wrapper, the loss logged from
   ``.backward()``, the first-backward check, the metrics batched for the live view) against
   the same loop written by hand, in the same kernel, rounds alternated: a host-bound MLP
   256-512-10, batch 64, SGD, tensors in memory, one intra-op thread in every variant; each
   figure is rank 0's median step over
   ``STEPS`` steps after ``WARMUP``, then the median over rounds.
   - 2 ranks: auto mode vs hand-written DDP (``--no-auto``, ``DistributedDataParallel`` by hand).
     Target: <= 1.02x.
   - 1 rank: auto mode (the model unwrapped: one rank has nothing to average) vs the plain
     loop in the rank (``--no-auto``) and vs the loop in the kernel itself. Target: <= 1.02x
     the hand loop, <= 1.03x the kernel's loop.
2. **Re-run, cell sent -> every rank running its first line**: a 2-rank cell whose first
   line records ``time.time()``; the figure is the last rank's time minus the time just
   before the kernel was sent the cell (one clock, one machine); median of ``RERUNS``
   re-runs after one first run. Target: <= 0.015 s.

``--first-line`` measures only 2 (about 15 s); ``--session-cells N`` first puts N cells of
20 lines in the kernel's linecache, as a long session leaves them (each run used to carry
every cell's lines for the ranks' tracebacks).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' kernel driver

from kernel_helpers import NotebookKernel

STEPS = 300
WARMUP = 30
RERUNS = 6
CELL_BOUND_S = 120.0
TARGET_AUTO_RATIO = 1.02
TARGET_KERNEL_RATIO = 1.03
TARGET_FIRST_LINE_S = 0.015

SETUP = f"""
%load_ext nbtrain
import time, statistics, torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
STEPS, WARMUP = {STEPS}, {WARMUP}
"""

# The loop, timed step by step; `net` is what the cell trains.
LOOP = """
torch.set_num_threads(1)  # every variant one thread: the same work, and less at the mercy of a busy machine
times = []
for step in range(STEPS + WARMUP):
    began = time.perf_counter()
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    times.append(time.perf_counter() - began)
step_s = (statistics.median(times[WARMUP:]), sorted(times[WARMUP:])[STEPS // 10])
"""

CELLS = {
    "kernel": "net = model" + LOOP,
    "1 rank, by hand": "%%distributed --devices 1 --accelerator cpu --no-auto\nnet = model" + LOOP,
    "1 rank, auto mode": "%%distributed --devices 1 --accelerator cpu\nnet = model" + LOOP,
    "2 ranks, DDP by hand": (
        "%%distributed --devices 2 --accelerator cpu --no-auto\n"
        "from torch.nn.parallel import DistributedDataParallel\nnet = DistributedDataParallel(model)" + LOOP
    ),
    "2 ranks, auto mode": "%%distributed --devices 2 --accelerator cpu\nnet = model" + LOOP,
}

FIRST_LINE_CELL = (
    "%%distributed --devices 2 --accelerator cpu\n"
    "first_line = time.time()\n"
    "print('FIRST', repr(first_line))\n"
)


def step_times(kernel: NotebookKernel, rounds: int) -> dict[str, tuple[float, float]]:
    """Per variant, the median over rounds of (median step, 10th-percentile step), seconds; variants alternated."""
    seen: dict[str, list[list[float]]] = {name: [] for name in CELLS}
    for round_index in range(rounds):
        for name, cell in CELLS.items():
            kernel.run_ok("model.load_state_dict(start_state)")
            kernel.run_ok(cell)
            seen[name].append(kernel.value("step_s"))
        print(f"  round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
            for name, values in seen.items()}


def first_line_latency(kernel: NotebookKernel, reruns: int) -> list[float]:
    """Cell sent -> the last rank's first line, for each re-run (seconds)."""
    kernel.run_ok(FIRST_LINE_CELL)  # the first run
    latencies = []
    for _ in range(reruns):
        sent = time.time()
        msg_id = kernel.start_cell(FIRST_LINE_CELL)
        reply, out = kernel.wait_for_reply(msg_id, CELL_BOUND_S)
        assert reply["status"] == "ok", out.text
        firsts = [float(value) for value in re.findall(r"FIRST (\S+)", out.stdout)]
        assert len(firsts) == 2, out.stdout
        latencies.append(max(firsts) - sent)
    return latencies


def session_cells(count: int) -> str:
    """Code that leaves ``count`` cells of 20 lines in the kernel's linecache, as run cells do."""
    return (
        "import linecache\n"
        f"for i in range({count}):\n"
        "    lines = [f'    x_{j} = model(batch_{j}) + some_call(arg, other_arg)  # {i}\\n' for j in range(20)]\n"
        "    name = f'/nbtrain-benchmark-session/cell-{i}.py'\n"
        "    linecache.cache[name] = (sum(map(len, lines)), None, lines, name)\n"
    )


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 5")
    parser.add_argument("--first-line", action="store_true", help="only the re-run's first-line latency")
    parser.add_argument("--session-cells", type=int, default=0, help="cells in the kernel's linecache first")
    args = parser.parse_args()
    rounds = 3 if args.quick else 5
    steps: dict[str, tuple[float, float]] = {}
    with NotebookKernel() as kernel:
        kernel.run_ok(SETUP + "start_state = {k: v.clone() for k, v in model.state_dict().items()}\n")
        kernel.run_ok(session_cells(args.session_cells))
        kernel.run_ok(CELLS["2 ranks, auto mode"])  # warm the launcher and the caches
        if not args.first_line:
            print(f"step times: {rounds} rounds of {len(CELLS)} variants", file=sys.stderr, flush=True)
            steps = step_times(kernel, rounds)
        print("re-run first-line latency", file=sys.stderr, flush=True)
        latencies = first_line_latency(kernel, RERUNS)
    if steps:
        print_steps(steps, rounds)
    print_first_line(latencies, args.session_cells)


def print_first_line(latencies: list[float], cells: int) -> None:
    median = statistics.median(latencies)
    shown = ", ".join(f"{value * 1000:.1f}" for value in latencies)
    where = f"2 CPU ranks, {cells} cells in the kernel's linecache" if cells else "2 CPU ranks"
    print(f"\nRe-run cell sent -> every rank running its first line ({where}): median {median * 1000:.1f} ms")
    target = f"target <= {TARGET_FIRST_LINE_S * 1000:.0f} ms: {verdict(median, TARGET_FIRST_LINE_S)}"
    print(f"  re-runs: {shown} ms  ({target})")


def print_steps(steps: dict[str, tuple[float, float]], rounds: int) -> None:
    print(f"\nSteady step, MLP 256-512-10, batch 64, CPU: rank 0's median and 10th percentile of {STEPS} steps,")
    print(f"median of {rounds} rounds (busy machine: the percentile shows the loop, the median the machine)")
    for name, (median, floor) in steps.items():
        print(f"  {name:<22} median {median * 1e6:8.1f} us   p10 {floor * 1e6:8.1f} us")
    for label, variant, baseline, target in (
        ("2 ranks: auto / by hand", "2 ranks, auto mode", "2 ranks, DDP by hand", TARGET_AUTO_RATIO),
        ("1 rank:  auto / by hand", "1 rank, auto mode", "1 rank, by hand", TARGET_AUTO_RATIO),
        ("1 rank:  auto / kernel loop", "1 rank, auto mode", "kernel", TARGET_KERNEL_RATIO),
    ):
        ratios = [steps[variant][i] / steps[baseline][i] for i in (0, 1)]
        shown = ", ".join(
            f"{name} {ratio:.3f}x: {verdict(ratio, target)}"
            for name, ratio in zip(("median", "p10"), ratios, strict=True)
        )
        print(f"  {label:<28} {shown}  (target <= {target}x)")


if __name__ == "__main__":
    main()
