"""The nbtrain agent: one per node of a cluster run, a Ray actor kept warm across runs.

A Ray worker has threads of its own (gRPC, the core worker), so forking it would hand a
rank whatever lock one of them held. The agent therefore forks nothing: it starts the
same clean, single-threaded launcher the kernel uses on one machine
(:mod:`nbtrain.launch_server`) and relays between it and the kernel. The launcher forks
this node's ranks with the rank runtime every local run uses.

Lifetimes: the launcher exits when the agent's end of its socket closes or the agent
process dies (it watches its parent), and its ranks die with it (PDEATHSIG). Ray ends the
agent when the kernel (its driver) goes, when the kernel kills it, or with its node.

Data: the run's payload arrives from Ray's object store and goes to the launcher in a
memfd, as on one machine. Rank 0's result is read out of rank 0's memory here (this
process is its ancestor) and put into the object store in pieces of ``PIECE_BYTES``; the
kernel copies each piece from there as it arrives. Every other record goes back through
:meth:`poll`. The request, the payload's pickle and each poll's records cross as bytes
signed with the run's secret (:mod:`nbtrain.cluster.runsecret`), which arrives with
:meth:`begin` itself: nothing of nbtrain's is unpickled here, or in the kernel, unless the
other side made it.

This module runs only inside a Ray worker; the kernel imports it only to name the class.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import mmap
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from nbtrain.cluster import runsecret
from nbtrain.messages import events, wire
from nbtrain.system import processes

READY_SECONDS = 180.0  # the launcher imports torch: seconds on a loaded small machine
MAX_POLL_SECONDS = 1.0
GATHER_SECONDS = 0.05
# Rank 0's result crosses the object store in pieces of this size, so the kernel copies
# one piece while Ray still moves the next, and the agent needs one piece of memory.
PIECE_BYTES = 32 << 20
PARENT_CHECK_SECONDS = 0.2
# Set by Ray in its worker processes only (OMP_NUM_THREADS: one thread; the ranks' count is
# sent with the run instead).
RAY_WORKER_VARIABLES = frozenset(
    {"OMP_NUM_THREADS", "RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_LD_PRELOAD_ON_WORKERS", "SPT_NOENV"}
)


@dataclass(frozen=True)
class NodeInfo:
    """What the kernel learns about an agent's node when the agent is up."""

    node_id: str
    address: str  # the node's IP address as Ray reports it
    cpus: int  # CPUs of this agent's placement-group bundle


@dataclass(frozen=True)
class NodeResult:
    """Agent -> kernel, before RunEnded: rank 0's result; its tensors in the object store."""

    run_id: int
    data: bytes
    pieces: tuple[tuple[int, int], ...]  # (offset in the layout, length): signed with the records
    total_bytes: int
    # Ray ObjectRefs to each piece's uint8 array, in order: Ray's own values, so they travel beside
    # the signed records (a pickle of them outside Ray would pin the objects for good).
    refs: tuple[Any, ...] = ()


