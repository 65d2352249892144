"""The notebook's imports, imported again on a rank before the cell's objects are unpickled there.

The kernel names them (``StartRun.notebook_modules``, :mod:`nbtrain.kernel.importedmodules`): a
rank forked from the launcher has none of them, and unpickling imports only the modules that
define the cell's objects, not those whose import changed them (a method patched onto a class,
a registry filled). Imported in the kernel's order, each one's import-time effects are there
before the first object arrives.

A standby rank imports the libraries among them ahead (:func:`import_ahead`), while it waits;
the user's own files are imported by the run (:func:`import_for_run`), as they are on disk by
then, as the payload would. A module that fails to import is left out and the run goes on: the
kernel may hold modules a rank has no use for (one that needs the kernel, or refuses where
``RANK`` is set), and a cell that needs it fails on its own line anyway, after one line from
rank 0 that says which module failed, why, and what to do (:meth:`ImportFailure.line`).

Example:
    >>> failed = import_for_run(["json", "nbtrain_no_such_module"], report=False)
    >>> failed[0].name, failed[0].error
    ('nbtrain_no_such_module', "ModuleNotFoundError: No module named 'nbtrain_no_such_module'")
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ImportFailure:
    """A notebook module this rank could not import: its name and the error, as one line."""

    name: str
    error: str  # "ModuleNotFoundError: No module named 'x'"

    def line(self) -> str:
        """What the cell shows, once, from rank 0."""
        return (
            f"nbtrain: the kernel imported {self.name}, but the ranks could not ({self.error}); the cell runs "
            f"without it, so what importing it adds (methods, registrations) is missing there: make it "
            f"importable on a rank (RANK, WORLD_SIZE are set there) or import what the cell needs in the cell."
        )


# A standby rank's failures ahead, by name: the run reports them without importing again.
_failed_ahead: dict[str, ImportFailure] = {}


def import_ahead(names: Iterable[str], is_library: Callable[[str], bool]) -> None:
    """A standby rank, waiting: import the libraries among ``names`` (``is_library`` of a file path)."""
    for name in names:
        if name not in sys.modules and _failed_parent(name, _failed_ahead) is None and is_library(_origin(name)):
            failure = _import(name)
            if failure is not None:
                _failed_ahead[name] = failure


def import_for_run(names: Iterable[str], report: bool) -> list[ImportFailure]:
    """Import what of ``names`` this rank has not; ``report``: print a line for each failure (rank 0)."""
    failures: dict[str, ImportFailure] = {}
    for name in names:
        if name in sys.modules or _failed_parent(name, failures) is not None:
            continue  # a package that failed: its submodules fail the same way, and say nothing new
        failure = _failed_ahead.get(name) or _import(name)
        if failure is not None:
            failures[name] = failure
    if report:
        for failure in failures.values():
            print(failure.line(), file=sys.stderr)
    return list(failures.values())


def _import(name: str) -> ImportFailure | None:
    try:
        importlib.import_module(name)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - any failure is one line, not the run's end
        return ImportFailure(name, f"{type(error).__name__}: {error}")
    return None


def _failed_parent(name: str, failed: dict[str, ImportFailure]) -> str | None:
    parts = name.split(".")
    return next((parent for i in range(1, len(parts)) if (parent := ".".join(parts[:i])) in failed), None)


def _origin(name: str) -> str:
    """Where the top-level package of ``name`` lives (a path; "" where it cannot be found or is built in).

    Asked of the top-level name only: finding a submodule would import its package.
    """
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    try:
        spec = module.__spec__ if module is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return ""
    if spec is None:
        return ""
    locations = list(spec.submodule_search_locations or ())
    return spec.origin if spec.origin and spec.has_location else (locations[0] if locations else "")
