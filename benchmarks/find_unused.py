#!/usr/bin/env python
"""What ``find_unused_parameters=True`` costs a DDP step, on a small transformer.

Run from the repository root::

    .venv/bin/python benchmarks/find_unused.py           # about a minute on 2 cores
    .venv/bin/python benchmarks/find_unused.py --quick   # about 20 seconds

Auto mode wraps models with ``find_unused_parameters=False`` (and checks the first backward
for parameters without a gradient instead); the ``ddp_find_unused_parameters_true``
strategy sets it to True, and DDP then walks the autograd graph from the outputs after
every forward. This measures that walk's price in one run of 2 CPU ranks (gloo, one
thread each): every rank builds the same transformer twice (token embedding, 4 encoder
layers of width 128 with 4 heads and a 512-wide feed-forward, a vocabulary head; batch 8
of 64 tokens), prepares one copy with each setting through ``nbtrain.prepare``, and trains
them in blocks, alternately, so drift on a busy machine hits both alike. The baseline is
the ``False`` copy in the same run. Printed: median step time of each, and the median of
the True/False ratios of neighbouring blocks with a 95% bootstrap interval, for wall time
and for the rank's CPU time; plus the first step of the ``False`` copy, which carries the
one-off check for unused parameters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from live_view import paired_overhead  # benchmarks/live_view.py, beside this script

import nbtrain

MODEL = {"vocabulary": 500, "width": 64, "heads": 4, "feed_forward": 256, "layers": 6}
BATCH, TOKENS = 4, 32


def transformer():
    """A small encoder-only language model (the module is built on the rank)."""
    from torch import nn

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(MODEL["vocabulary"], MODEL["width"])
            layer = nn.TransformerEncoderLayer(
                MODEL["width"], MODEL["heads"], MODEL["feed_forward"], dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, MODEL["layers"], enable_nested_tensor=False)
            self.head = nn.Linear(MODEL["width"], MODEL["vocabulary"])

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    return TinyTransformer()


def train_both(blocks: int, steps_per_block: int) -> dict:
    """On each rank: per-step wall and CPU times of the two copies, in alternating blocks."""
    import copy

    import torch
    from torch import nn

    torch.manual_seed(0)
    base = transformer()
    models = {flag: nbtrain.prepare(copy.deepcopy(base), find_unused_parameters=flag) for flag in (True, False)}
    optimizers = {flag: torch.optim.SGD(m.parameters(), lr=0.01) for flag, m in models.items()}
    tokens = torch.randint(0, MODEL["vocabulary"], (BATCH, TOKENS))
    targets = torch.randint(0, MODEL["vocabulary"], (BATCH, TOKENS))

    def step(flag: bool) -> None:
        logits = models[flag](tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizers[flag].zero_grad()
        loss.backward()
        optimizers[flag].step()

    first_step = {}
    for flag in (False, True):
        started = time.perf_counter()
        step(flag)  # False: the one-off check for unused parameters runs here
        first_step[flag] = time.perf_counter() - started

    def block(flag: bool) -> tuple[float, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(steps_per_block):
            step(flag)
        return (time.perf_counter() - started) / steps_per_block, (time.process_time() - cpu_started) / steps_per_block

    for flag in (False, True):
        block(flag)  # warm-up: allocator, gloo buffers, DDP's bucket rebuild
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for index in range(blocks):
        for flag in (True, False) if index % 2 == 0 else (False, True):
            times[flag].append(block(flag))
    return {"times": times, "first_step": first_step, "parameters": sum(p.numel() for p in base.parameters())}


def report(result: dict, blocks: int, steps_per_block: int) -> None:
    times = result["times"]
    print(
        f"DDP find_unused_parameters, 2 CPU ranks (gloo, 1 thread each); transformer "
        f"{MODEL['layers']} layers x width {MODEL['width']} ({result['parameters'] / 1e6:.2f} M parameters), "
        f"batch {BATCH} x {TOKENS} tokens"
    )
    print(f"   {blocks} pairs of blocks of {steps_per_block} steps, alternated; rank 0's clock")
    wall = {flag: statistics.median(w for w, _ in times[flag]) for flag in (False, True)}
    print(f"   median step, find_unused_parameters=False (auto mode, the baseline): {wall[False] * 1e3:7.2f} ms")
    print(f"   median step, find_unused_parameters=True  (ddp_find_unused_parameters_true): {wall[True] * 1e3:7.2f} ms")
    for name, index in (("wall time", 0), ("CPU time", 1)):
        median, low, high = paired_overhead([t[index] for t in times[True]], [t[index] for t in times[False]])
        print(
            f"   {name} per step, True/False: {1 + median:.3f}x (95% interval {1 + low:.3f}x .. {1 + high:.3f}x)"
        )
    first = result["first_step"]
    print(
        f"   first step (cold): False, with nbtrain's one-off unused-parameter check {first[False] * 1e3:.1f} ms; "
        f"True {first[True] * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks")
    args = parser.parse_args()
    blocks, steps_per_block = (6, 5) if args.quick else (20, 10)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: 2 ranks on 2 cores
    result = nbtrain.launch(train_both, blocks, steps_per_block, devices=2, accelerator="cpu", timeout=900)
    report(result, blocks, steps_per_block)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
