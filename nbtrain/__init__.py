"""nbtrain: distributed PyTorch training from a Jupyter notebook.

In a notebook::

    %load_ext nbtrain

    %%distributed --devices 2
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()

From Python, run a function on N ranks and get rank 0's return value back:

    >>> import nbtrain
    >>> nbtrain.launch(lambda: nbtrain.world_size(), devices=2, accelerator="cpu")
    2

Importing nbtrain starts nothing and does not import torch. ``%load_ext nbtrain`` starts
the warm launcher process in the background, so it has imported torch by the first cell
(set NBTRAIN_PREWARM=0 to start it on first use instead); from Python,
``nbtrain.prewarm()`` does the same. The last ``%%distributed`` run is ``nbtrain.last_run()``;
``nbtrain.watch(run)`` shows a run started with ``nbtrain.start`` live in the cell.
"""

from __future__ import annotations

import os as _os
import sys as _sys
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from nbtrain.errors import (
    ConfigurationError,
    LauncherError,
    NbtrainError,
    RankDiedError,
    RankError,
    RankStartError,
    RunFailedError,
    RunNotEndedError,
    RunStoppedError,
    RunTimeoutError,
    SerializationError,
)
from nbtrain.kernel.client import launch, start
from nbtrain.kernel.defaults import get_defaults, reset_defaults, set_defaults
from nbtrain.kernel.run_handle import Run
from nbtrain.planning.probe import find_usable_cuda_devices
from nbtrain.rank.api import all_reduce, device, is_rank_zero, local_rank, log, rank, world_size
from nbtrain.rank.auto.prepare import prepare

if _TYPE_CHECKING:
    from nbtrain.kernel.background import BackgroundRun
    from nbtrain.kernel.standbyview import StandbyRanks

__all__ = [
    "ConfigurationError",
    "LauncherError",
    "NbtrainError",
    "RankDiedError",
    "RankError",
    "RankStartError",
    "Run",
    "RunFailedError",
    "RunNotEndedError",
    "RunStoppedError",
    "RunTimeoutError",
    "SerializationError",
    "all_reduce",
    "debug",
    "device",
    "find_usable_cuda_devices",
    "get_defaults",
    "is_rank_zero",
    "last_run",
    "launch",
    "launcher",
    "local_rank",
    "log",
    "prepare",
    "prewarm",
    "rank",
    "release",
    "reset_defaults",
    "runs",
    "set_defaults",
    "set_trace",
    "start",
    "watch",
    "world_size",
]
__version__ = "0.1.0"


def launcher(**kwargs: _Any) -> object:
    """Show a form (ipywidgets) that sets the defaults of every ``%%distributed`` cell.

    Accelerator, devices (a checkbox per GPU, or a number of CPU processes), and a control for
    each launch option that names one (``Option.control`` in :mod:`nbtrain.options`); it shows the
    equivalent ``%%distributed`` line to copy. Returns the form's
    :class:`nbtrain.kernel.display.LauncherForm` (its controls are attributes named as the options,
    and ``gpus``).

    >>> import nbtrain
    >>> form = nbtrain.launcher()  # doctest: +SKIP
    """
    # deferred: start-up time
    from nbtrain.kernel.display import show_launcher_form as _launcher

    return _launcher(**kwargs)


def runs() -> list[BackgroundRun | StandbyRanks]:
    """This kernel's background runs, oldest first (``%%distributed --background``, ``launch(background=True)``).

    Standby ranks waiting for the next run (:class:`nbtrain.kernel.standbyview.StandbyRanks`,
    state ``"standby"``, with the memory each holds) come first, when there are any.
    """
    # deferred: start-up time
    from nbtrain.kernel import launcher_connection as _connection
    from nbtrain.kernel import standbyview as _standby
    from nbtrain.kernel.background import runs as _runs

    client = _connection._client
    _say_what_stays_reachable()
    return [*_standby.listed(client.standby if client is not None else None), *_runs()]


def _say_what_stays_reachable() -> None:
    """Once, after a run whose process group other users of the machine could reach (nbtrain.system.sharedhost)."""

    # deferred: start-up time (IPython)
    from nbtrain.kernel import cellrun as _cellrun
    from nbtrain.system import sharedhost as _sharedhost

    record = _cellrun.last_run
    if record is not None:
        reachable = _sharedhost.when_asked(record.accelerator, record.strategy, False)
        if reachable is not None:
            print(reachable, file=_sys.stderr)


def release() -> int:
    """End this kernel's standby ranks now, freeing their memory (GPU memory too); the number ended.

    After a run, the launcher keeps the next run's ranks waiting (a process group joined, a
    CUDA context on a GPU), so a re-run starts at once; they end by themselves after 10
    idle minutes (``set_defaults(standby_idle=...)``). The next run forks new ones.

    Example:
        >>> import nbtrain
        >>> nbtrain.release() >= 0
        True
    """
    # deferred: start-up time
    from nbtrain.kernel import launcher_connection as _connection
    from nbtrain.kernel import standbyview as _standby

    client = _connection._client
    if client is None or not client.alive:
        return 0
    pids = client.release_standby()
    _standby.wait_gone(pids)
    return len(pids)


