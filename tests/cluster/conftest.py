"""A real Ray cluster on this machine for the cluster engine's tests, one per test session.

A head node with no CPUs (so no rank lands there, as on clusters whose head only
coordinates) and two worker nodes with 2 CPUs each, every one a separate raylet with its
own small object store. Node failures are made by killing a worker node's raylet; a
replacement node is added afterwards. Teardown ends every process of the cluster by PID.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the cluster tests need Ray: pip install 'nbtrain[ray]'")
from ray.cluster_utils import Cluster

from helpers import procs, raycluster

OBJECT_STORE_BYTES = 80 * 2**20
WORKER_CPUS = 2
GONE_SECONDS = 15.0
# Ray's node failure detection (health checks): fast, so that a lost node is noticed in
# about two seconds instead of Ray's default thirty.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}


class TestCluster:
    """The session's cluster: its worker nodes, and a way to lose and replace one."""

    # How long Ray takes to declare a node dead with SYSTEM_CONFIG's health checks (+1 s of slack for its gRPC).
    detection_seconds = (
        SYSTEM_CONFIG["health_check_period_ms"] * SYSTEM_CONFIG["health_check_failure_threshold"] / 1000 + 1.0
    )

    def __init__(self) -> None:
        # raylets pass it on: agents never prewarm a launcher of their own
        with raycluster.environment(NBTRAIN_PREWARM="0"):
            self.cluster = _retried(
                lambda: Cluster(
                    initialize_head=True,
                    head_node_args={
                        "num_cpus": 0,
                        "object_store_memory": OBJECT_STORE_BYTES,
                        "include_dashboard": False,
                        "_system_config": SYSTEM_CONFIG,
                    },
                )
            )
            self.workers = [self.add_worker() for _ in range(2)]
        self.address = self.cluster.address

    def add_worker(self) -> Any:
        node = _retried(lambda: self.cluster.add_node(num_cpus=WORKER_CPUS, object_store_memory=OBJECT_STORE_BYTES))
        self.cluster.wait_for_nodes()
        return node

    def node_of(self, node_id: str) -> Any:
        return next(node for node in self.cluster.list_all_nodes() if node.node_id == node_id)

    def kill_raylet(self, node_id: str) -> int:
        """SIGKILL a worker node's raylet (the node is lost); its pid."""
        node = self.node_of(node_id)
        pid = node.all_processes["raylet"][0].process.pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def replace_lost_nodes(self) -> None:
        """Remove the nodes whose raylet died and add fresh ones until two workers are alive."""
        for node in list(self.cluster.list_all_nodes()):
            if not node.head and node.all_processes["raylet"][0].process.poll() is not None:
                self.cluster.remove_node(node, allow_graceful=False)
        while len([n for n in self.cluster.list_all_nodes() if not n.head]) < 2:
            self.add_worker()

    def pids(self) -> list[int]:
        found = []
        for node in self.cluster.list_all_nodes():
            for infos in node.all_processes.values():
                found.extend(info.process.pid for info in infos)
        return found

    def shutdown(self) -> None:
        pids = self.pids()
        self.cluster.shutdown()
        left = procs.wait_gone(pids, GONE_SECONDS, reaped=False)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _retried(start: Any, attempts: int = 3) -> Any:
    """Ray gives a raylet a fixed 30 s to register; on a machine this loaded it may need two tries.

    A try that failed may have started processes (a GCS, a raylet) before giving up: they
    are this process's children that were not there before, and are killed by PID.
    """
    for attempt in range(attempts):
        before = {child.pid for child in psutil.Process().children()}
        try:
            return start()
        except Exception:
            started = [child.pid for child in psutil.Process().children() if child.pid not in before]
            procs.kill_pids(started)
            procs.wait_gone(started, GONE_SECONDS)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[TestCluster]:
    started = time.monotonic()
    cluster = TestCluster()
    print(f"ray cluster up in {time.monotonic() - started:.1f} s at {cluster.address}")
    with raycluster.connected_to(cluster):
        yield cluster
