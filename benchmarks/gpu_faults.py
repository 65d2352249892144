#!/usr/bin/env python
"""Where the loop's thread takes page faults and CPU time, phase by phase: kernel, auto mode, ``--no-auto``.

Run from the repository root::

    python3 benchmarks/gpu_faults.py          # on a GPU machine: about 1 min
    python3 benchmarks/gpu_faults.py --cpu    # CPU ranks and small sizes (works anywhere)

The issue's ResNet loop (``benchmarks/gpu.py``'s: ResNet-18, or a small conv net where
torchvision is missing; a shuffled CPU DataLoader; SGD with momentum; batches moved with
``.to(device)``) in a real kernel, then under ``%%distributed --devices 1`` (auto mode: the
first run and re-runs on standby ranks) and ``--no-auto``. Each step is cut in phases: the
batch (``next`` on the loader, a new epoch's iterator included), its way to the device, forward
and loss, ``zero_grad`` and backward (auto mode's loss hook), ``opt.step()`` (nbtrain's step
hooks). Per phase: the loop thread's minor page faults (``RUSAGE_THREAD``) and CPU time
(``time.thread_time``) per steady step, summed over the steps after the warm-up. A phase
whose faults differ between auto mode and the kernel is where new pages are mapped or touched.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' kernel driver

import gpu  # beside this script: the same ResNet
import kernel_helpers
from kernel_helpers import NotebookKernel

PHASES = ("batch", "to device", "forward+loss", "backward", "step")
CELL_BOUND_S = 120.0

SETUP = """
import resource, time, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
DEVICE, IMAGE, BATCH, IMAGES, STEPS, WARM = {device!r}, {image}, {batch}, {images}, {steps}, {warm}
PHASES = {phases!r}

{make_resnet}
def mark():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()

def train_phases(model, opt, loader, steps, warm):
    faults, cpu = [0] * len(PHASES), [0.0] * len(PHASES)
    marks = [None] * (len(PHASES) + 1)
    batches = iter(loader)
    for step in range(steps):
        marks[0] = mark()
        try:
            x, y = next(batches)
        except StopIteration:  # a new epoch: its iterator (the sampler's order) is part of the batch's phase
            batches = iter(loader)
            x, y = next(batches)
        marks[1] = mark()
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
        marks[2] = mark()
        loss = F.cross_entropy(model(x), y)
        marks[3] = mark()
        opt.zero_grad(set_to_none=True); loss.backward()
        marks[4] = mark()
        opt.step()
        marks[5] = mark()
        if step >= warm:
            for i in range(len(PHASES)):
                faults[i] += marks[i + 1][0] - marks[i][0]
                cpu[i] += marks[i + 1][1] - marks[i][1]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    counted = steps - warm
    return [f / counted for f in faults], [c / counted * 1e6 for c in cpu]

torch.manual_seed(0)
images = TensorDataset(torch.randn(IMAGES, 3, IMAGE, IMAGE), torch.randint(0, 10, (IMAGES,)))
loader = DataLoader(images, batch_size=BATCH, shuffle=True)
resnet = make_resnet().to(DEVICE)
resnet_opt = torch.optim.SGD(resnet.parameters(), lr=0.01, momentum=0.9)
"""

CELL = "phase_faults, phase_cpu = train_phases(resnet, resnet_opt, loader, STEPS, WARM)\n"


def measure(kernel: NotebookKernel, source: str) -> tuple[list[float], list[float]]:
    kernel.run_ok(source)
    faults, cpu = kernel.value("[phase_faults, phase_cpu]")
    return faults, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU ranks and small sizes")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default 64 on a GPU, 40 with --cpu)")
    args = parser.parse_args()
    device, accelerator = ("cpu", "cpu") if args.cpu else ("cuda", "gpu")
    sizes = {"image": 32, "batch": 16, "images": 128} if args.cpu else {"image": 64, "batch": 128, "images": 512}
    steps = args.steps or (40 if args.cpu else 64)
    setup = SETUP.format(device=device, steps=steps, warm=8, phases=PHASES, make_resnet=gpu.MAKE_RESNET, **sizes)
    magic = f"%%distributed --devices 1 --accelerator {accelerator}\n"
    runs: dict[str, tuple[list[float], list[float]]] = {}
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\n" + setup)
        measure(kernel, CELL)  # the kernel's cold run
        runs["kernel"] = measure(kernel, CELL)
        runs["auto mode, first"] = measure(kernel, magic + CELL)
        for number in (1, 2):
            kernel_helpers.wait_for_standby(kernel, 30.0)
            runs[f"auto mode, re-run {number}"] = measure(kernel, magic + CELL)
        kernel_helpers.wait_for_standby(kernel, 30.0)
        runs["--no-auto, re-run"] = measure(kernel, magic.replace("\n", " --no-auto\n") + CELL)
    where = f"{device}, batch {sizes['batch']}, {sizes['image']}x{sizes['image']}, {steps} steps, 8 warm-up"
    print(f"The loop thread per steady step, by phase ({where}); one run each:")
    header = "".join(f"{phase:>14}" for phase in (*PHASES, "all"))
    for title, index, unit in (("minor page faults", 0, ""), ("CPU time (us)", 1, "")):
        print(f"\n{title}{unit}\n  {'':24}{header}")
        for name, figures in runs.items():
            values = figures[index]
            print(f"  {name:24}" + "".join(f"{value:14.2f}" for value in (*values, sum(values))))


if __name__ == "__main__":
    main()
