#!/usr/bin/env python
"""Where a fresh CUDA process's first ResNet-18 step goes, with and without a standby rank's warm-up.

A standby rank (nbtrain.launch_server.standby) creates its CUDA context and warms the device
(``nbtrain.rank.machinery.runtime._warm_device``) before a cell arrives; what the cell's first step
still pays is what this measures. Each row is one fresh process (``python -c``), as a rank is
a fresh CUDA process; in order:

- ``cold``: nothing before the cell (a rank forked for the run, no standby);
- ``context``: a CUDA context and one tiny kernel first (what "CUDA initialised" means);
- ``standby``: the standby rank's whole warm-up first;
- ``eager``: the same, with every kernel of CUDA's libraries loaded at the context's creation
  (``CUDA_MODULE_LOADING=EAGER``; is lazy loading what the first step still pays, and what
  would loading them all cost a standby rank in time and GPU memory?);
- ``same shapes``: the standby warm-up, then one step of a copy of the model on a batch of the
  same shapes (what a warm-up of the last run's own shapes would leave the first step).

Per process (seconds, each synchronised): the warm-up, the model's copy to the GPU, the first
step (batch to the GPU, forward, cross-entropy, backward, SGD with momentum), the second, and
the median of steps 3-20. Run from the repository root on a machine with a CUDA GPU
(``bash .ci/gpu`` runs it)::

    python3 benchmarks/gpu_first_step.py            # about a minute and a half on an H200
    python3 benchmarks/gpu_first_step.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json, statistics, sys, time
import torch, torch.nn.functional as F
from nbtrain.rank.machinery import runtime
way = sys.argv[1]
began = time.perf_counter()
if way == "context":
    torch.zeros(1, device="cuda").add_(1); torch.cuda.synchronize()
elif way in ("standby", "eager", "same shapes"):
    torch.cuda.set_device(0); runtime._warm_device("cuda")

def make_model():
    try:
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    except ImportError:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, 2, 1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))

def step(model, opt, x, y):
    loss = F.cross_entropy(model(x.to("cuda", non_blocking=True)), y.to("cuda", non_blocking=True))
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); torch.cuda.synchronize()

x, y = torch.randn(128, 3, 64, 64), torch.randint(0, 10, (128,))
if way == "same shapes":
    rehearsal = make_model().cuda()
    step(rehearsal, torch.optim.SGD(rehearsal.parameters(), lr=0.01, momentum=0.9), x, y)
    del rehearsal
warm = time.perf_counter() - began
model = make_model()
t = time.perf_counter(); model = model.cuda(); torch.cuda.synchronize(); to_gpu = time.perf_counter() - t
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
steps = []
for _ in range(20):
    t = time.perf_counter()
    step(model, opt, x, y)
    steps.append(time.perf_counter() - t)
free, total = torch.cuda.mem_get_info()
print(json.dumps({"warm": warm, "to_gpu": to_gpu, "first": steps[0], "second": steps[1],
                  "steady": statistics.median(steps[2:]), "threads": torch.get_num_threads(),
                  "used_mib": (total - free) / 2**20}))
"""

WAYS = ("cold", "context", "standby", "eager", "same shapes")


def probe(way: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    if way == "eager":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    command = [sys.executable, "-c", PROBE, way]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {way} probe failed:\n{done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="processes per way, in turns (default 2)")
    rounds = parser.parse_args().rounds
    rows: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    heads = f"{'way':12} {'warm-up':>8} {'model->GPU':>10} {'1st step':>9} {'2nd step':>9} {'steady':>8} threads"
    print(heads + " GPU MiB used  (s; one process each)", flush=True)
    for _ in range(rounds):
        for way in WAYS:
            run = probe(way)
            rows[way].append(run)
            print(f"{way:12} {run['warm']:8.3f} {run['to_gpu']:10.3f} {run['first']:9.3f} {run['second']:9.3f} "
                  f"{run['steady']:8.4f} {run['threads']:7.0f} {run['used_mib']:12.0f}", flush=True)
    medians = ", ".join(f"{way} {statistics.median(r['first'] for r in rows[way]):.3f} s" for way in WAYS)
    print(f"first step, median: {medians}")


if __name__ == "__main__":
    main()
