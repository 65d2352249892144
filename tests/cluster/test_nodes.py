"""The cluster engine's pure rules (nbtrain.cluster.nodes): which nodes a run can use, where each
rank goes, and how the nodes' ends combine into one. No Ray and no cluster: real records only.
"""

from __future__ import annotations

import signal

import pytest

from nbtrain.cluster import nodes
from nbtrain.cluster.nodes import ClusterPlan, NodeResources
from nbtrain.errors import ConfigurationError
from nbtrain.messages import events

ADDRESS = "10.0.0.1:6379"
CPU_NODES = [NodeResources("a1b2c3d4e5", "10.0.0.1", cpus=4, gpus=0), NodeResources("f6a7b8c9d0", "10.0.0.2", 4, 0)]
GPU_NODES = [NodeResources("a1b2c3d4e5", "10.0.0.1", cpus=8, gpus=2), NodeResources("f6a7b8c9d0", "10.0.0.2", 8, 2)]


# -- planning ----------------------------------------------------------------------------
def test_auto_takes_the_gpus_only_when_enough_nodes_have_them() -> None:
    assert nodes.plan_cluster(GPU_NODES, num_nodes=2, devices=2, accelerator="auto", address=ADDRESS) == ClusterPlan(
        2, "cuda", 2
    )
    mixed = [GPU_NODES[0], CPU_NODES[1]]
    assert nodes.plan_cluster(mixed, num_nodes=2, devices=2, accelerator="auto", address=ADDRESS).accelerator == "cpu"
    assert nodes.plan_cluster(GPU_NODES, num_nodes=2, devices=1, accelerator="gpu", address=ADDRESS).accelerator == (
        "cuda"
    )


def test_a_plans_bundle_holds_its_nodes_ranks_gpus_or_cpus() -> None:
    gpu = nodes.plan_cluster(GPU_NODES, num_nodes=2, devices=2, accelerator="cuda", address=ADDRESS)
    cpu = nodes.plan_cluster(CPU_NODES, num_nodes=2, devices=3, accelerator="cpu", address=ADDRESS)
    assert (gpu.world_size, gpu.bundle()) == (4, {"GPU": 2})
    assert (cpu.world_size, cpu.bundle()) == (6, {"CPU": 3})


def test_an_accelerator_a_cluster_cannot_run_is_refused_naming_the_ones_it_can() -> None:
    with pytest.raises(ConfigurationError, match="accelerator='mps' is not available on a Ray cluster; use 'cpu', "):
        nodes.plan_cluster(CPU_NODES, num_nodes=2, devices=1, accelerator="mps", address=ADDRESS)


def test_more_nodes_than_fit_are_refused_listing_every_node_and_what_to_do() -> None:
    small = [*CPU_NODES, NodeResources("0123456789", "10.0.0.3", cpus=1, gpus=0)]
    with pytest.raises(ConfigurationError) as caught:
        nodes.plan_cluster(small, num_nodes=3, devices=2, accelerator="cpu", address=ADDRESS)
    assert str(caught.value) == (
        "num_nodes=3 with devices=2 needs 3 nodes with 2 CPUs each, but only 2 of the cluster's nodes have that. "
        f"The cluster at {ADDRESS} has: 3 nodes: 10.0.0.1 (id a1b2c3d4): 4 CPUs, 0 GPUs; "
        "10.0.0.2 (id f6a7b8c9): 4 CPUs, 0 GPUs; 10.0.0.3 (id 01234567): 1 CPUs, 0 GPUs. "
        "Ask for fewer nodes or devices, or add nodes to the cluster."
    )


def test_gpus_no_node_has_are_refused_with_the_clusters_nodes() -> None:
    with pytest.raises(ConfigurationError) as caught:
        nodes.plan_cluster(CPU_NODES, num_nodes=2, devices=1, accelerator="cuda", address=ADDRESS)
    text = str(caught.value)
    assert f"The cluster at {ADDRESS} has: 2 nodes: 10.0.0.1 (id a1b2c3d4): 4 CPUs, 0 GPUs" in text


def test_nodes_are_described_with_their_count_or_as_none() -> None:
    assert nodes.describe_nodes([]) == "no alive nodes"
    assert nodes.describe_nodes(CPU_NODES).startswith("2 nodes: 10.0.0.1 (id a1b2c3d4): 4 CPUs, 0 GPUs; 10.0.0.2")
    assert nodes.node_label(0, "10.0.0.1") == "node 0 (10.0.0.1)"


# -- placement ---------------------------------------------------------------------------
def test_ranks_are_placed_as_torchrun_places_them() -> None:
    # torchrun --nnodes 2 --nproc-per-node 3: node n holds global ranks 3n..3n+2, local ranks 0..2.
    plan = ClusterPlan(2, "cuda", 3)
    placed = [nodes.node_ranks(plan, node) for node in range(2)]
    assert [(s.rank, s.local_rank, s.device_index) for s in placed[1]] == [(3, 0, 0), (4, 1, 1), (5, 2, 2)]
    everyone = [spec for specs in placed for spec in specs]
    assert [s.rank for s in everyone] == list(range(6))
    assert {(s.world_size, s.device_type) for s in everyone} == {(6, "cuda")}
    assert {s.device_index for s in nodes.node_ranks(ClusterPlan(2, "cpu", 2), 0)} == {None}


def test_a_nodes_cpus_are_shared_by_its_ranks_unless_the_kernel_sets_omp_num_threads() -> None:
    assert nodes.threads_per_rank(8, 3, {}) == 2
    assert nodes.threads_per_rank(2, 4, {}) == 1  # never zero threads
    assert nodes.threads_per_rank(8, 0, {}) == 8
    assert nodes.threads_per_rank(8, 2, {"OMP_NUM_THREADS": "5"}) == 5


