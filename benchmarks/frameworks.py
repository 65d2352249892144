#!/usr/bin/env python
"""Each framework's training through a ``%%distributed`` cell against the framework's own launcher.

Run from the repository root::

    .venv/bin/python benchmarks/frameworks.py           # 6-8 min on 2 cores under load average 8
    .venv/bin/python benchmarks/frameworks.py --quick   # 2 runs a side, fewer steps: a smoke test

Three frameworks, tiny models built in code, nothing downloaded, 2 CPU ranks, gloo, one
intra-op thread per rank (``torch.set_num_threads(1)`` in the training function, every side):

- **transformers' Trainer**: a BERT of one layer (hidden 16, the tests' config), batch 8 per rank;
- **accelerate**: an ``Accelerator(cpu=True)`` preparing an MLP 256-512-10, its loader (batch 64
  per rank) and SGD, a plain loop with ``accelerator.backward``;
- **Lightning**: a ``LightningModule`` of the same MLP, ``Trainer(devices=2, accelerator="cpu")``.

Each framework's training is one function, defined in a setup cell (or pasted into a script),
and run the same way on every side:

1. **nbtrain**: a real Jupyter kernel (ipykernel, driven as the tests drive it) with
   ``%load_ext nbtrain``; the cell is ``%%distributed --devices 2 --accelerator cpu`` then
   ``train(tag)`` (Lightning: ``strategy="ddp"``, as under torchrun: the ranks have torchrun's world);
2. **the framework's notebook launcher**, in a fresh kernel of the same environment without
   nbtrain: ``accelerate.notebook_launcher(train, args=(tag,), num_processes=2)`` (fork; the
   Trainer and accelerate; a free port is picked per call, where its default 29500 may be taken
   by another user of this machine), and Lightning's ``strategy="ddp_notebook"``;
3. **torchrun**: ``torchrun --standalone --nproc-per-node 2`` on a script of the setup and the
   same function (Lightning: ``strategy="ddp"``).

Per framework, a fresh nbtrain kernel and a fresh launcher kernel run their setup cells, then
``RUNS`` rounds take turns over the three sides (the order rotated each round): a side's first
round is its first run (the nbtrain kernel's first ``%%distributed`` cell, a launcher kernel's
first launch, torchrun's first start), the later rounds re-run the same cell (torchrun: the
same command again). Before an nbtrain re-run the kernel waits, bounded, until the standby ranks
are ready, as a user's pause between cells would (the wait is printed; the other sides' runs in
between usually leave them ready).

Each rank timestamps every training step's end (``time.time()``, one clock on one machine) from
inside the loop: a Trainer callback's ``on_step_end``, a Lightning callback's
``on_train_batch_end``, the accelerate loop after ``optimizer.step()``, the same callback on
every side, written to a file per rank at the end of training. A step's end is the later
rank's. Figures: the **steady step** (the median of the gaps between step ends after ``WARMUP``
steps; per side the median over its runs); **cell sent -> first step** (the first step's end minus
the time the cell was sent to the kernel; torchrun: minus its start); the **whole cell** (sent ->
the kernel's reply; torchrun: start -> exit). Targets (issue 54 item 9): nbtrain's steady step
<= 1.02x the best peer's; its first run's cell sent -> first step no slower than the fastest
peer's first run; its re-run cell (whole, median) faster than any peer's re-run.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the tests' kernel driver

import kernel_helpers
from kernel_helpers import NotebookKernel

RUNS = 3  # per side and framework: the first run, then re-runs
STEPS = 300
WARMUP = 100  # a re-run's new standby ranks warm up beside its first steps: past them
CELL_BOUND_S = 180.0  # any one cell or torchrun: a hang, not a slow machine
STANDBY_WAIT_S = 10.0
TARGET_STEP_RATIO = 1.02
# A user's kernel imports from compiled bytecode (pip compiles at install): so do these kernels
# and torchrun's processes, whatever this shell says.
KERNEL_ENV = {"PYTHONDONTWRITEBYTECODE": ""}
ENV = {**KERNEL_ENV, "OMP_NUM_THREADS": "1"}  # torchrun: what it would set itself; silences its warning
SIDES = ("nbtrain", "launcher", "torchrun")

COMMON = """
import json, os, socket, tempfile, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
STAMPS, STEPS = {stamps!r}, {steps}

