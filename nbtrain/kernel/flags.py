"""``%%distributed``'s flags: generated from :class:`nbtrain.options.LaunchOptions`, parsed once per cell.

Each launch option with a flag in the record becomes an argparse argument here (its help
is the record's), beside the flags that only a cell has (``--output``, ``--no-auto``,
``--background``). :func:`parse_flags` reads a cell's line into a frozen
:class:`CellOptions`, the session defaults filled in for every flag the cell did not give;
:func:`check_flags` plans the run once from it. :func:`flag_table` renders docs/magic.md's flag
table from the same record, so the help, the table and the record cannot drift apart.

Example:
    >>> from nbtrain.kernel.magic import DistributedMagics
    >>> options = parse_flags(DistributedMagics.distributed, "--devices 2 --accelerator cpu --output rank0")
    >>> options.devices, options.accelerator, options.output, options.strategy
    ('2', 'cpu', 'rank0', 'ddp_notebook')
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from IPython.core import magic_arguments
from IPython.core.error import UsageError

from nbtrain import options as options_module
from nbtrain.errors import ClusterError, ConfigurationError
from nbtrain.kernel import defaults, launchplan
from nbtrain.kernel import shell as kernel_shell
from nbtrain.options import LaunchOptions
from nbtrain.planning import config

OUTPUT_MODES = ("all", "rank0", "none")


class _SessionDefault:
    """A flag the cell did not give: the session's default applies (for --timeout, None there means no limit)."""

    def __repr__(self) -> str:
        return "<the session default>"


_SESSION: Any = _SessionDefault()


@dataclass(frozen=True)
class CellFlag:
    """A flag only a cell has (not a launch option): its argparse arguments and docs/magic.md's row."""

    flags: tuple[str, ...]
    arguments: dict[str, Any]
    values: str  # docs/magic.md's text (markdown); --help shows it without the backticks
    shown_default: str


CELL_FLAGS = (
    CellFlag(
        ("--output",), {"default": "all", "choices": OUTPUT_MODES},
        "whose prints and displays show: `all` (each line tagged `[rank N]`; a progress bar redrawn in place, "
        "such as tqdm's, is drawn live for rank 0 and shown for the other ranks as it stands when it ends, so the "
        "ranks' bars do not overwrite each other; the run's log keeps every redraw), `rank0` (rank 0's, untagged), "
        "`none`",
        "`all`",
    ),
    CellFlag(
        ("--no-auto",), {"dest": "auto", "action": "store_false"},
        "do not prepare the kernel's models, optimizers and loaders, nor log the loss: the cell does it all",
        "auto mode on",
    ),
    CellFlag(
        ("--background",), {"action": "store_true"},
        "return at once with a handle (listed by `nbtrain.runs()`); the live view keeps updating and has a Stop "
        "button; the kernel's objects are updated when the run finishes",
        "off",
    ),
    CellFlag(("-h", "--help"), {"action": "store_true"}, "print the help, do not run the cell", ""),
)


def _help(text: str, default: str) -> str:
    """argparse's help for a flag: the record's text, plain, and its default (``%`` escaped for argparse)."""
    plain = text.replace("`", "").rstrip(".")
    return (f"{plain}. Default: {default.replace('`', '')}." if default else f"{plain}.").replace("%", "%%")


def _launch_arguments() -> list[magic_arguments.argument]:
    arguments = []
    for name, info in options_module.flagged():
        argument = functools.partial(magic_arguments.argument, dest=name, default=_SESSION)
        shown = _help(info.help, f"the session default ({info.shown_default})")
        if not isinstance(getattr(LaunchOptions(), name), bool):
            arguments.append(argument(info.flag, type=info.parse or str, choices=info.choices, help=shown))
            continue
        arguments.append(argument(info.flag, action="store_true", help=shown))
        if info.no_flag:
            arguments.append(argument(info.no_flag, action="store_false", help=_help(info.no_help, "")))
    return arguments


def flag_arguments(magic: Callable[..., Any]) -> Any:
    """Decorate the ``%%distributed`` magic with every flag: the record's, then the cell's own.

    What IPython's ``@magic_arguments.argument`` decorators would, written once from the
    record: the parser and the magic's docstring list the flags in the record's order.
    """
    cell = [magic_arguments.argument(*flag.flags, **flag.arguments, help=_help(flag.values, flag.shown_default))
            for flag in CELL_FLAGS]
    help_flag, cell = cell[-1], cell[:-1]
    for argument in reversed([help_flag, *_launch_arguments(), *cell]):
        magic = argument(magic)
    return magic_arguments.magic_arguments()(magic)


