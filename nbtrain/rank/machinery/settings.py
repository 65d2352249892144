"""The run's settings on this rank: what its launch options ask of it, read here and only here.

The kernel builds one :class:`nbtrain.messages.events.RankSettings` from a run's launch options
(``LaunchOptions.config_for``: the strategy's model wrapper, DataParallel's GPUs, and every
option marked ``Option(rank=True)`` in :mod:`nbtrain.options`); ``StartRun`` carries it
whole (each node of a cluster gets its own copy), and the rank's runtime hands it here as the run's
``StartRun`` arrives, so a standby rank gets the run's settings, not those of the run it was
forked after. Every other rank module asks :func:`current`, as accelerate's code asks its
``PartialState``: no launch option travels as an environment variable. Outside a run (the
kernel, a test, a script under torchrun) it holds the options' built-in defaults.

Example:
    >>> current().precision, current().sync_batchnorm
    ('32-true', False)
    >>> adopt(RankSettings("fsdp", options={"precision": "bf16-mixed"}))
    >>> current().model_wrapper, current().precision, current().sync_batchnorm
    ('fsdp', 'bf16-mixed', False)
    >>> adopt(RankSettings())  # the built-in defaults again
"""

from __future__ import annotations

import dataclasses

from nbtrain.messages.events import RankSettings
from nbtrain.options import LaunchOptions

# Read once where this module is imported (the launcher preloads it): a forked rank has them.
_BUILT_IN = LaunchOptions().rank_options()
_current = RankSettings(options=_BUILT_IN)


def adopt(told: RankSettings) -> None:
    """This rank's settings from now on: ``told``, an option it lacks at its built-in default."""
    global _current
    _current = dataclasses.replace(told, options={**_BUILT_IN, **told.options})


def current() -> RankSettings:
    """The settings of this rank's run (the built-in defaults outside one)."""
    return _current
