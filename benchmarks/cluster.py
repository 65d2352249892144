#!/usr/bin/env python
"""nbtrain cluster benchmark: the cluster engine on a local 2-node Ray cluster, side by side
with the local engine and with Ray Train's ``TorchTrainer``.

Run from the repository root::

    .venv/bin/python -m pip install 'ray[train]'   # once; only this benchmark needs it
    .venv/bin/python benchmarks/cluster.py           # about 3 minutes on 2 quiet cores

It starts its own cluster (a head node without CPUs and two worker nodes with one CPU
each, separate raylets on this machine), so 2 ranks run as 2 nodes x 1 rank, against the
local engine's 2 ranks on this machine. Every figure comes from this one run:

1. launch to every rank's first step (the jobs of ``benchmarks/launch.py``: a DDP MLP
   784-256-10, one SGD step): *cold* is the first cluster run (placing the agents, their
   launchers importing torch); *warm* is the median of re-launches.
2. steady step: MLP 784-2048-2048-10, batch 64, one thread per rank on both engines
   (``OMP_NUM_THREADS=1``), median step over 30 steps after 5 warm-up, cluster and local
   engine alternated over rounds.
3. weights back: rank 0 returns 256 MB (one float32 tensor of 64 Mi elements); time from
   rank 0 returning to the caller holding it (after one untimed transfer: the first through
   fresh object stores costs seconds more), against one in-memory ``clone()`` of it and
   against Ray's own floor for that hop: a Ray task on rank 0's node returns the same
   256 MB (a numpy array, which Ray moves without pickling) and the caller copies it into
   its own memory, as nbtrain does. Rank 0's node is not the caller's, so both cross from
   one raylet's object store to another's, as on a real cluster (there over the network).
4. Ray Train's ``TorchTrainer`` (skipped when ``ray[train]`` is not installed): the same
   first-step job as its ``train_loop_per_worker``, 2 workers, one per node; launch to every
   worker's first step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# benchmarks/launch.py: one definition of each job
from launch import (
    FIRST_STEP_BATCH,
    FIRST_STEP_MODEL,
    STEADY_BATCH,
    STEADY_MODEL,
    first_step_figures,
    first_step_job,
    print_table,
    ratio,
    sig3,
    steady_job,
)

OBJECT_STORE_BYTES = 700 * 2**20  # 256 MB results pass through two nodes' stores
TRANSFER_NUMEL = 64 << 20  # 256 MB of float32
TARGET_WARM_S = 0.5
TARGET_VS_TRAINER = 10.0
TARGET_STEP_RATIO = 1.05
TARGET_TRANSFER_RATIO = 3.0
CLUSTER = {"cluster": "ray", "num_nodes": 2, "devices": 1, "accelerator": "cpu", "timeout": 300.0}


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def start_cluster(system_config: dict | None = None):
    """Head (0 CPUs) and two worker nodes (1 CPU each); ``system_config``: Ray's own settings."""
    from ray.cluster_utils import Cluster

    os.environ["NBTRAIN_PREWARM"] = "0"  # the nodes' agents start their launchers themselves
    head = {"num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    return cluster


def launch_figures(nbtrain, **options) -> dict:
    t_call = time.time()
    gathered = nbtrain.launch(first_step_job, FIRST_STEP_MODEL, FIRST_STEP_BATCH, **options)
    return first_step_figures(t_call, gathered, time.time())


def steady(nbtrain, **options) -> float:
    gathered = nbtrain.launch(steady_job, STEADY_MODEL, STEADY_BATCH, **options)
    return statistics.median(t for rank in gathered for t in rank["times"])


def transfer_job(numel: int) -> dict:
    import torch
    import torch.distributed as dist

    weights = torch.full((numel,), 1.0)
    dist.barrier()
    return {"t_return": time.time(), "weights": weights}


def weights_back(nbtrain, reps: int) -> tuple[float, float]:
    import torch

    # Untimed first: the first 256 MB through fresh object stores costs seconds more (their
    # memory is touched for the first time), and Ray's floor below runs on warm stores.
    del nbtrain.launch(transfer_job, TRANSFER_NUMEL, **CLUSTER)["weights"]
    times = []
    for _ in range(reps):
        result = nbtrain.launch(transfer_job, TRANSFER_NUMEL, **CLUSTER)
        times.append(time.time() - result["t_return"])
        del result
    source = torch.full((TRANSFER_NUMEL,), 1.0)
    copies = []
    for _ in range(reps):
        t = time.perf_counter()
        source.clone()
        copies.append(time.perf_counter() - t)
    return statistics.median(times), statistics.median(copies)


def ray_floor(reps: int) -> float:
    """Ray's own time for the same 256 MB from rank 0's node into the caller's memory (median)."""
    import numpy
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from nbtrain.cluster import engine

    node = engine._client.infos[0].node_id  # global rank 0's node

    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    def produce(numel: int) -> tuple[float, object]:
        array = numpy.full(numel, 1.0, dtype=numpy.float32)
        return time.time(), array

    times = []
    for _ in range(reps):
        t_return, array = ray.get(produce.remote(TRANSFER_NUMEL))
        mine = array.copy()  # out of the object store, into the caller's own memory
        times.append(time.time() - t_return)
        del array, mine
    return statistics.median(times)


def trainer_loop(config: dict) -> None:
    """TorchTrainer's worker: the same first-step job (its process group is Ray Train's)."""
    import json

    import ray.train

    records = first_step_job(*config["args"])
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(records, f)


def torch_trainer_first_step(reps: int) -> dict | None:
    try:
        import ray.cloudpickle
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        return None
    import json

    import launch

    ray.cloudpickle.register_pickle_by_value(launch)  # the workers cannot import benchmarks/
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            out = os.path.join(tmp, f"first-{rep}.json")
            trainer = TorchTrainer(
                trainer_loop,
                train_loop_config={"args": (FIRST_STEP_MODEL, FIRST_STEP_BATCH), "out": out},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1},
                                             placement_strategy="STRICT_SPREAD"),
                run_config=RunConfig(storage_path=tmp, name=f"first-{rep}"),
            )
            t_call = time.time()
            trainer.fit()
            t_end = time.time()
            with open(out) as f:
                figures.append(first_step_figures(t_call, json.load(f), t_end))
    return {key: statistics.median(f[key] for f in figures) for key in ("first_step", "ready", "total")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=7, help="warm re-launches (median)")
    parser.add_argument("--rounds", type=int, default=3, help="steady-step rounds per engine")
    parser.add_argument("--trainer-runs", type=int, default=2, help="TorchTrainer fits (median)")
    args = parser.parse_args()
    started = time.monotonic()
    progress("starting a local cluster: head (0 CPUs) + 2 worker nodes (1 CPU each)")
    cluster = start_cluster()
    import nbtrain
    from nbtrain.cluster import engine

    try:
        progress("cold cluster launch")
        cold = launch_figures(nbtrain, **CLUSTER)
        progress("warm cluster launches")
        warm = [launch_figures(nbtrain, **CLUSTER) for _ in range(args.warm)]
        progress("steady step: cluster and local engine, alternated")
        local = {"devices": 2, "accelerator": "cpu", "timeout": 300.0}
        nbtrain.launch(first_step_job, FIRST_STEP_MODEL, FIRST_STEP_BATCH, **local)  # warm the local launcher
        on_cluster, on_local = [], []
        # One thread per rank on both engines: a cluster rank's bundle holds one CPU, while
        # the local engine gives each rank cores / ranks (8 threads each on 16 cores).
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            for _ in range(args.rounds):
                on_cluster.append(steady(nbtrain, **CLUSTER))
                on_local.append(steady(nbtrain, **local))
        progress("256 MB of weights back")
        back, copy = weights_back(nbtrain, 3)
        floor = ray_floor(3)
        engine.close()  # the agents hold the nodes' CPUs; TorchTrainer needs them
        progress("Ray Train TorchTrainer, same first-step job")
        trainer = torch_trainer_first_step(args.trainer_runs)
    finally:
        engine.close()
        import ray

        ray.shutdown()
        cluster.shutdown()
    report(cold, warm, on_cluster, on_local, (back, copy, floor), trainer, time.monotonic() - started)


