"""Run as __main__ by tests/test_resources.py: a 4-rank run that closes over a 1 GB tensor.

A clean caller process, like a notebook kernel: the memory measured is the caller's, the
launcher's and the ranks', not the test runner's. Each rank sums the tensor (so every
page of its copy-on-write mapping is touched), prints "ready" and waits until the file
named on the command line exists; meanwhile this script prints one JSON line with every
pid so the test can sample their memory while the ranks are alive.
"""

import json
import os
import sys

import torch

import nbtrain
from nbtrain.kernel.launcher_connection import get_client
from nbtrain.messages import events

ELEMENTS = 256 * 1024 * 1024  # 1 GiB of float32


def main(release_file: str) -> int:
    big = torch.ones(ELEMENTS, dtype=torch.float32)

    def fn():
        import time

        total = big.sum().item()
        print("ready", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(release_file):  # bounded: the test samples, then releases
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the ranks")
            time.sleep(0.01)
        return total

    run = nbtrain.start(fn, devices=4, timeout=180)
    ready = set()

    def on_event(event):
        if isinstance(event, events.Output) and "ready" in event.text:
            ready.add(event.rank)
            if ready == {0, 1, 2, 3}:
                pids = {"caller": os.getpid(), "launcher": get_client().process.pid, "ranks": sorted(run.pids.values())}
                print(json.dumps(pids), flush=True)

    total = run.wait(on_event=on_event)
    print(f"SUM {total:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
