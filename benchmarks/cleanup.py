#!/usr/bin/env python
"""How fast a run's end cleans up: interrupts in a real kernel, and processes a rank left behind.

    .venv/bin/python benchmarks/cleanup.py            # about 2 min on a quiet 2-core machine
    .venv/bin/python benchmarks/cleanup.py --repeats 3

1. **Interrupt to the cell's end.** A real kernel (jupyter_client) runs a 2-rank
   ``%%distributed`` cell that spins; once both ranks printed, the kernel is interrupted.
   Figure: from ``interrupt_kernel()`` to the cell's ``execute_reply``.
2. **Interrupt during a 1 GiB result.** A 1-rank cell returns 1 GiB; the kernel is
   interrupted as soon as its RSS has grown by 128 MiB (the copy out of rank 0 is under
   way). Figures: interrupt to reply, and the kernel's RSS before the cell and right after
   the reply.
3. **Escaped descendants.** A rank starts a child in its own session and a double-forked
   daemon, both holding its stdout, then returns. Figures: from the rank's return to the
   run's end in the caller, and from the run's end until both processes are gone (reaped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from queue import Empty

import psutil
from jupyter_client.manager import KernelManager

MIB = 1 << 20

SPIN_CELL = """%%distributed --devices 2 --accelerator cpu
import nbtrain, time
print("running", nbtrain.rank(), flush=True)
while True:
    time.sleep(0.01)
"""
BIG_CELL = "%%distributed --devices 1 --accelerator cpu\nbig = torch.ones(256 * 1024 * 1024)\n"


class Kernel:
    """A real ipykernel, driven over its channels; every wait is bounded."""

    def __init__(self) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel()
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.pid = self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 300) -> dict:
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
        return reply["content"]

    def wait_output(self, msg_id: str, needles: list[str], timeout: float = 120) -> None:
        seen, deadline = "", time.monotonic() + timeout
        while not all(needle in seen for needle in needles):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{needles} not seen; output: {seen!r}")
            try:
                message = self.client.get_iopub_msg(timeout=1)
            except Empty:
                continue
            if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
                seen += message["content"]["text"]

    def reply(self, msg_id: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.client.get_shell_msg(timeout=1)
            except Empty:
                continue
            if message["parent_header"].get("msg_id") == msg_id:
                return message["content"]
        raise TimeoutError("no reply")

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


def interrupt_to_reply(kernel: Kernel) -> tuple[float, str]:
    msg_id = kernel.client.execute(SPIN_CELL)
    kernel.wait_output(msg_id, ["running 0", "running 1"])
    started = time.perf_counter()
    kernel.manager.interrupt_kernel()
    reply = kernel.reply(msg_id)
    return time.perf_counter() - started, reply.get("ename", reply["status"])


def interrupted_result(kernel: Kernel) -> tuple[float, float, float, str]:
    kernel.run("import gc; gc.collect()")
    process = psutil.Process(kernel.pid)
    before = process.memory_info().rss
    msg_id = kernel.client.execute(BIG_CELL)
    deadline = time.monotonic() + 120
    while process.memory_info().rss < before + 128 * MIB:
        if time.monotonic() > deadline:
            raise TimeoutError("the result copy never started")
        time.sleep(0.002)
    started = time.perf_counter()
    kernel.manager.interrupt_kernel()
    reply = kernel.reply(msg_id)
    elapsed = time.perf_counter() - started
    return elapsed, before / MIB, process.memory_info().rss / MIB, reply.get("ename", reply["status"])


def escapees() -> dict:
    """On a rank: a child in its own session and a double-forked daemon, both on our stdout."""
    import subprocess

    session = subprocess.Popen(["sleep", "600"], start_new_session=True)
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(write_end, str(os.getpid()).encode())
            while True:
                time.sleep(60)
        os._exit(0)
    os.close(write_end)
    orphan = int(os.read(read_end, 32))
    return {"pids": [session.pid, orphan], "returned": time.time()}


def escapee_cleanup() -> tuple[float, float]:
    import nbtrain

    result = nbtrain.launch(escapees, devices=1, accelerator="cpu", timeout=120)
    ended = time.time()
    left, deadline = list(result["pids"]), time.monotonic() + 30
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.001)
    gone = time.time()
    if left:
        raise RuntimeError(f"still present after 30 s: {left}")
    return ended - result["returned"], gone - ended


def summary(label: str, values: list[float], unit: str = "s") -> str:
    return f"{label}: median {statistics.median(values):.3f} {unit}, max {max(values):.3f} {unit} (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernel = Kernel()
    try:
        kernel.run("%load_ext nbtrain\nimport torch")
        kernel.run("%%distributed --devices 2 --accelerator cpu\nwarm = 1")
        spins = [interrupt_to_reply(kernel) for _ in range(args.repeats)]
        print(summary("interrupt -> cell end (2 ranks spinning)", [s for s, _ in spins]), {e for _, e in spins})
        big = [interrupted_result(kernel) for _ in range(max(1, args.repeats // 2))]
        print(summary("interrupt during a 1 GiB result -> cell end", [b[0] for b in big]), {b[3] for b in big})
        print("kernel RSS before -> right after (MiB):", ", ".join(f"{b[1]:.0f} -> {b[2]:.0f}" for b in big))
    finally:
        kernel.close()
    import nbtrain  # noqa: F401 - the caller of part 3 is this process

    cleanups = [escapee_cleanup() for _ in range(args.repeats)]
    print(summary("escapees: rank's return -> run's end", [c[0] for c in cleanups]))
    print(summary("escapees: run's end -> both gone", [c[1] for c in cleanups]))
    json.dump({"spins": spins, "big": big, "cleanups": cleanups}, sys.stderr)
    print(file=sys.stderr)


if __name__ == "__main__":
    main()