class Stamps:
    # Each step's end (time.time()) on this rank, written to STAMPS/<tag>.<rank>.json at the end.
    def __init__(self, tag):
        self.tag, self.times = tag, []
    def step(self):
        self.times.append(time.time())
    def save(self):
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        with open(os.path.join(STAMPS, f"{{self.tag}}.{{rank}}.json"), "w") as file:
            json.dump(self.times, file)

def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))

def mlp_data():  # one epoch of STEPS batches of 64 per rank
    g = torch.Generator().manual_seed(1)
    n = 2 * 64 * STEPS
    return TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
"""

TRAINER = """
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 64, (n, 12), generator=g)
        self.labels = (self.ids[:, 0] > 32).long()
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}

class StampSteps(TrainerCallback):
    def __init__(self, tag):
        self.stamps = Stamps(tag)
    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.step()
    def on_train_end(self, args, state, control, **kwargs):
        self.stamps.save()

def train(tag):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=STEPS,
                             use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens(2 * 8 * STEPS), callbacks=[StampSteps(tag)]).train()
"""

ACCELERATE = """
from accelerate import Accelerator

def train(tag):
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(mlp_data(), batch_size=64))
    stamps = Stamps(tag)
    for x, y in loader:
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        stamps.step()
    stamps.save()
"""

LIGHTNING = """
import lightning as L

class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_mlp()
    def training_step(self, batch, i):
        return F.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

class StampSteps(L.Callback):
    def __init__(self, tag):
        self.stamps = Stamps(tag)
    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.stamps.step()
    def on_train_end(self, trainer, module):
        self.stamps.save()

def train(tag, strategy):
    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, max_epochs=1,
                        default_root_dir=tempfile.mkdtemp(), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StampSteps(tag)])
    trainer.fit(MLP(), DataLoader(mlp_data(), batch_size=64))
