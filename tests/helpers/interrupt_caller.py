"""Run as __main__ by tests/test_failures.py: a caller whose long run gets interrupted or killed.

It starts a run that never ends by itself (rank 0 stuck in a barrier, rank 1 sleeping),
collects the rank pids from the RankStarted events, then blocks in ``run.wait()``. Once
both ranks print, it writes one JSON line with every pid involved; the test then sends
SIGINT (or SIGKILL) to this process. On KeyboardInterrupt it prints a marker and exits 0.
"""

import json
import os
import signal
import sys

import nbtrain
from nbtrain.kernel.launcher_connection import get_client
from nbtrain.messages import events

MARKER = "KeyboardInterrupt reached the caller"


def work():
    import time

    import torch.distributed as dist

    print("running", flush=True)
    if nbtrain.rank() == 0:
        dist.barrier()  # rank 1 never comes: stuck in a collective, in C++
    else:
        time.sleep(600)  # stuck in Python
    return "the run ended without an interrupt"


def main() -> int:
    # As in a Jupyter kernel, SIGINT raises KeyboardInterrupt, even if our parent ignored it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run = nbtrain.start(work, devices=2)
    started = set()
    for event in run.events():
        if isinstance(event, events.RankStarted):
            started.add(event.rank)
            if started == {0, 1}:
                break
    running = set()

    def announce(event):
        # Printed from inside run.wait(), so the signal lands while the caller waits.
        if isinstance(event, events.Output) and "running" in event.text:
            running.add(event.rank)
            if running == {0, 1}:
                pids = {"caller": os.getpid(), "launcher": get_client().process.pid, "ranks": sorted(run.pids.values())}
                print(json.dumps(pids), flush=True)

    try:
        result = run.wait(on_event=announce)
    except KeyboardInterrupt:
        print(f"{MARKER}; run state: {run.state}", flush=True)
        return 0
    print(f"no interrupt: {result!r}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
