"""A fault soak: one real Jupyter kernel, N random runs, every fault nbtrain claims to survive.

Each run is a ``%%distributed`` cell on 2-4 CPU ranks (chosen at random, as are the faulty
rank and the step the fault strikes at) that ends one of seven ways:

    clean      every rank finishes
    exception  the rank raises ValueError            -> RankError naming it
    sigkill    the rank SIGKILLs itself               -> RankDiedError, signal 9
    exit       the rank calls os._exit(3)             -> RankDiedError, exit code 3
    hang       the rank sleeps forever; --timeout     -> RunTimeoutError: "rank R: in time.sleep, Cell In[N], line L"
    deadlock   the rank skips one all_reduce; --timeout -> RunTimeoutError: the other ranks
               "waiting in all_reduce" at the collective's line, the rank "finished its work"
    interrupt  the kernel is interrupted at a random moment -> the run stops
    interrupt-step    a training loop (optimizer, StepLR) is interrupted at a random moment, mid-step
               as often as not -> every rank stops at one step and the kernel's model, optimizer
               and scheduler hold it (or, stopped hard, hold what they held before)
    interrupt-result  the same loop ends with a large result, and the interrupt lands around its end,
               often while the kernel copies rank 0's result -> the state is whole: the finished
               run's, the stop step's, or the old one; never a mix

After each run it checks that the cell ended within its bound, that the error names the
right rank and kind, that a stopped training loop left the kernel's objects at exactly one
step (against a reference trained in the kernel for that many steps), that the kernel runs a
plain cell, and that the next clean ``%%distributed`` run works. Across the soak it checks that
the kernel's process tree (the kernel, its launcher, their descendants) did not grow: processes, open fds, threads,
memfds, listening TCP ports, and the /dev/shm entries named after its processes.

``--launches N`` instead re-runs one trivial ``%%distributed`` cell N times and checks that
processes, fds, threads and the kernel's RSS stay flat and the launch time does not drift.

    .venv/bin/python benchmarks/soak.py --runs 40 --seed 12     # ~3 min; what the tests run
    nice -n 10 .venv/bin/python benchmarks/soak.py --runs 1000 --seed 7
    .venv/bin/python benchmarks/soak.py --launches 100
    .venv/bin/python benchmarks/soak.py --runs 200 --trace /tmp/soak.csv  # resources after each run

A failed check prints what happened, with the seed and run number to replay it; the exit
status is 1 if any check failed. Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' kernel driver

from queue import Empty

import psutil
from nbclient.util import run_sync

from kernel_helpers import NotebookKernel

KINDS = ("clean", "exception", "sigkill", "exit", "hang", "deadlock", "interrupt", "interrupt-step", "interrupt-result")
STATE_KINDS = ("interrupt-step", "interrupt-result")  # runs whose kernel state is checked after the stop
STEPS = 12  # all_reduces per run; a fault strikes at one of them
# Bounds are ceilings for a loaded 2-core machine, not measurements (those are in the table).
FAULT_BOUND = 30.0  # a failing rank's run: launch + steps + stop
TIMEOUT_SECONDS = 4.0  # --timeout of the hang and deadlock runs (the ranks must reach the fault first)
TIMEOUT_SLACK = 20.0  # a timed-out run ends within --timeout + this
INTERRUPT_BOUND = 12.0  # from the interrupt to the cell's reply
PLAIN_BOUND = 30.0  # a plain cell, and the clean run after each fault
WARM_UP_BOUND = 300.0  # the first run also waits for the launcher to import torch
SETTLE_SECONDS = 15.0  # how long resources may take to come back to their resting level
LAUNCH_TIME_RATIO = 1.2  # the last 10 launches within 20% of the first 10 (load-corrected)
RSS_GROWTH_BYTES = 64 << 20

CELL = """\
%%distributed --devices {world} --accelerator cpu{timeout}
import os, signal, time
import torch, torch.distributed as dist
print("soak-pid", os.getpid(), flush=True)
t = torch.ones(8)
me = dist.get_rank()
for step in range({steps}):
    time.sleep(0.01)
    if me == {rank} and step == {step}:
        {fault}
    dist.all_reduce(t)  # ALLREDUCE