def flag_table() -> str:
    """docs/magic.md's flag table (markdown), generated from the record and the cell's own flags.

    >>> flag_table().splitlines()[2].startswith("| `--devices` | how many ranks")
    True
    """
    rows = options_module.flag_rows()
    for flag in CELL_FLAGS:
        rows.append((", ".join(f"`{name}`" for name in flag.flags), flag.values, flag.shown_default))
    return options_module.markdown_table(("flag", "values", "default"), rows)


@dataclass(frozen=True)
class CellOptions(LaunchOptions):
    """The flags of one ``%%distributed`` line: the launch options (session defaults filled in) and the cell's own."""

    output: str = "all"  # one of OUTPUT_MODES
    auto: bool = True  # prepare the kernel's models, optimizers and loaders, and log the loss
    background: bool = False
    help: bool = False


def parse_flags(magic: Any, line: str) -> CellOptions:
    """The flags of ``line`` as a :class:`CellOptions`; any problem is one UsageError line."""
    try:
        parsed = argparse.Namespace(**vars(_parsed(magic.parser, line)))  # a copy: the cached one stays as parsed
    except UsageError as error:
        hint = _flag_hint(magic, str(error))
        raise UsageError(f"{kernel_shell.magic_name()}: {error}. {hint + ' ' if hint else ''}{_see_help()}") from None
    except ValueError as error:  # unbalanced quotes
        raise UsageError(
            f"{kernel_shell.magic_name()}: cannot read the flags {line!r}: {error}. Close the quote, or write "
            f"the value without quotes (--devices 0,1). {_see_help()}"
        ) from None
    return fill_defaults(parsed)


def _see_help() -> str:
    # "%%name?", not "%name?": IPython (7.34 to 9) finds a cell magic's help only under its "%%".
    magic = kernel_shell.magic_name()
    return f"{magic} --help (or {magic}?) says what each flag takes."


@functools.lru_cache(maxsize=64)
def _parsed(parser: Any, line: str) -> argparse.Namespace:
    """``line`` parsed; a re-run's line is read once (argparse took half a millisecond of each launch)."""
    return cast("argparse.Namespace", parser.parse_argstring(line))


def _flag_hint(magic: Any, error: str) -> str:
    """What the flag named in argparse's ``error`` takes, or the flag a misspelt one may have meant."""
    helps = {option: action.help or "" for action in magic.parser._actions for option in action.option_strings}
    flags = [option for option in helps if option.startswith("--") and option != "--help"]
    unknown = re.match(r"unrecognized arguments: (\S+)", error)
    if unknown:
        close = difflib.get_close_matches(unknown.group(1).split("=")[0], flags, n=1)
        return f"Did you mean {close[0]}?" if close else f"The flags are {', '.join(flags)}."
    named = re.match(r"argument (--[\w-]+)", error)
    if named and "choose from" not in error:  # argparse already listed the choices
        return f"{named.group(1)}: {helps.get(named.group(1), '')}".replace("%%", "%").rstrip(": ")
    return ""


def fill_defaults(parsed: Any) -> CellOptions:
    """The options of parsed flags; each launch flag the cell did not set takes the session's default."""

    given = {name: getattr(parsed, name) for name, _ in options_module.flagged()}
    given = {name: value for name, value in given.items() if value is not _SESSION}
    if "stall_warning" in given:
        _stall_warning(given["stall_warning"])
    try:
        launch = defaults.get_defaults().merged(given)
    except ConfigurationError as error:
        raise UsageError(f"{kernel_shell.magic_name()}: {error}") from None
    own = {"output": parsed.output, "auto": parsed.auto, "background": parsed.background, "help": parsed.help}
    return CellOptions(**launch.as_dict(), **own)


def _stall_warning(flag: float | None) -> None:
    if flag is not None and not flag > 0:
        raise UsageError(
            f"{kernel_shell.magic_name()}: --stall-warning {flag:g} is not a positive number of seconds; "
            "give one, or none for no warning."
        )


def help_text(magic: Any) -> str:
    """What ``%%distributed --help`` prints: the usage, the magic's description and every flag."""
    text: str = magic.parser.format_help().rstrip()
    return text.removeprefix("::\n\n  ")  # an RST code-block marker


def check_flags(options: CellOptions) -> tuple[Any, config.LaunchConfig]:
    """The engine (None: this machine's launcher) and launch configuration, planned once per cell.

    Raises a UsageError naming the bad flag and what is possible.
    """

    try:
        return launchplan.plan_run(options)
    except (ConfigurationError, ClusterError) as error:
        raise UsageError(f"{kernel_shell.magic_name()}: {error}") from None
