"""The session's defaults for ``%%distributed``: what a cell without flags runs on.

``nbtrain.set_defaults(devices=2, accelerator="cpu")`` (or the form of
``nbtrain.launcher()``, which calls it) changes them for every later cell of this kernel;
a flag written on a cell still wins over them. They are a
:class:`nbtrain.options.LaunchOptions`: what each setting takes, its check and its help
live there. Nothing here starts a process or imports torch; the values are checked when
they are set, so a typo fails at once instead of in the next cell.

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
from typing import Any

from nbtrain import options as options_module
from nbtrain.options import LaunchOptions

_lock = threading.Lock()
_current = LaunchOptions()


def get_defaults() -> LaunchOptions:
    """This kernel's current defaults (a frozen :class:`nbtrain.options.LaunchOptions`).

    >>> import nbtrain
    >>> nbtrain.get_defaults().strategy
    'ddp_notebook'
    """
    return _current


def set_defaults(**settings: Any) -> LaunchOptions:
    """Set the defaults of every later ``%%distributed`` cell that does not give the flag.

    Settings not passed keep their value. Each keyword is a field of
    :class:`nbtrain.options.LaunchOptions` (``nbtrain.options.described()`` lists them, and
    docs/magic.md's "Session defaults" table, generated from them, says what each takes).
    The combination is checked against this machine (its GPUs through NVML: CUDA is never
    initialised here) and a ConfigurationError says what is wrong; nothing changes then.
    Returns the new defaults.

    Example:
        >>> import nbtrain
        >>> previous = nbtrain.get_defaults()
        >>> nbtrain.set_defaults(devices=2, accelerator="cpu", timeout=600)  # doctest: +ELLIPSIS
        LaunchOptions(devices='2', accelerator='cpu', strategy='ddp_notebook', timeout=600.0, ..., on_stop='keep', ...)
        >>> _ = nbtrain.set_defaults(**previous.as_dict())
    """
    global _current
    unknown = sorted(set(settings) - {name for name, _ in options_module.described()})
    if unknown:
        known = ", ".join(name for name, _ in options_module.described())
        raise TypeError(f"set_defaults() got an unexpected keyword argument {unknown[0]!r}; it takes {known}.")
    # deferred: start-up time
    from nbtrain.kernel import launchplan

    with _lock:
        new = dataclasses.replace(_current, **settings)
        text = options_module.devices_text(new.devices)  # the session keeps them as --devices writes them
        # Checked with the devices as given, so a message names them as the user wrote them.
        launchplan.check_options(new)
        _current = dataclasses.replace(new, devices=text)
        return _current


def reset_defaults() -> LaunchOptions:
    """Back to the built-in defaults: ``--devices auto --accelerator auto --strategy ddp_notebook``.

    >>> import nbtrain
    >>> nbtrain.reset_defaults() == nbtrain.options.LaunchOptions()
    True
    """
    global _current
    with _lock:
        _current = LaunchOptions()
        return _current
