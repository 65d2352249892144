"""``%%distributed --cluster ray --num-nodes 2`` from a real kernel (nbclient) on the test cluster.

One kernel for the module (each cold start places agents and imports torch on every
node): a cell trains on two nodes and its state comes back; trackers write one run on rank 0's
node and the summary says where; an interrupt stops every rank
on every node; killing the kernel (Ray's driver) ends its agents and their ranks.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from helpers import procs
from kernel_helpers import NotebookKernel
from nbtrain.cluster import engine

pytest.importorskip("ray")

CELL_SECONDS = 300.0  # the first cell places the agents: slow on a loaded 2-core machine
FAULT_SECONDS = 2.0
GONE_SECONDS = 10.0

SETUP = """
%load_ext nbtrain
import copy, logging, os, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(32, 4), torch.randn(32, 1)
# What one process makes of the same steps: every rank trains on the same batch here,
# so DDP's averaged gradient is this one.
alone, alone_opt = copy.deepcopy(model), None
alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
for _ in range(3):
    alone_opt.zero_grad(); torch.nn.functional.mse_loss(alone(x), y).backward(); alone_opt.step()
"""

TRAIN = """%%distributed --cluster ray --num-nodes 2 --devices 1
print("training on node", os.environ["GROUP_RANK"])
logging.getLogger("train").info("logged on node %s", os.environ["GROUP_RANK"])
from IPython.display import HTML, display
display(HTML(f"<b>shown on node {os.environ['GROUP_RANK']}</b>"))
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
trained = True
"""

HANG = """%%distributed --cluster ray --num-nodes 2 --devices 1
import time, torch.distributed as dist
print("READY", os.getpid(), flush=True)
t = torch.ones(1)
while True:
    dist.all_reduce(t)
    time.sleep(0.01)
"""


# Rank 1 (node 1) sleeps while rank 0 (node 0) waits in its 2nd all_reduce: node 0 names its waiting rank.
STALL = """%%distributed --cluster ray --num-nodes 2 --devices 1 --stall-warning 2
import time, torch.distributed as dist
dist.all_reduce(torch.ones(4))
if os.environ["GROUP_RANK"] == "1":
    time.sleep(600)