class NodeAgent:
    """One node's agent (wrapped by ``ray.remote`` in :mod:`nbtrain.cluster.engine`)."""

    def __init__(self, label: str) -> None:
        # deferred: an optional dependency (ray)
        import ray

        self.label = label
        self.launcher = processes.start_launcher()
        self._ready = threading.Event()
        self._lock = threading.Condition()
        self._inboxes: dict[int, collections.deque[Any]] = {}  # launcher records, per run
        self._secrets: dict[int, bytes] = {}  # each run's secret, from its begin until its end
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._alive = True
        context = ray.get_runtime_context()
        self._node_id = context.get_node_id()
        self._address = ray.util.get_node_ip_address()
        self._resources = context.get_assigned_resources()
        threading.Thread(
            target=_leave_with_parent, args=(os.getppid(),), name="nbtrain-agent-parent", daemon=True
        ).start()
        threading.Thread(target=self._read_launcher, name="nbtrain-agent-events", daemon=True).start()
        threading.Thread(target=self._read_stderr, name="nbtrain-agent-stderr", daemon=True).start()

    # -- called by the kernel ----------------------------------------------------------
    def ready(self) -> tuple[Any, ...]:
        """Wait until the launcher has imported torch; what this node is (NodeInfo's fields).

        Plain values, which Ray carries without pickling; the kernel rebuilds the NodeInfo.
        """
        if not self._ready.wait(READY_SECONDS):
            raise RuntimeError(f"the nbtrain launcher on {self.label} was not ready in {READY_SECONDS:g} s")
        if not self._alive:
            raise RuntimeError(f"the nbtrain launcher on {self.label} exited: {''.join(self._stderr)}")
        return dataclasses.astuple(NodeInfo(self._node_id, self._address, int(self._resources.get("CPU", 0))))

    def begin(self, run_id: int, secret: bytes, signed_request: bytes, signed_data: bytes, tensors: Any) -> int | None:
        """Start this node's ranks; on the node hosting the store, return its port.

        ``secret``: the run's (the kernel's, for this run only). The request and the payload's
        pickle must be signed with it, or nothing starts and nothing of them is unpickled.
        ``tensors``: the payload's tensor bytes (a uint8 array), or None.
        """
        request = runsecret.unpickled(secret, signed_request, run_id, "request", self.label)
        data = bytes(runsecret.opened(secret, signed_data, run_id, "payload", self.label))
        if not isinstance(request, events.StartRun) or request.run_id != run_id or request.node is None:
            raise RuntimeError(f"{self.label} was sent {type(request).__name__} as run {run_id}'s request")
        self.label = request.node.label
        tensor_fd = _memfd_holding(tensors) if tensors is not None else None
        with self._lock:
            self._inboxes[request.run_id] = collections.deque()
            self._secrets[request.run_id] = secret
        start = _start_run(request, data, tensor_fd is not None, self.label, interface_of(self._address))
        try:
            self._send(start, () if tensor_fd is None else (tensor_fd,))
        finally:
            if tensor_fd is not None:
                os.close(tensor_fd)
        if request.node.master_port is not None:
            return None
        return self._wait_for_port(request.run_id)

    def poll(self, run_id: int, timeout: float = 0.25) -> tuple[bytes, tuple[Any, ...]]:
        """The run's records since the last poll (waits up to ``timeout`` for the first), signed with
        the run's secret; and the ObjectRefs of rank 0's result pieces among them, in order."""
        with self._lock:
            if run_id not in self._secrets:
                raise RuntimeError(f"{self.label} knows no run {run_id} (it was never begun here, or has ended)")
            batch = self._batch(run_id, timeout)
            secret = self._secrets[run_id]  # read as the batch is taken, under the same lock
            if any(isinstance(m, events.RunEnded) for m in batch):
                del self._secrets[run_id]
        refs = tuple(ref for record in batch if isinstance(record, NodeResult) for ref in record.refs)
        batch = [dataclasses.replace(r, refs=()) if isinstance(r, NodeResult) else r for r in batch]
        return runsecret.pickled(secret, run_id, "records", batch), refs

    def _batch(self, run_id: int, timeout: float) -> list[Any]:
        """The records of run ``run_id`` since the last poll (called holding the lock)."""
        deadline = time.monotonic() + min(timeout, MAX_POLL_SECONDS)
        inbox = self._inboxes[run_id]
        while not inbox and self._alive and time.monotonic() < deadline:
            self._lock.wait(max(0.0, deadline - time.monotonic()))
        # Records come in bursts (every rank's memory sample, a log per step): one call
        # for the burst, not one per record. Events reach the kernel at most this late;
        # what the kernel waits on to finish the run goes at once.
        gather = min(deadline, time.monotonic() + GATHER_SECONDS)
        while inbox and self._alive and not _awaited(inbox) and time.monotonic() < gather:
            self._lock.wait(max(0.0, gather - time.monotonic()))
        batch = list(inbox)
        inbox.clear()
        if not self._alive and not any(isinstance(m, events.RunEnded) for m in batch):
            batch.append(events.RunEnded(run_id, events.FAILED, detail=self._launcher_gone()))
        if any(isinstance(m, events.RunEnded) for m in batch):
            del self._inboxes[run_id]
        return batch

    def release(self, run_id: int) -> None:
        """Every node's ranks are done: let this node's leave."""
        self._send(events.ReleaseRanks(run_id))

    def stop(self, run_id: int, reason: str = "stopped", graceful: bool = False) -> None:
        """Stop this node's ranks; ``graceful``: at a step, which the kernel chooses (see :meth:`stop_at`)."""
        self._send(events.StopRun(run_id, reason, graceful))

    def stop_at(self, run_id: int, step: int, grace: float) -> None:
        """The step the kernel chose over every node's highest: this node's ranks stop there."""
        self._send(events.StepChosen(run_id, step, grace))

    def processes(self) -> list[int]:
        """This node's nbtrain processes: the agent, its launcher and every rank (for checks)."""
        return [os.getpid(), self.launcher.pid, *processes.descendants(self.launcher.pid)]

    # -- the launcher's side -----------------------------------------------------------
    def _send(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            wire.send(self.launcher.channel, message, fds)
        except OSError as error:
            raise RuntimeError(f"the nbtrain launcher on {self.label} is gone: {error}") from error

    def _wait_for_port(self, run_id: int) -> int | None:
        deadline = time.monotonic() + 30.0
        with self._lock:
            while time.monotonic() < deadline:
                inbox = self._inboxes.get(run_id, ())
                for message in inbox:
                    if isinstance(message, events.StoreListening):
                        return message.port
                    if isinstance(message, events.RunEnded):
                        return None  # it could not start; the kernel reads why from poll
                if not self._alive:
                    return None
                self._lock.wait(0.1)
        raise RuntimeError(f"the nbtrain launcher on {self.label} did not start run {run_id} within 30 s")

    def _read_launcher(self) -> None:
        channel = self.launcher.channel
        while True:
            try:
                message, fds = wire.receive(channel)
            except (wire.ChannelClosed, OSError):
                break
            if isinstance(message, events.LauncherReady):
                self._ready.set()
                continue
            for record in self._relayed(message, fds):
                self._file(record)
        with self._lock:
            self._alive = False
            self._lock.notify_all()
        self._ready.set()

    def _relayed(self, message: Any, fds: list[int]) -> list[Any]:
        """What the kernel gets for one launcher record: tagged with this node's label."""
        if isinstance(message, events.ResultOffer):
            return self._take_result(message)
        if isinstance(message, events.RunEnded) and fds:  # rank 0's result came as a file
            try:
                pieces, refs, size = _put_file(fds[0])
                result = NodeResult(message.run_id, message.result or b"", pieces, size, refs)
            finally:
                for fd in fds:
                    os.close(fd)
            return [result, dataclasses.replace(message, has_tensor_file=False)]
        for fd in fds:
            os.close(fd)
        if hasattr(message, "node"):
            message = dataclasses.replace(message, node=self.label)
        failure = message.failure if isinstance(message, events.RunEnded) else None
        if isinstance(failure, (events.RankFailed, events.RankExited, events.NodeLost)):  # the ones naming a node
            message = dataclasses.replace(message, failure=dataclasses.replace(failure, node=self.label))
        return [message]

    def _take_result(self, offer: events.ResultOffer) -> list[Any]:
        """Copy rank 0's tensors out of its memory into the object store, then release it."""
        try:
            pieces, refs = _put_from_process(offer)
        except OSError:  # reading rank 0 is forbidden here: it sends a file instead
            self._send(events.ReleaseResult(offer.run_id, send_file=True))
            return []
        self._send(events.ReleaseResult(offer.run_id))
        return [NodeResult(offer.run_id, offer.result, pieces, offer.total_bytes, refs)]

    def _file(self, record: Any) -> None:
        with self._lock:
            inbox = self._inboxes.get(getattr(record, "run_id", -1))
            if inbox is not None:
                inbox.append(record)
                self._lock.notify_all()

    def _read_stderr(self) -> None:
        stream = self.launcher.popen.stderr
        if stream is None:
            return
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace")
            self._stderr.append(text)
            sys.stderr.write(text)  # into Ray's log for this worker

    def _launcher_gone(self) -> str:
        tail = "".join(self._stderr).strip()
        return f"the nbtrain launcher on {self.label} exited" + (f"; its last output:\n{tail}" if tail else "")


def _awaited(inbox: collections.deque[Any]) -> bool:
    """Whether the inbox holds what ends a run: rank 0's result, the node's ranks done, the end."""
    return any(isinstance(record, (NodeResult, events.RanksDone, events.RunEnded)) for record in inbox)


def _leave_with_parent(parent: int) -> None:
    """Exit as soon as the process that started this worker (the node's raylet) is gone.

    A Ray worker notices its raylet's death only slowly; meanwhile its launcher and ranks
    would live on, on a node the cluster has already given up. This process's exit closes
    the launcher's socket, and the launcher stops its ranks.
    """
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)


