"""The kernel's side of the cluster engine: the Ray connection, the warm agents, one relay per run.

``nbtrain.launch(fn, cluster="ray", num_nodes=2)`` (or ``%%distributed --cluster ray
--num-nodes 2``) comes here instead of to the local launcher. The kernel is Ray's driver:

1. :func:`plan_cluster_run` connects (``RAY_ADDRESS``, the cluster this machine belongs to, or a
   named address), checks the request against the alive nodes, and returns the warm
   :class:`ClusterClient` for it. The client holds a STRICT_SPREAD placement group, one
   bundle per node, and one :class:`nbtrain.cluster.agent.NodeAgent` actor in each; it
   stays warm across runs, as the local launcher does.
2. :meth:`ClusterClient.submit` makes the run's secret (:mod:`nbtrain.cluster.runsecret`),
   puts the payload into the object store once, its pickle signed, and starts the node
   holding global rank 0 first (the secret travels in that call, never in the object store):
   its launcher binds the process group's port on the node's own address and reports it;
   then every other node starts, given that port.
3. A relay thread per run keeps one long poll outstanding at each agent and files what
   comes back under the run exactly as the local client does, so :class:`nbtrain.Run`, the
   magic and the live view cannot tell the engines apart. The nodes' outcomes combine into
   one (:func:`nbtrain.cluster.nodes.combine`).

Ray is imported only here and only when a cluster run is asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import mmap
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias
from urllib.parse import urlparse

from nbtrain.cluster import crossnodestop, nodes, runsecret
from nbtrain.cluster.agent import NodeAgent, NodeInfo
from nbtrain.errors import ClusterError, ConfigurationError
from nbtrain.launch_server.lifecycle import HARD_STOP, Lifecycle, RunPhase
from nbtrain.messages import events
from nbtrain.messages.records import CopiedResult
from nbtrain.options import LaunchOptions
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan

CONNECT_SECONDS = 10.0  # an address that does not answer fails within this
PROBE_SECONDS = 5.0
PLACEMENT_SECONDS = 30.0  # the cluster has the resources, but they may be busy
AGENTS_READY_SECONDS = 240.0  # Ray workers start, and each launcher imports torch
BEGIN_SECONDS = 60.0
# An agent answers a poll as soon as it has records (after a short gathering window), else
# after this long: an idle run costs each node one Ray call a second, not four.
POLL_SECONDS = 1.0
NODE_FATE_SECONDS = 120.0  # after a stop: how long Ray may take to say a silent node is gone
# A run's records from its agents, each with file descriptors (none here), as the kernel
# side's Run reads them (see nbtrain.kernel.launcher_connection.Inbox).
_Inbox: TypeAlias = "queue.Queue[tuple[Any, list[int]]]"

_lock = threading.Lock()
_client: ClusterClient | None = None
_connected_to: str | None = None


def import_ray() -> Any:
    """Ray, or an error saying which extra installs it."""
    try:
        # deferred: an optional dependency (ray)
        import ray
    except ImportError:
        raise ClusterError(
            "cluster='ray' needs Ray, which is not installed in this kernel's environment. "
            f"Install the extra with `{nodes.EXTRA}` (on every node of the cluster too), then restart the kernel."
        ) from None
    return ray


def plan_cluster_run(options: LaunchOptions) -> tuple[ClusterClient, config.LaunchConfig]:
    """The warm client for a cluster run of ``options``, and the run's launch settings.

    Connects (once) and checks the request against the cluster's alive nodes; refused with
    a ConfigurationError or ClusterError naming what the cluster has.
    """
    config.check_cluster_strategy(options.strategy)
    ray = import_ray()
    address = connect(options.cluster)
    alive = _alive_nodes(ray)
    plan = nodes.plan_cluster(
        alive, num_nodes=options.num_nodes, devices=options.devices, accelerator=options.accelerator, address=address
    )
    cfg = options.config_for(DevicePlan(plan.accelerator, tuple(range(plan.world_size))))
    return warm_client(plan, address, alive), cfg


def connect(cluster: str) -> str:
    """Connect this kernel to the cluster (once); the address, for messages."""
    global _connected_to
    ray = import_ray()
    address = resolve_address(cluster)
    with _lock:
        if ray.is_initialized() and _connected_to == address:
            return address
        began = time.monotonic()
        _probe(address)  # before leaving a cluster we are connected to for one that is not there
        if ray.is_initialized():
            _close_client()
            ray.shutdown()
        try:
            with _bounded_gcs_wait(CONNECT_SECONDS - (time.monotonic() - began)):
                ray.init(
                    address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False,
                    namespace="nbtrain",
                )
        except Exception as error:  # noqa: BLE001 - Ray raises several kinds; the message says which
            raise ClusterError(
                f"cannot reach the Ray cluster at {address}: {error}. Check that the cluster is up and the "
                "address is right (RAY_ADDRESS, or --cluster ray://host:10001); `ray status` on its head node "
                "prints it. To start one: `ray start --head`."
            ) from None
        _connected_to = address
    return address


@contextlib.contextmanager
def _bounded_gcs_wait(seconds: float) -> Iterator[None]:
    """Ray retries a silent cluster for 20 s; ask it to give up within ``seconds``.

    ``RAY_gcs_server_port_wait_time_s`` is Ray's own setting for that budget (seconds, one
    try each); a value the user set wins. Restored afterwards: nothing leaks into the kernel.
    """
    name = "RAY_gcs_server_port_wait_time_s"
    saved = os.environ.get(name)
    if saved is None:
        # Each try takes about 1.4 s here (a request, then a 1 s pause).
        os.environ[name] = str(max(1, int((seconds - 2.0) / 1.5)))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)


def resolve_address(cluster: str) -> str:
    """``ray`` means RAY_ADDRESS, else the cluster this machine belongs to ("auto").

    >>> resolve_address("ray://10.0.0.1:10001"), resolve_address("10.0.0.1:6379")
    ('ray://10.0.0.1:10001', '10.0.0.1:6379')
    """
    text = str(cluster).strip()
    if text.lower() == "ray":
        return os.environ.get("RAY_ADDRESS") or "auto"
    return text


def _probe(address: str) -> None:
    """Fail within seconds, naming the address, where Ray itself would retry for a long time."""
    if address in ("auto", "local"):
        return  # Ray finds (or fails to find) this machine's cluster at once
    target = urlparse(address if "://" in address else f"tcp://{address}")
    if target.hostname is None or target.port is None:
        raise ConfigurationError(
            f"cluster={address!r} is not a Ray address; use 'ray', 'ray://host:10001' or 'host:6379'."
        )
    try:
        socket.create_connection((target.hostname, target.port), timeout=PROBE_SECONDS).close()
    except OSError as error:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address}: {error}. Check that the cluster is up and the address "
            "(host and port of its head node) is right; `ray status` on the head node prints it."
        ) from None


def _alive_nodes(ray: Any) -> list[nodes.NodeResources]:
    return [
        nodes.NodeResources(
            node["NodeID"], node.get("NodeManagerAddress", "?"), int(node.get("Resources", {}).get("CPU", 0)),
            int(node.get("Resources", {}).get("GPU", 0)),
        )
        for node in ray.nodes()
        if node.get("Alive")
    ]


def warm_client(plan: nodes.ClusterPlan, address: str, alive: list[nodes.NodeResources]) -> ClusterClient:
    """The warm agents for ``plan``; other warm agents are ended first (they hold the nodes)."""
    global _client
    with _lock:
        if _client is not None and (not _client.alive or _client.plan != plan):
            _close_client()
        if _client is None:
            _client = ClusterClient(plan, address, alive)
        return _client


def close() -> None:
    """End the warm agents (and every rank of theirs); the next cluster run starts new ones."""
    with _lock:
        _close_client()


def _close_client() -> None:
    global _client
    if _client is not None:
        _client.close()
    _client = None


class ClusterClient:
    """The warm agents of one plan; the cluster engine's side of :class:`nbtrain.Run`.

    It answers what a Run asks of an engine (``stop``, ``forget``, ``close``) as the local
    launcher's client does.
    """

    def __init__(self, plan: nodes.ClusterPlan, address: str, alive: list[nodes.NodeResources]):
        ray = import_ray()
        # deferred: an optional dependency (ray)
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.address = address
        self.alive = True
        self._run_ids = itertools.count(1)
        self._relays: dict[int, _Relay] = {}
        self._group = placement_group([plan.bundle()] * plan.num_nodes, strategy="STRICT_SPREAD")
        try:
            self._wait_for_placement(ray, alive)
            self.agents, self.infos = self._start_agents(ray)
        except BaseException:
            self.close()
            raise
        self.labels = [nodes.node_label(i, info.address) for i, info in enumerate(self.infos)]

    def _wait_for_placement(self, ray: Any, alive: list[nodes.NodeResources]) -> None:
        ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_SECONDS)
        if not ready:
            raise ClusterError(
                f"the cluster at {self.address} has {self.plan.num_nodes} nodes that could hold "
                f"{self.plan.bundle()} each, but they stayed busy for {PLACEMENT_SECONDS:g} s (other jobs or "
                f"actors hold them). It has: {nodes.describe_nodes(alive)}. Free them, or ask for fewer."
            )

    def _start_agents(self, ray: Any) -> tuple[list[Any], list[Any]]:
        # deferred: an optional dependency (ray)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(NodeAgent)
        resources = self.plan.bundle()
        agents = [
            remote.options(
                num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0), max_concurrency=16,
                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, index),
            ).remote(f"node {index}")
            for index in range(self.plan.num_nodes)
        ]
        try:
            fields = ray.get([agent.ready.remote() for agent in agents], timeout=AGENTS_READY_SECONDS)
        except Exception as error:  # noqa: BLE001 - a worker that cannot start, or a timeout
            raise ClusterError(f"the nbtrain agents did not start on the cluster at {self.address}: {error}") from None
        infos = [NodeInfo(*values) for values in fields]
        # Global rank 0 (and the result's copy) on the kernel's own node when it is in the run.
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(len(agents)), key=lambda i: infos[i].node_id != here)
        return [agents[i] for i in order], [infos[i] for i in order]

    # -- the engine seam (what Run and start() use) -------------------------------------
    def submit(self, start_run: Callable[[int], events.StartRun], tensor_fd: int | None) -> tuple[int, _Inbox]:
        """Start a run on every node (its relay thread follows it); its id and the inbox its records go to."""
        if not self.alive:
            raise ClusterError("the nbtrain agents of this cluster were ended; start the run again")
        run_id = next(self._run_ids)
        inbox: _Inbox = queue.Queue()
        template = start_run(run_id)
        secret = runsecret.new_secret()
        signed = runsecret.sign(secret, run_id, "payload", template.payload)
        relay = _Relay(self, template, secret, _put_payload(signed, tensor_fd), inbox)
        self._relays[run_id] = relay
        threading.Thread(target=relay.run, name=f"nbtrain-cluster-run-{run_id}", daemon=True).start()
        return run_id, inbox

    def stop(self, run_id: int, reason: str, graceful: bool = False) -> None:
        """Stop the run on every node; ``graceful``: every rank at one step chosen over the nodes (stepstop)."""
        relay = self._relays.get(run_id)
        if relay is not None and graceful:
            relay.stop_at_step(reason)
        elif relay is not None:
            relay.stop(reason, by_caller=True)

    def forget(self, run_id: int) -> None:
        """The run's handle is done with it: drop its relay."""
        self._relays.pop(run_id, None)

    def output_taken(self, run_id: int, chars: int) -> None:
        """The local client bounds output not yet shown; a cluster run's arrives one poll at a time."""

    def close(self) -> None:
        """Kill every agent (their launchers and ranks go with them) and free the nodes."""
        self.alive = False
        ray = import_ray()
        # deferred: an optional dependency (ray)
        from ray.util.placement_group import remove_placement_group

        for agent in getattr(self, "agents", []):
            with contextlib.suppress(Exception):  # already dead
                ray.kill(agent)
        with contextlib.suppress(Exception):  # already removed, or Ray is gone
            remove_placement_group(self._group)


