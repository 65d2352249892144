"""The cluster engine: the same runs on the nodes of a Ray cluster (``cluster="ray"``).

Kernel side: :mod:`nbtrain.cluster.engine` (connection, warm agents, one relay per run);
pure rules: :mod:`nbtrain.cluster.nodes`; on each node: :mod:`nbtrain.cluster.agent`.
Importing this package imports neither Ray nor torch.

::

    kernel = Ray driver ── actor calls (begin, poll, stop, release) ──► NodeAgent, one per node
     (engine: placement group,                                            └─ socketpair ─► launcher ─ fork ─► ranks
      one relay thread per run)  ◄── object store: the payload (once), rank 0's result in pieces
    ranks ◄── gloo / nccl on the nodes' addresses; store: rank 0's TCPStore on node 0 ──► ranks

One run, beyond what :mod:`~nbtrain.cluster.engine` and :mod:`~nbtrain.cluster.agent` say:

- Connecting is a TCP probe first, then ``ray.init`` with Ray's retry budget cut, so a silent
  address fails within 10 s; global rank 0 goes to the kernel's own node when it is in the run.
- Each rank gets torchrun's variables for its place (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``) and ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` naming the
  interface that holds its node's address. Its environment is the node's plus what only the
  kernel has, less what Ray sets in its own workers (its debugger hook, its one-thread
  ``OMP_NUM_THREADS``); the ranks' thread count comes with the run.
- A poll answers 50 ms after its first record (a burst is one Ray call), at once for what the
  run's end waits on, and after 1 s when nothing came: a quiet run costs a node one call a second.
- Done together: a node whose ranks are all done reports ``RanksDone`` and its ranks wait; when
  every node has, the relay sends ``ReleaseRanks`` to all (else rank 0 could exit while another
  node's ranks still use its store).
- Failure: the first node whose run ends without success makes the relay stop every other node.
  :func:`nbtrain.cluster.nodes.combine` orders the causes: a lost node (its agent's actor died),
  then a rank that died on its own, then the timeout or the caller's stop, then the first
  exception that reached the kernel; peers' broken connections are consequences. A launcher
  calls a death "stopped" only when the signal was nbtrain's own, and the relay keeps every
  unreported exit, so a killed rank is the cause even when another node's broken connection
  arrived first. A lost node makes the next run place new agents.
- Lifetimes: a launcher exits when its agent's socket closes or its parent changes, and its
  ranks die with it (PDEATHSIG), so killing an agent, a node's raylet or the kernel leaves
  nothing behind.

Threat model (for users: docs/cluster.md, "Who can reach a cluster run"). Everything nbtrain
sends between nodes travels over Ray (actor calls over Ray's gRPC; the payload and rank 0's
result through its object store): nbtrain has no channel of its own between nodes, and adds no
listener but the process group's. What nbtrain itself unpickles after it crossed is signed with
the run's secret (:mod:`~nbtrain.cluster.runsecret`; ``tests/cluster/test_runsecret.py``: forged
bytes start nothing and create no file). Not covered: Ray's own framing and ports (whoever
reaches them runs code on every node as the cluster's user; Ray's token authentication,
``RAY_AUTH_MODE=token``, closes them), and torch's sockets: node 0's TCPStore (bound on node 0's
own address for the run's life) and gloo's and NCCL's on each node's interface, which
authenticate nothing (store keys, ``broadcast_object_list``/``all_gather_object`` unpickle what
they get). Run clusters on a network only their users reach, with Ray's token authentication on.
"""
