"""The cluster engine on a real 2-node Ray cluster (tests/cluster/conftest.py): results,
failures and leaks, through ``nbtrain.start(..., cluster="ray", num_nodes=2)``. What one node's
agent does (kept warm, results through the object store, killed mid-run) is in test_agent.py.

Every wait is bounded; faults are made for real (an exception, SIGKILL of a rank, killing
an agent actor, killing a node's raylet) and timed from the moment they happen.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import nbtrain
from helpers import procs
from nbtrain.cluster import engine
from nbtrain.errors import (
    ClusterError,
    ConfigurationError,
    NodeLostError,
    RankDiedError,
    RankError,
    RunStoppedError,
    RunTimeoutError,
)
from nbtrain.messages import events

ray = pytest.importorskip("ray")

RUN_SECONDS = 240.0  # a cold start places agents and imports torch on every node: slow on 2 cores
FAULT_SECONDS = 2.0  # a fault ends the run within this (the bound)
GONE_SECONDS = 10.0


def start(fn: Any, *args: Any, devices: int = 2, **options: Any) -> Any:
    return nbtrain.start(fn, args, devices=devices, cluster="ray", num_nodes=2, **options)


def node_processes(client: engine.ClusterClient) -> list[list[int]]:
    """Each node's nbtrain processes (agent, launcher, ranks), node 0 first."""
    import ray

    pids: list[list[int]] = ray.get([agent.processes.remote() for agent in client.agents], timeout=30)
    return pids


def rank_processes(seen: list[Any]) -> list[int]:
    return [e.pid for e in seen if isinstance(e, events.RankStarted)]


# -- functions the ranks run --------------------------------------------------------------
def _train_ddp(state: dict, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(x.shape[1], 1)
    model.load_state_dict(state)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = x.shape[0] // world
    mine = slice(rank * share, (rank + 1) * share)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        optimizer.step()
    print(f"trained on node {os.environ['GROUP_RANK']}")
    return model.state_dict()


def _train_alone(state: dict, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict:
    model = torch.nn.Linear(x.shape[1], 1)
    model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def _fault(kind: str, rank: int) -> None:
    """Every rank joins one collective; then ``rank`` faults and the others keep training."""
    import signal

    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    print("READY", flush=True)
    if dist.get_rank() == rank and kind != "hang":
        print(f"FAULT {time.time()!r}", flush=True)
        if kind == "raise":
            raise ValueError("a bad batch, on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # as a training loop: collectives, until stopped
        dist.all_reduce(t)
        time.sleep(0.01)


def _world() -> tuple[int, int, str, str]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"]


# -- results ------------------------------------------------------------------------------
@pytest.mark.parametrize("per_node", [1, 2])
def test_ddp_across_two_nodes_equals_one_process_with_the_full_batch(ray_cluster: Any, per_node: int) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(48, 8), torch.randn(48, 1)
    state = torch.nn.Linear(8, 1).state_dict()
    run = start(_train_ddp, state, x, y, 5, devices=per_node)
    result, error, seen = procs.collect(run, RUN_SECONDS)
    assert error is None, error
    expected = _train_alone(state, x, y, 5)
    for name, value in expected.items():
        assert (result[name] - value).abs().max().item() < 1e-5, name
    lines = [e for e in seen if isinstance(e, events.Output)]
    assert {e.rank for e in lines} == set(range(2 * per_node))
    assert {e.node.split(" (")[0] for e in lines} == {"node 0", "node 1"}
    assert all(f"trained on node {e.node[5]}" in e.text for e in lines)


def test_ranks_are_placed_as_torchrun_places_them(ray_cluster: Any) -> None:
    result = procs.finish(start(_world), RUN_SECONDS)
    assert result == (0, 4, "0", "2")
    client = engine._client
    assert client is not None and len({info.node_id for info in client.infos}) == 2


def _threads() -> list[tuple[int, str]]:
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]))
    return gathered


@pytest.mark.parametrize(("omp", "threads"), [(None, 1), ("3", 3)])
def test_ranks_run_their_bundles_cpus_as_threads_unless_the_kernel_sets_omp_num_threads(
    ray_cluster: Any, monkeypatch: pytest.MonkeyPatch, omp: str | None, threads: int
) -> None:
    # 2 ranks per node hold a bundle of 2 CPUs: one thread each. Ray sets OMP_NUM_THREADS=1
    # in its actors' environment; the kernel's own setting has to win over it.
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    result = procs.finish(start(_threads), RUN_SECONDS)
    assert result == [(threads, str(threads))] * 4