def _start_run(
    request: events.StartRun, data: bytes, has_tensor_file: bool, label: str, interface: str | None
) -> events.StartRun:
    """The launcher's request: the kernel's settings, adapted to this node."""
    # The kernel's interface names mean nothing here (a single-machine run sets loopback).
    kernel = {k: v for k, v in request.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    environ = node_environment(kernel, dict(os.environ))
    if interface is not None:
        # gloo and NCCL otherwise bind to whatever the host name resolves to, which is
        # often a loopback address the other nodes cannot reach.
        environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    assert request.node is not None  # checked as it arrived (NodeAgent.begin)
    return dataclasses.replace(
        request,
        payload=data,
        environ=environ,
        cwd=request.cwd if os.path.isdir(request.cwd) else os.getcwd(),
        sys_path=node_sys_path(request.sys_path, tuple(sys.path)),
        has_tensor_file=has_tensor_file,
        node=dataclasses.replace(request.node, label=label),
        interactive=False,  # a cluster's agents relay no pdb prompt: a breakpoint is passed with a note
        rank_settings=dataclasses.replace(request.rank_settings, debug_hold=None),  # no rank is held on a node
        log_path=None,
    )


def node_environment(kernel: dict[str, str], node: dict[str, str]) -> dict[str, str]:
    """The ranks' environment on a node: the node's own, plus what only the kernel has.

    The node's values win: its PATH, home and the CUDA_VISIBLE_DEVICES Ray gave this
    agent are right here; the kernel's may not even exist on this host. What Ray sets in
    its own workers (this agent is one) is not the node's: the ranks are not Ray workers.

    >>> node_environment({"A": "kernel", "B": "kernel"}, {"A": "node", "RAY_JOB_ID": "01000000"})
    {'A': 'node', 'B': 'kernel'}
    >>> node_environment({"PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}, {})
    {}
    """
    own = {key: value for key, value in node.items() if key not in RAY_WORKER_VARIABLES}
    return processes.inherited_environment({**kernel, **own})


def node_sys_path(kernel: tuple[str, ...], node: tuple[str, ...]) -> tuple[str, ...]:
    """The kernel's import path as far as it exists on this node, then the node's own."""
    kept = [entry for entry in kernel if entry == "" or os.path.exists(entry)]
    return tuple(kept + [entry for entry in node if entry not in kept])


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (for gloo and NCCL to bind to), if any."""

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def _memfd_holding(tensors: Any) -> int:
    """A memfd holding the payload's storages (what the launcher hands its ranks)."""
    view = memoryview(tensors).cast("B")
    fd = os.memfd_create("nbtrain-payload", os.MFD_CLOEXEC)
    try:
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def _put_from_process(offer: events.ResultOffer) -> tuple[tuple[tuple[int, int], ...], tuple[Any, ...]]:
    """Rank 0's layout into the object store piece by piece, through one reused buffer: (offset, length)
    of each piece, and its ObjectRef."""
    # deferred: an optional dependency (numpy)
    import numpy
    import ray

    from nbtrain.messages import sharedtensors

    buffer = numpy.zeros(min(PIECE_BYTES, offer.total_bytes), dtype=numpy.uint8)
    pieces, refs = [], []
    for start in range(0, offer.total_bytes, PIECE_BYTES):
        length = min(PIECE_BYTES, offer.total_bytes - start)
        sharedtensors.read_span_from_process(offer.pid, offer.regions, start, length, buffer.ctypes.data)
        pieces.append((start, length))
        refs.append(ray.put(buffer[:length]))  # put copies: the buffer is free again
    return tuple(pieces), tuple(refs)


def _put_file(fd: int) -> tuple[tuple[tuple[int, int], ...], tuple[Any, ...], int]:
    """A layout rank 0 wrote to a file, into the object store piece by piece: (offset, length) of
    each piece, their ObjectRefs, and its size."""
    # deferred: an optional dependency (numpy)
    import numpy
    import ray

    size = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    array = numpy.frombuffer(mapping, dtype=numpy.uint8, count=size)
    try:
        starts = range(0, size, PIECE_BYTES)
        pieces = tuple((start, min(PIECE_BYTES, size - start)) for start in starts)
        return pieces, tuple(ray.put(array[start : start + PIECE_BYTES]) for start in starts), size
    finally:
        del array  # the mapping can close only once no array refers to it
        mapping.close()