print("done", me, flush=True)
"""
FAULTS = {
    "clean": "pass",
    "exception": 'raise ValueError("soak fault")',
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
    "exit": "os._exit(3)",
    "hang": "time.sleep(3600)  # HANG",
    "deadlock": "continue  # skip one all_reduce",
}
INTERRUPT_CELL = """\
%%distributed --devices {world} --accelerator cpu
import time, torch, torch.distributed as dist
t = torch.ones(8)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.01)
    dist.all_reduce(t)
"""
NEXT_CELL = (
    "%%distributed --devices 2 --accelerator cpu\nimport torch.distributed as dist\nnext_ok = dist.get_world_size()"
)
ACCEPTED_INTERRUPT_ERRORS = ("RunInterrupted", "KeyboardInterrupt", "RunStoppedError")
TRAIN_STEPS = 300  # interrupt-step: the interrupt (0-3 s in) lands in the loop
RESULT_STEPS = 40  # interrupt-result: about as long as the wait before the interrupt, so it lands around the end
# Defined once in the soak's kernel: data, a fresh model, and the reference a stopped run is compared with.
TRAIN_SETUP = """
import torch, nbtrain
torch.manual_seed(0)
SX = torch.randn(4096, 8, dtype=torch.float64)
SY = SX @ torch.randn(8, 1, dtype=torch.float64)

def soak_make():
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.9)

def soak_state_gap(steps, world):
    ref, ref_opt, ref_sched = soak_make()
    for i in range(steps):
        idx = (torch.arange(64 * world) + i * 64 * world) % 4096
        loss = torch.nn.functional.mse_loss(ref(SX[idx]), SY[idx])
        ref_opt.zero_grad(); loss.backward(); ref_opt.step(); ref_sched.step()
    gap = max((a - b).abs().max().item() for a, b in zip(smodel.parameters(), ref.parameters()))
    return gap if ssched.last_epoch == ref_sched.last_epoch == steps else float("inf")
"""
TRAIN_CELL = """\
%%distributed --devices {world} --accelerator cpu
import time
r, w = nbtrain.rank(), nbtrain.world_size()
for i in range({steps}):
    idx = (torch.arange(64) + (i * w + r) * 64) % 4096
    loss = torch.nn.functional.mse_loss(smodel(SX[idx]), SY[idx])
    sopt.zero_grad(); loss.backward(); sopt.step(); ssched.step()
    time.sleep(0.002)
{tail}"""
BIG_RESULT = "blob = torch.ones(32 << 20, dtype=torch.float64)  # 256 MiB for the kernel to copy\n"
STATE_GAP = 1e-6


@dataclass
class Tally:
    runs: int = 0
    overran: int = 0
    wrong_blame: int = 0
    kernel_unusable: int = 0
    next_failed: int = 0
    wrong_state: int = 0
    seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    kind: str
    world: int
    rank: int
    step: int
    interrupt_after: float


def plan_runs(count: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for _ in range(count):
        world = rng.randint(2, 4)
        plans.append(Plan(rng.choice(KINDS), world, rng.randrange(world), rng.randrange(STEPS), rng.uniform(0.0, 3.0)))
    return plans


# -- the kernel's resources ----------------------------------------------------------------


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def fd_targets(pid: int) -> list[str]:
    targets = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return targets
    for name in names:
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            pass  # closed meanwhile
    return targets


def listening_ports(processes: list[psutil.Process]) -> int:
    count = 0
    for process in processes:
        try:
            count += sum(1 for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)
        except psutil.Error:
            pass
    return count


def resources(kernel_pid: int, pids_seen: set[int]) -> dict[str, int]:
    processes = tree(kernel_pid)
    pids_seen.update(p.pid for p in processes)
    fds = [t for p in processes for t in fd_targets(p.pid)]
    threads = 0
    for process in processes:
        try:
            threads += process.num_threads()
        except psutil.Error:
            pass
    try:
        rss = psutil.Process(kernel_pid).memory_info().rss
    except psutil.Error:
        rss = 0
    return {
        "descendant processes": len(processes) - 1,
        "open fds": len(fds),
        "threads": threads,
        "memfds": sum(1 for t in fds if t.startswith("/memfd:")),
        "listening ports": listening_ports(processes),
        "/dev/shm entries": len(shm_entries(pids_seen)),
        "kernel RSS (MiB)": rss >> 20,
    }


def shm_entries(pids: set[int]) -> list[str]:
    """/dev/shm entries torch named after one of our processes (torch_<pid>_...).

    Other users of the machine create and remove entries of their own at any moment:
    only those named after the kernel's tree can be ours.
    """
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    found = []
    for name in names:
        match = re.match(r"torch_(\d+)_", name)
        if match and int(match.group(1)) in pids:
            found.append(name)
    return found


def settled(kernel_pid: int, baseline: dict[str, int], pids_seen: set[int], keys: tuple[str, ...]) -> dict[str, int]:
    """Resources once they are back at the baseline, or as they are after SETTLE_SECONDS."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        now = resources(kernel_pid, pids_seen)
        if all(now[k] <= baseline[k] for k in keys) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)  # polling a resource count: nothing to wait on


