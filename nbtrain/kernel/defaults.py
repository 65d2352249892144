"""The session's defaults for ``%%distributed``: what a cell without flags runs on.

``nbtrain.set_defaults(devices=2, accelerator="cpu")`` (or the form of
``nbtrain.launcher()``, which calls it) changes them for every later cell of this kernel;
a flag written on a cell still wins over them. Nothing here starts a process or imports
torch; the values are checked when they are set, so a typo fails at once instead of in
the next cell.

Example:
    >>> previous = get_defaults()
    >>> set_defaults(devices=2, accelerator="cpu").magic_line()
    '%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook'
    >>> get_defaults().devices
    '2'
    >>> _ = set_defaults(**previous.as_dict())
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from nbtrain import config
from nbtrain import devices as devices_module
from nbtrain.errors import ConfigurationError
from nbtrain.runstate import STALL_SECONDS

DEBUG_HOLD_SECONDS = 600.0  # how long a failed run's root-cause rank waits, idle, for %nbtrain_debug
STANDBY_IDLE_SECONDS = 600.0


@dataclass(frozen=True)
class Defaults:
    """The settings a ``%%distributed`` cell uses for each flag it does not give.

    ``devices`` is kept as the flag's text (``"auto"``, ``"2"``, ``"-1"``, ``"0,2"``),
    ``timeout`` in seconds (None: no limit).
    """

    devices: str = "auto"
    accelerator: str = "auto"
    strategy: str = "ddp_notebook"
    timeout: float | None = None
    stall_warning: float | None = STALL_SECONDS  # the live view's "no step from rank N" after this
    cluster: str = "local"  # or "ray", or a Ray cluster's address (nbtrain.cluster)
    num_nodes: int = 1
    precision: str = "32-true"  # Lightning's name (nbtrain.config.PRECISIONS)
    sync_batchnorm: bool = False
    backend: str | None = None  # None: gloo on CPU, nccl on CUDA
    debug_hold: float | None = DEBUG_HOLD_SECONDS  # a failed rank kept for %nbtrain_debug; None: not kept
    # Standby ranks (the next run's, waiting after a run) end after this many idle seconds; None: none kept.
    standby_idle: float | None = STANDBY_IDLE_SECONDS
    on_stop: str = "keep"  # what a stop or a timeout does to the state: "keep" (at a step) or "discard"
    stop_grace: float = 2.0  # seconds every rank gets to reach the stop step, at least (3 x the median step)

    def magic_line(self) -> str:
        """The ``%%distributed`` line that asks for exactly these settings, to copy into a cell."""
        parts = ["%%distributed", "--devices", self.devices, "--accelerator", self.accelerator]
        parts += ["--strategy", self.strategy]
        if self.timeout is not None:
            parts += ["--timeout", f"{self.timeout:g}"]
        if self.stall_warning != STALL_SECONDS:
            parts += ["--stall-warning", "none" if self.stall_warning is None else f"{self.stall_warning:g}"]
        if self.cluster != "local":
            parts += ["--cluster", self.cluster, "--num-nodes", str(self.num_nodes)]
        if self.precision != "32-true":
            parts += ["--precision", self.precision]
        if self.sync_batchnorm:
            parts.append("--sync-batchnorm")
        if self.backend is not None:
            parts += ["--backend", self.backend]
        if self.on_stop != "keep":
            parts += ["--on-stop", self.on_stop]
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_UNSET: Any = object()
_DEVICE_FORMS = "pass a number of devices, -1, 'auto' or GPU indices"
_lock = threading.Lock()
_current = Defaults()


def get_defaults() -> Defaults:
    """This kernel's current defaults."""
    return _current


