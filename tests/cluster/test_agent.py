"""The node agent (nbtrain.cluster.agent): what it gives its node's ranks, and how one agent
behaves on the real 2-node Ray cluster of tests/cluster/conftest.py: kept warm and reused,
rank 0's result carried through the object store in pieces (or a file), killed mid-run.

The pure tests need no cluster: only the tests that take ``ray_cluster`` start one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cluster import (
    FAULT_SECONDS,
    RUN_SECONDS,
    _assert_all_gone,
    _fault,
    _rest,
    _running,
    _world,
    node_processes,
    rank_processes,
    start,
)

from helpers import procs
from nbtrain.cluster import agent, engine
from nbtrain.errors import NodeLostError

# The first test here to ask for the session's Ray cluster also pays for its start (about
# 150 s on 2 loaded cores), which pytest-timeout counts in that test's time.
pytestmark = pytest.mark.timeout(900)
ray = pytest.importorskip("ray")


# -- what the agent gives its ranks (pure) ------------------------------------------------
def test_the_ranks_get_the_nodes_environment_with_what_only_the_kernel_has() -> None:
    kernel = {"PATH": "/kernel/bin", "WANDB_PROJECT": "mine", "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}
    node = {"PATH": "/node/bin", "CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "1", "RAY_RAYLET_PID": "42"}
    assert agent.node_environment(kernel, node) == {
        "PATH": "/node/bin",
        "WANDB_PROJECT": "mine",
        "CUDA_VISIBLE_DEVICES": "1",
    }


def test_the_kernels_import_path_is_kept_where_it_exists_on_the_node(tmp_path: Path) -> None:
    here, gone = str(tmp_path), str(tmp_path / "only on the kernel's machine")
    node = (sys.prefix, here)
    assert agent.node_sys_path(("", gone, here), node) == ("", here, sys.prefix)


def test_the_interface_holding_an_address_is_found_or_none() -> None:
    assert agent.interface_of("127.0.0.1") == "lo"
    assert agent.interface_of("192.0.2.1") is None  # TEST-NET-1: no interface of this machine holds it


# -- one agent on a real cluster ----------------------------------------------------------
def _echo(tensor: torch.Tensor) -> tuple[tuple[int, int, str, str], torch.Tensor]:
    return _world(), tensor * 1


def test_warm_agents_are_reused_and_nothing_grows_over_20_runs(ray_cluster: Any) -> None:
    procs.finish(start(_world), RUN_SECONDS)  # warm
    client = engine._client
    weights = torch.ones(1 << 18)  # 1 MB each way: over Ray's inline limit, so it goes through the object stores
    seen = ray.put(weights)
    assert sum(_object_store_bytes()) >= weights.numel() * 4, "the object-store measure misses a 1 MB object"
    del seen
    before = _footprint(client)
    for _ in range(20):
        back = procs.finish(start(_echo, weights), 60.0)
        assert back[0][1] == 4 and torch.equal(back[1], weights)
    assert engine._client is client, "the warm agents were replaced"
    after = _footprint(client)
    assert after == before, f"grew over 20 runs: {before} -> {after}"


def _large(numel: int) -> dict[str, torch.Tensor]:
    return {"big": torch.arange(numel, dtype=torch.int32), "small": torch.arange(5.0), "odd": torch.ones(3).byte()}


def _assert_large(back: dict[str, torch.Tensor], numel: int) -> None:
    assert torch.equal(back["big"], torch.arange(numel, dtype=torch.int32))
    assert torch.equal(back["small"], torch.arange(5.0)) and torch.equal(back["odd"], torch.ones(3).byte())


def _forbid_reading_ranks(forbid: bool) -> Any:
    """Inside an agent: reading rank 0's memory fails (as in a sandbox), or works again."""

    def inside(_agent: Any) -> None:
        from nbtrain.messages import sharedtensors

        original = getattr(sharedtensors, "_allowed_read", sharedtensors.read_span_from_process)
        sharedtensors._allowed_read = original

        def refused(*args: Any) -> None:
            raise PermissionError("process_vm_readv: operation not permitted")

        sharedtensors.read_span_from_process = refused if forbid else original

    return inside


def test_a_result_of_several_pieces_comes_back_whole_and_leaves_no_object_behind(ray_cluster: Any) -> None:
    from nbtrain.cluster import agent

    procs.finish(start(_world), RUN_SECONDS)
    client = engine._client
    before = _footprint(client)
    numel = agent.PIECE_BYTES // 4 + 1_234_567  # two pieces; the second starts inside the storage
    _assert_large(procs.finish(start(_large, numel), 60.0), numel)
    assert _footprint(client) == before


def test_where_rank_0_cannot_be_read_its_result_comes_back_through_a_file(ray_cluster: Any) -> None:
    from nbtrain.cluster import agent

    procs.finish(start(_world), RUN_SECONDS)
    client = engine._client
    ray.get([a.__ray_call__.remote(_forbid_reading_ranks(True)) for a in client.agents], timeout=30)
    try:
        numel = agent.PIECE_BYTES // 4 + 1_234_567
        _assert_large(procs.finish(start(_large, numel), 60.0), numel)
    finally:
        ray.get([a.__ray_call__.remote(_forbid_reading_ranks(False)) for a in client.agents], timeout=30)


def _footprint(client: Any) -> tuple[Any, ...]:
    """Per node: nbtrain processes, object references, object-store bytes; actors alive; the kernel's references.

    The bytes are each raylet's own count of its object store's use (what `ray memory`
    reports); the references say why an object would still be there.
    """
    deadline = time.monotonic() + 10.0
    while True:
        counts = tuple(len(pids) for pids in node_processes(client))
        # A lambda travels by value: the agents cannot import this test module.
        count = lambda _agent: len(
            __import__("ray")._private.worker.global_worker.core_worker.get_all_reference_counts()
        )
        held = tuple(ray.get([a.__ray_call__.remote(count) for a in client.agents], timeout=30))
        actors = sum(1 for a in ray._private.state.actors().values() if a["State"] == "ALIVE")
        kernel = count(None)
        store = _object_store_bytes()
        if (counts, held, kernel, sum(store)) == ((2, 2), (0, 0), 0, 0) or time.monotonic() > deadline:
            return counts, held, store, actors, kernel
        time.sleep(0.1)


def _object_store_bytes() -> tuple[int, ...]:
    """Bytes in use in each live node's object store, as its raylet counts them."""
    from ray._private.internal_api import node_stats

    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
    replies = [node_stats(n["NodeManagerAddress"], n["NodeManagerPort"], include_memory_info=False) for n in nodes]
    return tuple(int(reply.store_stats.object_store_bytes_used) for reply in replies)


def test_an_agent_killed_mid_run_loses_its_node_and_the_next_run_works(ray_cluster: Any) -> None:
    procs.finish(start(_world), RUN_SECONDS)
    client = engine._client
    node_one = node_processes(client)[1]
    seen: list[Any] = []
    run = start(_fault, "hang", -1)
    iterator = _running(seen, run)
    killed = time.monotonic()
    ray.kill(client.agents[1])
    error = _rest(iterator, seen, run, 30.0)
    assert isinstance(error, NodeLostError), error
    assert time.monotonic() - killed < FAULT_SECONDS
    assert "node 1 (" in str(error) and "was lost during the run" in str(error)
    _assert_all_gone(rank_processes(seen) + node_one)
    assert procs.finish(start(_world), RUN_SECONDS)[1] == 4
    assert engine._client is not client
