"""Where a run's ranks meet: a store no other user of the machine can open.

A process group starts from a key-value store its ranks share (each rank writes where it
listens, and reads its peers'). torch's usual store is a TCP server (``TCPStore``): on a
machine shared by many users, any of them can connect to its port on loopback and write
keys. A single-machine run's store here is torch's ``FileStore`` on a memfd: a file with
no name in any directory, made by the launcher and inherited by each rank as a descriptor
(the rank opens it again as ``/proc/self/fd/N``, which only this user's processes may
follow). Nothing is left on disk to remove, and it is gone when the last of its ranks is.

A cluster's nodes share no file: there rank 0 hosts a ``TCPStore`` on the address the other
nodes reach (docs/architecture.md, "Sockets and who can reach them").

>>> fd = store_file()
>>> store = open_store(fd, 1)
>>> store.set("peer", b"here")
>>> store.get("peer")
b'here'
>>> os.close(fd)
"""

from __future__ import annotations

import datetime
import os
from typing import Any

STORE_TIMEOUT = datetime.timedelta(minutes=5)  # a rank waits this long for a peer's key


def store_file() -> int:
    """A new, empty, nameless file for one run's store (close-on-exec: a spawned rank is given it explicitly)."""
    return os.memfd_create("nbtrain-store", os.MFD_CLOEXEC)


def store_path(fd: int) -> str:
    """The path this process opens the store at: its own descriptor's, which only its user may follow."""
    return f"/proc/self/fd/{fd}"


def open_store(fd: int, world_size: int) -> Any:
    """torch's FileStore on the run's store file ``fd`` (inherited from the launcher)."""
    # deferred: start-up time (torch)
    import torch.distributed as dist

    store = dist.FileStore(store_path(fd), world_size)  # type: ignore[attr-defined]  # re-exported, not marked public
    store.set_timeout(STORE_TIMEOUT)
    return store
