"""The cluster engine: the same runs on the nodes of a Ray cluster (``cluster="ray"``).

Kernel side: :mod:`nbtrain.cluster.engine` (connection, warm agents, one relay per run);
pure rules: :mod:`nbtrain.cluster.nodes`; on each node: :mod:`nbtrain.cluster.agent`.
Importing this package imports neither Ray nor torch.
"""
