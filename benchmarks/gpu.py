#!/usr/bin/env python
"""One GPU, side by side: the same training cells in the kernel, under nbtrain, Lightning Fabric and torchrun.

Run from the repository root on a machine with a CUDA GPU (``bash .ci/gpu`` runs it)::

    python3 benchmarks/gpu.py          # about 1.5-2.5 min on an H200; bounded by --budget (170 s)
    python3 benchmarks/gpu.py --cpu    # the same script on CPU ranks, small sizes: a smoke test
    python3 benchmarks/gpu.py --phases # also where each run's time went, kernel and rank (gpu_phases.py)

The cells (the same loop code everywhere, in one run on the same GPU):

- **ResNet-18** (torchvision's, 10 classes; a small conv net stands in where torchvision is
  missing) on synthetic 3x64x64 images, batch 128, a shuffled CPU DataLoader (512 images,
  iterated for ``RESNET_STEPS`` steps), SGD with momentum, batches moved with ``.to(device)``.
- **MLP** 256-512-10, batch 64, tensors on the GPU: a host-bound loop.

Where they run:

1. **kernel**: a real Jupyter kernel (ipykernel) that initialised CUDA; the loop as a plain
   cell, first (cold) and again (warm).
2. **nbtrain**: in that same kernel, ``%%distributed --devices 1 --accelerator gpu`` (auto
   mode: the model is prepared, the loss logged): the first run and re-runs. A user re-runs a
   cell seconds after the last one, when the standby ranks forked after it are ready; so before
   each re-run the kernel waits (at most ``STANDBY_WAIT_S``, polling ``nbtrain.runs()``) until
   they are, and the wait is printed. One more re-run is sent at once (no wait) beside it.
   One ResNet re-run goes under ``--no-auto`` too (nothing prepared or hooked), beside them.
   The MLP cell runs in turns in the kernel, under auto mode and under ``--no-auto`` (the same
   loop in a rank, nothing prepared or hooked), ``MLP_ROUNDS`` times each: what auto mode adds
   and what the rank itself adds are told apart.
3. **Fabric**: Lightning Fabric ``ddp_notebook``, devices=1, in a fresh kernel (Lightning
   refuses a kernel that touched CUDA): first run and re-run. Skipped with a line where
   ``lightning`` is missing.
4. **torchrun**: ``torchrun --standalone --nproc-per-node 1`` on a script of the same loop
   under DDP, as a torchrun user writes it.

Figures (each from ``time.time()`` on one machine): the steady step (ms, the mean over the
steps after ``WARM_STEPS``, synchronised at both ends), "cell sent -> first step done"
(the first step synchronised), split where the loop began (before it: the cell's launch,
on a rank its payload and model prepared; after it: the first step's own set-ups), and the
whole cell (sent -> reply); for each ResNet run also the GPU's time between step ends (CUDA
events, read at the end: no sync in the loop), over stretches of steps, to show when a run
reaches its steady pace. Ratios and the issue's targets are printed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the tests' kernel driver

import gpu_phases  # beside this script

import kernel_helpers
from kernel_helpers import NotebookKernel

WARM_STEPS = 8
CELL_BOUND_S = 60.0  # any one cell: a hang, not a slow machine
TARGET_STEP_RATIO = 1.03
TARGET_AUTO_RATIO = 1.02
TARGET_RERUN_FIRST_STEP_S = 0.35
TARGET_RERUN_OVER_KERNEL_S = 0.4
TARGET_VS_FABRIC = 1.5
MLP_ROUNDS = 3
STANDBY_WAIT_S = 10.0  # a user's pause between cells: the standby ranks are ready well within it


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes: the issue's on a GPU, small ones for the CPU smoke test."""

    device: str  # "cuda" or "cpu"
    accelerator: str  # %%distributed's --accelerator
    image: int
    batch: int
    images: int
    resnet_steps: int
    mlp_steps: int
    reruns: int


GPU = Sizes("cuda", "gpu", 64, 128, 512, 48, 300, 2)
CPU = Sizes("cpu", "cpu", 32, 16, 64, 12, 60, 1)

# ResNet-18, or a small conv net where torchvision is missing (gpu_faults.py builds the same).
MAKE_RESNET = """def make_resnet():
    try:
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    except ImportError:  # a small conv net stands in
        return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1),
                             nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
"""

