"""Where a run goes and with what: the one plan of a cell's flags and of ``nbtrain.launch``'s keywords.

:func:`plan_run` takes a :class:`nbtrain.options.LaunchOptions` and returns the engine (a
cluster's warm agents, or None for this machine's launcher) and the run's
:class:`nbtrain.planning.config.LaunchConfig`; the magic and ``nbtrain.start`` both call it, so a
refusal reads the same from either. :func:`check_options` is the check ``set_defaults``
makes of the same options without connecting to anything. The hardware is probed through
NVML (never CUDA); Ray is imported only for a cluster run.

Example:
    >>> from nbtrain.options import LaunchOptions
    >>> engine, cfg = plan_run(LaunchOptions(devices=2, accelerator="cpu"))
    >>> engine is None, cfg.world_size, cfg.backend
    (True, 2, 'gloo')
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbtrain.cluster import engine
from nbtrain.options import LaunchOptions
from nbtrain.planning import config, probe

if TYPE_CHECKING:
    from nbtrain.cluster.engine import ClusterClient


def plan_run(options: LaunchOptions) -> tuple[ClusterClient | None, config.LaunchConfig]:
    """The engine (None: this machine's launcher) and the launch configuration of ``options``.

    Refused with a ConfigurationError (a ClusterError for a cluster that cannot be reached)
    naming the option, before any process starts.

    >>> plan_run(LaunchOptions(devices=2, accelerator="cpu", strategy="dp"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbtrain.errors.ConfigurationError: strategy 'dp' (DataParallel) splits each batch over CUDA GPUs ...
    """
    if not options.on_this_machine:

        return engine.plan_cluster_run(options)

    plan = probe.probe_plan(options.devices, options.accelerator, options.oversubscribe)
    return None, options.config_for(plan)


def check_options(options: LaunchOptions) -> None:
    """Raise ConfigurationError unless ``options`` can run on this machine (or ask for a cluster).

    What :func:`plan_run` would refuse, found without starting or connecting to anything: a
    cluster's nodes are checked when a run starts.

    >>> check_options(LaunchOptions(devices=2, accelerator="cpu", precision="16-mixed"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbtrain.errors.ConfigurationError: precision '16-mixed' cannot run on the cpu accelerator. ...
    """

    strategy = config.resolve_strategy(options.strategy, 2)
    if not options.on_this_machine:
        config.check_cluster_strategy(options.strategy)
        return
    plan = probe.probe_plan(options.devices, options.accelerator, options.oversubscribe)
    # What the devices can run: a precision, a backend, dp on CUDA only (as a run checks them).
    config.resolve_precision(options.precision, plan.accelerator)
    config.backend_for(plan.accelerator, options.backend)
    config.check_strategy_fits(strategy, plan, options.sync_batchnorm)

