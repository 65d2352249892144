"""The kernel's logging set-up, carried to its ranks: ``logger.info`` in a cell shows as in the kernel.

A notebook configures logging once (``logging.basicConfig(level=logging.INFO)``, a level on
a logger of its own) and then logs from its training code. The ranks are fresh processes,
where the root logger has no handler and a record below WARNING goes nowhere: a cell's
``logger.info`` lines vanished on the ranks. :func:`capture` reads, in the kernel, the levels
set on loggers and the handlers that write to the cell (a plain stream handler on
``sys.stdout`` or ``sys.stderr``), with their levels and formats; :func:`follow` sets the same
up on a rank, writing to the rank's own streams (shown in the cell, tagged with the rank).
What the launcher's libraries set up themselves on import (torch's loggers), its ranks have
already: the launcher reports it once, and a run carries only the rest.
Handlers writing anywhere else (a file, a socket, the kernel's own terminal) stay in the
kernel: several ranks appending to one file would interleave their lines, and the kernel's
own log handlers are not the notebook's.

Example:
    >>> import logging
    >>> logging.getLogger("nbtrain-example").setLevel(logging.INFO)
    >>> ("nbtrain-example", logging.INFO, True) in capture().levels
    True
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamHandling:
    """A handler that writes a logger's records to the cell: on which stream, from which level, in which format."""

    logger: str  # "" is the root logger
    stream: str  # "stdout" or "stderr"
    level: int
    fmt: str | None
    datefmt: str | None
    style: str  # "%", "{" or "$"


@dataclass(frozen=True)
class LoggingSetup:
    """The loggers a kernel configured: (name, level, propagate) of those set apart, and the handlers to its cell."""

    levels: tuple[tuple[str, int, bool], ...] = ()
    handlers: tuple[StreamHandling, ...] = ()


def capture(without: LoggingSetup | None = None) -> LoggingSetup:
    """The logging set-up of this process (the kernel), as its ranks should have it.

    ``without``: what the ranks have already, as their launcher's libraries set it up on
    import (``LauncherReady.libraries_logging``): torch's 40-odd loggers, say, which a rank
    just forked would otherwise read again (~0.4 ms, each page read copied).
    """
    levels, handlers = [], []
    for name, logger in _loggers():
        if name == "" or logger.level != logging.NOTSET or not logger.propagate:
            levels.append((name, logger.level, logger.propagate))
        for handler in logger.handlers:
            if setting := _to_the_cell(name, handler):
                handlers.append(setting)
    if without is not None:
        known = {*without.levels, *without.handlers}
        levels = [entry for entry in levels if entry not in known]
        handlers = [setting for setting in handlers if setting not in known]
    return LoggingSetup(tuple(levels), tuple(handlers))


# What follow() set up last in this process, and what takes it back: a process forked from
# here (a rank from its launcher) inherits both.
_followed: tuple[LoggingSetup, Callable[[], None]] | None = None


def follow(setup: LoggingSetup) -> None:
    """Make this process's logging the kernel's ``setup``, taking back what the last call set up.

    The launcher follows each run's before it forks the run's ranks, so they, and the
    standby ranks forked after, have it already: in a rank just forked, setting it up again
    took 0.4-1 ms (each logger it touched copied its page). A rank follows it too: nothing to
    do there, unless it was forked before the kernel's set-up changed (a standby rank) or
    from nothing (``spawn``). Stream handlers write to this process's stdout and stderr,
    which a forked rank's are too (its file descriptors 1 and 2).
    """
    global _followed
    if _followed is not None:
        if _followed[0] == setup:
            return
        _followed[1]()
    _followed = (setup, _set_up(setup))


def _set_up(setup: LoggingSetup) -> Callable[[], None]:
    """Set ``setup`` up here; returns what takes it back.

    A logger that has handlers here already keeps them and gets none: a library set up its
    own when it was imported, here as in the kernel (torch's loggers, say), and a second
    copy would print each line twice.
    """
    undo: list[Callable[[], None]] = []
    for name, level, propagate in setup.levels:
        logger = logging.getLogger(name or None)
        # Only what differs: each level set clears every logger's cache, and in a rank just
        # forked any write to a logger copies its page.
        if logger.level != level or logger.propagate != propagate:
            undo.append(functools.partial(_set_level, logger, logger.level, logger.propagate))
            _set_level(logger, level, propagate)
    own = {setting.logger for setting in setup.handlers if logging.getLogger(setting.logger or None).handlers}
    for setting in setup.handlers:
        if setting.logger not in own:
            logger = logging.getLogger(setting.logger or None)
            handler = _handler(setting, logger)
            logger.addHandler(handler)
            undo.append(functools.partial(logger.removeHandler, handler))
    return functools.partial(_take_back, undo)


class _KernelHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler of the kernel's, set up here, that steps aside for one its library adds later.

    A library that gives its logger a handler when it is imported and the root has none
    (Lightning) does so here too, once the kernel's handler is already on that logger (a rank
    imports the notebook's libraries after its launcher followed the kernel's logging, or in
    the cell): each line would print twice. The library's own prints it, as in the kernel.
    """

    def __init__(self, stream: Any, logger: logging.Logger) -> None:
        super().__init__(stream)
        self.logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record``, unless the logger has a handler of its library's own now."""
        if all(isinstance(handler, _KernelHandler) for handler in self.logger.handlers):
            super().emit(record)


def _set_level(logger: logging.Logger, level: int, propagate: bool) -> None:
    logger.setLevel(level)
    logger.propagate = propagate


def _take_back(undo: list[Callable[[], None]]) -> None:
    for step in reversed(undo):
        step()


def _handler(setting: StreamHandling, logger: logging.Logger) -> logging.Handler:
    handler = _KernelHandler(sys.stderr if setting.stream == "stderr" else sys.stdout, logger)
    handler.setLevel(setting.level)
    handler.setFormatter(logging.Formatter(setting.fmt, setting.datefmt, style=setting.style))  # type: ignore[arg-type]
    return handler


def _loggers() -> Iterator[tuple[str, logging.Logger]]:
    yield "", logging.getLogger()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):  # another thread may add one
        if isinstance(logger, logging.Logger):  # not a placeholder for a dotted name's parents
            yield name, logger


def _to_the_cell(logger: str, handler: logging.Handler) -> StreamHandling | None:
    # A plain StreamHandler only: FileHandler and others subclass it, and write elsewhere.
    if type(handler) is not logging.StreamHandler or handler.stream not in (sys.stdout, sys.stderr):
        return None
    formatter = handler.formatter or logging.Formatter()
    kind = formatter._style  # the two others subclass PercentStyle
    style = "{" if isinstance(kind, logging.StrFormatStyle) else "%"
    style = "$" if isinstance(kind, logging.StringTemplateStyle) else style
    stream = "stderr" if handler.stream is sys.stderr else "stdout"
    return StreamHandling(logger, stream, handler.level, formatter._fmt, formatter.datefmt, style)