# -- one run ---------------------------------------------------------------------------------


def line_of(source: str, marker: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if marker in line)


def cell_for(plan: Plan) -> str:
    if plan.kind == "interrupt":
        return INTERRUPT_CELL.format(world=plan.world)
    if plan.kind in STATE_KINDS:
        tail = BIG_RESULT if plan.kind == "interrupt-result" else ""
        return TRAIN_CELL.format(world=plan.world, steps=train_steps(plan), tail=tail)
    timeout = f" --timeout {TIMEOUT_SECONDS:g}" if plan.kind in ("hang", "deadlock") else ""
    return CELL.format(
        world=plan.world, timeout=timeout, steps=STEPS, rank=plan.rank, step=plan.step, fault=FAULTS[plan.kind]
    )


def bound_for(plan: Plan) -> float:
    if plan.kind in ("hang", "deadlock"):
        return TIMEOUT_SECONDS + TIMEOUT_SLACK
    if plan.kind in ("interrupt", *STATE_KINDS):
        return plan.interrupt_after + INTERRUPT_BOUND
    return FAULT_BOUND


def expected_error(plan: Plan, source: str, number: int) -> tuple[str, list[str]]:
    """The error a fault must end in, and the text it must contain (rank, kind, cell lines)."""
    r = plan.rank
    if plan.kind == "exception":
        return "RankError", [f"rank {r} raised ValueError: soak fault"]
    if plan.kind == "sigkill":
        return "RankDiedError", [f"rank {r} was killed by signal 9 (SIGKILL)"]
    if plan.kind == "exit":
        return "RankDiedError", [f"rank {r} exited with code 3"]
    if plan.kind == "hang":
        return "RunTimeoutError", [f"rank {r}: in time.sleep, Cell In[{number}], line {line_of(source, 'HANG')}"]
    waiting = f"waiting in all_reduce, Cell In[{number}], line {line_of(source, 'ALLREDUCE')}"
    stuck = [f"rank {i}: {waiting}" for i in range(plan.world) if i != r]
    return "RunTimeoutError", [f"rank {r}: finished its work, waiting for the other ranks", *stuck]


def blame_problem(plan: Plan, source: str, number: int, reply: dict, text: str) -> str | None:
    """What is wrong with the cell's outcome, or None when it is what this fault must give."""
    ename = reply.get("ename")
    if plan.kind == "clean":
        ok = reply["status"] == "ok" and all(f"done {i}" in text for i in range(plan.world))
        return None if ok else "a clean run did not finish on every rank"
    if plan.kind == "interrupt":
        ok = ename in ACCEPTED_INTERRUPT_ERRORS or "interrupted" in text
        return None if ok else f"an interrupt gave {ename}"
    if plan.kind in STATE_KINDS:  # it may also have finished before the interrupt landed
        ok = reply["status"] == "ok" or ename in ACCEPTED_INTERRUPT_ERRORS
        return None if ok else f"an interrupt gave {ename}"
    name, needles = expected_error(plan, source, number)
    missing = [n for n in needles if n not in text]
    if ename != name or missing:
        return f"expected {name} with {needles}, got {ename}; missing {missing}"
    return None


