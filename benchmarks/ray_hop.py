#!/usr/bin/env python
"""Ray's own hop for 256 MB between two nodes' object stores, under several of Ray's settings.

What bounds ``benchmarks/cluster.py``'s "weights back" figure from below: a Ray task on a
worker node returns 256 MB (a numpy array, which Ray moves without pickling) and the caller,
on the head node, copies it into its own memory, against one in-memory copy of the same
array. Each setting gets a fresh local cluster (the one ``cluster.py`` starts); nbtrain is not
involved. Run from the repository root::

    .venv/bin/python benchmarks/ray_hop.py            # about 1 minute per setting
    .venv/bin/python benchmarks/ray_hop.py --reps 9 --settings '{}' '{"object_manager_rpc_threads_num": 1}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# benchmarks/cluster.py's cluster and transfer size, benchmarks/launch.py's table
from launch import print_table, ratio, sig3

from cluster import TRANSFER_NUMEL, start_cluster

SETTINGS = (
    "{}",  # Ray's defaults (5 MiB chunks)
    '{"object_manager_default_chunk_size": 1048576}',
    '{"object_manager_default_chunk_size": 67108864}',
    '{"object_manager_rpc_threads_num": 1}',
)


def hop(reps: int) -> list[float]:
    """Seconds from a worker node's task returning 256 MB to the caller holding its own copy."""
    import numpy
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    worker = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)

    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(worker, soft=False))
    def produce(numel: int) -> tuple[float, object]:
        return time.time(), numpy.full(numel, 1.0, dtype=numpy.float32)

    times = []
    for _ in range(reps + 1):  # the first through fresh stores is left out
        t_return, array = ray.get(produce.remote(TRANSFER_NUMEL))
        mine = array.copy()
        times.append(time.time() - t_return)
        del array, mine
    return times[1:]


def copy_seconds(reps: int) -> float:
    import numpy

    source = numpy.full(TRANSFER_NUMEL, 1.0, dtype=numpy.float32)
    copies = []
    for _ in range(reps):
        t = time.perf_counter()
        source.copy()
        copies.append(time.perf_counter() - t)
    return statistics.median(copies)


def measure(setting: str, reps: int) -> list[str]:
    import ray

    cluster = start_cluster(json.loads(setting))
    try:
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        times = hop(reps)
        copy = copy_seconds(reps)
    finally:
        ray.shutdown()
        cluster.shutdown()
    floor = statistics.median(times)
    spread = f"{sig3(min(times))}-{sig3(max(times))}"
    return [setting, sig3(floor), spread, sig3(copy), ratio(floor, copy)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="transfers per setting (median)")
    parser.add_argument(
        "--settings", nargs="+", default=list(SETTINGS), help="Ray _system_config JSON, one cluster each"
    )
    args = parser.parse_args()
    rows = [measure(setting, args.reps) for setting in args.settings]
    print(f"Ray's hop for 256 MB, worker node -> head node's caller, {args.reps} transfers per setting\n")
    print_table(["Ray setting (_system_config)", "median (s)", "range (s)", "one copy (s)", "hop / copy"], rows)


if __name__ == "__main__":
    main()
