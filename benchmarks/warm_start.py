#!/usr/bin/env python
"""A fresh kernel's first run, and idle kernels' memory, with and without the warm template.

Run from the repository root::

    bash benchmarks/peers-env                            # once: .venv-peers with Lightning (PyPI)
    .venv/bin/python benchmarks/warm_start.py            # about 6 minutes on 2 quiet cores
    .venv/bin/python benchmarks/warm_start.py --quick    # one repetition of each

Real kernels (jupyter_client), 2 CPU ranks, gloo, DDP over an MLP 784-256-10, batch 32.
Every template this script starts lives in a private directory of its own
(``$NBTRAIN_TEMPLATE_DIR``) and is killed by PID at the end; the user's own is not touched.

1. First ``%%distributed`` cell right after ``%load_ext nbtrain`` in a fresh kernel: from
   the cell's start (an IPython ``pre_run_cell`` hook, ``time.time()``) to the last rank's
   first optimizer step (``time.time()`` on each rank, the maximum all-reduced). Three
   cases: the template switched off (every kernel starts its own launcher, as before the
   template); the very first kernel, no template yet; a template already there. Beside
   them, Lightning's ``ddp_notebook`` (Fabric, 2 CPU devices, the same MLP, batch and
   measurement) in a fresh kernel of ``.venv-peers`` (``benchmarks/peers-env`` makes it;
   without it this case is skipped, and the script says so): ``import lightning`` (its
   ``%load_ext``), then at once the first cell, then the same cell again.
2. Memory: the proportional set size (``/proc/<pid>/smaps_rollup``) of the kernel-side
   nbtrain processes (every kernel's launcher, and the template) with five idle kernels
   that loaded nbtrain, against one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import psutil
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from nbtrain.system import processes

# A user's kernel imports nbtrain, torch and Lightning from compiled bytecode (pip compiles
# it at install; an editable install writes it at the first import): so do these kernels,
# whatever this shell says (PYTHONDONTWRITEBYTECODE would have them compile every module).
KERNEL_ENV = {"PYTHONDONTWRITEBYTECODE": ""}
TARGET_FIRST_STEP = 0.2  # seconds, with a template there
TARGET_MEMORY_RATIO = 1.3  # five idle kernels against one

PEERS_PYTHON = os.path.join(REPO, ".venv-peers", "bin", "python")
HOOK = """import time as _time
def _nbtrain_bench_mark(info):
    if info.raw_cell.startswith(("%%distributed", "# timed")):
        globals()["_t_cell"] = _time.time()
get_ipython().events.register("pre_run_cell", _nbtrain_bench_mark)
"""
FIRST_CELL = """%%distributed --devices 2 --accelerator cpu
import time, torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = DDP(torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
loss = F.cross_entropy(net(torch.randn(32, 784)), torch.randint(0, 10, (32,)))
opt.zero_grad()
loss.backward()
opt.step()
stamp = torch.tensor([time.time()], dtype=torch.float64)
dist.all_reduce(stamp, op=dist.ReduceOp.MAX)
first_step = stamp.item()
"""
LAUNCHER_PID = "print(__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().process.pid)"
READY = "print(__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().ready.wait(300))"
LIGHTNING_CELL = """# timed: Lightning's ddp_notebook, the same first step
import time, torch
import torch.distributed as dist
import torch.nn.functional as F
def first_step_on(fabric):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net, opt = fabric.setup(net, opt)
    loss = F.cross_entropy(net(torch.randn(32, 784)), torch.randint(0, 10, (32,)))
    opt.zero_grad()
    fabric.backward(loss)
    opt.step()
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    dist.all_reduce(stamp, op=dist.ReduceOp.MAX)
    return stamp.item()
fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook")
first_step = fabric.launch(first_step_on)
"""


class Kernel:
    """A real ipykernel with the given environment; every wait bounded."""

    def __init__(self, env: dict[str, str], python: str | None = None) -> None:
        """``python``: the interpreter of another environment to run the kernel (Lightning's)."""
        self.folder = tempfile.mkdtemp(prefix="nbtrain-bench-kernelspec-")
        specs = KernelSpecManager(kernel_dirs=[self.folder])
        if python is not None:
            os.makedirs(os.path.join(self.folder, "peers"))
            argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            with open(os.path.join(self.folder, "peers", "kernel.json"), "w") as spec:
                json.dump({"argv": argv, "display_name": "peers", "language": "python"}, spec)
        self.manager = KernelManager(kernel_name="peers" if python else "python3", kernel_spec_manager=specs)
        self.manager.start_kernel(env={**os.environ, **KERNEL_ENV, **env})
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 300) -> str:
        printed: list[str] = []

        def hook(message: dict) -> None:
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content'].get('evalue')}")
        return "".join(printed)

    def value(self, expression: str) -> object:
        return json.loads(self.run(f"import json as _j\nprint(_j.dumps({expression}))").strip().splitlines()[-1])

    def launcher_pid(self) -> int:
        assert self.run(READY).strip().endswith("True"), "the launcher was not ready"
        return int(self.run(LAUNCHER_PID).strip())

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def template_folder() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="nbtrain-bench-template-")
    os.chmod(folder, 0o700)
    try:
        yield folder
    finally:
        stop_templates(folder)
        shutil.rmtree(folder, ignore_errors=True)


def templates(folder: str) -> list[int]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if processes.TEMPLATE_MODULE in cmdline and any(arg.startswith(folder) for arg in cmdline):
            found.append(process.pid)
    return found


def stop_templates(folder: str) -> None:
    for pid in templates(folder):
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
            psutil.Process(pid).wait(timeout=30)