"""

NOTEBOOK_LAUNCHER = "from accelerate import notebook_launcher\n"
LAUNCHER_CELL = "notebook_launcher(train, args=({tag!r},), num_processes=2, use_port=free_port())\n"


class Framework:
    """One framework: its source, and the call each side makes."""

    def __init__(self, name: str, source: str, launcher: str, launcher_name: str, strategy: bool = False):
        self.name, self.source, self.launcher_name = name, source, launcher_name
        self.launcher_setup = launcher  # the launcher kernel's extra import
        self.strategy = strategy  # Lightning: train(tag, strategy)

    def call(self, tag: str, side: str) -> str:
        if not self.strategy:
            return f"train({tag!r})"
        return f"train({tag!r}, {'ddp_notebook' if side == 'launcher' else 'ddp'!r})"

    def cell(self, tag: str, side: str) -> str:
        if side == "nbtrain":
            return "%%distributed --devices 2 --accelerator cpu\n" + self.call(tag, side) + "\n"
        if self.strategy:
            return self.call(tag, side) + "\n"
        return LAUNCHER_CELL.format(tag=tag)


FRAMEWORKS = (
    Framework("transformers' Trainer", TRAINER, NOTEBOOK_LAUNCHER, "notebook_launcher"),
    Framework("accelerate", ACCELERATE, NOTEBOOK_LAUNCHER, "notebook_launcher"),
    Framework("Lightning", LIGHTNING, "", "ddp_notebook", strategy=True),
)


def setup_source(framework: Framework, stamps: str, steps: int) -> str:
    return COMMON.format(stamps=stamps, steps=steps) + framework.source


def stamps_of(folder: str, tag: str) -> list[float]:
    """Each step's end: the later rank's (a step ends when both ranks have ended it)."""
    ranks = []
    for path in sorted(glob.glob(os.path.join(folder, f"{tag}.*.json"))):
        with open(path) as file:
            ranks.append(json.load(file))
    if len(ranks) != 2 or len({len(times) for times in ranks}) != 1:
        raise RuntimeError(f"{tag}: expected 2 ranks' stamps of equal length, got {[len(t) for t in ranks]}")
    return [max(ends) for ends in zip(*ranks, strict=True)]


def figures(ends: list[float], started: float, whole: float, warmup: int) -> dict:
    gaps = [b - a for a, b in itertools.pairwise(ends[warmup:])]
    early = [b - a for a, b in itertools.pairwise(ends[:warmup])]
    return {"steady": statistics.median(gaps), "early": statistics.median(early), "first_step": ends[0] - started,
            "whole": whole, "steps": len(ends)}


def run_cell(kernel: NotebookKernel, source: str) -> tuple[float, float]:
    """Send a cell; (the time it was sent, sent -> reply). Fails on an error or a rank that trained alone."""
    sent = time.time()
    msg_id = kernel.start_cell(source)
    reply, out = kernel.wait_for_reply(msg_id, CELL_BOUND_S)
    whole = time.time() - sent
    if reply["status"] != "ok" or "trained alone" in out.text:
        raise RuntimeError(f"the cell failed or trained alone:\n{source}\n{out.text[-3000:]}")
    return sent, whole


def torchrun(script: str, args: list[str]) -> tuple[float, float]:
    """torchrun on the script; (its start, start -> exit)."""
    runner = os.path.join(os.path.dirname(sys.executable), "torchrun")
    argv = [runner] if os.path.exists(runner) else [sys.executable, "-m", "torch.distributed.run"]
    started = time.time()
    done = subprocess.run(
        [*argv, "--standalone", "--nproc-per-node", "2", script, *args],
        capture_output=True, text=True, timeout=CELL_BOUND_S, check=False, env={**os.environ, **ENV},
        start_new_session=True,
    )
    whole = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}:\n{done.stderr[-3000:]}")
    return started, whole


def measure(framework: Framework, runs: int, steps: int, warmup: int) -> dict[str, list[dict]]:
    """One framework: a fresh nbtrain kernel and a fresh launcher kernel, ``runs`` rounds over the three sides."""
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    folder = tempfile.mkdtemp(prefix="nbtrain-bench-frameworks-")
    try:
        setup = setup_source(framework, folder, steps)
        script = os.path.join(folder, "train.py")
        with open(script, "w") as file:
            call = framework.call("TAG", "torchrun").replace("'TAG'", "sys.argv[1]")
            file.write(f"{setup}\nimport sys\n{call}\n")
        with NotebookKernel(env=KERNEL_ENV) as nb, NotebookKernel(env=KERNEL_ENV) as peer:
            nb.run_ok("%load_ext nbtrain\n" + setup)
            peer.run_ok(framework.launcher_setup + setup)
            for round_index in range(runs):
                order = SIDES[round_index % 3:] + SIDES[: round_index % 3]
                for side in order:
                    tag = f"{side}-{round_index}"
                    if side == "torchrun":
                        started, whole = torchrun(script, [tag])
                    else:
                        kernel = nb if side == "nbtrain" else peer
                        if side == "nbtrain" and round_index:
                            waited, ready = kernel_helpers.wait_for_standby(nb, STANDBY_WAIT_S)
                            progress(f"    nbtrain re-run: waited {waited:.2f} s for the standby ranks"
                                     + ("" if ready else " (not ready: sent anyway)"))
                        started, whole = run_cell(kernel, framework.cell(tag, side))
                    results[side].append(figures(stamps_of(folder, tag), started, whole, warmup))
                    shown = results[side][-1]
                    progress(f"  {framework.name}, {side} run {round_index + 1}: step {shown['steady'] * 1e3:.2f} ms "
                             f"(steps 2-{warmup}: {shown['early'] * 1e3:.2f} ms), "
                             f"first step {shown['first_step']:.2f} s, whole {shown['whole']:.2f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _median(runs: list[dict], figure: str) -> float:
    return statistics.median(run[figure] for run in runs)


def report(all_results: dict[str, dict[str, list[dict]]], framework_list: tuple[Framework, ...], runs: int,
           steps: int, warmup: int) -> None:
    print(f"\n2 CPU ranks, 1 thread each; {steps} steps a run, the steady step the median gap after {warmup}; "
          f"{runs} runs a side (the first, then re-runs); figures: medians over the runs unless 'first run'")
    header = (f"{'framework':22s} {'side':18s} {'steady step ms':>14s} {'first run: sent->step s':>24s} "
              f"{'re-run: sent->step s':>21s} {'re-run: whole s':>16s}")
    print(header)
    verdicts = []
    for framework in framework_list:
        results = all_results.get(framework.name)
        if not results:
            print(f"{framework.name:22s} not measured")
            continue
        names = {"nbtrain": "nbtrain", "launcher": framework.launcher_name, "torchrun": "torchrun"}
        for side in SIDES:
            rows = results[side]
            reruns = rows[1:] or rows
            print(f"{framework.name:22s} {names[side]:18s} {_median(rows, 'steady') * 1e3:14.2f} "
                  f"{rows[0]['first_step']:24.2f} {_median(reruns, 'first_step'):21.2f} "
                  f"{_median(reruns, 'whole'):16.2f}")
        verdicts.append((framework, results, names))
    print("\nRatios and targets (nbtrain against each peer; the target against the best)")
    for framework, results, names in verdicts:
        nb, peers = results["nbtrain"], [side for side in SIDES if side != "nbtrain"]
        # Steady step: per round, nbtrain's over the peer's of the same round (load drifting between
        # rounds cancels out), the median over rounds; the spread of the round ratios is the noise.
        rounds = {side: [a["steady"] / b["steady"] for a, b in zip(nb, results[side], strict=False)] for side in peers}
        steps = {side: statistics.median(ratios) for side, ratios in rounds.items()}
        firsts = {side: nb[0]["first_step"] / results[side][0]["first_step"] for side in peers}
        reruns = {side: _median(nb[1:] or nb, "whole") / _median(results[side][1:] or results[side], "whole")
                  for side in peers}
        worst = max(steps.values())
        print(f"  {framework.name}, steady step, nbtrain / peer (median of the round ratios, their range): "
              + "; ".join(f"{names[side]} {steps[side]:.3f} ({min(rounds[side]):.2f}-{max(rounds[side]):.2f})"
                          for side in peers)
              + f" -> {worst:.3f} against the best (target <= {TARGET_STEP_RATIO}: "
              + ("met" if worst <= TARGET_STEP_RATIO else "MISSED") + ")")
        print(f"  {framework.name}, first run, cell sent -> first step, nbtrain / peer: "
              + "; ".join(f"{names[side]} {firsts[side]:.3f}" for side in peers)
              + f" (target <= 1 against the fastest: {'met' if max(firsts.values()) <= 1 else 'MISSED'})")
        print(f"  {framework.name}, re-run, whole cell, nbtrain / peer: "
              + "; ".join(f"{names[side]} {reruns[side]:.3f}" for side in peers)
              + f" (target < 1 against any: {'met' if max(reruns.values()) < 1 else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 runs a side, 60 steps: a smoke test")
    parser.add_argument("--only", choices=("trainer", "accelerate", "lightning"), action="append",
                        help="only this framework (repeatable)")
    args = parser.parse_args()
    runs, steps, warmup = (2, 60, 10) if args.quick else (RUNS, STEPS, WARMUP)
    keys = {"trainer": FRAMEWORKS[0], "accelerate": FRAMEWORKS[1], "lightning": FRAMEWORKS[2]}
    chosen = tuple(keys[name] for name in args.only) if args.only else FRAMEWORKS
    progress(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average {os.getloadavg()[0]:.2f}")
    all_results: dict[str, dict[str, list[dict]]] = {}
    try:
        for framework in chosen:
            progress(f"{framework.name} ...")
            try:
                all_results[framework.name] = measure(framework, runs, steps, warmup)
            except Exception as error:  # noqa: BLE001  # one framework failing still leaves the others' figures
                print(f"failed: {framework.name}: {type(error).__name__}: {str(error)[-3000:]}", flush=True)
    except KeyboardInterrupt:
        print("stopped before the end: the figures so far follow", flush=True)
    progress(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average {os.getloadavg()[0]:.2f}")
    report(all_results, chosen, runs, steps, warmup)


if __name__ == "__main__":
    main()
