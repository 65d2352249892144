"""What the tests that start a Ray cluster of their own share: leaving it cleanly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


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


def disconnect() -> None:
    """End this process's warm agents and its Ray connection, so a next cluster starts afresh."""
    import ray

    from nbtrain.cluster import engine

    engine.close()
    if ray.is_initialized():
        ray.shutdown()
    engine._connected_to = None
