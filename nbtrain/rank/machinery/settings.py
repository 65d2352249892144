"""The run's settings on this rank: every setting a rank reads, read here and only here.

The kernel builds one :class:`nbtrain.messages.events.RankSettings` per run (the strategy's model
wrapper, DataParallel's GPUs, the process group's backend, threads per rank, whether a failure
is held for a post-mortem, and every option marked ``Option(rank=True)`` in
:mod:`nbtrain.options`); ``StartRun`` carries it whole (each node of a cluster gets its own
copy), and the rank's runtime hands it here as the run's ``StartRun`` arrives (a standby rank
first its plan's, then its run's, not those of the run it was forked after). Every other rank
module asks :func:`current`, as accelerate's code asks its ``PartialState``: no setting travels
as an environment variable, and no rank reads it from ``StartRun``. Outside a run (the kernel,
a test, a script under torchrun) it holds the record's defaults, the options' built-in ones.

Example:
    >>> current().precision, current().sync_batchnorm
    ('32-true', False)
    >>> adopt(RankSettings("fsdp", precision="bf16-mixed"))
    >>> current().model_wrapper, current().precision, current().sync_batchnorm
    ('fsdp', 'bf16-mixed', False)
    >>> adopt(RankSettings())  # the built-in defaults again
"""

from __future__ import annotations

from nbtrain.messages.events import RankSettings

_current = RankSettings()


def adopt(told: RankSettings) -> None:
    """This rank's settings from now on: ``told``."""
    global _current
    _current = told


def current() -> RankSettings:
    """The settings of this rank's run (the built-in defaults outside one)."""
    return _current
