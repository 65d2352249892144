"""Which of the kernel's modules the notebook imported: each rank imports them before a cell's objects arrive.

A rank is forked from the warm launcher, not from the kernel, and a cell's objects reach it by
cloudpickle, which imports only the modules that define them. What the notebook's imports did
as they ran is missing there: fastai's ``fit_one_cycle``, added to ``Learner`` by importing
``fastai.callback.schedule`` (unpickling a ``Learner`` imports ``fastai.learner`` only), a
model registry filled by ``import timm``, a ``copyreg`` registration, a torch custom op. So
every run's ``StartRun.notebook_modules`` names them, in the kernel's order, and the rank imports
them before it unpickles (:mod:`nbtrain.rank.machinery.reimport`).

The rule (:func:`select_modules`, pure): a module of the kernel's ``sys.modules`` goes when its
package (:func:`package_of`) is the notebook's: a package one of the user's names comes from (a
module, a function or class, an object's type: :func:`namespace_packages`, which sees what cells
before ``%load_ext nbtrain`` imported), or one a cell imported (:class:`CellImports`, IPython's
``pre_run_cell``/``post_run_cell``, which sees an import bound to no name) — and not the kernel's
own: the packages of the running shell's and kernel's classes (IPython, ipykernel, or Colab's
shell; :func:`kernel_packages`) and nbtrain. A rule rather than a list of names: the kernel's
other machinery (zmq, tornado, jupyter_client, traitlets, comm, debugpy) is imported before the
first cell and named by no user variable, so it is never the notebook's, whatever the kernel.

Only what the launcher was not sent before travels with a run (:func:`not_sent`): the launcher keeps
the list and hands the whole of it to every rank, so a re-run with nothing new imported sends none.

Example:
    >>> import json, os, sys
    >>> "json.decoder" in select_modules(sys.modules, {"json"})
    True
    >>> "os.path" in select_modules(sys.modules, {"os"})  # posixpath, under another name
    False
    >>> sorted(namespace_packages({"json": json, "loads": json.loads, "n": 1, "_": json}, hidden={}))
    ['json']
"""

from __future__ import annotations

import sys
import types
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from nbtrain.kernel import launcher_connection
from nbtrain.kernel import shell as kernel_shell

# nbtrain's kernel side must not run on a rank, and its rank side is there already.
_ALWAYS_OWN = frozenset({"nbtrain"})


def package_of(name: str, modules: Mapping[str, Any]) -> str:
    """The package a module belongs to, as the rule counts them: its top-level name.

    A namespace package (``google``: no file of its own) is shared by unrelated distributions
    (``google.colab``, the kernel's, and ``google.protobuf``, a model's): there the two first
    names are the package.

    >>> package_of("json.decoder", {})
    'json'
    """
    top, _, rest = name.partition(".")
    module = modules.get(top)
    if rest and module is not None and getattr(module, "__file__", None) is None and hasattr(module, "__path__"):
        return ".".join(name.split(".")[:2])
    return top


def namespace_packages(namespace: Mapping[str, Any], hidden: Mapping[str, Any]) -> set[str]:
    """The packages the user's names come from: a module bound, a function's or class's module, an object's type's.

    Names IPython set itself (``hidden``, unless the user bound them again) and names starting
    with ``_`` (the output cache, ``_i1``) are not the user's, as ``%who`` counts them.
    """
    modules = sys.modules
    found: set[str] = set()
    for name, value in list(namespace.items()):
        if name.startswith("_") or (name in hidden and hidden[name] is value):
            continue
        module = _module_of(value)
        if module and module != "builtins":
            found.add(package_of(module, modules))
    return found


def _module_of(value: Any) -> str | None:
    kind = type(value)  # not isinstance: a proxy's __class__ may raise, or lie
    if issubclass(kind, types.ModuleType):
        name = value.__name__
    elif issubclass(kind, (type, types.FunctionType, types.BuiltinFunctionType)):
        name = getattr(value, "__module__", None)
    else:
        name = kind.__module__
    return name if isinstance(name, str) else None


def select_modules(
    modules: Mapping[str, Any], packages: Collection[str], leave_out: Collection[str] = ()
) -> tuple[str, ...]:
    """The modules of ``packages`` in ``modules`` (``sys.modules``: the kernel's order) a rank imports by name.

    Left out: entries that are no module, or were made in memory (no ``__spec__``), or stand under
    another module's name (``os.path`` is ``posixpath``), and ``__main__``: importing them by
    their name would not give the kernel's module; and ``leave_out`` (nbtrain's own imports).
    """
    chosen = []
    for name, module in list(modules.items()):
        spec = _spec(module)
        if spec is None or spec.name != name or name == "__main__" or name in leave_out:
            continue
        if package_of(name, modules) in packages:
            chosen.append(name)
    return tuple(chosen)


