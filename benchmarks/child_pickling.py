#!/usr/bin/env python
"""What sending notebook code by value to a rank's child processes costs, and what each start method
costs a rank's DataLoader before its first batch.

Run from the repository root::

    .venv/bin/python benchmarks/child_pickling.py            # the pickling alone: a few seconds
    .venv/bin/python benchmarks/child_pickling.py --kernel   # and first batches on 2 ranks: about 2 min

The pickling (nbtrain.rank.machinery.childpickling, in this process, the best of ``ROUNDS`` rounds
of ``REPEATS``, with and without the patch in turns):

- **a worker's start**: what a DataLoader sends each spawn/forkserver worker (a notebook Dataset,
  collate and init functions, cloudpickled by value), against the same objects of an importable
  module (by reference: what pickle does where it can);
- **a batch**: what every forked worker's batch pays for the ``reducer_override`` (called for each
  object pickle does not write inline), with and without the patch, for a tensor batch and for a
  batch of 256 small dicts.

``--kernel``: in a real kernel, 2 CPU ranks, ``num_workers=2``, the time from ``iter(loader)`` to
the first batch on rank 0 in each of two passes under fork, forkserver (torch preloaded, as nbtrain sets
a rank's up), forkserver as Python sets it up, and spawn (a notebook Dataset and collate function),
each twice, in turns.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import timeit
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch

from nbtrain import patches
from nbtrain.rank.machinery import childpickling

REPEATS = 100
ROUNDS = 5
NOTEBOOK = """
import torch
from torch.utils.data import Dataset, get_worker_info

class Squares(Dataset):
    offset = 0
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return i * i + self.offset

def to_batch(items):
    return torch.tensor(items)

def offset_by_one(worker_id):
    get_worker_info().dataset.offset = 1
"""


def _best_us(fn: Any, number: int = 20) -> float:
    return min(timeit.repeat(fn, number=number, repeat=REPEATS // number or 1)) / number * 1e6


def pickling() -> None:
    """Print the pickling figures."""
    notebook: dict[str, Any] = {"__name__": "__main__"}
    exec(NOTEBOOK, notebook)  # noqa: S102 - classes and functions as a rank holds the notebook's
    importable: dict[str, Any] = {"__name__": "child_pickling_importable"}
    exec(NOTEBOOK, importable)  # noqa: S102 - the same code, in a module
    module = type(sys)("child_pickling_importable")
    vars(module).update(importable)
    sys.modules[module.__name__] = module  # the same code, findable by reference
    sent = (notebook["Squares"](), notebook["to_batch"], notebook["offset_by_one"])
    same = (importable["Squares"](), importable["to_batch"], importable["offset_by_one"])
    tensors = (torch.randn(64, 3, 32, 32), torch.arange(64))
    dicts = [{"id": i, "text": "abc", "x": 1.0} for i in range(256)]
    batches = {"tensor batch": tensors, "256 dicts": dicts}
    times: dict[str, list[float]] = {}
    for _ in range(ROUNDS):  # in turns, so that a busy moment weighs on both
        for name, batch in batches.items():
            times.setdefault(f"{name} without", []).append(_best_us(lambda batch=batch: ForkingPickler.dumps(batch)))
        times.setdefault("by reference", []).append(_best_us(lambda: ForkingPickler.dumps(same)))
        with contextlib.ExitStack() as stack:
            patches.install(childpickling.GROUP, stack)
            for name, batch in batches.items():
                times.setdefault(f"{name} with", []).append(_best_us(lambda batch=batch: ForkingPickler.dumps(batch)))
            times.setdefault("by value", []).append(_best_us(lambda: ForkingPickler.dumps(sent)))
            size = len(ForkingPickler.dumps(sent))
    best = {key: min(values) for key, values in times.items()}
    by_value, by_reference = best["by value"], best["by reference"]
    plain, patched = [best[f"{name} without"] for name in batches], [best[f"{name} with"] for name in batches]
    print(f"a worker's start: by value {by_value:.0f} us ({size} bytes), by reference {by_reference:.0f} us")
    for name, before, after in zip(("tensor batch", "256 dicts"), plain, patched, strict=True):
        print(f"a batch, {name}: {before:.1f} us without the patch, {after:.1f} us with it")


CELL = """%%distributed --devices 2 --accelerator cpu
import multiprocessing, time
{preload}
first_batch_s = []
for _ in range(2):  # without persistent workers each pass starts its own
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, collate_fn=to_batch, multiprocessing_context={method!r})
    began = time.perf_counter()
    first = next(iter(loader))
    first_batch_s.append(round(time.perf_counter() - began, 2))
    del loader
"""
PYTHONS_OWN = "multiprocessing.set_forkserver_preload(['__main__'])"  # what Python preloads: nothing ahead
CHOICES = (("fork", ""), ("forkserver", ""), ("forkserver", PYTHONS_OWN), ("spawn", ""))


def first_batches() -> None:
    """Print each start method's first-batch latency on rank 0 of 2 ranks, for two passes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from kernel_helpers import nbtrain_kernel

    kernel_session = nbtrain_kernel(NOTEBOOK + "from torch.utils.data import DataLoader\n")
    kernel = next(kernel_session)
    try:
        for method, preload in CHOICES * 2:
            kernel.run_ok(CELL.format(method=method, preload=preload))
            name = f"{method} (Python's preload)" if preload else method
            print(f"first batch of each pass, {name}: {kernel.value('first_batch_s')} s")
    finally:
        kernel_session.close()


def main() -> None:
    """Parse the flags and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="store_true", help="also time first batches on 2 ranks in a kernel")
    args = parser.parse_args()
    pickling()
    if args.kernel:
        first_batches()


if __name__ == "__main__":
    main()