def _told() -> list[tuple[str, str, bool]]:
    import torch.distributed as dist

    from nbtrain.rank.machinery import settings

    told = settings.current()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (told.model_wrapper, told.precision, told.sync_batchnorm))
    return gathered


def test_the_runs_options_reach_the_ranks_of_every_node(ray_cluster: Any) -> None:
    run = start(_told, devices=1, strategy="fsdp", precision="bf16-mixed", sync_batchnorm=True)
    assert procs.finish(run, RUN_SECONDS) == [("fsdp", "bf16-mixed", True)] * 2


def _at_a_breakpoint() -> None:
    breakpoint()  # noqa: T100 - what a rank's breakpoint does is the test


@pytest.mark.parametrize("where", ["cluster", "this machine"])
def test_a_breakpoint_in_a_rank_is_passed_with_a_note_where_nothing_prompts(ray_cluster: Any, where: str) -> None:
    # Ray puts its own breakpoint hook in its workers' environment and, once connected, in
    # the kernel's; outside a Ray worker that hook raises. The ranks use nbtrain's relay
    # instead; a cluster's agents relay no prompt, and run.wait() answers none: the
    # breakpoint is passed and the rank's output says so.
    procs.finish(start(_world), RUN_SECONDS)  # the kernel is Ray's driver from its first cluster run
    assert os.environ.get("PYTHONBREAKPOINT", "").startswith("ray.")
    if where == "cluster":
        run = start(_at_a_breakpoint)
    else:
        run = nbtrain.start(_at_a_breakpoint, devices=2, accelerator="cpu")
    _, error, seen = procs.collect(run, RUN_SECONDS)
    assert error is None, error
    note = "cannot prompt" if where == "cluster" else "nothing here answers its prompt"
    assert any(note in e.text for e in seen if isinstance(e, events.Output)), seen


# -- failures -----------------------------------------------------------------------------
def _fault_time(seen: list[Any]) -> float:
    text = "".join(e.text for e in seen if isinstance(e, events.Output))
    return float(re.search(r"FAULT ([0-9.]+)", text).group(1))


def _assert_all_gone(pids: list[int]) -> None:
    assert pids, "no rank started"
    left = procs.wait_gone(pids, GONE_SECONDS, reaped=False)
    assert not left, f"ranks left behind: {left}"


def test_an_exception_on_node_1_names_its_rank_and_node_and_stops_every_rank(ray_cluster: Any) -> None:
    procs.finish(start(_world), RUN_SECONDS)
    _, error, seen = procs.collect(start(_fault, "raise", 3), 60.0)
    ended = time.time()
    assert isinstance(error, RankError), error
    assert error.rank == 3 and error.node.startswith("node 1 (")
    assert "rank 3 on node 1" in str(error) and "a bad batch, on purpose" in str(error)
    assert "_fault" in error.remote_traceback
    assert ended - _fault_time(seen) < FAULT_SECONDS
    _assert_all_gone(rank_processes(seen))
    assert procs.finish(start(_world), 60.0)[1] == 4  # the next run works


def test_a_rank_killed_on_node_1_is_the_cause(ray_cluster: Any) -> None:
    procs.finish(start(_world), RUN_SECONDS)
    _, error, seen = procs.collect(start(_fault, "kill", 2), 60.0)
    ended = time.time()
    assert isinstance(error, RankDiedError), error
    assert error.rank == 2 and "rank 2 on node 1" in str(error) and "signal 9 (SIGKILL)" in str(error)
    assert "when nbtrain stopped it" not in str(error)  # reaped after the stop began, still the cause
    assert ended - _fault_time(seen) < FAULT_SECONDS
    _assert_all_gone(rank_processes(seen))
    assert procs.finish(start(_world), 60.0)[1] == 4


def _running(seen: list[Any], run: Any, ranks: int = 4) -> Any:
    """Events until every rank printed READY (bounded); the run's event iterator."""
    iterator = run.events(poll=0.05)
    deadline = time.monotonic() + RUN_SECONDS
    ready = 0
    for event in iterator:
        if event is not None:
            seen.append(event)
            ready += isinstance(event, events.Output) and event.text.count("READY")
        if ready >= ranks:
            return iterator
        assert time.monotonic() < deadline, "the ranks did not all start"
        assert run.state == "running", f"the run ended early: {seen[-3:]}"
    raise AssertionError(f"the run ended before every rank was ready: {seen[-3:]}")