# The kernel's (and every peer's) definitions: data, models, one train function for all.
SETUP = """
import contextlib, resource, time, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
DEVICE, IMAGE, BATCH, IMAGES = {device!r}, {image}, {batch}, {images}
RESNET_STEPS, MLP_STEPS, WARM_STEPS = {resnet_steps}, {mlp_steps}, {warm}

def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()

{make_resnet}
def usage_now():
    # What the loop's own thread and its whole process spent: CPU seconds, page faults, waits.
    own = resource.getrusage(resource.RUSAGE_THREAD)
    return {{"thread_cpu": time.thread_time(), "process_cpu": time.process_time(),
            "faults": own.ru_minflt, "waits": own.ru_nvcsw, "preempted": own.ru_nivcsw}}

def train(model, opt, batches, steps):
    # Per step: the batch to the device, forward, loss, backward, step; synchronised only at
    # the first step (its end), at WARM_STEPS and at the end.
    # A CUDA event after each step (no sync): the GPU's time between step ends, read at the end.
    figures, step, marks = {{"began": time.time(), "threads": torch.get_num_threads()}}, 0, []
    with contextlib.suppress(Exception):  # when this process began: a rank's fork, a standby rank's before the cell
        import psutil
        figures["process_began"] = psutil.Process().create_time()
    while step < steps:
        for x, y in batches:
            x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
            step += 1
            if DEVICE == "cuda":
                marks.append(torch.cuda.Event(enable_timing=True)); marks[-1].record()
            if step == 1:
                sync(); figures["first"] = time.time()
            if step == WARM_STEPS:
                sync(); began = time.perf_counter(); usage = usage_now()
            if step == steps:
                break
    sync()
    figures["steady"] = (time.perf_counter() - began) / (steps - WARM_STEPS)
    figures.update({{name: (value - usage[name]) / (steps - WARM_STEPS) for name, value in usage_now().items()}})
    figures["step_ms"] = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    figures["end"] = time.time()
    return figures

torch.manual_seed(0)
images = TensorDataset(torch.randn(IMAGES, 3, IMAGE, IMAGE), torch.randint(0, 10, (IMAGES,)))
loader = DataLoader(images, batch_size=BATCH, shuffle=True)
mlp_data = [(torch.randn(64, 256, device={model_device!r}), torch.randint(0, 10, (64,), device={model_device!r}))]
"""

MODELS = """
resnet = make_resnet().to({model_device!r})
resnet_opt = torch.optim.SGD(resnet.parameters(), lr=0.01, momentum=0.9)
mlp = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to({model_device!r})
mlp_opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
"""

RESNET_CELL = "figures = train(resnet, resnet_opt, loader, RESNET_STEPS)\n"
MLP_CELL = "figures = train(mlp, mlp_opt, mlp_data, MLP_STEPS)\n"

class Budget:
    """The whole run's time bound: a part that would start past it is skipped, with a line."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, what: str, needs: float) -> bool:
        if self.left() >= needs:
            return True
        print(f"skipped: {what} (the run's time budget is spent; {self.left():.0f} s left)", flush=True)
        return False


_budget = Budget(600.0)  # main() sets the run's own
_phases_log: str | None = None  # --phases: the probes' log


def run_cell(kernel: NotebookKernel, source: str) -> dict:
    """Send a cell; its ``figures`` with 'sent' and 'whole' (sent -> reply) added."""
    sent = time.time()
    msg_id = kernel.start_cell(source)
    reply, out = kernel.wait_for_reply(msg_id, max(5.0, min(CELL_BOUND_S, _budget.left())))
    whole = time.time() - sent
    if reply["status"] != "ok":
        raise RuntimeError(f"the cell failed:\n{source}\n{out.text}")
    figures = kernel.value("figures")
    result = {
        **figures,
        "sent": sent,
        "whole": whole,
        "first_step": figures["first"] - sent,
        "to_loop": figures["began"] - sent,  # the cell's launch: on a rank, its payload and model prepared
        "loop_to_first_step": figures["first"] - figures["began"],  # the first step's own set-ups
    }
    if source.startswith("%%distributed") and "process_began" in figures:  # a rank (the kernel began long ago)
        result["process_to_loop"] = figures["began"] - figures["process_began"]
    return result


def setup_source(sizes: Sizes, model_device: str) -> str:
    return SETUP.format(
        device=sizes.device,
        image=sizes.image,
        batch=sizes.batch,
        images=sizes.images,
        resnet_steps=sizes.resnet_steps,
        mlp_steps=sizes.mlp_steps,
        warm=WARM_STEPS,
        model_device=model_device,
        make_resnet=MAKE_RESNET,
    ) + MODELS.format(model_device=model_device)


def wait_for_standby(kernel: NotebookKernel) -> None:
    """Wait (bounded) in the kernel until its standby ranks are ready, as a user's pause would; say how long."""
    waited, ready = kernel_helpers.wait_for_standby(kernel, STANDBY_WAIT_S)
    if ready:
        print(f"waited {waited:.2f} s for the standby ranks to be ready before the re-run", flush=True)
    else:
        print(f"the standby ranks were not ready after {waited:.1f} s: the re-run is sent anyway", flush=True)