def run_one(kernel: NotebookKernel, plan: Plan, tally: Tally, pids_seen: set[int]) -> list[str]:
    """Run one planned fault and the checks after it; the problems found."""
    problems = []
    source = cell_for(plan)
    if plan.kind in STATE_KINDS:
        kernel.run_ok("smodel, sopt, ssched = soak_make()")
    started = time.monotonic()
    msg_id = kernel.start_cell(source)
    if plan.kind in ("interrupt", *STATE_KINDS):
        wait_until_executing(kernel, msg_id)
        time.sleep(plan.interrupt_after)  # the random moment of the interrupt is the point
        kernel.interrupt()
    try:
        reply, out = kernel.wait_for_reply(msg_id, timeout=bound_for(plan) + 60)
    except AssertionError as error:
        return [f"no reply: {error}"]
    elapsed = time.monotonic() - started
    tally.seconds.append(elapsed)
    if elapsed > bound_for(plan):
        tally.overran += 1
        problems.append(f"the cell took {elapsed:.1f} s, over its bound of {bound_for(plan):.0f} s")
    text = out.text
    pids_seen.update(int(pid) for pid in re.findall(r"soak-pid (\d+)", text))  # the ranks, for /dev/shm
    problem = blame_problem(plan, source, reply.get("execution_count", 0), reply, text)
    if problem:
        tally.wrong_blame += 1
        problems.append(problem + "\n" + textwrap.indent(text[-3000:], "    | "))
    if plan.kind in STATE_KINDS:
        state_problem = wrong_state(kernel, plan, reply, text)
        if state_problem:
            tally.wrong_state += 1
            problems.append(state_problem)
    if not plain_cell_works(kernel):
        tally.kernel_unusable += 1
        problems.append("the kernel did not run a plain cell afterwards")
    why = next_run_works(kernel)
    if why:
        tally.next_failed += 1
        problems.append("the next clean %%distributed run failed: " + why)
    return problems


def train_steps(plan: Plan) -> int:
    return RESULT_STEPS if plan.kind == "interrupt-result" else TRAIN_STEPS


def wrong_state(kernel: NotebookKernel, plan: Plan, reply: dict, text: str) -> str | None:
    """What is wrong with the kernel's model after a stopped training run, or None when it holds one whole step.

    The step it must hold: the stop's (``stopped at step N``), all of them for a run that finished
    (or was interrupted after its results were in), none for a hard stop (nothing changed).
    """
    kept = re.search(r"stopped at step (\d+) on every rank", text)
    if kept:
        steps = int(kept.group(1))
    elif reply["status"] == "ok" or "its results are in the kernel" in text:
        steps = train_steps(plan)
    else:
        steps = 0
    try:
        gap = kernel.value(f"soak_state_gap({steps}, {plan.world})")
    except AssertionError as error:
        return f"the kernel's state could not be compared: {error}"
    if not gap < STATE_GAP:
        return f"the kernel's model, optimizer or scheduler is not at step {steps} (gap {gap}):\n{text[-1500:]}"
    return None