# -- combining the nodes' ends -----------------------------------------------------------
RAISED_0 = events.RankFailed(1, 0, "RuntimeError", "Connection closed by peer", "", node="node 0")
RAISED_3 = events.RankFailed(1, 3, "ValueError", "a bad batch", "", node="node 1")
KILLED_2 = events.RankExited(1, 2, None, signal.SIGKILL, reported=False, node="node 1")
LOST_1 = events.NodeLost(1, "node 1 (10.0.0.2)", "its agent died")
LATE = "stopped hard (rank 3 did not reach step 9 within 2.0 s)"
SECOND = "stopped hard at once (asked to stop a second time)"


def test_every_node_finishing_is_node_0s_end_with_its_result() -> None:
    ended = [events.RunEnded(1, events.FINISHED, result=b"rank 0"), events.RunEnded(1, events.FINISHED)]
    assert nodes.combine(1, ended, {}) is ended[0]


def test_the_first_exception_to_reach_the_kernel_wins_over_the_consequences() -> None:
    ended = [events.RunEnded(1, events.FAILED, failure=RAISED_0), events.RunEnded(1, events.FAILED, failure=RAISED_3)]
    first = {("node 1", 3): 0, ("node 0", 0): 1}
    assert nodes.combine(1, ended, first) == events.RunEnded(1, events.FAILED, failure=RAISED_3)


def test_a_lost_node_wins_over_a_killed_rank_and_a_killed_rank_over_exceptions() -> None:
    raised = events.RunEnded(1, events.FAILED, failure=RAISED_0)
    lost = events.RunEnded(1, events.FAILED, failure=LOST_1)
    assert nodes.combine(1, [raised, lost], {}, deaths=[KILLED_2]).failure == LOST_1
    assert nodes.combine(1, [raised, events.RunEnded(1, events.STOPPED)], {}, deaths=[KILLED_2]).failure == KILLED_2


def test_ranks_ended_by_the_stop_itself_are_not_the_cause() -> None:
    stopped = events.RankExited(1, 2, None, signal.SIGKILL, reported=False, stopped=True, node="node 1")
    terminated = events.RankExited(1, 3, None, signal.SIGTERM, reported=False, node="node 1")
    ended = [events.RunEnded(1, events.STOPPED), events.RunEnded(1, events.STOPPED)]
    combined = nodes.combine(1, ended, {}, stopped_by_caller=True, deaths=[stopped, terminated])
    assert (combined.state, combined.failure) == (events.STOPPED, None)


def test_a_timeout_or_the_callers_stop_wins_over_the_exceptions_it_caused() -> None:
    ended = [events.RunEnded(1, events.TIMED_OUT), events.RunEnded(1, events.FAILED, failure=RAISED_3)]
    assert nodes.combine(1, ended, {}) == events.RunEnded(1, events.TIMED_OUT)
    ended = [events.RunEnded(1, events.STOPPED), events.RunEnded(1, events.FAILED, failure=RAISED_3)]
    assert nodes.combine(1, ended, {}, stopped_by_caller=True) == events.RunEnded(1, events.STOPPED)
    assert nodes.combine(1, ended, {}).failure == RAISED_3  # not asked to stop: node 1 raised


def test_a_hard_stop_carries_the_note_of_the_node_with_the_late_rank() -> None:
    ended = [events.RunEnded(1, events.STOPPED, stop_note=SECOND), events.RunEnded(1, events.STOPPED, stop_note=LATE)]
    assert nodes.combine(1, ended, {}, stopped_by_caller=True) == events.RunEnded(1, events.STOPPED, stop_note=LATE)
    assert nodes.combine(1, ended, {}).stop_note == LATE


def test_a_stop_every_node_kept_is_node_0s_end_at_that_step() -> None:
    node_0 = events.RunEnded(1, events.STOPPED, result=b"rank 0 at step 9", stopped_at=9)
    node_1 = events.RunEnded(1, events.STOPPED, stopped_at=9)
    assert nodes.combine(1, [node_0, node_1], {}, stopped_by_caller=True) == node_0
    timed_out = nodes.combine(1, [node_0, events.RunEnded(1, events.TIMED_OUT, stopped_at=9)], {})
    assert (timed_out.state, timed_out.stopped_at, timed_out.result) == (events.TIMED_OUT, 9, b"rank 0 at step 9")


def test_a_node_that_finished_before_the_stop_keeps_the_run_finished() -> None:
    node_0 = events.RunEnded(1, events.FINISHED, result=b"rank 0")
    assert nodes.combine(1, [node_0, events.RunEnded(1, events.STOPPED, stopped_at=9)], {}) is node_0


def test_a_stop_one_node_could_not_keep_keeps_nothing() -> None:
    ended = [events.RunEnded(1, events.STOPPED, stopped_at=9), events.RunEnded(1, events.STOPPED, stop_note=LATE)]
    assert nodes.combine(1, ended, {}, stopped_by_caller=True) == events.RunEnded(1, events.STOPPED, stop_note=LATE)


def test_nodes_that_failed_without_a_cause_give_their_details_or_say_so() -> None:
    ended = [events.RunEnded(1, events.FAILED, detail="the launcher exited"), events.RunEnded(1, events.FAILED)]
    assert nodes.combine(1, ended, {}) == events.RunEnded(1, events.FAILED, detail="the launcher exited")
    silent = nodes.combine(1, [events.RunEnded(1, events.FAILED)], {})
    assert silent.detail == "a node ended the run without saying why"
