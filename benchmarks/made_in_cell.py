#!/usr/bin/env python
"""What a model made in the cell costs a step, against the same model made before the cell.

Run from the repository root::

    .venv/bin/python benchmarks/made_in_cell.py           # about 1 min on 2 cores
    .venv/bin/python benchmarks/made_in_cell.py --quick   # 3 rounds: about 35 s

One Jupyter kernel (ipykernel, driven as the tests drive it), 2 CPU ranks, gloo, a
host-bound MLP 256-512-10, batch 64, SGD, one intra-op thread, the loop timed step by step
on rank 0 (median over ``STEPS`` steps after ``WARMUP``, then the median over rounds; the
variants alternate within each round):

- **made before the cell**: auto mode wraps the kernel's model in DDP (its all-reduce
  overlapped with the backward);
- **made in the cell**: the cell makes the model and its optimizer, so nothing wraps it;
  nbtrain keeps it one model over the ranks (gradients averaged before each step, one
  all-reduce after the backward, rank 0's buffers broadcast);
- **DDP by hand** (``--no-auto``): the baseline both are compared with.

No target: the figure says what the summary's advice (``nbtrain.prepare`` where the model
is made, for DDP's overlap) is worth on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' kernel driver

from autoloop import LOOP  # the same timed loop: `net` and `opt` are what the cell trains

from kernel_helpers import NotebookKernel

STEPS = 300
WARMUP = 30

SETUP = f"""
%load_ext nbtrain
import time, statistics, torch, torch.nn as nn
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
STEPS, WARMUP = {STEPS}, {WARMUP}
HAND_WRAPPER = "DistributedDataParallel"
"""

FRESH_OPTIMIZER = "opt = torch.optim.SGD({model}.parameters(), lr=0.01)\n"
TWO = "%%distributed --devices 2 --accelerator cpu"
CELLS = {
    "made before the cell (auto mode's DDP)": f"{TWO}\nnet = model\n" + LOOP,
    "made in the cell (kept one)": f"{TWO}\nnet = make_model()\n{FRESH_OPTIMIZER.format(model='net')}" + LOOP,
    # Named through a string: a cell that names DDP's class itself gets no auto mode at all.
    "DDP by hand (--no-auto)": (
        f"{TWO} --no-auto\nnet = getattr(torch.nn.parallel, HAND_WRAPPER)(make_model())\n"
        + FRESH_OPTIMIZER.format(model="net") + LOOP
    ),
}


def step_times(kernel: NotebookKernel, rounds: int) -> dict[str, list[float]]:
    """Per variant, rank 0's median step (seconds) in each round; the variants alternate."""
    seen: dict[str, list[float]] = {name: [] for name in CELLS}
    for round_index in range(rounds):
        for name, cell in CELLS.items():
            # The kernel's model and optimizer afresh: a cell that makes its own sends them back as `opt`.
            kernel.run_ok("model.load_state_dict(make_model().state_dict())\n" + FRESH_OPTIMIZER.format(model="model"))
            kernel.run_ok(cell)
            seen[name].append(kernel.value("step_s[0]"))  # the median step
        print(f"  round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    rounds = 3 if parser.parse_args().quick else 7
    with NotebookKernel() as kernel:
        kernel.run_ok(SETUP)
        kernel.run_ok(CELLS["made in the cell (kept one)"])  # the first run forks the launcher: not timed
        seen = step_times(kernel, rounds)
    baseline = statistics.median(seen["DDP by hand (--no-auto)"])
    print(f"2 CPU ranks, MLP 256-512-10, batch 64; rank 0's median step, median of {rounds} rounds")
    for name, values in seen.items():
        figure = statistics.median(values)
        print(f"  {name:40s} {figure * 1e6:8.1f} us   {figure / baseline:5.3f}x DDP by hand")
    made, before = statistics.median(seen["made in the cell (kept one)"]), statistics.median(
        seen["made before the cell (auto mode's DDP)"]
    )
    print(f"  made in the cell / made before the cell: {made / before:.3f}")


if __name__ == "__main__":
    main()
