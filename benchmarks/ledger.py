#!/usr/bin/env python
"""What the collective ledger costs a step: the same ranks, with and without it, in one run.

Run from the repository root::

    .venv/bin/python benchmarks/ledger.py            # about 1 min on 2 cores
    .venv/bin/python benchmarks/ledger.py --quick    # about 20 s

Two CPU ranks (gloo, one intra-op thread each) started by ``nbtrain.launch`` train an MLP
784-2048-2048-10 (batch 64, SGD) with the gradients averaged by hand: one
``dist.all_reduce`` per parameter per step, as torchrun-style code does, so each step makes
6 ledgered calls. Blocks of ``BLOCK`` steps take turns (the order rotated each round):

- **ledger**: ``torch.distributed.all_reduce`` as a rank has it (the ledger's wrapper);
- **bare**: the function it wraps (``__wrapped__``), the same collective without the ledger.

A round's ratio compares blocks a few milliseconds apart; the figure is the median over
rounds. Target: ledger / bare <= 1.01. Also printed: the cost of one ledgered call on a
4-element tensor (its median over many, against the bare call), the ledger's own cost per
call on a no-op collective (no network noise around it) and its share of the step, and the
entries 5 DDP steps make (one each: DDP's forward counts its backward's gradient all-reduce,
which runs in C++ and is not checked). The launcher's watch reads two words per rank per
tick, off the ranks' path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

BLOCK = 20


def _ranks_measure(rounds: int, block: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from nbtrain.system import stepboard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    ways = {"ledger": dist.all_reduce, "bare": dist.all_reduce.__wrapped__}

    def step(all_reduce: object) -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            all_reduce(p.grad)  # type: ignore[operator]
        opt.step()

    for way in ways.values():
        for _ in range(5):
            step(way)
    ratios = []
    for index in range(rounds):
        order = list(ways) if index % 2 == 0 else list(reversed(ways))
        seconds = {}
        for name in order:
            dist.barrier()
            began = time.perf_counter()
            for _ in range(block):
                step(ways[name])
            seconds[name] = (time.perf_counter() - began) / block
        ratios.append(seconds["ledger"] / seconds["bare"])
    small = torch.ones(4)
    calls = {}
    for name, way in ways.items():
        times = []
        for _ in range(2000):
            began = time.perf_counter()
            way(small)
            times.append(time.perf_counter() - began)
        calls[name] = statistics.median(times) * 1e6
    step_seconds = statistics.median(_block_seconds(step, ways["bare"], block) for _ in range(3))
    return {
        "ratios": ratios,
        "calls_us": calls,
        "ledger_us": _ledger_alone_us(),
        "step_us": step_seconds * 1e6,
        "ddp_calls": _ddp_step_calls(model, x, y, stepboard),
    }


def _block_seconds(step: object, way: object, block: int) -> float:
    began = time.perf_counter()
    for _ in range(block):
        step(way)  # type: ignore[operator]
    return (time.perf_counter() - began) / block


def _ledger_alone_us() -> float:
    """The ledger's own cost per call, on this rank's board: a ledgered no-op against the no-op itself
    (no network: what a collective pays for the ledger, without gloo's noise around it)."""
    import torch

    from nbtrain.rank.machinery import collectives

    def all_reduce(tensor: object, op: object = None, group: object = None, async_op: bool = False) -> None:
        return None

    ledgered, small = collectives.ledgered(all_reduce), torch.ones(4)
    collectives._ledger.group_calls[0] += 10**9  # type: ignore[union-attr]  # numbers no peer will reach
    medians = {}
    for name, way in (("ledgered", ledgered), ("bare", all_reduce)):
        times = []
        for _ in range(20000):
            began = time.perf_counter()
            way(small)
            times.append(time.perf_counter() - began)
        medians[name] = statistics.median(times)
    return (medians["ledgered"] - medians["bare"]) * 1e6


def _ddp_step_calls(model: object, x: object, y: object, stepboard: object) -> int:
    """Entries the ledger counts over 5 DDP steps (one a step: its syncing forward counts the backward's all-reduce)."""
    import torch
    from torch import nn

    from nbtrain.rank.machinery import collectives

    ledger = collectives._ledger
    if ledger is None:
        return -1
    ddp = nn.parallel.DistributedDataParallel(model)  # type: ignore[arg-type]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    before = ledger.board.collective(ledger.slot).calls
    for _ in range(5):
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ledger.board.collective(ledger.slot).calls - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 20 s)")
    args = parser.parse_args()
    rounds = 6 if args.quick else 20
    import nbtrain

    result = nbtrain.launch(_ranks_measure, rounds, BLOCK, devices=2, accelerator="cpu")
    ratios = result["ratios"]
    ratio = statistics.median(ratios)
    calls = result["calls_us"]
    print(f"rounds: {len(ratios)} of {BLOCK} steps each way; ratios: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"  ledger / bare, steady step with 6 all_reduce a step: {ratio:.4f} (target <= 1.01: "
          f"{'met' if ratio <= 1.01 else 'MISSED'})")
    print(f"  one all_reduce of 4 elements: ledger {calls['ledger']:.1f} us, bare {calls['bare']:.1f} us "
          f"(+{calls['ledger'] - calls['bare']:.1f} us)")
    share = 6 * result["ledger_us"] / result["step_us"]
    print(f"  the ledger alone, per call: {result['ledger_us']:.2f} us; 6 a step of {result['step_us'] / 1000:.1f} ms: "
          f"{share:.4%} of the step")
    print(f"  ledger entries over 5 DDP steps: {result['ddp_calls']}")
    sys.exit(0 if ratio <= 1.01 else 1)


if __name__ == "__main__":
    main()
