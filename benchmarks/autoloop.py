#!/usr/bin/env python
"""What auto mode costs a step, and how soon a re-run cell's ranks start, from a real kernel.

Run from the repository root::

    .venv/bin/python benchmarks/autoloop.py           # about 1.5 min on 2 cores
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
3. **Paired blocks, the same ranks**: the separate cells above run seconds apart, and on a
   shared machine their step times drift by more than 2%. So one auto-mode cell (1 rank, then
   2 ranks) also trains three copies of the model, in blocks of ``BLOCK`` steps that take turns
   (``PAIRS`` rounds, the order rotated each round): **auto mode** (the cell's own ``model``
   and ``opt``, as auto mode prepared them, its loss hook on), **by hand** (a copy wrapped by
   hand in ``DistributedDataParallel`` on 2 ranks, its own SGD, auto mode's loss hook off: what
   a ``--no-auto`` cell runs; the stop-at-step hooks every cell has stay on) and **bare** (the
   same with nbtrain's optimizer-step hooks off too: the loop as a plain process would run
   it). A round's ratio compares blocks a few milliseconds apart; the figure is the median
   over rounds. Target: auto / by hand <= 1.02x.

``--paired`` measures only 3 (about 30 s); ``--first-line`` measures only 2 (about 15 s);
``--one-rank`` only the kernel's loop and 1 rank's (auto mode and by hand) in 1., with the loop
thread's CPU time and minor page faults per step (``--rounds N`` of them);
``--session-cells N`` first puts N cells of 20 lines in the kernel's linecache, as a long
session leaves them (each run used to carry every cell's lines for the ranks' tracebacks);
``--uses MODULE.NAME`` has the first-line cell name that library object too (say
``matplotlib.colors.Normalize``), so each rank imports its module to load the payload, as a
model from torchvision or a fitted scaler from scikit-learn makes it (standby ranks import
such libraries ahead: the re-run's ranks find them imported).
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

import kernel_helpers
from kernel_helpers import NotebookKernel

STEPS = 300
WARMUP = 30
RERUNS = 6
CELL_BOUND_S = 120.0
STANDBY_WAIT_S = 30.0  # --uses: a re-run waits this long at most for ready standby ranks
TARGET_AUTO_RATIO = 1.02
TARGET_KERNEL_RATIO = 1.03
TARGET_FIRST_LINE_S = 0.015
PAIRS = 30
BLOCK = 20
HOOK_PAIRS = 100

SETUP = f"""
%load_ext nbtrain
import time, statistics, torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
STEPS, WARMUP = {STEPS}, {WARMUP}
HAND_WRAPPER = "DistributedDataParallel"
"""

# The loop, timed step by step; `net` is what the cell trains.
LOOP = """
import resource
torch.set_num_threads(1)  # every variant one thread: the same work, and less at the mercy of a busy machine
times = [0.0] * (STEPS + WARMUP)  # made before the loop: the loop itself allocates nothing of the benchmark's
for step in range(STEPS + WARMUP):
    if step == WARMUP:  # the loop's own thread: CPU seconds and minor page faults over the steady steps
        cpu_began, faults_began = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    began = time.perf_counter()
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    times[step] = time.perf_counter() - began
thread_cpu = (time.thread_time() - cpu_began) / STEPS
thread_faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults_began) / STEPS
step_s = (statistics.median(times[WARMUP:]), sorted(times[WARMUP:])[STEPS // 10], thread_cpu, thread_faults)
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


# Three ways through the same loop in one auto-mode cell, in blocks that take turns (see 3.
# above). Auto mode's loss hook is the patched Tensor.backward (its original kept as
# __wrapped__); the stop-at-step hooks are torch's global optimizer-step hooks, taken out of
# torch's tables for the bare blocks and put back after each.
PAIRED = f"""
import copy, torch.optim.optimizer as optimizer_tables, nbtrain
torch.set_num_threads(1)
# Named through a string: a cell that names DDP's class itself gets no auto mode at all.
wrapper_by_hand = getattr(torch.nn.parallel, HAND_WRAPPER)
hooked_backward = torch.Tensor.backward
plain_backward = getattr(hooked_backward, "__wrapped__", hooked_backward)
tables = optimizer_tables._global_optimizer_pre_hooks, optimizer_tables._global_optimizer_post_hooks
kept = [dict(table) for table in tables]

def hooks(loss_hook, step_hooks):
    torch.Tensor.backward = hooked_backward if loss_hook else plain_backward
    for table, saved in zip(tables, kept):
        table.clear()
        table.update(saved if step_hooks else {{}})

def by_hand():
    copied = copy.deepcopy(getattr(model, "module", model))  # auto mode's DDP wraps the model as .module
    net = wrapper_by_hand(copied) if nbtrain.world_size() > 1 else copied
    return net, torch.optim.SGD(net.parameters(), lr=0.01)

ways = {{
    "auto mode": (model, opt, True, True),
    "by hand": (*by_hand(), False, True),
    "bare": (*by_hand(), False, False),
}}

def block(net, optimizer, loss_hook, step_hooks, steps):
    hooks(loss_hook, step_hooks)
    began = time.perf_counter()
    for _ in range(steps):
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    took = (time.perf_counter() - began) / steps
    hooks(True, True)
    return took

# Auto mode's first steps in one stretch, as a loop run alone takes them: their pace sets the
# stride of the losses its hook logs (taking turns first would read the turns as a slow loop).
block(*ways["auto mode"], 64)
for way in ways.values():
    block(*way, WARMUP)
names = list(ways)
paired = {{name: [] for name in names}}
for round_index in range({PAIRS}):
    for name in names[round_index % 3:] + names[:round_index % 3]:
        paired[name].append(block(*ways[name], {BLOCK}))

def backwards(backward, calls=200):
    began = time.perf_counter()
    for _ in range(calls):
        backward((one_element * 2).sum())
    return (time.perf_counter() - began) / calls

hook_costs = []  # the loss hook alone: a one-element graph's backward, hooked less plain
if nbtrain.world_size() == 1:  # the hook is the same on every rank; after the blocks, whose losses it logs
    one_element = torch.ones(4, requires_grad=True)
    for round_index in range({HOOK_PAIRS}):
        order = (hooked_backward, plain_backward) if round_index % 2 else (plain_backward, hooked_backward)
        took = {{backward: backwards(backward) for backward in order}}
        hook_costs.append(took[hooked_backward] - took[plain_backward])
"""


def paired_steps(kernel: NotebookKernel) -> tuple[dict[int, dict[str, list[float]]], list[float]]:
    """Per world size (1, 2), each way's mean step per round (seconds), from rank 0; the loss hook's costs."""
    seen = {}
    for devices in (2, 1):
        kernel.run_ok("model.load_state_dict(start_state)")
        kernel.run_ok(f"%%distributed --devices {devices} --accelerator cpu\n" + PAIRED)
        seen[devices] = kernel.value("paired")
    return {devices: seen[devices] for devices in (1, 2)}, kernel.value("hook_costs")


def step_times(kernel: NotebookKernel, rounds: int, cells: dict[str, str]) -> dict[str, tuple[float, ...]]:
    """Per variant, the median over rounds of (median step, 10th-percentile step, the loop thread's CPU
    seconds per step, its minor page faults per step); variants alternated."""
    seen: dict[str, list[list[float]]] = {name: [] for name in cells}
    for round_index in range(rounds):
        for name, cell in cells.items():
            kernel.run_ok("model.load_state_dict(start_state)")
            kernel.run_ok(cell)
            seen[name].append(kernel.value("step_s"))
        print(f"  round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {name: tuple(statistics.median(v[i] for v in values) for i in range(4)) for name, values in seen.items()}


def first_line_latency(kernel: NotebookKernel, reruns: int, uses: str | None = None) -> list[float]:
    """Cell sent -> the last rank's first line, for each re-run (seconds).

    ``uses`` ("module.name"): the cell also names that library object, so its payload
    imports the module on each rank (what standby ranks import ahead); each re-run is then
    sent once the standby ranks are ready, as after a user's pause (importing it ahead takes
    them longer than the kernel takes to send the next cell).
    """
    cell = FIRST_LINE_CELL
    if uses:
        module, _, name = uses.rpartition(".")
        kernel.run_ok(f"import importlib\nlibrary_object = getattr(importlib.import_module({module!r}), {name!r})\n")
        cell += "library_object\n"
    kernel.run_ok(cell)  # the first run
    latencies = []
    for _ in range(reruns):
        if uses:
            kernel_helpers.wait_for_standby(kernel, STANDBY_WAIT_S)
        sent = time.time()
        msg_id = kernel.start_cell(cell)
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
    parser.add_argument("--paired", action="store_true", help="only the paired blocks in one cell")
    parser.add_argument("--session-cells", type=int, default=0, help="cells in the kernel's linecache first")
    parser.add_argument("--uses", metavar="MODULE.NAME", help="the first-line cell names this library object too")
    parser.add_argument("--one-rank", action="store_true", help="only the step times of the kernel and 1 rank")
    parser.add_argument("--rounds", type=int, help="rounds of the step times (default 5, --quick 3)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    cells = {name: cell for name, cell in CELLS.items() if not (args.one_rank and name.startswith("2 ranks"))}
    steps: dict[str, tuple[float, ...]] = {}
    paired: dict[int, dict[str, list[float]]] = {}
    hook_costs: list[float] = []
    latencies: list[float] = []
    with NotebookKernel() as kernel:
        kernel.run_ok(SETUP + "start_state = {k: v.clone() for k, v in model.state_dict().items()}\n")
        kernel.run_ok(session_cells(args.session_cells))
        kernel.run_ok(CELLS["2 ranks, auto mode"])  # warm the launcher and the caches
        if not (args.first_line or args.one_rank):
            print("paired blocks: 1 and 2 ranks", file=sys.stderr, flush=True)
            paired, hook_costs = paired_steps(kernel)
        if not (args.first_line or args.paired):
            print(f"step times: {rounds} rounds of {len(cells)} variants", file=sys.stderr, flush=True)
            steps = step_times(kernel, rounds, cells)
        if not (args.paired or args.one_rank):
            print("re-run first-line latency", file=sys.stderr, flush=True)
            latencies = first_line_latency(kernel, RERUNS, args.uses)
    if steps:
        print_steps(steps, rounds)
    if paired:
        print_paired(paired, hook_costs)
    if latencies:
        print_first_line(latencies, args.session_cells, args.uses)


def print_first_line(latencies: list[float], cells: int, uses: str | None = None) -> None:
    median = statistics.median(latencies)
    shown = ", ".join(f"{value * 1000:.1f}" for value in latencies)
    where = f"2 CPU ranks, {cells} cells in the kernel's linecache" if cells else "2 CPU ranks"
    where += f", the cell names {uses}" if uses else ""
    print(f"\nRe-run cell sent -> every rank running its first line ({where}): median {median * 1000:.1f} ms")
    target = f"target <= {TARGET_FIRST_LINE_S * 1000:.0f} ms: {verdict(median, TARGET_FIRST_LINE_S)}"
    print(f"  re-runs: {shown} ms  ({target})")


def print_paired(paired: dict[int, dict[str, list[float]]], hook_costs: list[float]) -> None:
    print(f"\nPaired blocks in one auto-mode cell: {PAIRS} rounds of {BLOCK} steps per way, order rotated;")
    print("rank 0's mean step per block, median over rounds; ratios: median over rounds of the round's ratio")
    for devices, ways in paired.items():
        ranks = "1 rank " if devices == 1 else f"{devices} ranks"
        shown = ", ".join(f"{name} {statistics.median(times) * 1e6:.1f} us" for name, times in ways.items())
        print(f"  {ranks}: {shown}")
        for variant, baseline, target in (("auto mode", "by hand", TARGET_AUTO_RATIO), ("auto mode", "bare", None)):
            ratios = sorted(a / b for a, b in zip(ways[variant], ways[baseline], strict=True))
            middle = statistics.median(ratios)
            spread = f"middle half {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}"
            aim = f"  (target <= {target}x: {verdict(middle, target)})" if target else ""
            print(f"    {variant} / {baseline}: {middle:.3f}x, {spread}{aim}")
    costs = sorted(hook_costs)
    hand_step = statistics.median(paired[1]["by hand"])
    cost = statistics.median(costs)
    middle = f"middle half {costs[len(costs) // 4] * 1e6:.1f}-{costs[3 * len(costs) // 4] * 1e6:.1f}"
    print(f"  auto mode's loss hook alone (a one-element backward, hooked less plain, {len(costs)} pairs):")
    print(f"    {cost * 1e6:.1f} us a step ({middle}), {cost / hand_step:.2%} of the 1-rank step by hand")


def print_steps(steps: dict[str, tuple[float, ...]], rounds: int) -> None:
    print(f"\nSteady step, MLP 256-512-10, batch 64, CPU: rank 0's median and 10th percentile of {STEPS} steps,")
    print(f"median of {rounds} rounds (busy machine: the percentile shows the loop, the median the machine);")
    print("the loop's own thread: CPU time and minor page faults per step (what other processes' load barely moves)")
    for name, (median, floor, cpu, faults) in steps.items():
        print(
            f"  {name:<22} median {median * 1e6:8.1f} us   p10 {floor * 1e6:8.1f} us   "
            f"thread CPU {cpu * 1e6:8.1f} us   faults {faults:6.2f}"
        )
    for label, variant, baseline, target in (
        ("2 ranks: auto / by hand", "2 ranks, auto mode", "2 ranks, DDP by hand", TARGET_AUTO_RATIO),
        ("1 rank:  auto / by hand", "1 rank, auto mode", "1 rank, by hand", TARGET_AUTO_RATIO),
        ("1 rank:  auto / kernel loop", "1 rank, auto mode", "kernel", TARGET_KERNEL_RATIO),
        ("1 rank:  by hand / kernel loop", "1 rank, by hand", "kernel", TARGET_KERNEL_RATIO),
    ):
        if variant not in steps or baseline not in steps:
            continue
        ratios = [steps[variant][i] / steps[baseline][i] for i in (0, 1, 2)]
        shown = ", ".join(
            f"{name} {ratio:.3f}x: {verdict(ratio, target)}"
            for name, ratio in zip(("median", "p10", "thread CPU"), ratios, strict=True)
        )
        print(f"  {label:<30} {shown}  (target <= {target}x)")


if __name__ == "__main__":
    main()