def wait_until_executing(kernel: NotebookKernel, msg_id: str, timeout: float = PLAIN_BOUND) -> None:
    """Until the kernel took the cell up (its execute_input): an interrupt before that is lost."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = run_sync(kernel.client.kc.get_iopub_msg)(timeout=1.0)
        except Empty:
            continue
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "execute_input":
            return


def plain_cell_works(kernel: NotebookKernel) -> bool:
    try:
        reply, out = kernel.wait_for_reply(kernel.start_cell("print(6 * 7)"), timeout=PLAIN_BOUND)
    except AssertionError:
        return False
    return reply["status"] == "ok" and "42" in out.stdout


def next_run_works(kernel: NotebookKernel, bound: float = PLAIN_BOUND) -> str | None:
    """Why the next clean ``%%distributed`` run failed, or None when it worked."""
    try:
        reply, out = kernel.wait_for_reply(kernel.start_cell(NEXT_CELL), timeout=bound)
        if reply["status"] != "ok":
            return f"it ended in {reply.get('ename')}:\n" + textwrap.indent(out.text[-3000:], "    | ")
        cell = kernel.start_cell("print('next', next_ok); del next_ok")
        reply, out = kernel.wait_for_reply(cell, timeout=PLAIN_BOUND)
    except AssertionError as error:
        return f"no reply: {error}"
    if reply["status"] == "ok" and "next 2" in out.stdout:
        return None
    return "the kernel did not get its result:\n" + textwrap.indent(out.text[-3000:], "    | ")


# -- the soak and the launch series -----------------------------------------------------------


GROWTH_KEYS = ("descendant processes", "open fds", "threads", "memfds", "listening ports", "/dev/shm entries")


def soak(runs: int, seed: int, trace: str | None = None) -> bool:
    plans = plan_runs(runs, seed)
    tallies = {kind: Tally() for kind in KINDS}
    failures: list[str] = []
    pids_seen: set[int] = set()
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain")
        kernel.run_ok(TRAIN_SETUP)
        progress("nbtrain in the kernel: " + kernel.value("__import__('nbtrain').__file__"))
        for _ in range(2):  # the launcher warm, every lazy import done: the resting level
            why = next_run_works(kernel, WARM_UP_BOUND)
            if why:
                print("the warm-up run failed: " + why, file=sys.stderr)
                return False
        # One interrupted training run with a large result: its first time starts what the kernel keeps
        # for the next (the copy's reader threads, a ZMQ context of the kernel's own): the resting level.
        run_one(kernel, Plan("interrupt-result", 2, 0, 0, 1.0), Tally(), pids_seen)
        baseline = settled(kernel.pid, resources(kernel.pid, pids_seen), pids_seen, GROWTH_KEYS)
        started = time.monotonic()
        for index, plan in enumerate(plans):
            tally = tallies[plan.kind]
            tally.runs += 1
            problems = run_one(kernel, plan, tally, pids_seen)
            pids_seen.update(p.pid for p in tree(kernel.pid))
            if trace:
                write_trace(trace, index + 1, plan, resources(kernel.pid, pids_seen))
            status = "ok" if not problems else "FAILED"
            where = f"world={plan.world} rank={plan.rank} step={plan.step}"
            progress(f"run {index + 1}/{runs} {plan.kind} {where}: {status}")
            for problem in problems:
                failures.append(f"run {index + 1} (seed {seed}) {plan}: {problem}")
                progress("  " + problem.splitlines()[0])
        elapsed = time.monotonic() - started
        end = settled(kernel.pid, baseline, pids_seen, GROWTH_KEYS)
    print(f"\nnbtrain fault soak: {runs} runs, seed {seed}, {elapsed / 60:.1f} min\n")
    print_fault_table(tallies)
    growth_ok = print_resource_table(baseline, end, GROWTH_KEYS)
    for failure in failures:
        print("\n" + failure)
    return not failures and growth_ok


def write_trace(path: str, number: int, plan: Plan, now: dict[str, int]) -> None:
    """One CSV row per run: the kernel tree's resources right after it, to see when a count grows."""
    new = not os.path.exists(path) or number == 1
    with open(path, "w" if number == 1 else "a") as f:
        if new:
            f.write(",".join(["run", "kind", *now]) + "\n")
        f.write(",".join([str(number), plan.kind, *map(str, now.values())]) + "\n")


def print_fault_table(tallies: dict[str, Tally]) -> None:
    header = (
        "fault", "runs", "cells over bound", "wrong blame", "wrong state", "kernel unusable", "next run failed",
        "median s", "max s",
    )
    rows = []
    for kind, t in tallies.items():
        counts = (t.runs, t.overran, t.wrong_blame, t.wrong_state, t.kernel_unusable, t.next_failed)
        rows.append((kind, *counts, *_times(t.seconds)))
    every = [s for t in tallies.values() for s in t.seconds]
    counted = ("runs", "overran", "wrong_blame", "wrong_state", "kernel_unusable", "next_failed")
    sums = [sum(getattr(t, f) for t in tallies.values()) for f in counted]
    rows.append(("total", *sums, *_times(every)))
    print_table(header, rows)


def _times(seconds: list[float]) -> tuple[str, str]:
    if not seconds:
        return ("-", "-")
    return (f"{statistics.median(seconds):.2f}", f"{max(seconds):.2f}")


def print_resource_table(before: dict[str, int], after: dict[str, int], keys: tuple[str, ...], allowed=None) -> bool:
    allowed = allowed or {}
    rows, ok = [], True
    for key, start in before.items():
        growth = after[key] - start
        limit = allowed.get(key, 0)
        checked = key in keys
        bad = checked and growth > limit
        ok = ok and not bad
        shown = f"<= {limit}" if checked else "(shown)"
        rows.append((key, start, after[key], f"{growth:+d}", shown, "GREW" if bad else ""))
    print()
    print_table(("resource of the kernel's tree", "at start", "at end", "growth", "allowed", ""), rows)
    return ok


