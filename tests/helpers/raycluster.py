"""What the tests that start a Ray cluster of their own share: leaving it cleanly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set these variables for the block; afterwards each is as it was (or unset again)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def connected_to(cluster: Any) -> Iterator[Any]:
    """``cluster`` (a ``ray.cluster_utils.Cluster``) as the one runs use for the block.

    Afterwards this process's warm agents and Ray connection end, then the cluster itself,
    so a next cluster starts afresh.
    """
    import ray

    from nbtrain.cluster import engine

    with environment(RAY_ADDRESS=cluster.address):
        try:
            yield cluster
        finally:
            engine.close()
            if ray.is_initialized():
                ray.shutdown()
            engine._connected_to = None
            cluster.shutdown()