def _put_payload(signed: bytes, tensor_fd: int | None) -> tuple[Any, Any]:
    """The payload in the object store, once for every node: its signed pickle (plain bytes, which Ray
    stores raw) and its tensors' bytes (a uint8 array), or None."""
    ray = import_ray()
    if tensor_fd is None:
        return ray.put(signed), None

    # deferred: an optional dependency (numpy)
    import numpy

    size = os.fstat(tensor_fd).st_size
    mapping = mmap.mmap(tensor_fd, max(size, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        array = numpy.frombuffer(mapping, dtype=numpy.uint8, count=size)
        ref = ray.put(array)
        del array
    finally:
        mapping.close()
    return ray.put(signed), ref


class _Relay:
    """One run across the nodes: start them, relay their records, combine their ends."""

    def __init__(
        self, client: ClusterClient, template: events.StartRun, secret: bytes, payload: tuple[Any, Any], inbox: _Inbox
    ):
        self.client = client
        self.template = template
        self.secret = secret  # the run's: signs what crosses between the kernel and the agents
        self.payload: tuple[Any, Any] | None = payload  # ObjectRefs: the signed pickle, the tensors' bytes
        self.inbox = inbox
        self.run_id = template.run_id
        count = client.plan.num_nodes
        self.ended: list[events.RunEnded | None] = [None] * count
        self.failure_order: dict[tuple[str, int], int] = {}
        self.deaths: list[events.RankExited] = []  # ranks that died unreported, as they were reaped
        self.done_nodes: set[int] = set()
        self.stopped_by_caller = False
        self.started: list[int] = []  # the nodes whose ranks were started
        self.step_stop: crossnodestop.CrossNodeStop | None = None  # a stop at a step, while the nodes report
        # The run's stop as the launchers' (RUNNING, STOPPING_AT_STEP, TERMINATING): moved under _lock, since
        # the kernel's thread stops too; its ending's note says why the relay itself stopped a stop at a step hard.
        self.life = Lifecycle(self.run_id, time.monotonic())
        self._lock = threading.Lock()

    def run(self) -> None:
        """The relay thread: start the nodes, follow them, and file the combined end under the run."""
        ray = import_ray()
        try:
            started = self._begin(ray)
            self._follow(ray, started)
        except Exception as error:  # noqa: BLE001 - whatever happens, the run must end
            self.stop("failed", by_caller=False)  # first: it stops the nodes not ended yet
            for index, ended in enumerate(self.ended):
                if ended is None:
                    self.ended[index] = events.RunEnded(self.run_id, events.FAILED, detail=f"{error}")
        finally:
            self.payload = None  # frees the object store's copy
        final = nodes.combine(self.run_id, [e for e in self.ended if e is not None], self.failure_order,
                              self.stopped_by_caller, self.deaths)
        if self.life.ending.note and final.stopped_at is None and final.state in (events.STOPPED, events.TIMED_OUT):
            final = dataclasses.replace(final, stop_note=self.life.ending.note)
        if any(isinstance(e.failure, events.NodeLost) for e in self.ended if e is not None):
            self.client.alive = False  # the next run places new agents
        self.inbox.put((final, []))

    # -- starting ------------------------------------------------------------------------
    def _begin(self, ray: Any) -> list[int]:
        """Start node 0 (it binds the store's port), then all the others with that port."""
        try:
            port = ray.get(self._begin_node(0, None), timeout=BEGIN_SECONDS)
        except ray.exceptions.RayActorError as error:
            self._lost(0, error)
            return []
        others = list(range(1, self.client.plan.num_nodes))
        if port is None:  # node 0 could not start its ranks; its poll says why
            for index in others:
                self.ended[index] = events.RunEnded(self.run_id, events.STOPPED)
            return [0]
        refs = {index: self._begin_node(index, port) for index in others}
        started = [0]
        for index, ref in refs.items():
            try:
                ray.get(ref, timeout=BEGIN_SECONDS)
                started.append(index)
            except ray.exceptions.RayActorError as error:
                self._lost(index, error)
        return started

    def _begin_node(self, index: int, port: int | None) -> Any:
        """Node ``index``'s begin call: the run's secret with it, its request signed, the payload's refs."""
        assert self.payload is not None
        request = runsecret.pickled(self.secret, self.run_id, "request", self._request(index, port))
        return self.client.agents[index].begin.remote(self.run_id, self.secret, request, *self.payload)

    def _request(self, index: int, port: int | None) -> events.StartRun:
        """Node ``index``'s part of the run: the kernel's StartRun with this node's ranks and place.

        Its payload goes beside it (the object store); the strategy's name and standby ranks are
        this machine's launcher's alone.
        """
        plan, template, info = self.client.plan, self.template, self.client.infos[index]
        place = events.NodePlace(
            node_rank=index, num_nodes=plan.num_nodes, local_world_size=plan.per_node,
            master_addr=self.client.infos[0].address, master_port=port, label=self.client.labels[index],
        )
        threads = nodes.threads_per_rank(info.cpus, plan.per_node, template.environ)  # this node's cores
        return dataclasses.replace(
            template, payload=b"", ranks=nodes.node_ranks(plan, index), node=place, strategy="", standby_seconds=None,
            has_tensor_file=False, environ=dict(template.environ), source_lines=dict(template.source_lines),
            rank_settings=dataclasses.replace(template.rank_settings, threads_per_rank=threads),
        )

    # -- following -----------------------------------------------------------------------
    def _follow(self, ray: Any, started: list[int]) -> None:
        agents = self.client.agents
        self.started = list(started)
        pending = {agents[i].poll.remote(self.run_id, POLL_SECONDS): i for i in started}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
            for ref in ready:
                index = pending.pop(ref)
                try:
                    signed, pieces = ray.get(ref)
                except ray.exceptions.RayError as error:
                    self._lost(index, error)
                    continue
                batch = runsecret.unpickled(self.secret, signed, self.run_id, "records", "the kernel")
                batch = [_with_refs(record, pieces) for record in batch]
                if not self._take(index, batch):
                    pending[agents[index].poll.remote(self.run_id, POLL_SECONDS)] = index
            self._choose_step()  # every node has reported, or the ones left have ended
            if self.life.state is RunPhase.TERMINATING and time.monotonic() - self.life.since > NODE_FATE_SECONDS:
                for index in pending.values():  # Ray never said: count them lost, end them
                    self._lost(index, TimeoutError(f"no answer {NODE_FATE_SECONDS:g} s after the run was stopped"))
                    ray.kill(agents[index])
                return

    def _take(self, index: int, batch: list[Any]) -> bool:
        """File one poll's records; True once this node's run has ended."""
        for record in batch:
            if isinstance(record, events.RunEnded):
                self.ended[index] = record
                if record.state != events.FINISHED and record.stopped_at is None:  # not ended at the stop step
                    self.stop("a node's run ended", by_caller=False)
                return True
            if isinstance(record, events.StepsBegun):
                self._steps_begun(index, record)
            elif isinstance(record, events.RanksDone):
                self._node_done(index)
            elif not isinstance(record, (events.StoreListening, events.StopStep)):  # the relay sends its own StopStep
                if isinstance(record, (events.RankFailed, events.RankExited)):
                    self.failure_order.setdefault((record.node, record.rank), len(self.failure_order))
                if isinstance(record, events.RankExited) and not record.reported:
                    # Its node may end as stopped, not failed: another node's error, a consequence
                    # of this death, can reach the kernel first and stop it before it reaps this.
                    self.deaths.append(record)
                if type(record).__name__ == "NodeResult":
                    record = _copied_result(record)
                self.inbox.put((record, []))
        return False

    def _node_done(self, index: int) -> None:
        """Release every node's ranks once all are done: rank 0 hosts the store until then."""
        self.done_nodes.add(index)
        if len(self.done_nodes) == self.client.plan.num_nodes and self.life.state is not RunPhase.TERMINATING:
            for agent in self.client.agents:
                agent.release.remote(self.run_id)

    # -- a stop at a step (nbtrain.cluster.crossnodestop) --------------------------------------
    def stop_at_step(self, reason: str) -> None:
        """Ask every node to stop at a step; asked again meanwhile, stop hard at once (as on one machine)."""
        with self._lock:
            self.stopped_by_caller = True
            if self.life.state is RunPhase.TERMINATING:
                return
            again = self.life.state is RunPhase.STOPPING_AT_STEP
            if not again:  # moved first: the relay's thread reads step_stop without the lock
                self.life.move(RunPhase.STOPPING_AT_STEP, time.monotonic())
                self.step_stop = crossnodestop.CrossNodeStop(time.monotonic())
        if again:
            self.stop(reason, by_caller=True)
        else:
            self._ask_nodes(reason, graceful=True)

    def _steps_begun(self, index: int, report: events.StepsBegun) -> None:
        """A node's highest step; the first report of a stop the relay did not ask for is a node's timeout."""
        with self._lock:
            if self.life.state is RunPhase.TERMINATING:
                return
            fresh = self.step_stop is None
            if self.step_stop is None:
                self.life.move(RunPhase.STOPPING_AT_STEP, time.monotonic())
                self.step_stop = crossnodestop.CrossNodeStop(time.monotonic())
            self.step_stop.take(index, report)
        if fresh:  # every other node stops at the same step
            self._ask_nodes(report.state, graceful=True, skip=index)

    def _choose_step(self) -> None:
        stop = self.step_stop
        if stop is None or self.life.state is not RunPhase.STOPPING_AT_STEP:
            return
        if stop.overdue(time.monotonic()):
            late = ", ".join(self.client.labels[i] for i in self._running() if i not in stop.reports)
            seconds = crossnodestop.CHOICE_SECONDS
            self.life.learn(note=f"{HARD_STOP} ({late} did not report its optimizer step within {seconds:g} s)")
            self.stop("no step was chosen in time", by_caller=False)
            return
        chosen = stop.choose(self._running())
        if chosen is None:
            return
        if chosen.step == 0:  # no rank on any node began an optimizer step: nothing to keep
            self.stop("no optimizer step to stop at", by_caller=False)
            return
        for index in stop.reports:
            if self.ended[index] is None:
                with contextlib.suppress(Exception):  # a dead agent: its node is lost, the run stops
                    self.client.agents[index].stop_at.remote(self.run_id, chosen.step, chosen.grace)
        self.inbox.put((events.StopStep(self.run_id, chosen.step, chosen.grace), []))

    def _running(self) -> set[int]:
        """The nodes whose ranks are still in the cell: neither done nor ended."""
        return {i for i in self.started if self.ended[i] is None and i not in self.done_nodes}

    def _ask_nodes(self, reason: str, *, graceful: bool, skip: int | None = None) -> None:
        for index, agent in enumerate(self.client.agents):
            if self.ended[index] is None and index != skip and (not graceful or index not in self.done_nodes):
                with contextlib.suppress(Exception):  # a dead agent: its ranks died with it
                    agent.stop.remote(self.run_id, reason, graceful)
                if not graceful and index in self.done_nodes:  # its ranks wait for the others: let them go
                    with contextlib.suppress(Exception):
                        agent.release.remote(self.run_id)

    def _lost(self, index: int, error: BaseException) -> None:
        label = self.client.labels[index]
        detail = f"its nbtrain agent died ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        self.ended[index] = events.RunEnded(
            self.run_id, events.FAILED, failure=events.NodeLost(self.run_id, label, detail)
        )
        self.stop("a node was lost", by_caller=False)

    def stop(self, reason: str, *, by_caller: bool) -> None:
        """Stop the run on every node still running it (each launcher stops its ranks)."""
        with self._lock:
            self.stopped_by_caller = self.stopped_by_caller or by_caller
            if self.life.state is RunPhase.TERMINATING:
                return
            self.life.move(RunPhase.TERMINATING, time.monotonic())
        self._ask_nodes(reason, graceful=False)


def _with_refs(record: Any, refs: tuple[Any, ...]) -> Any:
    """Rank 0's result with the ObjectRefs of its pieces that came beside the signed records."""
    if type(record).__name__ != "NodeResult":
        return record
    if len(refs) != len(record.pieces):
        raise ClusterError(
            f"run {record.run_id}'s result came with {len(refs)} pieces in the object store for a layout of "
            f"{len(record.pieces)}: it cannot be put together."
        )
    return dataclasses.replace(record, refs=tuple(refs))


def _copied_result(record: Any) -> Any:
    """Rank 0's result out of the object store into the kernel's own memory (one copy).

    Each piece is copied as soon as it has arrived, while Ray still moves the others.
    """
    # deferred: start-up time (cloudpickle, torch)
    from nbtrain.messages import sharedtensors

    ray = import_ray()
    mapping = sharedtensors.private_memory(record.total_bytes)
    places = dict(zip(record.refs, record.pieces, strict=True))
    pending = list(record.refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            piece = memoryview(ray.get(ref)).cast("B")
            start, length = places[ref]
            if len(piece) != length:  # the layout's lengths are signed; the pieces' bytes are Ray's
                raise ClusterError(f"a piece of run {record.run_id}'s result has {len(piece)} bytes, not {length}")
            mapping[start : start + length] = piece
            del piece  # a view pins its object in the store: the store frees each once the run is done
    return CopiedResult(record.data, mapping)