def set_defaults(
    devices: Any = _UNSET,
    accelerator: Any = _UNSET,
    strategy: Any = _UNSET,
    timeout: Any = _UNSET,
    stall_warning: Any = _UNSET,
    cluster: Any = _UNSET,
    num_nodes: Any = _UNSET,
    precision: Any = _UNSET,
    sync_batchnorm: Any = _UNSET,
    backend: Any = _UNSET,
    debug_hold: Any = _UNSET,
    standby_idle: Any = _UNSET,
    on_stop: Any = _UNSET,
    stop_grace: Any = _UNSET,
) -> Defaults:
    """Set the defaults of every later ``%%distributed`` cell that does not give the flag.

    Settings not passed keep their value. ``devices`` takes what ``--devices`` takes
    (2, -1, "auto", "0,2" or a list of GPU indices), ``accelerator`` one of auto, cpu,
    cuda (gpu), mps, ``strategy`` one of :data:`nbtrain.config.STRATEGIES`, ``timeout`` a
    number of seconds or None, ``stall_warning`` the seconds without a step after which the
    live view names the rank (None: never; 30 built in), ``cluster`` "local", "ray" or a Ray
    address and ``num_nodes`` the nodes a cluster run spans (see README "On a cluster"),
    ``precision`` one of Lightning's names (``"bf16-mixed"``, ``"16"``, ...), ``sync_batchnorm``
    True or False, ``backend`` one of gloo, nccl, mpi, cpu:gloo,cuda:nccl or None (gloo on
    CPU, nccl on CUDA), ``debug_hold`` the seconds a failed run's root-cause rank is kept,
    idle, for ``%nbtrain_debug`` (None or "none": not kept; 600 built in), ``standby_idle``
    the seconds standby ranks wait for the next run before they end (None or 0: no standby
    ranks; 600 built in), ``on_stop`` "keep" (an interrupt, Stop or timeout brings back the state at
    the last optimizer step every rank reached) or "discard" (the kernel keeps what it had), and
    ``stop_grace`` the least seconds ranks get to reach that step (3 x the median step when longer).
    The combination is checked against this machine (its GPUs through NVML: CUDA is never
    initialised here) and a ConfigurationError says what is wrong; nothing changes then. Returns the new defaults.

    Example:
        >>> import nbtrain
        >>> previous = nbtrain.get_defaults()
        >>> nbtrain.set_defaults(devices=2, accelerator="cpu", timeout=600)  # doctest: +NORMALIZE_WHITESPACE
        Defaults(devices='2', accelerator='cpu', strategy='ddp_notebook', timeout=600.0,
                 stall_warning=30.0, cluster='local', num_nodes=1, precision='32-true',
                 sync_batchnorm=False, backend=None, debug_hold=600.0, standby_idle=600.0,
                 on_stop='keep', stop_grace=2.0)
        >>> _ = nbtrain.set_defaults(**previous.as_dict())
    """
    global _current
    with _lock:
        old = _current
        new = Defaults(
            devices=old.devices if devices is _UNSET else devices_text(devices),
            accelerator=old.accelerator if accelerator is _UNSET else devices_module.normalize_accelerator(accelerator),
            strategy=old.strategy if strategy is _UNSET else _strategy_text(strategy),
            timeout=old.timeout if timeout is _UNSET else config.validate_timeout(timeout),
            stall_warning=old.stall_warning if stall_warning is _UNSET else _stall_seconds(stall_warning),
            cluster=old.cluster if cluster is _UNSET else _cluster_text(cluster),
            num_nodes=old.num_nodes if num_nodes is _UNSET else num_nodes,
            precision=old.precision if precision is _UNSET else _precision_text(precision),
            sync_batchnorm=old.sync_batchnorm if sync_batchnorm is _UNSET else _flag(sync_batchnorm),
            backend=old.backend if backend is _UNSET else _backend_text(backend),
            debug_hold=old.debug_hold if debug_hold is _UNSET else _hold_seconds(debug_hold),
            standby_idle=old.standby_idle if standby_idle is _UNSET else _standby_idle(standby_idle),
            on_stop=old.on_stop if on_stop is _UNSET else on_stop_text(on_stop),
            stop_grace=old.stop_grace if stop_grace is _UNSET else _grace_seconds(stop_grace),
        )
        # Checked with the value as given, so a message names it as the user wrote it.
        check(new, devices=new.devices if devices is _UNSET else devices)
        _current = new
        return new


def reset_defaults() -> Defaults:
    """Back to the built-in defaults: ``--devices auto --accelerator auto --strategy ddp_notebook``."""
    global _current
    with _lock:
        _current = Defaults()
        return _current


def check(defaults: Defaults, devices: Any = None) -> None:
    """Raise ConfigurationError unless ``defaults`` can run on this machine (or ask for a cluster).

    A cluster's nodes are checked when a cell runs: setting a default connects to nothing.
    """
    from nbtrain import hardware
    from nbtrain.cluster import nodes

    nodes.validate_num_nodes(defaults.num_nodes, defaults.cluster)
    strategy = config.resolve_strategy(defaults.strategy, 2)
    if defaults.cluster != "local":
        config.check_cluster_strategy(defaults.strategy)
        return
    plan = hardware.probe_plan(defaults.devices if devices is None else devices, defaults.accelerator)
    # What the devices can run: a precision, a backend, dp on CUDA only (as a cell checks them).
    config.resolve_precision(defaults.precision, plan.accelerator)
    config.backend_for(plan.accelerator, defaults.backend)
    config.check_strategy_fits(strategy, plan, defaults.sync_batchnorm)


