"""The per-run secret that signs the pickles nbtrain sends between a cluster's nodes.

What nbtrain unpickles after it crossed from one node to another: the run's request and
payload (kernel -> each node's agent, whose ranks unpickle the payload) and every batch of
records an agent's poll returns (node -> kernel; rank 0's result among them). Each is sent
as ``tag + pickle`` bytes, the tag an HMAC-SHA256 of the run's id, what it is, and the
pickle, under a secret the kernel makes for the run (:func:`new_secret`). The secret reaches
each agent only as an argument of its ``begin`` call, never in the object store the payload
and the results travel through; the agent forgets it when the run ends. Bytes whose tag does
not match are refused before any unpickling, naming what and where.

What this does not cover is Ray's own framing (the calls, the ObjectRefs, the numpy pieces of
a result's tensors, an exception a call raises): Ray deserializes those itself, and whoever
can speak Ray's protocol to the cluster can run code on it anyway (docs/cluster.md, "Who can
reach a cluster run"). Standard library only.

>>> secret = new_secret()
>>> signed = pickled(secret, 7, "records", ["a record"])
>>> unpickled(secret, signed, 7, "records", "the kernel")
['a record']
>>> unpickled(new_secret(), signed, 7, "records", "the kernel")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
nbtrain.errors.ClusterError: nbtrain refused the records of run 7 that reached the kernel: ...
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
from typing import Any

from nbtrain.errors import ClusterError

SECRET_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size


def new_secret() -> bytes:
    """A fresh secret for one run (32 random bytes from the OS)."""
    return secrets.token_bytes(SECRET_BYTES)


def _tag(secret: bytes, run_id: int, what: str, data: bytes | memoryview) -> bytes:
    # The run and the kind are signed too: a run's payload cannot pass for its records, nor
    # one run's records for another's.
    mac = hmac.new(secret, f"nbtrain {run_id} {what}\n".encode(), hashlib.sha256)
    mac.update(data)
    return mac.digest()


def sign(secret: bytes, run_id: int, what: str, data: bytes) -> bytes:
    """``data`` with its tag in front (what :func:`opened` checks)."""
    return _tag(secret, run_id, what, data) + data


def opened(secret: bytes, signed: bytes, run_id: int, what: str, where: str) -> memoryview:
    """The data of ``signed`` once its tag matches; otherwise a ClusterError, and nothing is unpickled.

    >>> bytes(opened(b"k", sign(b"k", 1, "payload", b"data"), 1, "payload", "node 1"))
    b'data'
    >>> opened(b"k", b"too short", 1, "payload", "node 1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbtrain.errors.ClusterError: nbtrain refused the payload of run 1 that reached node 1: ...
    """
    view = memoryview(signed) if isinstance(signed, (bytes, bytearray, memoryview)) else memoryview(b"")
    data = view[TAG_BYTES:]
    if len(view) < TAG_BYTES or not hmac.compare_digest(bytes(view[:TAG_BYTES]), _tag(secret, run_id, what, data)):
        raise ClusterError(
            f"nbtrain refused the {what} of run {run_id} that reached {where}: it is not signed with the run's "
            "secret (made by the kernel for this run and given to its agents in their start call only), so it "
            "was not unpickled. Something other than this run's kernel and agents made it, or changed it on the "
            "way. Check who can reach the Ray cluster (docs/cluster.md, \"Who can reach a cluster run\")."
        )
    return data


def pickled(secret: bytes, run_id: int, what: str, obj: Any) -> bytes:
    """``obj`` pickled and signed for run ``run_id``."""
    return sign(secret, run_id, what, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def unpickled(secret: bytes, signed: bytes, run_id: int, what: str, where: str) -> Any:
    """What :func:`pickled` signed, unpickled only once its tag matches (``where``: who reads it, for the error)."""
    return pickle.loads(opened(secret, signed, run_id, what, where))