dist.all_reduce(torch.ones(4))
"""


@pytest.fixture(scope="module")
def kernel(ray_cluster: Any) -> Iterator[NotebookKernel]:
    engine.close()  # this process's agents hold the nodes; the kernel places its own
    with NotebookKernel(env={"RAY_ADDRESS": ray_cluster.address}) as started:
        started.run_ok(SETUP)
        yield started


def test_a_cell_trains_on_two_nodes_and_its_state_comes_back(kernel: NotebookKernel) -> None:
    msg_id = kernel.start_cell(TRAIN)
    _reply, out = kernel.wait_for_reply(msg_id, CELL_SECONDS)
    assert out.error is None, out.text
    assert re.search(r"\[rank 0, node 0 \([0-9.]+\)\] training on node 0", out.stdout), out.stdout
    assert re.search(r"\[rank 1, node 1 \([0-9.]+\)\] training on node 1", out.stdout), out.stdout
    assert re.search(r"\[rank 1, node 1 \([0-9.]+\)\] INFO logged on node 1", out.stderr), out.stderr  # as configured
    assert re.search(r"\[rank 1, node 1 \([0-9.]+\)\] HTML:", out.stdout), out.stdout  # a display, named by its rank
    assert kernel.value("trained") is True
    assert kernel.value("float((model.weight - alone.weight).abs().max())") < 1e-5
    assert kernel.value("float((model.bias - alone.bias).abs().max())") < 1e-5
    assert kernel.value("len(opt.state)") == 2  # its momentum buffers came back too


def _ready_ranks(kernel: NotebookKernel, msg_id: str) -> list[int]:
    text = kernel.wait_for_stream(msg_id, ["rank 0, node 0", "rank 1, node 1"], CELL_SECONDS)
    while text.count("READY") < 2:
        text = kernel.wait_for_stream(msg_id, ["READY"] * 2, CELL_SECONDS)
    return [int(pid) for pid in re.findall(r"READY (\d+)", text)]


def test_interrupting_the_kernel_stops_every_rank_on_every_node(kernel: NotebookKernel) -> None:
    msg_id = kernel.start_cell(HANG)
    ranks = _ready_ranks(kernel, msg_id)
    asked = time.monotonic()
    kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, 30.0)
    took = time.monotonic() - asked
    assert reply["status"] == "error" and out.error is not None
    assert out.error["ename"] in ("KeyboardInterrupt", "RunInterrupted"), out.error
    assert took < FAULT_SECONDS, f"{took:.2f} s"
    assert not procs.wait_gone(ranks, GONE_SECONDS, reaped=False)
    kernel.run_ok(TRAIN)  # the next run works


def test_a_stall_on_two_nodes_names_the_node_and_its_waiting_rank(kernel: NotebookKernel) -> None:
    msg_id = kernel.start_cell(STALL)
    try:
        seen = kernel.wait_for_stream(msg_id, ["has moved for"], timeout=60, displays=True)
    finally:
        kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, 30.0)
    assert reply["status"] == "error" and out.error is not None
    note = seen[seen.index("nbtrain: no rank on "):]
    waits = r"nbtrain: no rank on node 0 \([^)]*\) has moved for \d+ s\. Waiting for the others: rank 0 in all_reduce"
    assert re.search(waits + r" of 4 float32 elements \(its 2nd collective\), Cell In\[\d+\], line 6", note), note


def test_trackers_in_a_cell_write_one_run_on_rank_0s_node_and_the_summary_says_where(
    kernel: NotebookKernel, tmp_path: Any
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    pytest.importorskip("trackio")
    kernel.run_ok(f"TB_DIR, ROOT = {str(tmp_path / 'tb')!r}, {str(tmp_path)!r}")
    msg_id = kernel.start_cell(
        "%%distributed --cluster ray --num-nodes 2 --devices 1\n"
        "os.environ['TRACKIO_DIR'] = ROOT + '/trackio'\n"
        "import mlflow, trackio\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        "writer = SummaryWriter(TB_DIR)\n"
        "mlflow.set_tracking_uri(f'sqlite:///{ROOT}/mlflow.db')\n"
        "experiment = mlflow.create_experiment('cluster', artifact_location=ROOT + '/mlartifacts')\n"
        "with mlflow.start_run(experiment_id=experiment):\n"
        "    for step in range(3):\n"
        "        writer.add_scalar('rank_value', 10.0 * int(os.environ['RANK']) + step, step)\n"
        "        mlflow.log_metric('rank_value', 10.0 * int(os.environ['RANK']) + step, step=step)\n"
        "writer.close()\n"
        "trackio.init(project='cluster', name='where')\n"
        "trackio.log({'rank_value': 1.0})\n"
        "trackio.finish()\n"
    )
    _reply, out = kernel.wait_for_reply(msg_id, CELL_SECONDS)
    assert out.error is None, out.text
    assert len(list((tmp_path / "tb").glob("events.out.tfevents*"))) == 1  # rank 0's only, both nodes on this machine
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rank_value")] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    where = re.escape(f"host {socket.gethostname()!r}, in {str(tmp_path / 'tb')!r}")
    assert re.search(r"a SummaryWriter wrote on rank 0's node 0 \([0-9.]+\), " + where, out.text), out.text
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("cluster").experiment_id])  # one run, rank 0's
    history = client.get_metric_history(run.info.run_id, "rank_value")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0), (2, 2.0)]
    where = re.escape(f"host {socket.gethostname()!r}, in 'sqlite:///{tmp_path}/mlflow.db (artifacts ")
    assert re.search(rf"MLflow run '{run.info.run_id}' wrote on rank 0's node 0 \([0-9.]+\), " + where, out.text)
    where = re.escape(f"host {socket.gethostname()!r}, in {str(tmp_path / 'trackio')!r}")
    said = r"trackio run 'where' of project 'cluster' wrote on rank 0's node 0 \([0-9.]+\), "
    assert re.search(said + where, out.text), out.text


def test_killing_the_kernel_ends_its_agents_and_every_rank(kernel: NotebookKernel) -> None:
    msg_id = kernel.start_cell(HANG)
    ranks = _ready_ranks(kernel, msg_id)
    launchers = [p.ppid() for p in map(_process, ranks) if p is not None]
    agents = [p.ppid() for p in map(_process, launchers) if p is not None]
    assert len(agents) == 2, (ranks, launchers, agents)
    killed = time.monotonic()
    os.kill(kernel.pid, signal.SIGKILL)
    left = procs.wait_gone(ranks + launchers + agents, GONE_SECONDS, reaped=False)
    took = time.monotonic() - killed
    assert not left, f"left after {took:.1f} s: {left}"
    print(f"everything gone {took:.2f} s after the kernel was killed")


def _process(pid: int) -> Any:
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
