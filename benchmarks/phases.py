#!/usr/bin/env python
"""Where the time of one nbtrain launch goes: a timeline of the caller, launcher and ranks.

    .venv/bin/python benchmarks/phases.py              # first-step job, cold then warm
    .venv/bin/python benchmarks/phases.py --transfer   # 1 GiB result, 1 and 2 ranks

The engine is not modified. This script sets PYTHONPATH to a temporary directory holding a
``sitecustomize.py`` before importing nbtrain, so the warm launcher (and the ranks it forks)
wrap a few engine functions with probes that append "label pid start end" lines to a log
file; the caller's functions are wrapped in this process. Each probe costs ~20 us.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# record(), wrap() and wrap_exit(): what a sitecustomize.py needs to probe engine functions.
PROBE_FUNCTIONS = r'''
import os, time

LOG = os.environ.get("NBTRAIN_PHASES_LOG")


def record(label, t0, t1):
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{label} {os.getpid()} {t0:.6f} {t1:.6f}\n".encode())
    finally:
        os.close(fd)


def wrap(owner, name, label):
    original = getattr(owner, name, None)
    if original is None:  # the engine moved on: skip this probe, keep the others
        import sys
        print(f"phases probe: {getattr(owner, '__name__', owner)}.{name} not found", file=sys.stderr)
        return

    def probe(*args, **kwargs):
        t0 = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            record(label, t0, time.time())

    setattr(owner, name, probe)


def wrap_exit(owner, name, label):  # functions that never return: log their start
    original = getattr(owner, name, None)
    if original is None:
        return

    def probe(*args, **kwargs):
        t = time.time()
        record(label, t, t)
        return original(*args, **kwargs)

    setattr(owner, name, probe)
'''

PROBE = PROBE_FUNCTIONS + r'''

if LOG and os.environ.get("NBTRAIN_ROLE") == "launcher":
    import torch.distributed as dist
    from nbtrain.system import processes
    from nbtrain.messages import sharedtensors
    from nbtrain.launch_server import forking, server
    from nbtrain.rank.machinery import runtime

    wrap(server.Launcher, "_on_control", "launcher: request from kernel (StartRun: ranks forked)")
    wrap(server.Launcher, "_hand_over", "launcher: all ranks done: Release (or ResultOffer)")
    wrap(server.Launcher, "_start_rank", "launcher: fork one rank + register fds")
    wrap(server.Launcher, "_on_exit", "launcher: rank exit seen (pidfd) + reap")
    wrap(server.Launcher, "_finish", "launcher: finish run, send RunEnded")
    wrap(processes, "_become_rank", "rank: first instruction after fork (setpgid, pdeathsig)")
    wrap(forking, "close_all_but", "rank: close inherited fds")
    wrap(runtime, "_adopt_caller_state", "rank: adopt env/cwd/sys.path, set threads")
    wrap(sharedtensors, "loads", "rank: unpickle payload")
    wrap(runtime, "_join_process_group", "rank: join process group (TCPStore + init)")
    wrap(dist, "init_process_group", "rank:   init_process_group")
    wrap(runtime, "_send_done", "rank: send RankDone (pickle result, tensors stay in place)")
    wrap(sharedtensors, "_write_storages", "rank:   write storages to memfd (fallback only)")
    wrap(runtime, "_wait_for_release", "rank: wait for Release")
    wrap(sharedtensors.InPlace, "discard_before_exit", "rank:   give the result's pages back (threads)")
    wrap_exit(processes, "exit_now", "rank: os._exit")
'''


def mark(label: str) -> None:
    """Called from inside a job: one instant on the timeline."""
    import os
    import time

    log = os.environ.get("NBTRAIN_PHASES_LOG")
    if log:
        t = time.time()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{label} {os.getpid()} {t:.6f} {t:.6f}\n".encode())
        finally:
            os.close(fd)


def first_step_job():
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    mark("job: enter fn")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    mark("job: model built")
    model = DDP(model)
    mark("job: DDP wrapped")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    loss = F.cross_entropy(model(x), y)
    mark("job: forward done")
    opt.zero_grad()
    loss.backward()
    mark("job: backward done")
    opt.step()
    mark("job: FIRST STEP DONE")


def transfer_job():
    import torch
    import torch.distributed as dist

    weights = {f"w{i}": torch.full((64 << 20,), float(i)) for i in range(4)}
    dist.barrier()
    mark("job: return 1 GiB")
    return weights


def install_caller_probes() -> None:
    import nbtrain
    from nbtrain.kernel import launcher_connection, run_handle
    from nbtrain.messages import sharedtensors
    from nbtrain.planning import probe

    probes: dict = {}
    exec(PROBE, probes)  # noqa: S102 - the launcher's probe functions, unwrapped (this is not the launcher)
    wrap, record = probes["wrap"], probes["record"]

    wrap(probe, "probe_plan", "caller: probe_plan (devices)")
    wrap(sharedtensors, "dumps", "caller: pickle fn + args")
    wrap(launcher_connection.LauncherClient, "submit", "caller: send StartRun")
    wrap(launcher_connection.LauncherClient, "_take_result", "caller: take result (read + ReleaseResult)")
    wrap(sharedtensors, "read_from_process", "caller:   read rank 0's tensors (process_vm_readv)")
    wrap(run_handle.Run, "_load_result", "caller: load result (unpickle)")
    original_take = run_handle.Run._take

    def take(self, message, fds):
        t = time.time()
        record(f"caller: got {type(message).__name__}", t, t)
        return original_take(self, message, fds)

    run_handle.Run._take = take
    del nbtrain


def show(log: str, t_call: float, t_end: float, title: str) -> None:
    rows = []
    with open(log) as f:
        for line in f:
            label, pid, t0, t1 = line.rsplit(" ", 3)
            t0, t1 = float(t0), float(t1)
            if t0 >= t_call - 1e-3:
                rows.append((t0, t1, label, int(pid)))
    open(log, "w").close()
    rows.sort()
    pids = []
    for _, _, label, pid in rows:
        if label.startswith(("rank", "job")) and pid not in pids:
            pids.append(pid)
    print(f"\n{title}: call -> return {1000 * (t_end - t_call):.1f} ms")
    print(f"{'start ms':>9} {'end ms':>9} {'dur ms':>8}  who       phase")
    for t0, t1, label, pid in rows:
        who = f"rank@{pids.index(pid)}" if pid in pids else ("caller" if label.startswith("caller") else "launcher")
        dur = f"{1000 * (t1 - t0):8.1f}" if t1 > t0 else " " * 8
        print(f"{1000 * (t0 - t_call):9.1f} {1000 * (t1 - t_call):9.1f} {dur}  {who:8}  {label}")
    print(f"{1000 * (t_end - t_call):9.1f} {'':9} {'':8}  caller    launch() returned")
    print("(rank@N numbers ranks in the order they first appear; ranks fork in rank order)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfer", action="store_true", help="1 GiB result instead of the first-step job")
    parser.add_argument("--warm", type=int, default=2, help="launches to show after the first")
    parser.add_argument(
        "--caller", choices=("torch", "bare"), default="torch",
        help="torch: the caller imports torch during the 5 s wait (a notebook's first cell); "
        "bare: it imports nbtrain only",
    )
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="nbtrain-phases-")
    with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
        f.write(PROBE)
    log = os.path.join(tmp, "phases.log")
    os.environ["NBTRAIN_PHASES_LOG"] = log
    os.environ["PYTHONPATH"] = tmp + os.pathsep + os.environ.get("PYTHONPATH", "")

    t_import = time.monotonic()
    import nbtrain

    nbtrain.prewarm()  # as %load_ext nbtrain does: the launcher starts, with the probe on its path

    if args.caller == "torch":
        import torch  # noqa: F401 - the caller variant that imported torch
    time.sleep(max(0.0, 5.0 - (time.monotonic() - t_import)))

    job = transfer_job if args.transfer else first_step_job
    runs = (1, 2, 1, 2) if args.transfer else (2,) * (1 + args.warm)
    for i, devices in enumerate(runs):
        # The caller's probes import nbtrain.messages.sharedtensors (torch, cloudpickle): installing
        # them before the first launch would hide what that launch pays for those imports,
        # so the first launch shows the launcher and ranks only.
        t_call = time.time()
        result = nbtrain.launch(job, devices=devices, accelerator="cpu", timeout=120)
        t_end = time.time()
        del result
        what = f"1 GiB result, {devices} rank(s)" if args.transfer else "first-step job, 2 ranks"
        when = "first launch in this process (cold; caller not probed)" if i == 0 else f"launch {i + 1}"
        show(log, t_call, t_end, f"{what}, {when}")
        if i == 0:
            install_caller_probes()


if __name__ == "__main__":
    sys.exit(main())
