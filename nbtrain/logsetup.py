"""The kernel's logging set-up, carried to its ranks: ``logger.info`` in a cell shows as in the kernel.

A notebook configures logging once (``logging.basicConfig(level=logging.INFO)``, a level on
a logger of its own) and then logs from its training code. The ranks are fresh processes,
where the root logger has no handler and a record below WARNING goes nowhere: a cell's
``logger.info`` lines vanished on the ranks. :func:`capture` reads, in the kernel, the levels
set on loggers and the handlers that write to the cell (a plain stream handler on
``sys.stdout`` or ``sys.stderr``), with their levels and formats; :func:`set_up` sets the same
up on a rank, writing to the rank's own streams (shown in the cell, tagged with the rank).
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

import logging
import sys
from dataclasses import dataclass


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


def capture() -> LoggingSetup:
    """The logging set-up of this process (the kernel), as its ranks should have it."""
    levels, handlers = [], []
    for name, logger in _loggers():
        if name == "" or logger.level != logging.NOTSET or not logger.propagate:
            levels.append((name, logger.level, logger.propagate))
        handlers += [setting for handler in logger.handlers if (setting := _to_the_cell(name, handler))]
    return LoggingSetup(tuple(levels), tuple(handlers))


def set_up(setup: LoggingSetup) -> None:
    """Set ``setup`` up in this process (a rank), its stream handlers writing to this process's own streams.

    A logger that has handlers here already keeps them and gets none: a library set up its
    own when it was imported, here as in the kernel (torch's loggers, say), and a second
    copy would print each of its lines twice.
    """
    for name, level, propagate in setup.levels:
        logger = logging.getLogger(name or None)
        if logger.level != level:  # each change clears every logger's cache
            logger.setLevel(level)
        logger.propagate = propagate
    own = {setting.logger for setting in setup.handlers if logging.getLogger(setting.logger or None).handlers}
    for setting in setup.handlers:
        if setting.logger not in own:
            logging.getLogger(setting.logger or None).addHandler(_handler(setting))


def _handler(setting: StreamHandling) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr if setting.stream == "stderr" else sys.stdout)
    handler.setLevel(setting.level)
    handler.setFormatter(logging.Formatter(setting.fmt, setting.datefmt, style=setting.style))  # type: ignore[arg-type]
    return handler


def _loggers() -> list[tuple[str, logging.Logger]]:
    named = [(name, logger) for name, logger in logging.Logger.manager.loggerDict.items()]
    return [("", logging.getLogger())] + [(name, lg) for name, lg in named if isinstance(lg, logging.Logger)]


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
