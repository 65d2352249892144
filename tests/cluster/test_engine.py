"""The cluster engine's planning (nbtrain.cluster.engine.plan_cluster_run), before any Ray cluster is reached.

What these tests ask is refused before a connection is made, or by a connection that fails
at once: they need Ray installed, not a cluster.
"""

from __future__ import annotations

import socket
import time

import pytest

from nbtrain.cluster import engine
from nbtrain.errors import ClusterError, ConfigurationError
from nbtrain.options import LaunchOptions


def test_dp_is_refused_before_connecting():
    with pytest.raises(ConfigurationError, match="cannot span a cluster's nodes"):
        engine.plan_cluster_run(LaunchOptions(cluster="ray://nowhere.invalid:10001", strategy="dp"))


def test_an_address_without_a_port_is_refused_naming_it():
    with pytest.raises(ConfigurationError, match="cluster='ray://headnode' is not a Ray address"):
        engine.plan_cluster_run(LaunchOptions(cluster="ray://headnode"))


def test_a_cluster_that_does_not_answer_fails_within_seconds_naming_its_address():
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(ClusterError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        engine.plan_cluster_run(LaunchOptions(cluster=f"127.0.0.1:{port}", num_nodes=2))
    assert time.monotonic() - began < engine.PROBE_SECONDS + 5


def test_ray_means_ray_address_else_this_machines_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert engine.resolve_address("ray") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert engine.resolve_address(" RAY ") == "10.0.0.1:6379"
