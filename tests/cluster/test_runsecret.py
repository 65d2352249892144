"""The per-run secret (nbtrain.cluster.runsecret): what crosses between the kernel and a node's
agent is unpickled only when the run's secret signed it; and every listener of a cluster run's
own processes is on the node's cluster address.

The pure tests need no cluster. On the real 2-node cluster of tests/cluster/conftest.py, a
forged payload sent to an agent and forged records an agent returns are each refused with an
error naming them, and never unpickled: unpickled, each would create a marker file.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import test_cluster as cluster  # the cluster tests' own helpers: a run started, its processes, a fault

from helpers import listeners, procs
from nbtrain.cluster import engine, runsecret
from nbtrain.errors import ClusterError
from nbtrain.messages import events

pytestmark = pytest.mark.timeout(900)
ray = pytest.importorskip("ray")


class _Marker:
    """Unpickled, it creates the file at ``path``: what a forged pickle could do instead."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> Any:
        return (os.mknod, (self.path,))


# -- the signature (pure) -----------------------------------------------------------------
def _flipped(signed: bytes) -> bytes:
    """One bit of the tag changed."""
    return bytes([signed[0] ^ 1]) + signed[1:]


def test_the_forged_bytes_would_run_if_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Marker(str(marker))))
    assert marker.exists()  # so the refusals below are what keeps the markers away


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda data, secret: data, id="unsigned"),
        pytest.param(
            lambda data, secret: runsecret.sign(runsecret.new_secret(), 7, "records", data), id="other-secret"
        ),
        pytest.param(lambda data, secret: runsecret.sign(secret, 8, "records", data), id="other-run"),
        pytest.param(lambda data, secret: runsecret.sign(secret, 7, "payload", data), id="other-kind"),
        pytest.param(lambda data, secret: _flipped(runsecret.sign(secret, 7, "records", data)), id="changed"),
    ],
)
def test_bytes_not_signed_for_this_run_and_kind_are_refused_and_not_unpickled(tmp_path: Path, forge: Any) -> None:
    secret, marker = runsecret.new_secret(), tmp_path / "ran"
    forged = forge(pickle.dumps([_Marker(str(marker))]), secret)
    with pytest.raises(ClusterError, match=r"refused the records of run 7 that reached the kernel: .* not unpickled"):
        runsecret.unpickled(secret, forged, 7, "records", "the kernel")
    assert not marker.exists()


def test_what_the_run_signed_comes_back_whole() -> None:
    secret = runsecret.new_secret()
    record = events.RunEnded(7, events.FINISHED, result=b"\x00" * 1000)
    signed = runsecret.pickled(secret, 7, "records", [record])
    assert runsecret.unpickled(secret, signed, 7, "records", "the kernel") == [record]
    assert len(runsecret.new_secret()) == runsecret.SECRET_BYTES and runsecret.new_secret() != secret


# -- on the real cluster --------------------------------------------------------------------
def _request(run_id: int) -> events.StartRun:
    place = events.NodePlace(node_rank=1, num_nodes=2, local_world_size=2, master_addr="192.0.2.1", master_port=1)
    return events.StartRun(
        run_id=run_id, payload=b"", ranks=(), start_method="fork", environ={}, cwd="/",
        sys_path=(), source_lines={}, timeout=None, node=place,
    )


def test_a_payload_or_request_not_signed_with_the_runs_secret_starts_nothing_on_the_node(
    ray_cluster: Any, tmp_path: Path
) -> None:
    procs.finish(cluster.start(cluster._world), cluster.RUN_SECONDS)  # warm agents
    client = engine._client
    before = cluster.node_processes(client)
    node_one = client.agents[1]
    secret, marker = runsecret.new_secret(), tmp_path / "ran"
    evil = pickle.dumps(_Marker(str(marker)))
    signed_request = runsecret.pickled(secret, 99, "request", _request(99))
    attempts = {
        "payload": (secret, signed_request, ray.put(evil)),  # the object store's bytes replaced, unsigned
        "request": (secret, runsecret.sign(runsecret.new_secret(), 99, "request", evil), ray.put(evil)),
    }
    for what, (given, request, payload) in attempts.items():
        with pytest.raises(ray.exceptions.RayTaskError) as refused:
            ray.get(node_one.begin.remote(99, given, request, payload, None), timeout=60)
        assert f"nbtrain refused the {what} of run 99 that reached node 1" in str(refused.value)
        assert "not unpickled" in str(refused.value)
    assert not marker.exists()
    assert cluster.node_processes(client) == before, "a rank started from a refused begin"
    assert procs.finish(cluster.start(cluster._world), cluster.RUN_SECONDS)[1] == 4  # the agent still runs the next run


def _forge_records(run_id: int, marker: str) -> Any:
    """Inside node 1's agent: its run's secret swapped for another, and a record that would create ``marker``."""

    def inside(node_agent: Any) -> None:
        import os

        class Forged:
            def __reduce__(self) -> Any:
                return (os.mknod, (marker,))

        with node_agent._lock:
            node_agent._secrets[run_id] = b"a secret that is not the run's!!"
            node_agent._inboxes[run_id].append(Forged())
            node_agent._lock.notify_all()

    return inside


def test_records_not_signed_with_the_runs_secret_are_refused_by_the_kernel_and_stop_the_run(
    ray_cluster: Any, tmp_path: Path
) -> None:
    seen: list[Any] = []
    run = cluster.start(cluster._fault, "hang", -1)
    iterator = cluster._running(seen, run)
    client, marker = engine._client, tmp_path / "ran"
    ray.get(client.agents[1].__ray_call__.remote(_forge_records(run.run_id, str(marker))), timeout=30)
    error = cluster._rest(iterator, seen, run, 60.0)
    assert error is not None and f"nbtrain refused the records of run {run.run_id} that reached the kernel" in str(
        error
    ), error
    assert not marker.exists()
    cluster._assert_all_gone(cluster.rank_processes(seen))


def test_every_listener_of_a_runs_processes_is_on_its_nodes_cluster_address(ray_cluster: Any) -> None:
    seen: list[Any] = []
    run = cluster.start(cluster._fault, "hang", -1)
    iterator = cluster._running(seen, run)
    client = engine._client
    found = []
    for info, (_agent_pid, *pids) in zip(client.infos, cluster.node_processes(client), strict=True):
        # The agent is a Ray worker: its ports are Ray's. Its launcher and the ranks are nbtrain's.
        for pid in pids:
            found += [(info.address, listener) for listener in listeners.listeners_of(pid)]
    run.stop("the test has looked")
    cluster._rest(iterator, seen, run, 60.0)
    tcp = [(address, listener) for address, listener in found if listener.kind != "unix"]
    assert len(tcp) >= 3, f"expected rank 0's store and a gloo listener per rank, found {found}"
    elsewhere = [listener.label() for address, listener in tcp if listener.address != address]
    assert not elsewhere, f"listening beyond the node's cluster address: {elsewhere}"
    cluster._assert_all_gone(cluster.rank_processes(seen))