def environment(folder: str | None) -> dict[str, str]:
    if folder is None:
        return {"NBTRAIN_TEMPLATE": "0"}
    return {"NBTRAIN_TEMPLATE": "1", "NBTRAIN_TEMPLATE_DIR": folder}


def first_run(env: dict[str, str]) -> tuple[float, float]:
    """A fresh kernel: ``%load_ext nbtrain``, then at once the first cell, then the same cell
    again (the re-run: the baseline in the same kernel); each cell -> last rank's first step."""
    kernel = Kernel(env)
    try:
        kernel.run(HOOK)
        kernel.run("%load_ext nbtrain")
        figures = []
        for _ in range(2):
            kernel.run(FIRST_CELL)
            figures.append(float(kernel.value("first_step - _t_cell")))  # type: ignore[arg-type]
        return figures[0], figures[1]
    finally:
        kernel.close()


def lightning_run() -> tuple[float, float]:
    """A fresh kernel of .venv-peers: ``import lightning``, then at once the first Fabric cell, then again."""
    kernel = Kernel({}, python=PEERS_PYTHON)
    try:
        kernel.run(HOOK)
        kernel.run("import lightning as L")
        figures = []
        for _ in range(2):
            kernel.run(LIGHTNING_CELL)
            figures.append(float(kernel.value("first_step - _t_cell")))  # type: ignore[arg-type]
        return figures[0], figures[1]
    finally:
        kernel.close()


def lightning_there() -> bool:
    if os.path.exists(PEERS_PYTHON):
        return True
    print("skipped: Lightning ddp_notebook (no .venv-peers: `bash benchmarks/peers-env` makes it)", flush=True)
    return False


def first_runs(reps: int) -> dict[str, list[float]]:
    cases = ("no template (as before)", "first kernel, no template yet", "template there", "re-run (same kernel)")
    figures: dict[str, list[float]] = {case: [] for case in cases}
    lightning = lightning_there()
    if lightning:
        figures["Lightning ddp_notebook, first"], figures["Lightning ddp_notebook, re-run"] = [], []
    for _ in range(reps):  # alternated, so that a busy moment does not favour one case
        if lightning:
            first, again = lightning_run()
            figures["Lightning ddp_notebook, first"].append(first)
            figures["Lightning ddp_notebook, re-run"].append(again)
        figures["no template (as before)"].append(first_run(environment(None))[0])
        with template_folder() as folder:
            figures["first kernel, no template yet"].append(first_run(environment(folder))[0])
            for _ in range(2):
                first, again = first_run(environment(folder))
                figures["template there"].append(first)
                figures["re-run (same kernel)"].append(again)
    return figures


def pss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def idle_memory(folder: str | None, count: int) -> int:
    """PSS of the kernel-side nbtrain processes with ``count`` idle kernels that loaded nbtrain."""
    kernels = []
    try:
        launchers = []
        for _ in range(count):
            kernel = Kernel(environment(folder))
            kernels.append(kernel)
            kernel.run("%load_ext nbtrain")
            launchers.append(kernel.launcher_pid())
        pids = launchers + (templates(folder) if folder is not None else [])
        return sum(pss_bytes(pid) for pid in pids)
    finally:
        for kernel in kernels:
            kernel.close()


def memory() -> dict[str, tuple[int, int]]:
    found = {"no template (as before)": (idle_memory(None, 1), idle_memory(None, 5))}
    with template_folder() as folder:
        one = idle_memory(folder, 1)
        found["template"] = (one, idle_memory(folder, 5))
    return found


def report(firsts: dict[str, list[float]], memories: dict[str, tuple[int, int]]) -> None:
    print("First %%distributed cell right after %load_ext nbtrain (cell start -> last rank's first step):")
    for case, values in firsts.items():
        shown = ", ".join(f"{value:.3f}" for value in values)
        print(f"  {case:32s} median {statistics.median(values):.3f} s  [{shown}]")
    print("Kernel-side nbtrain processes' PSS, idle kernels with nbtrain loaded:")
    for case, (one, five) in memories.items():
        mib = (one / 2**20, five / 2**20)
        print(f"  {case:32s} 1 kernel {mib[0]:7.1f} MiB   5 kernels {mib[1]:7.1f} MiB   ratio {five / one:.2f}x")
    warm = statistics.median(firsts["template there"])
    ratio = memories["template"][1] / memories["template"][0]
    before = statistics.median(firsts["no template (as before)"])
    first = statistics.median(firsts["first kernel, no template yet"])
    print("Targets:")
    rerun = statistics.median(firsts["re-run (same kernel)"])
    print(f"  {'PASS' if warm <= TARGET_FIRST_STEP else 'FAIL'}  template there: first step <= 0.2 s  {warm:.3f} s")
    print(f"        template there against a re-run in the same kernels: {warm / rerun:.2f}x ({rerun:.3f} s)")
    if "Lightning ddp_notebook, first" in firsts:
        peer = statistics.median(firsts["Lightning ddp_notebook, first"])
        print(f"        template there against Lightning ddp_notebook's first cell: {warm / peer:.2f}x ({peer:.3f} s)")
    verdict = "PASS" if first <= before * 1.1 else "FAIL"
    print(f"  {verdict}  first kernel no slower than before (within 10%)  {first:.3f} vs {before:.3f} s")
    print(f"  {'PASS' if ratio <= TARGET_MEMORY_RATIO else 'FAIL'}  five idle kernels <= 1.3x one  {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repetition of each case")
    args = parser.parse_args()
    # As after `pip install`: nbtrain's bytecode is there before the first kernel (KERNEL_ENV).
    compile_all = [sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "nbtrain")]
    subprocess.run(compile_all, check=False, env={**os.environ, **KERNEL_ENV})
    firsts = first_runs(1 if args.quick else 3)
    report(firsts, memory())


if __name__ == "__main__":
    main()