def _cluster_text(cluster: Any) -> str:
    text = "local" if cluster is None else str(cluster).strip()
    if not text or any(ch.isspace() for ch in text):
        raise ConfigurationError(
            f"cluster={cluster!r} is not valid: pass 'local', 'ray', or a Ray address such as 'ray://host:10001'."
        )
    return "local" if text.lower() == "local" else text


def devices_text(devices: Any) -> str:
    """``devices`` as ``--devices`` writes it: 2 -> "2", [1] -> "1,", [0, 2] -> "0,2".

    >>> devices_text(2), devices_text([1]), devices_text((0, 2)), devices_text(" auto ")
    ('2', '1,', '0,2', 'auto')
    """
    if devices is None:
        return "auto"
    if isinstance(devices, (bool, float)):
        raise ConfigurationError(f"devices={devices!r} is not valid: {_DEVICE_FORMS}.")
    if isinstance(devices, (list, tuple, range)):
        items = [str(int(item)) for item in devices]
        # As for --devices, a trailing comma makes a one-element list (GPU 1, not one GPU).
        return ",".join(items) + ("," if len(items) == 1 else "")
    text = str(devices).strip()
    if not text or any(ch.isspace() for ch in text):
        raise ConfigurationError(f"devices={devices!r} is not valid: {_DEVICE_FORMS}.")
    return text


def _stall_seconds(seconds: Any) -> float | None:
    if seconds is None:
        return None
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(seconds, bool) or not value > 0 or value == float("inf"):
        raise ConfigurationError(
            f"stall_warning={seconds!r} is not valid: give a positive number of seconds, or None for no warning."
        )
    return value


def _hold_seconds(seconds: Any) -> float | None:
    wanted = "a positive number of seconds a failed rank is kept for %nbtrain_debug, or None (or 'none') to keep none"
    return _optional_seconds("debug_hold", seconds, wanted)


def _standby_idle(seconds: Any) -> float | None:
    if seconds == 0 and not isinstance(seconds, bool):
        return None
    wanted = "the seconds standby ranks may wait (600 built in), or None for no standby ranks"
    return _optional_seconds("standby_idle", seconds, wanted)


def _optional_seconds(name: str, seconds: Any, wanted: str) -> float | None:
    """A positive number of seconds, or None for none (also written ``"none"``)."""
    if seconds is None or (isinstance(seconds, str) and seconds.strip().lower() == "none"):
        return None
    return _positive_seconds(name, seconds, wanted)


ON_STOP = ("keep", "discard")


def on_stop_text(value: Any) -> str:
    """``on_stop`` checked: "keep" or "discard".

    >>> on_stop_text(" Discard ")
    'discard'
    """
    text = str(value).strip().lower()
    if text not in ON_STOP:
        raise ConfigurationError(
            f"on_stop={value!r} is not valid: pass 'keep' (a stop brings back the state at the last optimizer "
            "step every rank reached) or 'discard' (a stop changes nothing in the kernel)."
        )
    return text


def _grace_seconds(seconds: Any) -> float:
    return _positive_seconds("stop_grace", seconds, "a positive number of seconds (2 built in)")


def _positive_seconds(name: str, seconds: Any, wanted: str) -> float:
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(seconds, bool) or not value > 0 or value == float("inf"):
        raise ConfigurationError(f"{name}={seconds!r} is not valid: give {wanted}.")
    return value


def _precision_text(precision: Any) -> str:
    return config.resolve_precision(precision, "cuda")  # every name; the machine is checked with the rest


def _backend_text(backend: Any) -> str | None:
    if backend is None or str(backend).strip().lower() in ("", "default", "none"):
        return None
    name = str(backend).strip().lower()
    config.backend_for("cuda", name)  # raises, listing the backends
    return name


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"sync_batchnorm={value!r} is not valid: pass True or False.")
    return value


def _strategy_text(strategy: Any) -> str:
    name = str(strategy).strip().lower()
    config.resolve_strategy(name, 2)  # raises, listing the strategies
    return name
