#!/usr/bin/env python
"""nbtrain launch benchmark: latency, wall time, step time and result transfer.

Run from the repository root::

    .venv/bin/python benchmarks/launch.py           # full run, about 2 minutes on 2 quiet cores
    .venv/bin/python benchmarks/launch.py --quick   # fewer repetitions, about 1 minute

Every figure is measured in this one run, baselines included, on 2 CPU ranks with gloo:

1. launch-to-first-step latency: from the launch call (``time.time()`` in the caller) to
   the moment the *last* rank finished its first optimizer step (``time.time()`` in each
   rank; same clock). Job: MLP 784-256-10 under DDP, SGD, batch 32.
     - nbtrain cold: first ``nbtrain.launch`` in a fresh process, 5 s after ``import nbtrain;
       nbtrain.prewarm()`` (what ``%load_ext nbtrain`` does; two variants: the caller imported
       only nbtrain / the caller also imported torch).
     - nbtrain warm: median of re-launches from this process, each on the standby ranks
       waiting for it; before: the same re-launch on freshly forked ranks (standby ranks
       released first), alternated with it. "Group up" of a re-launch is the target's figure:
       launch -> every rank running its first line.
     - fork floor: ``torch.multiprocessing.start_processes(start_method="fork")`` from this
       process, which has preloaded the same modules the nbtrain launcher preloads;
       one thread per rank. Cold: first launch in a fresh process that imported torch.
     - ``torch.multiprocessing.spawn`` and ``torchrun --standalone --nproc-per-node 2``.
2. total wall time of that same small run (call to return / process exit).
3. steady-state step time: MLP 784-2048-2048-10, batch 64, one thread per rank, median
   step over 30 steps after 5 warm-up steps; nbtrain and the fork floor run the *same*
   function, alternated over several rounds.
4. result transfer: rank 0 returns 1 GiB (4 float32 tensors of 64 Mi elements) to the
   caller; time = (caller has the result) - (rank 0 returned from fn), against one
   in-memory ``clone()`` of the same tensors in the caller.

Every subprocess and every rank has a timeout and is killed when it runs past it.
Nothing here imports torch at module level: ``mp.spawn`` children import this file, and
the cold nbtrain child must start with nothing but nbtrain imported.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# Workload sizes (the brief's figures).
FIRST_STEP_MODEL = (784, 256, 10)
FIRST_STEP_BATCH = 32
STEADY_MODEL = (784, 2048, 2048, 10)
STEADY_BATCH = 64
TRANSFER_TENSORS = 4
TRANSFER_NUMEL = 64 << 20  # 4 x 64 Mi float32 = 1 GiB

# Targets.
TARGET_WARM_FIRST_STEP_S = 0.05
TARGET_RERUN_FIRST_LINE_S = 0.015  # re-run on standby ranks: launch -> every rank's first line
TARGET_COLD_FIRST_STEP_S = 0.21  # Lightning ddp_notebook on this machine
TARGET_STEP_RATIO = 1.02
TARGET_TRANSFER_RATIO = 2.0

LAUNCH_TIMEOUT_S = 120.0  # any single launch
SUBPROCESS_TIMEOUT_S = 180.0  # any cold child / torchrun


# ---------------------------------------------------------------------------------------
# Jobs: the code the ranks run. Self-contained (imports inside, no module globals) so the
# very same function runs under nbtrain (cloudpickled), fork/spawn (by reference) and
# torchrun (its source is pasted into the script).
# ---------------------------------------------------------------------------------------
def mlp(sizes):
    """Linear layers of these widths with ReLU between them."""
    import itertools  # here, not at the top: torchrun's script is this function's source

    from torch import nn

    layers = []
    for width_in, width_out in itertools.pairwise(sizes):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def first_step_job(sizes=(784, 256, 10), batch=32):
    """DDP MLP, one SGD step; every rank's timestamps (time.time()) gathered to rank 0."""
    import time

    t_enter = time.time()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(mlp(sizes))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, sizes[0])
    y = torch.randint(0, sizes[-1], (batch,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    t_first = time.time()
    mine = {"enter": t_enter, "first_step": t_first, "threads": torch.get_num_threads()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def steady_job(sizes=(784, 2048, 2048, 10), batch=64, warmup=5, steps=30):
    """DDP MLP; per-step wall times (perf_counter) of every rank, gathered to rank 0."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(mlp(sizes))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, sizes[0], generator=generator)
    y = torch.randint(0, sizes[-1], (batch,), generator=generator)
    times, cpu = [], []
    for _ in range(warmup + steps):
        t, c = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)  # every thread of the rank, gloo's included
    mine = {"times": times[warmup:], "cpu": cpu[warmup:], "threads": torch.get_num_threads()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def transfer_job(n_tensors=4, numel=64 << 20):
    """Every rank builds n_tensors float32 tensors; rank 0's come back to the caller."""
    import time

    import torch
    import torch.distributed as dist

    weights = {f"w{i}": torch.full((numel,), float(i)) for i in range(n_tensors)}
    dist.barrier()  # both ranks hold their weights before rank 0 returns
    return {"t_return": time.time(), "weights": weights}


JOBS = {"first_step": first_step_job, "steady": steady_job}


# ---------------------------------------------------------------------------------------
# Baseline rank entry point (fork floor and mp.spawn): init the group as a script would,
# run the job, write this rank's record to a file, leave without teardown (as nbtrain's
# ranks do; a gloo group destroyed under DDP can hang in its destructor).
# ---------------------------------------------------------------------------------------
def baseline_rank(index, world_size, port, outdir, job, job_args):
    t_start = time.time()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world_size
    )
    t_pg = time.time()
    result = JOBS[job](*job_args)
    path = os.path.join(outdir, f"rank{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"start": t_start, "pg": t_pg, "result": result}, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


TORCHRUN_SCRIPT = """\
import json, os, sys, time
t_start = time.time()
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
t_pg = time.time()

{job_source}

result = first_step_job({sizes!r}, {batch!r})
rank = dist.get_rank()
path = os.path.join(sys.argv[1], f"rank{{rank}}.json")
with open(path + ".tmp", "w") as f:
    json.dump({{"start": t_start, "pg": t_pg, "result": result}}, f)
os.replace(path + ".tmp", path)
sys.stdout.flush()
os._exit(0)
"""


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------
def sig3(x: float | None) -> str:
    """x with 3 significant digits, never in exponent form."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x == 0:
        return "0"
    decimals = 2 - math.floor(math.log10(abs(x)))
    value = round(x, decimals)
    return f"{value:.{max(decimals, 0)}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return sig3(a / b) + "x"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(
        str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=False))
    )
    print(line)
    print("-" * len(line))
    for r in rows:
        cells = enumerate(zip(r, widths, strict=False))
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in cells))


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


class Budget:
    """Time budgets per section, so that a busy machine shortens the run instead of doubling it.

    A section always does its ``minimum`` repetitions; further ones only while the next is
    expected (from the last one's duration) to end within the section's share of the budget.
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.cut: list[str] = []

    def reps(self, name: str, n: int, seconds: float, minimum: int = 1):
        end = time.monotonic() + seconds * self.scale
        last = 0.0
        for i in range(n):
            now = time.monotonic()
            if i >= minimum and now + last > end:
                self.cut.append(f"{name}: {i} of {n}")
                return
            yield i
            last = time.monotonic() - now


_live_popen: list[subprocess.Popen] = []


def run_subprocess(argv, timeout=SUBPROCESS_TIMEOUT_S, env=None) -> str:
    """Run argv in its own session; kill the whole session on timeout. Returns stdout."""
    popen = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
        cwd=REPO,
    )
    _live_popen.append(popen)
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(popen)
        raise RuntimeError(f"{argv[:4]} ran past {timeout} s and was killed") from None
    finally:
        if popen in _live_popen:
            _live_popen.remove(popen)
    if popen.returncode != 0:
        raise RuntimeError(
            f"{argv[:4]} exited with {popen.returncode}:\n{err.decode(errors='replace')[-3000:]}"
        )
    return out.decode(errors="replace")


def _kill_session(popen: subprocess.Popen) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(subprocess.TimeoutExpired):  # a killed session ends within this
        popen.communicate(timeout=5)


class ForeignCpu:
    """CPU time used by processes outside this benchmark's process tree, between marks.

    The machine is shared: other people's tests on the same cores skew every figure here,
    so each section reports how much CPU others took while it ran. Reads /proc only at
    section boundaries (a few ms); children that others started and reaped in between
    are counted through their parents' cutime/cstime.
    """

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.last = self._snapshot()
        self.t_last = time.monotonic()

    def _snapshot(self) -> tuple[dict[int, int], dict[int, int]]:
        cpu, parent = {}, {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            pid = int(name)
            parent[pid] = int(fields[1])
            cpu[pid] = sum(int(x) for x in fields[11:15])  # utime stime + cutime cstime (reaped children)
        return cpu, parent

    def _ours(self, parent: dict[int, int]) -> set[int]:
        me = os.getpid()
        ours = set()
        for pid in parent:
            p, seen = pid, 0
            while p > 1 and seen < 64:
                if p == me:
                    ours.add(pid)
                    break
                p, seen = parent.get(p, 0), seen + 1
        return ours

    def mark(self) -> tuple[float, float]:
        """(CPU-seconds others used since the last mark, their share of all cores)."""
        cpu0, parent0 = self.last
        cpu1, parent1 = self._snapshot()
        ours = self._ours(parent0) | self._ours(parent1)
        ticks = 0
        for pid, c in cpu1.items():  # alive now: what it (and children it reaped) used since
            if pid not in ours:
                ticks += c - cpu0.get(pid, 0)
        for pid, c in cpu0.items():  # gone: its parent's cutime now holds all of it; the
            if pid not in cpu1 and pid not in ours:  # part before the last mark is not ours to count
                ticks -= c
        now = time.monotonic()
        wall = max(1e-9, now - self.t_last)
        self.last, self.t_last = (cpu1, parent1), now
        seconds = max(0, ticks) / self.tick
        return seconds, seconds / (wall * (os.cpu_count() or 1))


def last_json_line(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result in child output:\n{text[-2000:]}")


def first_step_figures(t_call: float, per_rank: list[dict], t_end: float, pg_key="enter") -> dict:
    return {
        "first_step": max(r["first_step"] for r in per_rank) - t_call,
        "ready": max(r[pg_key] for r in per_rank) - t_call,  # every rank in the job (group up)
        "total": t_end - t_call,
        "threads": [r.get("threads") for r in per_rank],
    }


# ---------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------
def nbtrain_first_step(nbtrain) -> dict:
    t_call = time.time()
    gathered = nbtrain.launch(
        first_step_job, FIRST_STEP_MODEL, FIRST_STEP_BATCH, devices=2, accelerator="cpu",
        strategy="ddp_notebook", timeout=LAUNCH_TIMEOUT_S,
    )
    t_end = time.time()
    return first_step_figures(t_call, gathered, t_end)


def wait_for_standby(timeout: float = 10.0) -> None:
    """Until the launcher reports the next run's standby ranks all in their group (bounded)."""
    from nbtrain.kernel import launcher_connection

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        standby = launcher_connection.get_client().standby
        if standby is not None and standby.ready:
            return
        time.sleep(0.005)
    progress(f"WARNING: no standby ranks ready within {timeout} s")


def torch_mp_run(start_method: str, job: str, job_args: tuple, timeout=LAUNCH_TIMEOUT_S):
    """Run JOBS[job] on 2 ranks via torch.multiprocessing; (t_call, per-rank records, t_end)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as outdir:
        t_call = time.time()
        context = mp.start_processes(
            baseline_rank, args=(2, free_port(), outdir, job, job_args), nprocs=2,
            join=False, start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.01, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{start_method} run ran past {timeout} s")
        except BaseException:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
            raise
        t_end = time.time()
        records = []
        for rank in range(2):
            with open(os.path.join(outdir, f"rank{rank}.json")) as f:
                records.append(json.load(f))
    return t_call, records, t_end


def torch_mp_first_step(start_method: str) -> dict:
    t_call, records, t_end = torch_mp_run(start_method, "first_step", (FIRST_STEP_MODEL, FIRST_STEP_BATCH))
    per_rank = records[0]["result"]
    for r, rec in zip(per_rank, records, strict=False):
        r["pg"] = rec["pg"]
    return first_step_figures(t_call, per_rank, t_end, pg_key="pg")


def torchrun_first_step(tmp: str) -> dict:
    script = os.path.join(tmp, "torchrun_job.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(TORCHRUN_SCRIPT.format(
                job_source="\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in (mlp, first_step_job)),
                sizes=FIRST_STEP_MODEL, batch=FIRST_STEP_BATCH,
            ))
    outdir = tempfile.mkdtemp(prefix="out-", dir=tmp)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    argv = [torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]
    argv += ["--standalone", "--nproc-per-node", "2", script, outdir]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun itself would set; silences its warning
    t_call = time.time()
    run_subprocess(argv, env=env)
    t_end = time.time()
    records = []
    for rank in range(2):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            records.append(json.load(f))
    per_rank = records[0]["result"]
    for r, rec in zip(per_rank, records, strict=False):
        r["pg"] = rec["pg"]
    return first_step_figures(t_call, per_rank, t_end, pg_key="pg")


def cold_child(kind: str, pre_import_torch: bool, wait: float) -> dict:
    """A fresh interpreter running this file's --child mode; its figures."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", kind, "--wait", str(wait)]
    if pre_import_torch:
        argv.append("--pre-import-torch")
    env = dict(os.environ)
    env.pop("NBTRAIN_PREWARM", None)
    return last_json_line(run_subprocess(argv, env=env))


def child_main(kind: str, pre_import_torch: bool, wait: float) -> None:
    """Inside a fresh process: import like a user would, wait, launch once, print JSON."""
    if kind == "nbtrain":
        t_import = time.monotonic()
        import nbtrain

        nbtrain.prewarm()  # what %load_ext nbtrain does: importing nbtrain alone starts nothing
        if pre_import_torch:
            import torch  # a notebook's first cell usually has it
        time.sleep(max(0.0, wait - (time.monotonic() - t_import)))
        figures = nbtrain_first_step(nbtrain)
    else:
        t_import = time.monotonic()
        import torch
        import torch.distributed
        import torch.multiprocessing  # noqa: F401 - imported as a torch user's caller would have
        from torch.nn.parallel import DistributedDataParallel  # noqa: F401 - likewise

        time.sleep(max(0.0, wait - (time.monotonic() - t_import)))
        figures = torch_mp_first_step(kind)
    print(json.dumps(figures), flush=True)


def preload_like_launcher() -> None:
    """Import what the nbtrain launcher preloads, so the fork floor's ranks start equally warm."""
    from nbtrain.launch_server import server

    for module in server.PRELOAD:
        with contextlib.suppress(Exception):  # as the launcher does: a missing module only costs speed
            __import__(module)


# ---------------------------------------------------------------------------------------
# The four benchmarks
# ---------------------------------------------------------------------------------------
def bench_latency(nbtrain, reps: dict, tmp: str, load: dict, foreign: ForeignCpu, budget: Budget) -> dict:
    res: dict[str, list] = {key: [] for key in (
        "nbtrain_cold", "nbtrain_cold_torch", "fork_cold", "spawn_cold", "nbtrain_warm", "fork_warm",
        "nbtrain_warm_fresh")}

    progress("nbtrain cold: fresh processes, 5 s after import nbtrain (without / with import torch) ...")
    for _ in budget.reps("nbtrain cold", reps["cold"], 60):
        res["nbtrain_cold"].append(cold_child("nbtrain", False, 5.0))
        res["nbtrain_cold_torch"].append(cold_child("nbtrain", True, 5.0))
    progress("fork floor cold / mp.spawn cold (fresh processes) ...")
    for i in budget.reps("fork/spawn cold", reps["cold"], 30):
        res["fork_cold"].append(cold_child("fork", False, 1.0))
        if i < reps["cold_spawn"]:
            res["spawn_cold"].append(cold_child("spawn", False, 1.0))
    load["cold launches"] = foreign.mark()

    progress("warm: nbtrain (standby ranks / fresh ranks) and fork floor, alternated ...")
    nbtrain_first_step(nbtrain)  # one unrecorded launch of each, so both start equally warm
    torch_mp_first_step("fork")
    for _ in budget.reps("warm launches", reps["warm"], 15, minimum=3):
        wait_for_standby()  # a re-run finds them waiting; they wait without taking CPU
        res["fork_warm"].append(torch_mp_first_step("fork"))
        res["nbtrain_warm"].append(nbtrain_first_step(nbtrain))
        # Before: the same re-launch with freshly forked ranks (the standby ranks released first).
        wait_for_standby()
        nbtrain.release()
        res["nbtrain_warm_fresh"].append(nbtrain_first_step(nbtrain))
    load["warm launches"] = foreign.mark()

    progress("mp.spawn repeats, torchrun (its first run = cold) ...")
    res["spawn_warm"], runs = [], [torchrun_first_step(tmp)]
    for _ in budget.reps("mp.spawn / torchrun repeats", reps["slow"], 30):
        res["spawn_warm"].append(torch_mp_first_step("spawn"))
        runs.append(torchrun_first_step(tmp))
    res["torchrun_cold"], res["torchrun_warm"] = runs[:1], runs[1:]
    load["mp.spawn and torchrun"] = foreign.mark()
    return res


def bench_steady(nbtrain, rounds: int, steps: int, budget: Budget) -> dict:
    job_args = (STEADY_MODEL, STEADY_BATCH, 5, steps)
    out = {"nbtrain": [], "fork": [], "nbtrain_cpu": [], "fork_cpu": [], "threads": set()}

    def run_nbtrain():
        gathered = nbtrain.launch(
            steady_job, *job_args, devices=2, accelerator="cpu", timeout=LAUNCH_TIMEOUT_S
        )
        return gathered

    def run_fork():
        _, records, _ = torch_mp_run("fork", "steady", job_args)
        return records[0]["result"]

    for i in budget.reps("steady-state rounds", rounds, 45, minimum=2):
        progress(f"steady-state round {i + 1}/{rounds} ...")
        order = (("nbtrain", run_nbtrain), ("fork", run_fork))
        if i % 2:
            order = order[::-1]
        for name, fn in order:
            gathered = fn()
            # DDP makes the ranks step in lock-step; a step's time is the slower rank's.
            per_step = [max(ts) for ts in zip(*(g["times"] for g in gathered), strict=False)]
            out[name].append(per_step)
            # CPU seconds per step, both ranks together: what other load cannot inflate much
            out[name + "_cpu"].append([sum(cs) for cs in zip(*(g["cpu"] for g in gathered), strict=False)])
            out["threads"].update(g["threads"] for g in gathered)
    return out


def bench_transfer(nbtrain, reps: int, budget: Budget) -> dict:
    """1 GiB back from rank 0, against one in-memory clone() of the same tensors.

    The baseline clones the very tensors that came back (after one full read, so their
    pages are mapped), and the caller holds no other copy: on this VM, memory touched
    for the first time after the footprint grows can cost 2-5x more (host-side faults;
    see README), so each measurement should find the same amount of recently used memory.
    An unrecorded 2-rank transfer (the largest footprint) warms that up first.
    """
    import torch

    n, numel = TRANSFER_TENSORS, TRANSFER_NUMEL
    nbytes = n * numel * 4
    out = {"bytes": nbytes, "t1": [], "t2": [], "read1": [], "total1": [], "total2": [],
           "clone": [], "clone1": [], "read_clone": []}
    threads = torch.get_num_threads()

    def transfer(devices, baseline=False):
        t_call = time.time()
        result = nbtrain.launch(
            transfer_job, n, numel, devices=devices, accelerator="cpu", timeout=LAUNCH_TIMEOUT_S
        )
        t_have = time.time()
        weights = result["weights"]
        assert len(weights) == n and all(float(weights[f"w{i}"][-1]) == float(i) for i in range(n))
        t = time.perf_counter()
        for w in weights.values():
            w.sum()
        read = time.perf_counter() - t
        if baseline:
            copy_baseline(weights)
        elapsed = (t_have - result["t_return"], read, t_have - t_call)
        del result, weights
        return elapsed

    def copy_baseline(src):
        t = time.perf_counter()
        copy = {k: v.clone() for k, v in src.items()}
        out["clone"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for w in copy.values():
            w.sum()
        out["read_clone"].append(time.perf_counter() - t)
        del copy
        torch.set_num_threads(1)
        try:
            t = time.perf_counter()
            copy = {k: v.clone() for k, v in src.items()}
            out["clone1"].append(time.perf_counter() - t)
            del copy
        finally:
            torch.set_num_threads(threads)

    progress("transfer warm-up (unrecorded) ...")
    transfer(2)
    for i in budget.reps("transfer rounds", reps, 35):
        progress(f"transfer round {i + 1}/{reps} ...")
        t1, read1, total1 = transfer(1, baseline=True)
        t2, _, total2 = transfer(2)
        out["t1"].append(t1)
        out["read1"].append(read1)
        out["total1"].append(total1)
        out["t2"].append(t2)
        out["total2"].append(total2)
    out["caller_threads"] = threads
    return out


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------
def load_note(load: dict, *sections: str) -> str:
    parts = [f"{name} {sig3(100 * load[name][1])}%" for name in sections if name in load]
    return "   CPU taken by other processes on this machine meanwhile: " + ", ".join(parts)


def engine_fingerprint() -> str:
    """Which engine code was measured: HEAD plus a hash of nbtrain/'s sources as they are now."""
    import hashlib

    digest = hashlib.sha1()
    package = os.path.join(REPO, "nbtrain")
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, package).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    try:
        head = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, timeout=10
        ).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        head = "?"
    return f"git HEAD {head}, nbtrain/*.py sha1 {digest.hexdigest()[:12]}"


def report(lat: dict, steady: dict, transfer: dict, load: dict, budget: Budget, args, started: float) -> None:
    import torch

    print()
    print("=" * 96)
    print("nbtrain launch benchmark" + (" (--quick)" if args.quick else ""))
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"2 CPU ranks, gloo, {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    print(f"engine measured: {engine_fingerprint()}")
    print(f"CPU taken by other processes while this benchmark started: {sig3(100 * load['start-up'][1])}%")
    print("=" * 96)

    def m(key, field):
        return median([r[field] for r in lat[key]])

    fork_first, fork_total = m("fork_warm", "first_step"), m("fork_warm", "total")
    spec = [
        ("nbtrain ddp_notebook", "nbtrain_cold", "nbtrain_warm"),
        ("nbtrain, caller had imported torch", "nbtrain_cold_torch", None),
        ("fork floor (mp fork, preloaded)", "fork_cold", "fork_warm"),
        ("torch.multiprocessing.spawn", "spawn_cold", "spawn_warm"),
        ("torchrun --standalone", "torchrun_cold", "torchrun_warm"),
    ]
    print()
    print("1. Launch-to-first-step latency, MLP 784-256-10, batch 32, 2 ranks (seconds)")
    print("   first step = last rank's first optimizer step - launch call; group up = last rank")
    print("   entered the job with its process group ready. cold = first launch in a fresh process")
    print("   (median of its runs); warm = median of n re-launches from one process.")
    headers = ["launcher", "cold: group up", "cold: first step", "warm: group up", "warm: first step",
               "n", "warm vs fork floor"]
    rows = []
    for label, cold, warm in spec:
        row = [label, sig3(m(cold, "ready")), sig3(m(cold, "first_step"))]
        if warm:
            wf = m(warm, "first_step")
            row += [sig3(m(warm, "ready")), sig3(wf), str(len(lat[warm])), ratio(wf, fork_first)]
        else:
            row += ["-"] * 4
        rows.append(row)
    print_table(headers, rows)
    nb_warm = m("nbtrain_warm", "first_step")
    warm_all = sorted(r["first_step"] for r in lat["nbtrain_warm"])
    print(f"   nbtrain warm first step: min {sig3(warm_all[0])}, median {sig3(nb_warm)}, "
          f"max {sig3(warm_all[-1])} s over {len(warm_all)} launches")
    standby_up, fresh_up = m("nbtrain_warm", "ready"), m("nbtrain_warm_fresh", "ready")
    print(f"   re-launch -> every rank running its first line: {sig3(standby_up)} s on standby ranks, "
          f"{sig3(fresh_up)} s on freshly forked ranks (standby released first; first step "
          f"{sig3(m('nbtrain_warm_fresh', 'first_step'))} s): {ratio(fresh_up, standby_up)} faster; "
          f"target <= {TARGET_RERUN_FIRST_LINE_S} s: {'met' if standby_up <= TARGET_RERUN_FIRST_LINE_S else 'NOT met'}")
    cold_all = [sig3(r["first_step"]) for r in lat["nbtrain_cold"]]
    cold_t_all = [sig3(r["first_step"]) for r in lat["nbtrain_cold_torch"]]
    print(f"   nbtrain cold first step, each fresh process: {', '.join(cold_all)} s "
          f"(caller had imported torch: {', '.join(cold_t_all)} s)")
    print(f"   speed-ups, warm first step: nbtrain is {ratio(m('spawn_warm', 'first_step'), nb_warm)} faster "
          f"than mp.spawn, {ratio(m('torchrun_warm', 'first_step'), nb_warm)} faster than torchrun")
    threads = {t for key in lat for r in lat[key] for t in r["threads"]}
    print(f"   intra-op threads seen in ranks: {sorted(threads)}")
    print(load_note(load, "cold launches", "warm launches", "mp.spawn and torchrun"))

    print()
    print("2. Total wall time of that run: launch call -> result back / every process exited (seconds)")
    headers = ["launcher", "cold", "warm", "warm vs fork floor"]
    rows = []
    for label, cold, warm in spec:
        wt = m(warm, "total") if warm else None
        rows.append([label, sig3(m(cold, "total")), sig3(wt) if warm else "-", ratio(wt, fork_total) if warm else "-"])
    print_table(headers, rows)
    print()
    print(f"3. Steady-state step time, MLP 784-2048-2048-10, batch 64, 2 ranks, "
          f"{len(steady['nbtrain'][0])} timed steps after 5 warm-up (seconds)")
    headers = ["round", "nbtrain median step", "fork floor median step", "nbtrain / fork"]
    rows, round_ratios = [], []
    for i, (a, b) in enumerate(zip(steady["nbtrain"], steady["fork"], strict=False)):
        ma, mb = statistics.median(a), statistics.median(b)
        round_ratios.append(ma / mb)
        rows.append([str(i + 1), sig3(ma), sig3(mb), sig3(ma / mb) + "x"])
    nb_steps = [s for run in steady["nbtrain"] for s in run]
    fk_steps = [s for run in steady["fork"] for s in run]
    nb_med = median([statistics.median(r) for r in steady["nbtrain"]])
    fk_med = median([statistics.median(r) for r in steady["fork"]])
    # Headline: the median of the paired per-round ratios (each round runs both back to back,
    # so load that drifts between rounds cancels out).
    step_ratio = statistics.median(round_ratios)
    rows.append(["median of rounds", sig3(nb_med), sig3(fk_med), sig3(step_ratio) + "x (median ratio)"])
    rows.append(["all steps pooled", sig3(statistics.median(nb_steps)), sig3(statistics.median(fk_steps)),
                 sig3(statistics.median(nb_steps) / statistics.median(fk_steps)) + "x"])
    print_table(headers, rows)
    spread = (max(round_ratios) - min(round_ratios)) / 2
    nb_cpu = median([statistics.median(r) for r in steady["nbtrain_cpu"]])
    fk_cpu = median([statistics.median(r) for r in steady["fork_cpu"]])
    print(f"   CPU time per step, both ranks (diagnostic; little affected by other load): nbtrain {sig3(nb_cpu)} s, "
          f"fork floor {sig3(fk_cpu)} s, ratio {ratio(nb_cpu, fk_cpu)}")
    print(f"   noise: per-round ratio ranges {sig3(min(round_ratios))}-{sig3(max(round_ratios))} "
          f"(+-{sig3(100 * spread)}%); threads per rank seen: {sorted(steady['threads'])}")
    print(load_note(load, "steady state"))

    print()
    gib = transfer["bytes"] / 2**30
    print(f"4. Result transfer: rank 0 returns {sig3(gib)} GiB ({TRANSFER_TENSORS} float32 tensors of "
          f"{TRANSFER_NUMEL >> 20} Mi elements) to the caller (seconds, median of {len(transfer['t1'])})")
    print("   transfer = (caller has the result) - (rank 0 returned from fn)")
    clone = median(transfer["clone"])
    t1, t2 = median(transfer["t1"]), median(transfer["t2"])
    headers = ["measurement", "median", "min", "vs clone"]
    rows = [
        ["nbtrain transfer, 1 rank", sig3(t1), sig3(min(transfer["t1"])), ratio(t1, clone)],
        ["nbtrain transfer, 2 ranks (rank 0's value)", sig3(t2), sig3(min(transfer["t2"])), ratio(t2, clone)],
        [f"baseline: clone() in caller ({transfer['caller_threads']} threads)", sig3(clone),
         sig3(min(transfer["clone"])), "1x"],
        ["context: clone() in caller, 1 thread", sig3(median(transfer["clone1"])),
         sig3(min(transfer["clone1"])), ratio(median(transfer["clone1"]), clone)],
        ["context: nbtrain launch total, 1 rank", sig3(median(transfer["total1"])),
         sig3(min(transfer["total1"])), "-"],
        ["context: nbtrain launch total, 2 ranks", sig3(median(transfer["total2"])),
         sig3(min(transfer["total2"])), "-"],
        ["context: first full read of the result", sig3(median(transfer["read1"])),
         sig3(min(transfer["read1"])), "-"],
        ["context: first full read of the clone", sig3(median(transfer["read_clone"])),
         sig3(min(transfer["read_clone"])), "-"],
    ]
    print_table(headers, rows)
    print(f"   effective bandwidth, 1 rank: {sig3(gib / t1)} GiB/s (clone: {sig3(gib / clone)} GiB/s)")
    print(load_note(load, "transfer"))

    print()
    print("Targets")
    cold_first = m("nbtrain_cold", "first_step")
    cold_first_torch = m("nbtrain_cold_torch", "first_step")
    targets = [
        (f"warm launch-to-first-step < {TARGET_WARM_FIRST_STEP_S} s", nb_warm < TARGET_WARM_FIRST_STEP_S,
         f"{sig3(nb_warm)} s"),
        (f"cold launch-to-first-step <= {TARGET_COLD_FIRST_STEP_S} s (Lightning ddp_notebook)",
         cold_first <= TARGET_COLD_FIRST_STEP_S, f"{sig3(cold_first)} s"),
        ("  same, caller had imported torch (as Lightning's caller has)",
         cold_first_torch <= TARGET_COLD_FIRST_STEP_S, f"{sig3(cold_first_torch)} s"),
        (f"steady step within 2% of fork floor (ratio <= {TARGET_STEP_RATIO})", step_ratio <= TARGET_STEP_RATIO,
         f"{sig3(step_ratio)}x, noise +-{sig3(100 * spread)}%"),
        (f"1 GiB result transfer < {TARGET_TRANSFER_RATIO}x one in-memory copy, 1 rank",
         t1 / clone < TARGET_TRANSFER_RATIO, f"{sig3(t1 / clone)}x"),
        (f"1 GiB result transfer < {TARGET_TRANSFER_RATIO}x one in-memory copy, 2 ranks",
         t2 / clone < TARGET_TRANSFER_RATIO, f"{sig3(t2 / clone)}x"),
    ]
    width = max(len(t[0]) for t in targets)
    for name, ok, value in targets:
        print(f"  {'PASS' if ok else 'FAIL'}  {name.ljust(width)}  {value}")
    busiest = max(share for name, (_, share) in load.items() if name != "start-up")
    if busiest > 0.05:
        print(f"  NOTE: other processes took up to {sig3(100 * busiest)}% of the CPUs during a section;"
              " those figures are skewed (rerun on a quiet machine).")
    if budget.cut:
        print(f"  NOTE: repetitions cut to stay within the time budget: {'; '.join(budget.cut)}")
    print()
    print(f"benchmark wall time: {sig3(time.monotonic() - started)} s")


def wait_for_quiet(limit: float) -> None:
    """Wait until others use < 10% of the CPUs over 3 s, 2 times in a row (at most ``limit`` s)."""
    foreign, end, quiet = ForeignCpu(), time.monotonic() + limit, 0
    while time.monotonic() < end and quiet < 2:
        time.sleep(3)
        share = foreign.mark()[1]
        quiet = quiet + 1 if share < 0.1 else 0
        progress(f"other processes use {sig3(100 * share)}% of the CPUs" + ("" if quiet else "; waiting"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument(
        "--budget", type=float, default=220.0, metavar="S",
        help="seconds the measurements may take in all (default 220); on a busy machine, "
        "repetitions beyond each section's minimum are dropped to keep to it",
    )
    parser.add_argument(
        "--wait-quiet", type=float, default=0.0, metavar="S",
        help="first wait up to S seconds until other processes use under 10%% of the CPUs",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--wait", type=float, default=5.0, help=argparse.SUPPRESS)
    parser.add_argument("--pre-import-torch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.pre_import_torch, args.wait)

    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet)
    started = time.monotonic()
    budget = Budget(args.budget / 220.0)
    if args.quick:
        reps = {"cold": 1, "cold_spawn": 1, "warm": 7, "slow": 1}
        rounds, steps, transfer_reps = 3, 30, 3
    else:
        reps = {"cold": 3, "cold_spawn": 2, "warm": 15, "slow": 2}
        rounds, steps, transfer_reps = 6, 30, 7

    import nbtrain
    from nbtrain.kernel import launcher_connection

    progress("waiting for the warm launcher and preloading torch in this process ...")
    foreign = ForeignCpu()
    preload_like_launcher()
    if not launcher_connection.get_client().ready.wait(60):
        raise RuntimeError("the nbtrain launcher did not become ready in 60 s")
    load: dict[str, tuple[float, float]] = {"start-up": foreign.mark()}
    if load["start-up"][1] > 0.1:
        progress(f"WARNING: other processes are using {sig3(100 * load['start-up'][1])}% of the CPUs; "
                 "figures will be noisy")

    try:
        with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as tmp:
            lat = bench_latency(nbtrain, reps, tmp, load, foreign, budget)
        steady = bench_steady(nbtrain, rounds, steps, budget)
        load["steady state"] = foreign.mark()
        transfer = bench_transfer(nbtrain, transfer_reps, budget)
        load["transfer"] = foreign.mark()
    finally:
        for popen in _live_popen:
            _kill_session(popen)
    report(lat, steady, transfer, load, budget, args, started)


if __name__ == "__main__":
    main()
