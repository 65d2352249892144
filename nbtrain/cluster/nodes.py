"""The cluster engine's rules, pure: which nodes a run can use, where each rank goes, and
how the nodes' outcomes combine into one.

Nothing here imports Ray or torch or starts anything, so each rule is tested directly.

Example:
    >>> nodes = [NodeResources("a1", "10.0.0.1", cpus=4, gpus=0), NodeResources("b2", "10.0.0.2", cpus=4, gpus=0)]
    >>> plan = plan_cluster(nodes, num_nodes=2, devices=2, accelerator="auto", address="10.0.0.1:6379")
    >>> plan.accelerator, plan.per_node, plan.world_size, plan.bundle()
    ('cpu', 2, 4, {'CPU': 2})
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbtrain.cluster import crossnodestop
from nbtrain.errors import ConfigurationError
from nbtrain.messages import events
from nbtrain.planning import config
from nbtrain.planning import deviceplan as _devices

EXTRA = "pip install 'nbtrain[ray]'"


@dataclass(frozen=True)
class NodeResources:
    """One alive node of the cluster, as Ray reports it (total resources)."""

    node_id: str
    address: str
    cpus: int
    gpus: int

    def describe(self) -> str:
        """This node for messages: its address, the start of its id, its CPUs and GPUs."""
        return f"{self.address} (id {self.node_id[:8]}): {self.cpus} CPUs, {self.gpus} GPUs"


@dataclass(frozen=True)
class ClusterPlan:
    """How many nodes, which accelerator, and how many ranks on each node."""

    num_nodes: int
    accelerator: str  # "cpu" | "cuda"
    per_node: int

    @property
    def world_size(self) -> int:
        """Ranks in the whole run: ``per_node`` on each of ``num_nodes`` nodes."""
        return self.num_nodes * self.per_node

    def bundle(self) -> dict[str, float]:
        """One node's placement-group bundle: its ranks' GPUs, or one CPU per CPU rank."""
        return {"GPU": self.per_node} if self.accelerator == "cuda" else {"CPU": self.per_node}


def plan_cluster(
    nodes: Sequence[NodeResources], *, num_nodes: int, devices: Any, accelerator: str, address: str
) -> ClusterPlan:
    """Check the request against the cluster's nodes; raise listing what it has if it cannot fit."""
    if accelerator in (None, "auto"):
        accelerator = "cuda" if sum(1 for n in nodes if n.gpus > 0) >= num_nodes else "cpu"
    if accelerator == "gpu":
        accelerator = "cuda"
    if accelerator not in ("cpu", "cuda"):
        raise ConfigurationError(
            f"accelerator={accelerator!r} is not available on a Ray cluster; use 'cpu', 'cuda' or 'auto'."
        )
    per_node = _per_node(nodes, num_nodes, devices, accelerator, address)
    plan = ClusterPlan(num_nodes, accelerator, per_node)
    fitting = [n for n in nodes if (n.gpus if accelerator == "cuda" else n.cpus) >= per_node]
    if len(fitting) < num_nodes:
        kind = "GPUs" if accelerator == "cuda" else "CPUs"
        raise ConfigurationError(
            f"num_nodes={num_nodes} with devices={devices!r} needs {num_nodes} nodes with {per_node} {kind} each, "
            f"but only {len(fitting)} of the cluster's nodes have that. The cluster at {address} has: "
            + describe_nodes(nodes)
            + ". Ask for fewer nodes or devices, or add nodes to the cluster."
        )
    return plan


def _per_node(nodes: Sequence[NodeResources], num_nodes: int, devices: Any, accelerator: str, address: str) -> int:
    """Ranks per node, as ``devices`` means on one machine (checked against the largest node)."""
    biggest_gpus = max((n.gpus for n in nodes), default=0)
    biggest_cpus = max((n.cpus for n in nodes), default=0)
    gpus = [_devices.GpuInfo(i, "GPU", 0, 0) for i in range(biggest_gpus)]
    try:
        plan = _devices.plan_devices(devices, accelerator, gpus=gpus, mps_available=False, cpu_count=biggest_cpus)
    except ConfigurationError as error:
        raise ConfigurationError(f"{error} The cluster at {address} has: {describe_nodes(nodes)}.") from None
    return plan.world_size


def describe_nodes(nodes: Sequence[NodeResources]) -> str:
    """The cluster's alive nodes, for messages.

    >>> describe_nodes([NodeResources("abcdef123", "10.0.0.1", 4, 1)])
    '1 node: 10.0.0.1 (id abcdef12): 4 CPUs, 1 GPUs'
    """
    count = f"{len(nodes)} node" + ("" if len(nodes) == 1 else "s")
    return f"{count}: " + "; ".join(n.describe() for n in nodes) if nodes else "no alive nodes"