def report(cold, warm, on_cluster, on_local, transfer, trainer, took) -> None:
    back, copy, floor = transfer
    warm_first = statistics.median(w["first_step"] for w in warm)
    warm_total = statistics.median(w["total"] for w in warm)
    step_cluster, step_local = statistics.median(on_cluster), statistics.median(on_local)
    print(f"nbtrain cluster benchmark: 2 nodes x 1 CPU rank (local Ray cluster), gloo; {took:.0f} s in all\n")
    rows = [
        ["nbtrain cluster, cold", sig3(cold["first_step"]), sig3(cold["total"])],
        ["nbtrain cluster, warm (median)", sig3(warm_first), sig3(warm_total)],
    ]
    if trainer is not None:
        rows.append(["Ray Train TorchTrainer (median)", sig3(trainer["first_step"]), sig3(trainer["total"])])
    print_table(["launch to every rank's first step", "first step (s)", "call to return (s)"], rows)
    print()
    print_table(
        ["steady step, MLP 784-2048-2048-10, batch 64", "median step (ms)"],
        [["cluster engine, 2 nodes x 1 rank", sig3(step_cluster * 1e3)],
         ["local engine, 2 ranks", sig3(step_local * 1e3)]],
    )
    print()
    print_table(
        ["256 MB of weights", "seconds"],
        [
            ["rank 0 return -> caller holds it (median of 3)", sig3(back)],
            ["one in-memory clone()", sig3(copy)],
            ["Ray's floor: a task on rank 0's node -> caller's copy", sig3(floor)],
        ],
    )
    print(f"   nbtrain / Ray's floor: {ratio(back, floor)}")
    print("\ntargets:")
    checks = [
        (f"warm re-launch to first step < {TARGET_WARM_S} s", warm_first < TARGET_WARM_S, sig3(warm_first) + " s"),
        (
            f"first step >= {TARGET_VS_TRAINER:g}x faster than TorchTrainer (warm)",
            trainer is not None and trainer["first_step"] / warm_first >= TARGET_VS_TRAINER,
            "n/a (ray[train] not installed)" if trainer is None else ratio(trainer["first_step"], warm_first),
        ),
        (
            f"steady step within {round((TARGET_STEP_RATIO - 1) * 100)}% of local",
            step_cluster / step_local <= TARGET_STEP_RATIO,
            ratio(step_cluster, step_local),
        ),
        (
            f"weights back within {TARGET_TRANSFER_RATIO:g}x one copy",
            back / copy <= TARGET_TRANSFER_RATIO,
            ratio(back, copy),
        ),
    ]
    if trainer is not None:
        checks.insert(2, (
            "cold first step faster than TorchTrainer",
            cold["first_step"] < trainer["first_step"],
            ratio(trainer["first_step"], cold["first_step"]),
        ))
    for name, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {name}: {value}")


if __name__ == "__main__":
    main()
