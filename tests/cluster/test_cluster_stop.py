"""A stop keeps what a cluster run learned: every rank on every node ends at one optimizer step.

A real kernel (nbclient) drives ``%%distributed --cluster ray --num-nodes 2 --devices 1`` on the
test cluster (two raylets, tests/cluster/conftest.py): one rank per node, CPU. The kernel's
relay asks every node's launcher for its highest step, chooses the highest over the nodes and
every node stops there; the kernel's model, optimizer and scheduler are compared with a
reference trained in the kernel's own process for exactly the reported step (the same seeded
loop and data order as tests/test_graceful_stop.py).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kernel_helpers import NotebookKernel
from nbtrain.cluster import engine
from test_graceful_stop import LOOP, SETUP, SLEEPS_AT_40

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(900)

CELL_SECONDS = 300.0  # the first cell places the agents: slow on a loaded 2-core machine
STOP_BOUND = 20.0  # from the interrupt to the cell's reply, Ray calls included, on a loaded machine
ON_NODES = LOOP.replace("--devices 2 --accelerator cpu", "--cluster ray --num-nodes 2 --devices 1 --accelerator cpu")


@pytest.fixture(scope="module")
def kernel(ray_cluster: Any) -> Iterator[NotebookKernel]:
    engine.close()  # this process's agents hold the nodes; the kernel places its own
    with NotebookKernel(env={"RAY_ADDRESS": ray_cluster.address}) as started:
        started.run_ok(SETUP)
        started.run_ok(ON_NODES.format(flags="").split("\n", 1)[0] + "\nwarm = 1")  # the agents are placed
        yield started


def _holds(kernel: NotebookKernel, step: int) -> None:
    found = kernel.value(f"compare({step})")
    assert found["weights"] < 1e-6 and found["momentum"] < 1e-6, found
    assert found["last_epoch"] == found["ref_last_epoch"] == step, found
    assert kernel.value("nbtrain.last_run().stopped_at") == step
    assert kernel.value("nbtrain.last_run().stopped") == "at a step"


def test_an_interrupt_stops_every_node_at_one_step_and_brings_its_state_back(kernel: NotebookKernel) -> None:
    kernel.run_ok("model, opt, sched = make()")
    msg_id = kernel.start_cell(ON_NODES.format(flags=""))
    kernel.wait_for_stream(msg_id, ["training 0", "training 1"], CELL_SECONDS)
    time.sleep(random.uniform(0.0, 1.5))  # the random moment of the interrupt is the point
    asked = time.monotonic()
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, 120.0)
    seconds = time.monotonic() - asked
    assert reply["ename"] == "RunInterrupted", out.text
    found = re.search(r"stopped at step (\d+) on every rank; model, opt and sched hold step (\d+)", out.text)
    assert found is not None and found.group(1) == found.group(2), out.text
    step = int(found.group(1))
    assert 0 < step < 2000, step
    _holds(kernel, step)
    assert seconds < STOP_BOUND, seconds
    print(f"stopped at step {step}, {seconds:.2f} s after the interrupt")


def test_a_timeout_on_the_nodes_stops_every_node_at_one_step(kernel: NotebookKernel) -> None:
    kernel.run_ok("model, opt, sched = make()")
    out = kernel.run(ON_NODES.format(flags="--timeout 6"))
    assert out.error is not None and out.error["ename"] == "RunTimeoutError", out.text
    found = re.search(r"exceeded timeout=6 s and was stopped at step (\d+) on every rank", out.text)
    assert found is not None, out.text
    _holds(kernel, int(found.group(1)))
    assert kernel.value("nbtrain.last_run().state") == "timed out"


def test_a_rank_on_node_1_that_never_reaches_the_step_makes_it_a_hard_stop_naming_it(kernel: NotebookKernel) -> None:
    kernel.run_ok("model, opt, sched = make()")
    msg_id = kernel.start_cell(ON_NODES.format(flags="").replace("    time.sleep(0.003)", SLEEPS_AT_40))
    kernel.wait_for_stream(msg_id, ["training 0", "training 1"], CELL_SECONDS)
    time.sleep(1.0)  # rank 1 (node 1) is asleep by now
    asked = time.monotonic()
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, 120.0)
    seconds = time.monotonic() - asked
    assert reply["ename"] == "RunInterrupted", out.text
    # Node 1's launcher gives up on rank 1; the relay stops node 0, whose own note is the consequence.
    assert "stopped hard (rank 1 did not reach" in out.text and "within 2.0 s)" in out.text, out.text
    assert "nothing in the kernel was changed" in out.text, out.text
    assert seconds < 2.0 + 1.0 + 6.0, seconds  # the grace, the stop, Ray's calls and a loaded machine's slack
    assert kernel.value("compare(0)")["weights"] == 0.0
    assert kernel.value("nbtrain.last_run().stopped") == "hard"