def _spec(module: Any) -> Any:
    try:  # a lazy module's attributes run its code, which may raise anything
        return module.__spec__ if isinstance(module, types.ModuleType) else None
    except Exception:  # noqa: BLE001 - a module that cannot say what it is is not imported again
        return None


def kernel_packages(shell: Any) -> frozenset[str]:
    """The kernel's own packages: those of the running shell's and kernel's classes, and nbtrain."""
    classes = [*type(shell).__mro__, *type(getattr(shell, "kernel", None)).__mro__] if shell is not None else []
    own = {package_of(cls.__module__, sys.modules) for cls in classes if cls.__module__ != "builtins"}
    return _ALWAYS_OWN | own


class CellImports:
    """The packages notebook cells imported: IPython's ``pre_run_cell`` and ``post_run_cell`` (``%load_ext``'s).

    A ``%%distributed`` cell's code runs on the ranks; the modules the kernel imports meanwhile into a
    package it had are nbtrain's (``own``: a torch submodule its result handling needed), and no rank
    needs them. A package new in that cell came with the ranks' results (a module the cell imported
    and bound): the namespace rule counts it.
    """

    def __init__(self) -> None:
        self.packages: set[str] = set()
        self.own: set[str] = set()
        self._known: int | None = None  # len(sys.modules) as the cell began; None: not seen begin (%load_ext's)
        self._nbtrains = False  # the cell is nbtrain's (%%distributed)

    def before_cell(self, info: Any = None) -> None:
        """``pre_run_cell``: remember where ``sys.modules`` ends."""

        cell = getattr(info, "raw_cell", "") or ""
        self._known, self._nbtrains = len(sys.modules), kernel_shell.is_nbtrain_cell(cell.lstrip())

    def after_cell(self, result: Any = None) -> None:
        """``post_run_cell``: the modules the cell imported (the newest, last in ``sys.modules``)."""
        if self._known is None:  # %load_ext's cell: what the cells before it imported
            _tell_launcher()
            return
        names = list(sys.modules)
        new = names[self._known :]  # a cell's imports are appended: what lies past its start is new
        if self._nbtrains and new:
            had = set(names[: self._known])
            self.own.update(name for name in new if package_of(name, sys.modules) in had)
        elif new:
            self.packages.update(package_of(name, sys.modules) for name in new)
            _tell_launcher()
        self._known = None


def _tell_launcher() -> None:
    """A cell imported modules: the launcher imports the libraries among them while no run goes, and so
    do standby ranks waiting for the next run, before its cell comes (nbtrain.launch_server.server)."""

    client = launcher_connection.current_client()
    if client is None:
        return  # no launcher yet: the first run sends them
    modules = not_sent(notebook_modules(kernel_shell.get_shell()), client.modules_sent)
    if modules:
        client.send_notebook_modules(modules)


CELLS = CellImports()  # the kernel's one record of what its cells imported


def notebook_modules(shell: Any) -> tuple[str, ...]:
    """The modules the notebook imported, by the rule above, in the kernel's order."""

    if shell is not None:
        namespace, hidden = kernel_shell.user_namespace(shell), kernel_shell.hidden_names(shell)
    else:  # a script calling nbtrain.launch: its __main__ is the notebook
        namespace, hidden = vars(sys.modules["__main__"]) if "__main__" in sys.modules else {}, {}
    packages = frozenset((namespace_packages(namespace, hidden) | CELLS.packages) - kernel_packages(shell))
    global _last
    key = (len(sys.modules), packages)
    if _last is None or _last[0] != key:  # a re-run with nothing imported since reads no module (~1 ms saved)
        _last = (key, select_modules(sys.modules, packages, CELLS.own))
    return _last[1]


_last: tuple[tuple[int, frozenset[str]], tuple[str, ...]] | None = None  # notebook_modules' last answer


def not_sent(modules: Iterable[str], sent: Collection[str]) -> tuple[str, ...]:
    """Of ``modules``, those the engine was not sent before (it keeps them), in their order.

    >>> not_sent(["a", "b", "c"], {"b"})
    ('a', 'c')
    """
    return tuple(name for name in modules if name not in sent)