def node_ranks(plan: ClusterPlan, node_rank: int) -> tuple[events.RankSpec, ...]:
    """The ranks on node ``node_rank``: global ranks in node order, local ranks from 0.

    >>> [(s.rank, s.local_rank) for s in node_ranks(ClusterPlan(2, "cpu", 2), 1)]
    [(2, 0), (3, 1)]
    """
    return tuple(
        events.RankSpec(
            rank=node_rank * plan.per_node + local,
            local_rank=local,
            world_size=plan.world_size,
            device_type=plan.accelerator,
            device_index=local if plan.accelerator == "cuda" else None,
        )
        for local in range(plan.per_node)
    )


def node_label(node_rank: int, address: str) -> str:
    """How messages name a node of the run.

    >>> node_label(1, "10.0.0.7")
    'node 1 (10.0.0.7)'
    """
    return f"node {node_rank} ({address})"


def threads_per_rank(bundle_cpus: int, per_node: int, kernel_environ: Mapping[str, str]) -> int:
    """Intra-op threads per rank on a node: its bundle's CPUs shared by its ranks.

    OMP_NUM_THREADS in the kernel's environment wins, as on one machine: the count is sent
    explicitly because Ray sets its own (one thread) in the agent's environment, which the
    ranks inherit.

    >>> threads_per_rank(4, 2, {}), threads_per_rank(1, 2, {}), threads_per_rank(4, 2, {"OMP_NUM_THREADS": "3"})
    (2, 1, 3)
    """
    return config.user_thread_count(kernel_environ) or max(1, bundle_cpus // max(1, per_node))


def combine(
    run_id: int,
    ended: Sequence[events.RunEnded],
    failure_order: dict[tuple[str, int], int],
    stopped_by_caller: bool = False,
    deaths: Sequence[events.RankExited] = (),
) -> events.RunEnded:
    """One RunEnded for the run from each node's (node 0's first).

    The root cause wins over its consequences: a lost node; a rank that died on its own
    (a node's failure, or one of ``deaths``: the exits of ranks that had not reported,
    in the order they reached the kernel); the run's timeout or the caller's stop (the
    other nodes' ranks then see broken connections and raise); and only then the first
    exception raised (``failure_order``: when each rank's failure reached the kernel).

    >>> boom = events.RankFailed(1, 1, "RuntimeError", "Connection closed by peer", "", node="node 0")
    >>> killed = events.RankExited(1, 2, None, 9, reported=False, node="node 1")
    >>> ended = [events.RunEnded(1, events.FAILED, failure=boom), events.RunEnded(1, events.STOPPED)]
    >>> combine(1, ended, {("node 0", 1): 0, ("node 1", 2): 1}, deaths=[killed]).failure.rank
    2
    """
    if all(e.state == events.FINISHED for e in ended):
        return ended[0]
    kept = _kept(ended)
    if kept is not None:
        return kept
    failures = [e.failure for e in ended if e.failure is not None]
    lost = [f for f in failures if isinstance(f, events.NodeLost)]
    died = [
        f for f in (*failures, *deaths)
        if isinstance(f, events.RankExited) and not f.stopped and f.signal_number != signal.SIGTERM
    ]
    if lost or died:
        return events.RunEnded(run_id, events.FAILED, failure=(lost or died)[0])
    states = {e.state for e in ended}
    note = crossnodestop.stop_note(list(ended))  # a stop at a step that could not keep the state: why
    if events.TIMED_OUT in states:
        return events.RunEnded(run_id, events.TIMED_OUT, stop_note=note)
    if stopped_by_caller:
        return events.RunEnded(run_id, events.STOPPED, stop_note=note)
    raised = sorted(
        (f for f in failures if isinstance(f, events.RankFailed)),
        key=lambda f: failure_order.get((f.node, f.rank), len(failure_order)),
    )
    if raised or failures:
        return events.RunEnded(run_id, events.FAILED, failure=(raised or failures)[0])
    if events.STOPPED in states:
        return events.RunEnded(run_id, events.STOPPED, stop_note=note)
    details = "; ".join(e.detail for e in ended if e.detail)
    return events.RunEnded(run_id, events.FAILED, detail=details or "a node ended the run without saying why")


def _kept(ended: Sequence[events.RunEnded]) -> events.RunEnded | None:
    """A stop at a step that every node kept: node 0's end (it holds rank 0's state), or None.

    A node whose ranks had finished the cell before the stop ends FINISHED: the run then ran
    through, and node 0's end says so. One node's own timeout makes the whole run timed out.

    >>> at = [events.RunEnded(1, events.STOPPED, stopped_at=9), events.RunEnded(1, events.TIMED_OUT, stopped_at=9)]
    >>> _kept(at).state, _kept(at).stopped_at
    ('timed out', 9)
    >>> _kept([at[0], events.RunEnded(1, events.STOPPED)]) is None
    True
    """
    if any(e.failure is not None or (e.state != events.FINISHED and e.stopped_at is None) for e in ended):
        return None
    first = ended[0]
    if first.state == events.FINISHED or first.stopped_at is None:
        return first
    state = events.TIMED_OUT if any(e.state == events.TIMED_OUT for e in ended) else first.state
    return dataclasses.replace(first, state=state)