def last_run() -> _Any:
    """The last ``%%distributed`` run of this kernel (a :class:`nbtrain.kernel.cellrun.LastRun`), or None.

    Its state, duration, the metrics each rank logged, what auto mode prepared and what
    came back to the kernel.

    Example:
        >>> import nbtrain
        >>> run = nbtrain.last_run()
        >>> run is None or run.state in ("running", "finished", "failed", "stopped", "timed out")
        True
    """
    # deferred: start-up time (IPython)
    from nbtrain.kernel import cellrun as _cellrun

    return _cellrun.last_run


def watch(run: Run, **options: _Any) -> _Any:
    """Show ``run``'s live view (status, progress, charts) in this cell until it ends.

    See :func:`nbtrain.kernel.display.watch` for ``total_steps`` and the other options.

    Example:
        >>> import nbtrain
        >>> def train():
        ...     for step in range(100):
        ...         nbtrain.log(loss=1.0 / (step + 1))
        ...     return "done"
        >>> nbtrain.watch(nbtrain.start(train, devices=2, accelerator="cpu"), total_steps=100)  # doctest: +ELLIPSIS
        [nbtrain] starting ...
        nbtrain · ddp_notebook · cpu · 2 ranks · finished ...
        step 100/100 [####################] 100%
        ...
        'done'
    """
    # deferred: start-up time
    from nbtrain.kernel.display import watch as _watch

    return _watch(run, **options)


def set_trace(*, rank: _Any = 0) -> None:
    """Stop here in pdb, prompting in the notebook cell: ``breakpoint()`` that chooses its ranks.

    ``rank=0`` (the default, as ``breakpoint()``) stops rank 0 and the other ranks pass (they
    wait for it in their next collective); ``rank=1`` stops rank 1, ``rank=[0, 1]`` or
    ``rank="all"`` those ranks, one prompt after another. Outside a rank it is pdb's own.

    Example (a rank not chosen passes at once, as rank 1 does here):
        >>> import nbtrain
        >>> def train():
        ...     nbtrain.set_trace(rank=5)  # no rank 5 in a run of two: nobody stops
        ...     return nbtrain.rank()
        >>> nbtrain.launch(train, devices=2, accelerator="cpu")
        0
    """

    # deferred: start-up time
    from nbtrain.rank.machinery.debugger import stop_at as _stop_at

    _stop_at(_sys._getframe().f_back, rank)


def debug() -> None:
    """Open pdb in the frames of the rank kept alive after the last failed run: ``%nbtrain_debug``.

    Commands go in the notebook's input box; ``q`` or ``c`` ends it and releases the rank.
    With no rank held it says why (docs/debugging.md).

    Example:
        >>> import nbtrain
        >>> nbtrain.debug()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        IPython.core.error.UsageError: %nbtrain_debug: no rank is held for a post-mortem: ...
    """
    # deferred: start-up time (IPython)
    from nbtrain.kernel.magic import nbtrain_debug as _debug

    _debug()


def prewarm() -> None:
    """Start the warm launcher now, in the background, so the first run finds torch imported.

    ``%load_ext nbtrain`` calls it; importing nbtrain starts nothing. Runs start a launcher
    on first use without it, only later. Calling it again does nothing.

    Example:
        >>> import nbtrain
        >>> nbtrain.prewarm()
    """
    # deferred: start-up time
    from nbtrain.kernel.launcher_connection import prewarm as _prewarm

    _prewarm()


def load_ipython_extension(ip: object) -> None:
    """``%load_ext nbtrain``: registers the ``%%distributed`` cell magic (and ``%%nbtrain``), warms the launcher."""
    # deferred: start-up time (IPython)
    from nbtrain.kernel.magic import load_ipython_extension as _load

    _load(ip)
    if _should_prewarm():
        prewarm()


def unload_ipython_extension(ip: object) -> None:
    """``%unload_ext nbtrain``: gives IPython's own ``%debug`` back."""
    # deferred: start-up time (IPython)
    from nbtrain.kernel.magic import unload_ipython_extension as _unload

    _unload(ip)


def _should_prewarm() -> bool:
    # Only the caller warms a launcher: never the launcher itself or a rank.
    # A Jupyter server imports nbtrain for its server extension (nbtrain.serverext): it runs no cell.
    import sys as _sys

    if "jupyter_server" in _sys.modules:
        return False
    return _os.environ.get("NBTRAIN_ROLE") is None and _os.environ.get("NBTRAIN_PREWARM", "1") != "0"