def _rest(iterator: Any, seen: list[Any], run: Any, seconds: float) -> BaseException | None:
    deadline = time.monotonic() + seconds
    for event in iterator:
        if event is not None:
            seen.append(event)
        if time.monotonic() > deadline:
            run.stop("the test gave up")
            raise AssertionError(f"the run did not end within {seconds} s")
    try:
        run.result()
    except Exception as error:  # noqa: BLE001 - the caller asserts on it
        return error
    return None


def test_stopping_a_run_stops_every_node(ray_cluster: Any) -> None:
    seen: list[Any] = []
    run = start(_fault, "hang", -1)
    _running(seen, run)
    asked = time.monotonic()
    run.stop("interrupted")
    assert time.monotonic() - asked < FAULT_SECONDS
    with pytest.raises(RunStoppedError):
        run.result()
    _assert_all_gone(rank_processes(seen))
    assert procs.finish(start(_world), 60.0)[1] == 4


def test_a_timeout_stops_every_node(ray_cluster: Any) -> None:
    procs.finish(start(_world), RUN_SECONDS)
    run = start(_fault, "hang", -1, timeout=10.0)
    began = time.monotonic()  # the nodes' launchers start counting a little later: a ceiling
    _, error, seen = procs.collect(run, 60.0)
    assert isinstance(error, RunTimeoutError), error
    assert time.monotonic() - began < 10.0 + FAULT_SECONDS
    _assert_all_gone(rank_processes(seen))
    assert procs.finish(start(_world), 60.0)[1] == 4


def test_a_node_whose_raylet_dies_is_lost_and_the_next_run_works(ray_cluster: Any) -> None:
    procs.finish(start(_world), RUN_SECONDS)
    client = engine._client
    node_one = node_processes(client)[1]
    seen: list[Any] = []
    run = start(_fault, "hang", -1)
    iterator = _running(seen, run)
    killed = time.monotonic()
    ray_cluster.kill_raylet(client.infos[1].node_id)
    error = _rest(iterator, seen, run, 60.0)
    took = time.monotonic() - killed
    assert isinstance(error, (NodeLostError, RankError)), error
    assert isinstance(error, NodeLostError), f"{error} (after {took:.1f} s)"
    assert "node 1 (" in str(error)
    assert took < ray_cluster.detection_seconds + FAULT_SECONDS, f"{took:.1f} s"
    _assert_all_gone(rank_processes(seen) + node_one)
    ray_cluster.replace_lost_nodes()
    assert procs.finish(start(_world), RUN_SECONDS)[1] == 4


# -- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("address", ["127.0.0.1:1", "10.255.255.1:6379"])
def test_an_unreachable_address_fails_within_10_s_naming_it(ray_cluster: Any, address: str) -> None:
    began = time.monotonic()
    with pytest.raises(ClusterError, match=re.escape(f"cannot reach the Ray cluster at {address}")):
        nbtrain.start(_world, cluster=address, num_nodes=2)
    assert time.monotonic() - began < 10.0


def test_more_nodes_than_the_cluster_has_fails_at_once_listing_them(ray_cluster: Any) -> None:
    began = time.monotonic()
    with pytest.raises(ConfigurationError) as caught:
        nbtrain.start(_world, devices=1, cluster="ray", num_nodes=3)
    text = str(caught.value)
    assert "num_nodes=3" in text and "only 2 of the cluster's nodes" in text and "3 nodes:" in text
    assert text.count("CPUs") >= 3 and time.monotonic() - began < 5.0


@pytest.mark.parametrize(
    ("devices", "accelerator", "expected"),
    [(3, "cpu", "needs 2 nodes with 3 CPUs each"), (1, "cuda", "accelerator")],
)
def test_more_devices_than_a_node_has_fails_at_once_listing_the_nodes(
    ray_cluster: Any, devices: int, accelerator: str, expected: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        nbtrain.start(_world, devices=devices, accelerator=accelerator, cluster="ray", num_nodes=2)
    assert expected in str(caught.value) and "The cluster at" in str(caught.value)
    assert "2 CPUs, 0 GPUs" in str(caught.value)


def test_num_nodes_without_a_cluster_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="num_nodes=2 needs a cluster"):
        nbtrain.start(_world, num_nodes=2)


def test_without_ray_the_error_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import nbtrain\n"
        "try:\n    nbtrain.start(print, cluster='ray', num_nodes=2)\n"
        "except nbtrain.NbtrainError as error:\n    print(error)\n"
    )
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, env=env
    )
    assert "pip install 'nbtrain[ray]'" in done.stdout, done.stdout + done.stderr


def test_the_local_engine_never_imports_ray() -> None:
    code = "import nbtrain, sys\nprint(nbtrain.launch(lambda: 7, devices=1), 'ray' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["7", "False"], done.stdout + done.stderr