def nbtrain_reruns(kernel: NotebookKernel, source: str, count: int) -> list[dict]:
    """``count`` re-runs, each sent once the standby ranks are ready."""
    runs = []
    for _ in range(count):
        wait_for_standby(kernel)
        runs.append(run_cell(kernel, source))
    return runs


def kernel_and_nbtrain(sizes: Sizes, budget: Budget, results: dict) -> None:
    """One kernel that initialised CUDA: the loops in it, then under %%distributed."""
    magic = f"%%distributed --devices 1 --accelerator {sizes.accelerator}\n"
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\n" + setup_source(sizes, sizes.device))
        if _phases_log:
            kernel.run_ok(gpu_phases.KERNEL_CELL)
        results["resnet", "kernel, cold"] = [run_cell(kernel, RESNET_CELL)]
        results["resnet", "kernel"] = [run_cell(kernel, RESNET_CELL)]
        if not budget.allows("nbtrain's runs", 30):
            return
        results["resnet", "nbtrain, first"] = [run_cell(kernel, magic + RESNET_CELL)]
        results["resnet", "nbtrain, re-run"] = nbtrain_reruns(kernel, magic + RESNET_CELL, sizes.reruns)
        if budget.allows("nbtrain's re-run under --no-auto", 25):
            # The same re-run with nothing prepared or hooked: what auto mode costs this loop.
            no_auto = magic.replace("\n", " --no-auto\n")
            results["resnet", "nbtrain --no-auto, re-run"] = nbtrain_reruns(kernel, no_auto + RESNET_CELL, 1)
        if budget.allows("nbtrain's re-run sent at once", 25):
            # Sent as the last one returns: its standby ranks are still warming up.
            results["resnet", "nbtrain, re-run at once"] = [run_cell(kernel, magic + RESNET_CELL)]
        if budget.allows("the MLP runs", 25):
            mlp_rounds(kernel, magic, results)


def mlp_rounds(kernel: NotebookKernel, magic: str, results: dict) -> None:
    """The MLP loop in the kernel, under auto mode and under ``--no-auto``, in turns (``MLP_ROUNDS`` each).

    ``--no-auto`` runs the same loop in the same kind of rank with nothing prepared or hooked
    (the model is on the GPU already): auto mode / ``--no-auto`` is what auto mode costs a step,
    ``--no-auto`` / kernel what the rank itself costs. Taking turns keeps a drifting machine out
    of the ratios; each way's first run is a warm-up.
    """
    by_hand = magic.replace("\n", " --no-auto\n")
    ways = {"kernel": MLP_CELL, "nbtrain": magic + MLP_CELL, "nbtrain --no-auto": by_hand + MLP_CELL}
    for source in ways.values():
        run_cell(kernel, source)
    for _ in range(MLP_ROUNDS):
        for where, source in ways.items():
            results.setdefault(("mlp", where), []).append(run_cell(kernel, source))


FABRIC_CELL = """
def on_fabric(fabric):
    model, opt = fabric.setup(resnet, resnet_opt)
    return train(model, opt, fabric.setup_dataloaders(loader), RESNET_STEPS)
fabric = L.Fabric(accelerator=DEVICE, devices=1, strategy="ddp_notebook")  # a re-run makes it anew
figures = fabric.launch(on_fabric)
"""


def fabric(sizes: Sizes, budget: Budget, results: dict) -> None:
    """Lightning Fabric ddp_notebook, devices=1, in a fresh kernel that never touched CUDA."""
    if importlib.util.find_spec("lightning") is None:  # the kernel imports it, not this process
        print("skipped: Lightning Fabric (the lightning package is not installed here)", flush=True)
        return
    if not budget.allows("Lightning Fabric", 25):
        return
    with NotebookKernel() as kernel:
        kernel.run_ok(setup_source(sizes, "cpu") + "import lightning as L\n")
        results["resnet", "Fabric, first"] = [run_cell(kernel, FABRIC_CELL)]
        results["resnet", "Fabric, re-run"] = [run_cell(kernel, FABRIC_CELL)]