TRIVIAL_CELL = "%%distributed --devices 2 --accelerator cpu\nx = 1"


def launch_time(kernel: NotebookKernel) -> float:
    """One launch of a trivial cell, timed in the kernel by the magic's own record of the run
    (launch, rank start, process group, result and teardown are all of it)."""
    kernel.run_ok(TRIVIAL_CELL)
    return kernel.value("_cellrun.last_run.seconds")


def alternate(aged: NotebookKernel, control: NotebookKernel, count: int) -> tuple[list[float], list[float]]:
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(count):
        times[0].append(launch_time(aged))
        times[1].append(launch_time(control))
    return times


def launches(count: int) -> bool:
    """Re-run a trivial cell ``count`` times in one kernel: flat resources, no drift in launch time.

    The machine's load moves launch times far more than 20% over a few minutes, so the
    first and last 10 launches alternate with those of a second, fresh kernel, which sees
    the same load: the drift is how much the series slowed beyond what the control did.
    """
    pids_seen: set[int] = set()
    keys = ("descendant processes", "open fds", "threads", "kernel RSS (MiB)")
    allowed = {"kernel RSS (MiB)": RSS_GROWTH_BYTES >> 20}
    setup = "%load_ext nbtrain\nimport nbtrain.kernel.cellrun as _cellrun"
    with NotebookKernel() as kernel, NotebookKernel() as control:
        for k in (kernel, control):
            k.run_ok(setup)
            for _ in range(3):
                k.run_ok(TRIVIAL_CELL)
        baseline = settled(kernel.pid, resources(kernel.pid, pids_seen), pids_seen, keys)
        first, control_first = alternate(kernel, control, 10)
        times = list(first)
        for index in range(count - 20):
            times.append(launch_time(kernel))
            if (index + 1) % 10 == 0:
                progress(f"launch {index + 11}/{count}")
        last, control_last = alternate(kernel, control, 10)
        times += last
        end = settled(kernel.pid, baseline, pids_seen, keys)
    return report_launches(times, first, last, control_first, control_last, baseline, end, keys, allowed)


def report_launches(times, first, last, control_first, control_last, baseline, end, keys, allowed) -> bool:
    median = statistics.median
    raw = median(last) / median(first)
    control = median(control_last) / median(control_first)
    drift = raw / control
    print(f"\nnbtrain launch series: {len(times)} runs of a trivial %%distributed cell (2 CPU ranks) in one kernel\n")
    rows = [
        ("first 10", first),
        ("last 10", last),
        ("all", times),
        ("control, beside the first 10", control_first),
        ("control, beside the last 10", control_last),
    ]
    table = [(n, f"{min(t):.3f}", f"{median(t):.3f}", f"{max(t):.3f}") for n, t in rows]
    print_table(("launches", "fastest s", "median s", "slowest s"), table)
    tens = " ".join(f"{median(times[i:i + 10]):.3f}" for i in range(0, len(times), 10))
    print("\nmedian of each 10, in order: " + tens)
    print(f"median of the last 10 / median of the first 10: {raw:.2f}; the fresh control kernel's: {control:.2f}")
    print(f"drift (the series' ratio / the control's): {drift:.2f}")
    # The control excuses a slowdown the machine's load caused; it must never condemn a series
    # that did not slow down (a control whose last 10 ran fast would, by dividing).
    verdict = min(raw, drift)
    print(f"slowdown counted (the smaller of the two): {verdict:.2f} (allowed <= {LAUNCH_TIME_RATIO})")
    ok = print_resource_table(baseline, end, keys, allowed)
    return ok and verdict <= LAUNCH_TIME_RATIO


def print_table(header, rows) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=False)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip())


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="random runs in the soak (default 40)")
    parser.add_argument("--seed", type=int, default=12, help="seed of the random plan, to replay a soak (default 12)")
    parser.add_argument("--launches", type=int, default=0, help="instead: re-run a trivial cell this many times")
    parser.add_argument("--trace", help="write the kernel tree's resources after every run to this CSV file")
    args = parser.parse_args()
    ok = launches(args.launches) if args.launches else soak(args.runs, args.seed, args.trace)
    print("\nresult:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