TORCHRUN_MAIN = """
import json, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
if DEVICE == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
figures = train(DistributedDataParallel(resnet), resnet_opt, loader, RESNET_STEPS)
print("FIGURES " + json.dumps(figures), flush=True)
dist.destroy_process_group()
"""


def torchrun(sizes: Sizes, budget: Budget, results: dict) -> None:
    """The same loop as a torchrun script (DDP, one process), from its start to its exit."""
    runner = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(runner):
        print("skipped: torchrun (not found beside this Python)", flush=True)
        return
    if not budget.allows("torchrun", 25):
        return
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as file:
            file.write(setup_source(sizes, sizes.device) + textwrap.dedent(TORCHRUN_MAIN))
        started = time.time()
        done = subprocess.run(
            [runner, "--standalone", "--nproc-per-node", "1", script],
            capture_output=True, text=True, timeout=min(90.0, max(budget.left(), 10.0)), check=False,
        )
        whole = time.time() - started
    found = re.search(r"^FIGURES (.*)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or found is None:
        print(f"failed: torchrun exited {done.returncode}:\n{done.stderr[-2000:]}", flush=True)
        return
    figures = json.loads(found.group(1))
    results["resnet", "torchrun"] = [{**figures, "whole": whole, "first_step": figures["first"] - started}]


def _median(results: dict, key: tuple[str, str], figure: str) -> float | None:
    runs = results.get(key)
    return statistics.median(run[figure] for run in runs) if runs else None


def _row(label: str, results: dict, workload: str, figure: str, scale: float, unit: str) -> None:
    cells = []
    for where in WHERE:
        runs = [run for run in results.get((workload, where), ()) if figure in run]
        if runs:
            shown = ", ".join(f"{run[figure] * scale:.{1 if scale > 1 else 2}f}" for run in runs)
            cells.append(f"{where}: {shown}")
    print(f"  {label} ({unit}): " + ("; ".join(cells) if cells else "not measured"))


WHERE = ("kernel, cold", "kernel", "nbtrain, first", "nbtrain, re-run", "nbtrain --no-auto, re-run",
         "nbtrain, re-run at once", "nbtrain", "nbtrain --no-auto", "Fabric, first", "Fabric, re-run", "torchrun")


def _trajectory(results: dict) -> None:
    """Each ResNet run's GPU time between step ends (ms), as means over stretches of steps."""
    runs = [(where, run) for where in WHERE for run in results.get(("resnet", where), ())]
    traced = [(where, run["step_ms"]) for where, run in runs if run.get("step_ms")]
    if traced:
        print("\nResNet, GPU time between step ends (ms, CUDA events; mean over steps 2-8, 9-16, 17-32, 33-48)")
    for where, gaps in traced:
        parts = [gaps[a:b] for a, b in ((0, 7), (7, 15), (15, 31), (31, len(gaps))) if gaps[a:b]]
        print(f"  {where}: " + ", ".join(f"{statistics.fmean(part):.2f}" for part in parts))


def _target(label: str, value: float | None, target: float, *, at_least: bool = False) -> None:
    if value is None:
        print(f"  {label}: not measured")
        return
    met = value >= target if at_least else value <= target
    print(f"  {label}: {value:.3f} (target {'>=' if at_least else '<='} {target:.3g}: {'met' if met else 'MISSED'})")


def report(results: dict, sizes: Sizes) -> None:
    print(f"\nResNet cell: batch {sizes.batch}, 3x{sizes.image}x{sizes.image}, {sizes.resnet_steps} steps; "
          f"MLP cell: {sizes.mlp_steps} steps (each figure one run, listed in order; 'nbtrain, re-run': "
          f"sent once the standby ranks were ready, 'at once': sent as the previous run returned)")
    _row("ResNet steady step", results, "resnet", "steady", 1e3, "ms")
    _row("MLP steady step", results, "mlp", "steady", 1e6, "us")
    _row("cell sent -> first step done", results, "resnet", "first_step", 1, "s; torchrun: from its start")
    _row("of which: cell sent -> the loop began", results, "resnet", "to_loop", 1, "s")
    _row("of which: the loop began -> first step done", results, "resnet", "loop_to_first_step", 1, "s")
    _row("whole cell", results, "resnet", "whole", 1, "s; torchrun: start to exit")
    _row("the loop's process began -> the loop began", results, "resnet", "process_to_loop", 1, "s; a rank: forked")
    _row("intra-op threads", results, "resnet", "threads", 1, "torch.get_num_threads() in the loop")
    _row("ResNet steady step, the loop's thread on a CPU", results, "resnet", "thread_cpu", 1e3, "ms")
    _row("ResNet steady step, its whole process on CPUs", results, "resnet", "process_cpu", 1e3, "ms")
    _row("ResNet steady step, the loop's thread: page faults", results, "resnet", "faults", 1, "per step")
    _row("ResNet steady step, the loop's thread: waits", results, "resnet", "waits", 1, "voluntary switches per step")
    _row("ResNet steady step, the loop's thread: preempted", results, "resnet", "preempted", 1, "per step")
    _trajectory(results)
    if _phases_log:
        for where, index in (("nbtrain, first", 0), ("nbtrain, re-run", -1), ("nbtrain, re-run at once", 0)):
            runs = results.get(("resnet", where))
            if runs:
                gpu_phases.timeline(_phases_log, f"ResNet, {where}", runs[index]["sent"], runs[index]["whole"])
    kernel_step = _median(results, ("resnet", "kernel"), "steady")
    rerun_step = _median(results, ("resnet", "nbtrain, re-run"), "steady")
    mlp_kernel, mlp_rank = _median(results, ("mlp", "kernel"), "steady"), _median(results, ("mlp", "nbtrain"), "steady")
    rerun_whole = _median(results, ("resnet", "nbtrain, re-run"), "whole")
    kernel_whole = _median(results, ("resnet", "kernel"), "whole")
    fabric_whole = _median(results, ("resnet", "Fabric, re-run"), "whole")
    print("\nRatios and targets")
    _target("ResNet steady step, nbtrain re-run / kernel", _ratio(rerun_step, kernel_step), TARGET_STEP_RATIO)
    _ratio_line("ResNet steady step, nbtrain re-run / nbtrain --no-auto re-run (what auto mode adds)",
                _ratio(rerun_step, _median(results, ("resnet", "nbtrain --no-auto, re-run"), "steady")))
    _target("MLP steady step, nbtrain / kernel", _ratio(mlp_rank, mlp_kernel), TARGET_STEP_RATIO)
    mlp_hand = _median(results, ("mlp", "nbtrain --no-auto"), "steady")
    _target("MLP steady step, nbtrain / nbtrain --no-auto (what auto mode adds)", _ratio(mlp_rank, mlp_hand),
            TARGET_AUTO_RATIO)
    _ratio_line("MLP steady step, nbtrain --no-auto / kernel (what the rank adds)", _ratio(mlp_hand, mlp_kernel))
    _target("re-run after the standby ranks are ready, cell sent -> first step done (s)",
            _median(results, ("resnet", "nbtrain, re-run"), "first_step"), TARGET_RERUN_FIRST_STEP_S)
    over = None if rerun_whole is None or kernel_whole is None else rerun_whole - kernel_whole
    _target("whole re-run cell minus the kernel's warm loop (s)", over, TARGET_RERUN_OVER_KERNEL_S)
    _target("Fabric's re-run / nbtrain's re-run, whole cell", _ratio(fabric_whole, rerun_whole), TARGET_VS_FABRIC,
            at_least=True)


def _ratio_line(label: str, value: float | None) -> None:
    print(f"  {label}: " + ("not measured" if value is None else f"{value:.3f}"))


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or not baseline else value / baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU ranks and small sizes: a smoke test without a GPU")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run (default 170)")
    parser.add_argument("--only", choices=sorted(PARTS), action="append", help="run only this part (repeatable)")
    parser.add_argument("--phases", action="store_true", help="probe the engine: where a run's time went, per side")
    args = parser.parse_args()
    global _phases_log
    if args.phases:
        _phases_log = gpu_phases.install()  # before any kernel or template starts
    sizes = CPU if args.cpu else GPU
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: run with --cpu for the smoke test", file=sys.stderr)
            raise SystemExit(2)
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    global _budget
    budget = _budget = Budget(args.budget)
    signal.signal(signal.SIGTERM, _stopped)  # `timeout` stops the run: still print what was measured
    results: dict = {}
    try:
        for name, part in PARTS.items():
            if args.only and name not in args.only:
                continue
            try:
                part(sizes, budget, results)
            except Exception as error:  # noqa: BLE001  # one peer failing still leaves the others' figures
                print(f"failed: {part.__name__}: {type(error).__name__}: {str(error)[-1500:]}", flush=True)
    except KeyboardInterrupt:
        print("stopped before the end: the figures so far follow", flush=True)
    report(results, sizes)
    if _phases_log:
        gpu_phases.uninstall(_phases_log)


PARTS = {"nbtrain": kernel_and_nbtrain, "fabric": fabric, "torchrun": torchrun}


def _stopped(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
