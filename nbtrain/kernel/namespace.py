"""The kernel's side of a ``%%distributed`` cell's namespace: what goes out, what comes back.

Going out (:func:`analyse_cell`): the kernel globals a cell uses are the names it loads,
in nested functions and comprehensions too (read from the compiler's symbol table, so a
function's own parameters and locals do not count), plus, transitively, the globals of
the notebook functions and classes it uses: the same names cloudpickle ships with them.
Only those travel. :func:`explain_unpicklable` names the one that cannot.

Coming back (:func:`decode_result`, :func:`apply_result`): rank 0 sends a
:class:`CellResult`. Every object the ranks received, a global or an object inside one
(``trainer.model``, ``trainer.config``: :func:`nbtrain.messages.reach.find_reached`), comes back as
a reference to the kernel's own object, never as a copy, and the kernel's object is changed
in place to what the cell left: Modules, Optimizers and LR schedulers load their state
(same objects, same devices and dtypes), tensors are copied into, lists, dicts and objects
are refilled with what they hold. So what was shared stays shared (``trainer.model is
model``), as if the cell had run in the kernel. Names the cell bound are set, and functions
the cell defined get the kernel's globals. Each object loads whole or not at all: one the
kernel cannot rebuild, refill or put back in its place keeps its kernel value and is named,
with why and what to do (``ApplyReport.skipped``); the others load.

Pure apart from the objects it is handed: it starts nothing and imports torch only to
load state into torch objects that already exist.

Example:
    >>> analyse_cell("for x in data:\\n    total += f(x)\\n", {"data": [1], "f": abs, "total": 0}).names
    ('data', 'f', 'total')
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import dis
import functools
import gc
import io
import itertools
import pickle
import symtable
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nbtrain.errors import SerializationError
from nbtrain.messages import reach
from nbtrain.messages.records import (
    GLOBALS_TAG,
    KERNEL_TAG,
    PART_TAG,
    SELF_DISTRIBUTING,
    STORAGE_TAG,
    CellResult,
    is_internal,
    made,
    set_rng_states,
    type_name,
)

_UNTRAVELLING_HINT = (
    "Open files, locks, threads, sockets, database connections and generators cannot be sent to "
    "other processes: create it inside the cell (or in a function the cell calls), or keep what "
    "it is made from (a path, a query) in the variable instead."
)


# -- going out -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CellAnalysis:
    """What the kernel learns from a cell's code before it runs it anywhere."""

    names: tuple[str, ...]  # kernel globals the cell uses, sorted
    used_by: Mapping[str, str | None] = field(default_factory=dict)  # name -> notebook function using it
    self_distributes: tuple[str, ...] = ()  # e.g. ("DistributedDataParallel",): auto mode steps aside
    calls_log: bool = False  # the cell (or a function it calls) logs with nbtrain.log itself
    needs_shell: bool = False  # the transformed code calls get_ipython()
    display_last: bool = False  # the last statement is an expression whose value is shown
    # What the notebook functions and classes the cell uses do, as far as their code shows:
    function_names: frozenset[str] = frozenset()  # names and attributes they refer to
    function_writes: frozenset[str] = frozenset()  # globals they assign or delete


def analyse_cell(
    code: str, user_ns: Mapping[str, Any], hidden: Iterable[str] = (), *, raw_cell: str | None = None
) -> CellAnalysis:
    """Which kernel globals ``code`` (transformed, valid Python) uses, and how it distributes.

    ``hidden``: names IPython put in the namespace (``shell.user_ns_hidden``); never shipped.

    >>> ns = {"model": object(), "unused": 1}
    >>> analyse_cell("def f(model):\\n    return model\\nf(2)\\n", ns).names  # a parameter, not the global
    ()
    >>> analyse_cell("y = [model for _ in range(3)]", ns).names
    ('model',)
    """
    tree = ast.parse(code)
    loaded, deleted = _module_names(code)
    hidden = set(hidden)
    direct = sorted(n for n in loaded | deleted if n in user_ns and n not in hidden and not is_internal(n))
    used_by: dict[str, str | None] = {}
    pending: list[tuple[str, str | None]] = [(n, None) for n in direct]
    code_names: set[str] = set()
    code_writes: set[str] = set()
    while pending:
        name, via = pending.pop(0)
        if name in used_by:
            continue
        used_by[name] = via
        for code_object in _notebook_code(user_ns[name], user_ns):
            globals_used = _code_globals(code_object)
            code_names |= _code_names(code_object)
            code_writes |= _code_globals(code_object, _GLOBAL_WRITES)
            for inner in sorted(globals_used):
                if inner in user_ns and inner not in hidden and not is_internal(inner) and inner not in used_by:
                    pending.append((inner, name if via is None else via))
    syntax_names = _syntax_names(tree)
    self_distributes = sorted((syntax_names | code_names) & SELF_DISTRIBUTING)
    if _refers_to_nbtrain(tree, user_ns, "prepare", code_names):
        self_distributes.append("nbtrain.prepare")
    return CellAnalysis(
        names=tuple(sorted(used_by)),
        used_by=used_by,
        self_distributes=tuple(self_distributes),
        calls_log=_refers_to_nbtrain(tree, user_ns, "log", code_names),
        needs_shell="get_ipython" in loaded,
        display_last=_shows_last_value(tree, raw_cell if raw_cell is not None else code),
        function_names=frozenset(code_names),
        function_writes=frozenset(code_writes),
    )


def _module_names(code: str) -> tuple[set[str], set[str]]:
    """(global names loaded anywhere in ``code``, global names deleted at module level)."""
    table = symtable.symtable(code, "<cell>", "exec")
    loaded: set[str] = set()

    def visit(scope: symtable.SymbolTable, top: bool) -> None:
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (top or symbol.is_global()):
                loaded.add(symbol.get_name())
        for child in scope.get_children():
            visit(child, False)

    visit(table, True)
    tree = ast.parse(code)
    loaded |= _augmented_globals(tree)  # `total += x` reads total, yet symtable says "assigned"
    deleted = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del)}
    return loaded, deleted


def _augmented_globals(tree: ast.AST) -> set[str]:
    """Targets of ``name += ...`` that are globals: at module level, or declared ``global``."""
    found: set[str] = set()

    def visit(node: ast.AST, declared: set[str] | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            inner = {n for stmt in body for g in ast.walk(stmt) if isinstance(g, ast.Global) for n in g.names}
            for child in ast.iter_child_nodes(node):
                visit(child, inner)
            return
        if (
            isinstance(node, ast.AugAssign)
            and isinstance(node.target, ast.Name)
            and (declared is None or node.target.id in declared)
        ):
            found.add(node.target.id)
        for child in ast.iter_child_nodes(node):
            visit(child, declared)

    visit(tree, None)
    return found


_LOOK_DEPTH = 4  # steps inside an object for notebook functions: engine._event_handlers[event][0][0]
_LOOKED_AT = 1024  # objects looked into for one value, at most: a list of data holds no handler


def _notebook_code(value: Any, user_ns: Mapping[str, Any]) -> list[types.CodeType]:
    """Code objects that travel with ``value`` because it was defined in the notebook, or is held
    (a few steps inside) by what travels: an ignite engine's handler, a library function's closure."""
    codes: list[types.CodeType] = []
    seen: set[int] = set()
    looked: set[int] = set()

    def add_function(fn: Any) -> None:
        if isinstance(fn, types.FunctionType) and id(fn) not in seen and fn.__globals__ is user_ns:
            seen.add(id(fn))
            codes.append(fn.__code__)
            for cell in fn.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    add_any(cell.cell_contents)

    def add_class(cls: type) -> None:
        for klass in getattr(cls, "__mro__", ()):
            if klass.__module__ != "__main__" or id(klass) in seen:
                continue
            seen.add(id(klass))
            for member in vars(klass).values():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    for accessor in (member.fget, member.fset, member.fdel):
                        add_function(accessor)
                add_function(member)

    def add_any(obj: Any, depth: int = 0) -> None:
        if isinstance(obj, types.FunctionType) and obj.__globals__ is user_ns:
            add_function(obj)
            return
        if isinstance(obj, type):
            add_class(obj)
            return
        if type(obj).__module__ == "__main__":
            add_class(type(obj))
        # What it holds travels with it: a notebook function in there ships its globals too.
        if depth < _LOOK_DEPTH and id(obj) not in looked and len(looked) < _LOOKED_AT:
            looked.add(id(obj))
            for inner in _travelling_parts(obj):
                add_any(inner, depth + 1)

    add_any(value)
    return codes


def _travelling_parts(obj: Any) -> list[Any]:
    """What ``obj`` holds that pickles with it, as far as looking for notebook functions goes: a
    container's items, a library function's closure, the attributes of an object pickled as them
    (an object that pickles otherwise, a logger by its name, is not looked into)."""
    if isinstance(obj, (int, float, complex, str, bytes, bool, type(None), types.ModuleType)):
        return []
    if isinstance(obj, types.FunctionType):
        return [cell.cell_contents for cell in obj.__closure__ or () if reach.is_filled(cell)]
    if isinstance(obj, dict):
        return list(itertools.islice(obj.values(), reach.ITEMS))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(itertools.islice(obj, reach.ITEMS))
    try:
        own = vars(obj) if reach.is_users_object(obj) or reach.torch_kind(obj) == "module" else {}
    except Exception:  # noqa: BLE001 - an object that cannot say what it holds holds nothing we look for
        return []
    return list(itertools.islice(own.values(), reach.ITEMS))


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})
_GLOBAL_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})


def _code_globals(code: types.CodeType, ops: frozenset[str] = _GLOBAL_OPS) -> set[str]:
    """Global names a code object (and the code nested in it) reads or writes, as cloudpickle finds them.

    ``ops`` narrows it down, e.g. to the names it writes (``_GLOBAL_WRITES``).
    """
    names = {ins.argval for inner in _nested_code(code) for ins in dis.get_instructions(inner) if ins.opname in ops}
    return {n for n in names if isinstance(n, str)}


def _code_names(code: types.CodeType) -> set[str]:
    return {name for inner in _nested_code(code) for name in inner.co_names}


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every code object nested in it (its functions, classes, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested_code(const)


def _syntax_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rsplit(".", 1)[-1])
    return names


def _refers_to_nbtrain(tree: ast.AST, user_ns: Mapping[str, Any], attr: str, code_names: set[str]) -> bool:
    """Does the cell (or a notebook function it calls) use ``nbtrain.<attr>``?"""
    # The package itself, always loaded before any of its modules: importing it here would
    # make the package and the magic it registers import each other.
    nbtrain = sys.modules["nbtrain"]
    target = getattr(nbtrain, attr, None)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == attr
            and isinstance(node.value, ast.Name)
            and (node.value.id == "nbtrain" or user_ns.get(node.value.id) is nbtrain)
        ):
            return True
        if isinstance(node, ast.Name) and node.id == attr and user_ns.get(attr) is target is not None:
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "nbtrain" and any(a.name == attr for a in node.names):
            return True
    return attr in code_names and ("nbtrain" in code_names or user_ns.get(attr) is target is not None)


def _shows_last_value(tree: ast.Module, raw_cell: str) -> bool:
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return False
    lines = [line for line in raw_cell.rstrip().splitlines() if line.strip()]
    return bool(lines) and not lines[-1].rstrip().endswith(";")


def anchor_function(user_ns: dict[str, Any]) -> types.FunctionType:
    """A function whose globals are ``user_ns``: on a rank its ``__globals__`` is the cell's namespace.

    cloudpickle gives every function that shares a globals dict one shared dict on the
    other side. Shipping this one beside the cell's names makes that dict known, so the
    cell runs in the very namespace its notebook functions see: when auto mode swaps
    ``model`` for the wrapped one, a helper that reads the global ``model`` sees it too.
    """
    return types.FunctionType(compile("None", "<nbtrain-anchor>", "eval"), user_ns, "_nbtrain_anchor")


def explain_unpicklable(namespace: Mapping[str, Any], used_by: Mapping[str, str | None]) -> SerializationError | None:
    """The error naming the variables that cannot be sent to the ranks (None if all can).

    A notebook function that fails only because it uses a failing variable is reported
    through that variable, so the message points at the object to change.
    """
    failures = {name: reason for name in sorted(namespace) if (reason := _pickle_failure(namespace[name]))}
    if not failures:
        return None
    culprits = [n for n in failures if not isinstance(namespace[n], (types.FunctionType, type))] or list(failures)
    lines = [f"{_cannot_send(name, namespace[name], used_by)}: {failures[name]}." for name in culprits]
    return SerializationError(" ".join(lines) + " " + _UNTRAVELLING_HINT)


def _cannot_send(name: str, value: Any, used_by: Mapping[str, str | None]) -> str:
    where = f", used by `{used_by[name]}`" if used_by.get(name) else ""
    return f"cannot send `{name}` (a {type_name(value)}{where}) to the ranks"


def refuse_open_files(namespace: Mapping[str, Any], used_by: Mapping[str, str | None]) -> None:
    """Raise SerializationError for an open file among the values to ship.

    cloudpickle would send a file opened for reading as a StringIO snapshot of its
    contents: the ranks would read a copy, never write the file. Better to say so.

    >>> import io
    >>> refuse_open_files({"buffer": io.StringIO("in memory is fine")}, {})
    """

    for name in sorted(namespace):
        value = namespace[name]
        if isinstance(value, io.IOBase) and not isinstance(value, (io.StringIO, io.BytesIO)):
            raise SerializationError(
                f"{_cannot_send(name, value, used_by)}: it is an open file, "
                f"and a file handle belongs to one process. {_UNTRAVELLING_HINT}"
            )


def _pickle_failure(value: Any) -> str | None:
    try:
        _probe_pickler_class()(_NullSink()).dump(value)
    except Exception as error:  # noqa: BLE001 - any failure means it cannot travel
        return str(error) or type(error).__name__
    return None


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


_probe_pickler: type | None = None


def _probe_pickler_class() -> type:
    """cloudpickle that skips tensor data: checking a 1 GB model copies nothing."""
    global _probe_pickler
    if _probe_pickler is None:
        # deferred: start-up time (cloudpickle)
        from nbtrain.messages import codepickle

        class ProbePickler(codepickle.Pickler):
            def persistent_id(self, obj: Any) -> Any:
                torch = sys.modules.get("torch")
                if torch is not None and isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
                    return ("storage", id(obj))
                return None

        _probe_pickler = ProbePickler
    return _probe_pickler


# -- coming back ---------------------------------------------------------------------------


def _load_persistent(pid: Any, storages: list[Any], shipped: Mapping[str, Any], user_ns: dict[str, Any]) -> Any:
    """The object a rank's result refers to by ``pid``: a tensor's storage, or the kernel's own object."""
    tag = pid[0]
    if tag == STORAGE_TAG:
        # deferred: start-up time (torch)
        import torch

        untyped = storages[pid[1]]
        if pid[2] is None:
            return untyped
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=pid[2], _internal=True)
    if tag == KERNEL_TAG:
        return shipped[pid[1]]
    if tag == PART_TAG:
        _, name, kind, path = pid
        module = shipped[name]
        if kind == "param":
            return module.get_parameter(path)
        if kind == "buffer":
            return module.get_buffer(path)
        return module.get_submodule(path)
    if tag == GLOBALS_TAG:
        return user_ns
    raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a rank's result")


class _ResultUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: list[Any], shipped: Mapping[str, Any], user_ns: dict[str, Any]):
        super().__init__(io.BytesIO(data))
        self._context = (storages, shipped, user_ns)

    def persistent_load(self, pid: Any) -> Any:
        return _load_persistent(pid, *self._context)


class _Unloadable:
    """Stands for an object of a rank's result that could not be rebuilt in the kernel."""

    def __init__(self, kind: str, error: Exception):
        self.kind, self.error = kind, error

    def append(self, item: Any) -> None:  # what pickle does to a list it rebuilt: nothing to do here
        pass

    def extend(self, items: Any) -> None:
        pass

    def __setitem__(self, key: Any, item: Any) -> None:
        pass


class _TolerantUnpickler(pickle._Unpickler):
    """The same result read in Python, object by object: one that cannot be rebuilt is marked, not fatal.

    Only used once the fast reading failed, to find which objects failed and load the rest.
    """

    stack: list[Any]  # pickle's own, as it reads

    def __init__(self, data: bytes, storages: list[Any], shipped: Mapping[str, Any], user_ns: dict[str, Any]):
        super().__init__(io.BytesIO(data))
        self._context = (storages, shipped, user_ns)
        self.failed: list[tuple[Any, str, Exception]] = []  # (the object, its class, why)

    def persistent_load(self, pid: Any) -> Any:
        return _load_persistent(pid, *self._context)

    def load_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        try:
            super().load_reduce()  # type: ignore[misc]
        except Exception as error:  # noqa: BLE001 - named below, with what holds it
            cls = args[0] if func is made and args else func
            stand_in = _Unloadable(_kind_name(cls), error)
            self.stack[-1:] = [stand_in]
            self.failed.append((stand_in, stand_in.kind, error))

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, _Unloadable):
            self.stack.pop()
            return
        try:
            super().load_build()  # type: ignore[misc]
        except Exception as error:  # noqa: BLE001 - named below, with what holds it
            if not _set_slots_directly(inst, state):
                self.failed.append((inst, type_name(inst), error))

    dispatch: ClassVar[dict[int, Callable[[pickle.Unpickler], None]]] = {
        **pickle._Unpickler.dispatch,
        pickle.REDUCE[0]: load_reduce,  # type: ignore[dict-item]  # called with this class's objects only
        pickle.BUILD[0]: load_build,  # type: ignore[dict-item]
    }


def _kind_name(cls: Any) -> str:
    """The name of the class (or function) that failed to make an object, as :func:`type_name` names a class."""
    if not isinstance(cls, type):
        return str(getattr(cls, "__qualname__", "object"))
    return cls.__qualname__ if cls.__module__ in ("builtins", "__main__") else f"{cls.__module__}.{cls.__qualname__}"


def _set_slots_directly(inst: Any, state: Any) -> bool:
    """Set a slotted object's state as pickle sets a ``__dict__``: past the class's own ``__setattr__``.

    A frozen dataclass with slots (Python 3.10's, fastai's plum dispatchers) refuses pickle's
    ``setattr`` of its fields, yet is rebuilt faithfully this way. False where that is not the case.
    """
    if hasattr(type(inst), "__setstate__") or not (isinstance(state, tuple) and len(state) == 2):
        return False
    if not isinstance(state[1], dict):
        return False
    try:
        for key, value in state[1].items():
            object.__setattr__(inst, key, value)
    except Exception:  # noqa: BLE001 - then it stays failed
        return False
    return True


def decode_result(result: CellResult, shipped: Mapping[str, Any], user_ns: dict[str, Any]) -> dict[str, Any]:
    """Unpickle rank 0's outcome; the kernel's namespace is left exactly as it was.

    An object the kernel cannot rebuild is left out with the name it came back under, in
    ``outcome["unloaded"]`` ((name, class, why) each): the kernel keeps its value of that name.
    """
    # cloudpickle writes __builtins__ into the globals of each function it rebuilds; for a
    # function defined in the cell that is the kernel's namespace: put back IPython's.
    missing = object()
    saved = user_ns.get("__builtins__", missing)
    try:
        try:
            outcome: dict[str, Any] = _ResultUnpickler(result.payload, result.storages, shipped, user_ns).load()
            return outcome
        except Exception as error:  # noqa: BLE001 - read it again, object by object, to name the culprits
            tolerant = _TolerantUnpickler(result.payload, result.storages, shipped, user_ns)
            try:
                outcome = tolerant.load()
            except Exception:  # noqa: BLE001 - not one object's fault: the first error says it
                raise error from None
            return _leave_out(outcome, tolerant.failed, shipped) if tolerant.failed else outcome
    finally:
        if saved is missing:
            user_ns.pop("__builtins__", None)
        else:
            user_ns["__builtins__"] = saved


_NAMED_SECTIONS = ("modules", "optimizers", "schedulers", "contents", "changed", "tensors", "bound")
_WALK_LIMIT = 100_000  # objects looked at for one value: a failed one lies near the top of what holds it


def _leave_out(
    outcome: dict[str, Any], failed: list[tuple[Any, str, Exception]], shipped: Mapping[str, Any]
) -> dict[str, Any]:
    """``outcome`` without each value that is or holds an object that failed to load: nothing of it is
    loaded, never part; each is named in ``outcome["unloaded"]``, the others load."""
    marks = {id(obj): (kind, error) for obj, kind, error in failed}
    kernel_own = {id(value) for value in shipped.values()}  # the kernel's objects: not rebuilt, not looked into
    unloaded: dict[str, tuple[str, str, str]] = {}
    for section in _NAMED_SECTIONS:
        entries = outcome.get(section, {})
        for name in list(entries):
            value = entries[name]
            as_attributes = section == "contents" and not isinstance(shipped.get(name), (dict, list))
            culprit = _failed_inside(value, marks, kernel_own, as_attributes)
            if culprit is not None:
                del entries[name]
                kind = value.kind if isinstance(value, _Unloadable) else type_name(shipped.get(name, value))
                unloaded.setdefault(name, (name, kind, _why_unloaded(name, *culprit)))
    for name in unloaded:  # an optimizer's parts go with it
        for section in ("optimizer_attributes", "inner_optimizers", "places"):
            outcome.get(section, {}).pop(name, None)
    display = outcome.get("display")
    culprit = None if display is None else _failed_inside(display[0], marks, kernel_own, False)
    if culprit is not None:
        outcome["display"] = None
        unloaded["the cell's value"] = ("the cell's value", culprit[1], _why_unloaded("the cell's value", *culprit))
    outcome["unloaded"] = list(unloaded.values())
    return outcome


def _failed_inside(
    value: Any, marks: Mapping[int, tuple[str, Exception]], skip: set[int], as_attributes: bool
) -> tuple[str, str, Exception] | None:
    """(where, class, error) of the nearest failed object ``value`` is or holds (where: ``""`` for
    itself, ``.extra``, ``['key']``, ``[0]``); None if it holds none. ``as_attributes``: ``value`` is
    a dict of an object's attributes (what refills it)."""
    torch = sys.modules.get("torch")
    opaque = (type, types.ModuleType, types.FunctionType, types.CodeType, *((torch.Tensor,) if torch else ()))
    pending, seen = collections.deque([("", value)]), set(skip)
    while pending and len(seen) < len(skip) + _WALK_LIMIT:
        where, obj = pending.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if id(obj) in marks:
            return (where, *marks[id(obj)])
        if not isinstance(obj, opaque):
            pending.extend(_named_parts(obj, where, as_attributes and obj is value))
    return None


def _named_parts(obj: Any, where: str, as_attributes: bool) -> list[tuple[str, Any]]:
    """What ``obj`` holds, each with the Python that reaches it from ``where``."""
    if isinstance(obj, dict):
        return [(f"{where}.{k}" if as_attributes else f"{where}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
    held = {} if isinstance(obj, (set, frozenset)) else reach.attributes(obj)
    if held:
        return [(f"{where}.{k}", v) for k, v in held.items()]
    return [(where, part) for part in gc.get_referents(obj)]  # what it keeps otherwise (a deque's items)


def _why_unloaded(name: str, where: str, kind: str, error: Exception) -> str:
    what = "it" if not where else f"`{name}{where}` (a {kind})"
    whole = name if name == "the cell's value" else f"`{name}`"
    return (
        f"{what} could not be rebuilt in the kernel ({type(error).__name__}: {error}), so none of {whole} "
        "was loaded; make that object in the kernel from what it is made of, or keep something plainer "
        "in its place (its settings)"
    )


@dataclass
class ApplyReport:
    """What applying rank 0's result did to the user's namespace: names updated, deleted, and skipped (why)."""

    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, why)


def apply_result(
    outcome: Mapping[str, Any], shipped: Mapping[str, Any], user_ns: dict[str, Any], deleted: Iterable[str] = ()
) -> ApplyReport:
    """Put rank 0's outcome into the kernel, as if the cell had run there.

    Order matters: weights first (an optimizer's state is loaded against them), then
    optimizers and schedulers, then plain values; a name the cell rebound wins over an
    in-place update of the object it used to hold.

    Each object is loaded whole or not at all: one that cannot be is named in
    ``report.skipped`` with why and what to do, keeps its kernel value, and the others load.
    """
    report = ApplyReport(skipped=list(outcome.get("unloaded", ())))  # what the kernel could not rebuild
    for name, (state, modes, *own) in outcome.get("modules", {}).items():
        module, params = shipped[name], own[0] if own else None
        try:
            if module_differs(module, state, modes) or parameters_differ(module, params):
                load_module_state(module, state, modes)
                load_parameter_states(module, params)
                report.updated.append(name)
        except Exception as error:  # noqa: BLE001 - one bad object must not stop the rest
            report.skipped.append((name, type_name(module), f"its weights could not be loaded ({error})"))
    _apply_optimizers(outcome, shipped, report)
    for name, state in outcome.get("schedulers", {}).items():
        target = shipped[name]
        try:
            if target.state_dict() != state:
                target.load_state_dict(state)
                report.updated.append(name)
        except Exception as error:  # noqa: BLE001 - one bad object must not stop the rest
            report.skipped.append((name, type_name(target), f"its state could not be loaded ({error})"))
    _apply_objects(outcome, shipped, user_ns, report)
    for name, value in outcome.get("bound", {}).items():
        user_ns[name] = value
        if name not in report.updated:
            report.updated.append(name)
    for name in deleted:
        if name in user_ns:
            del user_ns[name]
            report.deleted.append(name)
    set_rng_states(outcome.get("rng"))
    report.updated = list(dict.fromkeys(report.updated))  # a model's weights and its attributes: named once
    return report


def _apply_objects(
    outcome: Mapping[str, Any], shipped: Mapping[str, Any], user_ns: dict[str, Any], report: ApplyReport
) -> None:
    """Refill the kernel's plain objects the cell changed; copy into, or rebind, those that travelled whole."""
    places = outcome.get("places", {})
    for name, held in outcome.get("contents", {}).items():
        why = _refill(shipped[name], held)  # what it held, the kernel's own objects by reference
        _record(report, name, shipped[name], why)
    for kind, fits in (("tensors", _fill), ("changed", update_in_place)):  # in place, or rebound where it does not fit
        for name, value in outcome.get(kind, {}).items():
            why = None if fits(shipped[name], value) else _rebind(user_ns, shipped, places.get(name), name, value)
            _record(report, name, shipped[name], why)


def _record(report: ApplyReport, name: str, target: Any, why: str | None) -> None:
    if why is None:
        report.updated.append(name)
    else:
        report.skipped.append((name, type_name(target), why))


def _refill(target: Any, held: Any) -> str | None:
    """:func:`reach.refill`, whole or not at all: why not (None: done)."""
    before = reach.contents(target)
    try:
        reach.refill(target, held)
    except Exception as error:  # noqa: BLE001 - one bad object must not stop the rest
        with contextlib.suppress(Exception):  # back to what it held: never half of each
            reach.refill(target, before)
        return (
            f"it could not be refilled in place ({type(error).__name__}: {error}), so it was left as it was; "
            "rebind it in the cell to a new object, or run this change in the kernel"
        )
    return None


def _apply_optimizers(outcome: Mapping[str, Any], shipped: Mapping[str, Any], report: ApplyReport) -> None:
    """Load each optimizer's state, the optimizers it wraps and its own attributes: all of them, or none."""
    inner_states = outcome.get("inner_optimizers", {})
    for name, state in outcome.get("optimizers", {}).items():
        target = shipped[name]
        try:
            inner = inner_states.get(name, {})
            loads = [optimizer_loader(target, state)]
            loads += [optimizer_loader(getattr(target, key), held) for key, held in inner.items()]
        except Exception as error:  # noqa: BLE001 - one bad object must not stop the rest
            report.skipped.append((name, type_name(target), f"its state could not be loaded ({error})"))
            continue
        for load in loads:
            load()
        for key, value in outcome.get("optimizer_attributes", {}).get(name, {}).items():
            set_attribute(target, key, value)
        report.updated.append(name)


def optimizer_loader(optimizer: Any, state: Mapping[str, Any]) -> Callable[[], None]:
    """A function loading ``state`` (an ``Optimizer.state_dict()``) into ``optimizer``; raises now if it cannot.

    ``Optimizer.load_state_dict`` binds new ``state`` and ``param_groups`` objects, so an
    optimizer that shares them with one it wraps (SAM's base optimizer, a Lookahead's inner
    one) would part from it, and it needs what ``Optimizer.__init__`` sets, which such a wrapper
    may never have called. So the state is loaded into a stand-in over the same parameters
    (torch's checks, and each tensor cast to its parameter's device and dtype), then copied into
    the optimizer's own dicts. A class with its own ``load_state_dict`` is loaded its own way.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> groups = opt.param_groups
    >>> saved = {**groups[0], "params": [0], "lr": 0.5}
    >>> state = {"state": {0: {"momentum_buffer": torch.full((2,), 3.0)}}, "param_groups": [saved]}
    >>> optimizer_loader(opt, state)()
    >>> opt.param_groups is groups, groups[0]["lr"], opt.state[w]["momentum_buffer"].tolist()
    (True, 0.5, [3.0, 3.0])
    """
    # deferred: start-up time (torch)
    import torch

    if type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return functools.partial(optimizer.load_state_dict, state)
    stand_in = _stand_in_class()([{"params": group["params"]} for group in optimizer.param_groups])
    stand_in.load_state_dict(state)
    optimizer.state  # noqa: B018 - an optimizer without one fails here, before anything is loaded
    return functools.partial(_copy_optimizer_state, optimizer, stand_in)


@functools.cache
def _stand_in_class() -> type:
    """A bare optimizer class: what torch's ``load_state_dict`` needs, nothing of a step."""
    # deferred: start-up time (torch)
    import torch

    class StandIn(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

    return StandIn


def _copy_optimizer_state(optimizer: Any, loaded: Any) -> None:
    """``loaded``'s state and hyperparameters into ``optimizer``'s own dicts (their identities kept)."""
    optimizer.state.clear()
    optimizer.state.update(loaded.state)
    for group, new in zip(optimizer.param_groups, loaded.param_groups, strict=True):
        params = group["params"]
        group.clear()
        group.update(new)
        group["params"] = params


def module_differs(module: Any, state: Mapping[str, Any], modes: Iterable[tuple[str, bool]]) -> bool:
    """Whether loading ``state`` and ``modes`` would change ``module`` at all."""
    # deferred: start-up time (torch)
    import torch

    own = module.state_dict()
    if own.keys() != state.keys():
        return True
    if any(module.get_submodule(path).training != training for path, training in modes):
        return True
    return any(
        not isinstance(own[k], torch.Tensor)
        or own[k].shape != state[k].shape
        or not torch.equal(own[k], state[k].to(device=own[k].device, dtype=own[k].dtype))
        for k in own
    )


def load_module_state(module: Any, state: Mapping[str, Any], modes: Iterable[tuple[str, bool]]) -> None:
    """Copy ``state`` into ``module``'s own tensors (their devices and dtypes stay), and train/eval modes.

    All of them or, where one does not fit, none (torch's own loading copies those that fit, then raises).
    """
    own = module.state_dict()
    unfit = sorted(own.keys() ^ state.keys()) or [k for k in own if _shape(own[k]) != _shape(state[k])]
    if unfit:
        raise ValueError(f"{', '.join(unfit[:5])} differ from the kernel's model in name or shape")
    module.load_state_dict(state, strict=True)  # copy_ under no_grad, per tensor
    for path, training in modes:
        module.get_submodule(path).training = training


def _shape(value: Any) -> Any:
    return getattr(value, "shape", None)


def parameters_differ(module: Any, params: Iterable[tuple[str, bool, Any]] | None) -> bool:
    """Whether ``params`` (path, requires_grad, grad or None per parameter) differ from ``module``'s own."""
    # deferred: start-up time (torch)
    import torch

    for path, requires_grad, grad in params or ():
        own = module.get_parameter(path)
        if own.requires_grad != requires_grad or (own.grad is None) != (grad is None):
            return True
        if grad is not None and (own.grad.shape != grad.shape or not torch.equal(own.grad, grad.to(own.grad))):
            return True
    return False


def load_parameter_states(module: Any, params: Iterable[tuple[str, bool, Any]] | None) -> None:
    """Set each parameter's ``requires_grad`` and ``.grad`` as the cell left them, in the kernel's own
    parameters (a grad of the same shape is copied into, keeping its tensor; None stays None)."""
    # deferred: start-up time (torch)
    import torch

    for path, requires_grad, grad in params or ():
        own = module.get_parameter(path)
        own.requires_grad_(requires_grad)
        if grad is None:
            own.grad = None
        elif own.grad is not None and own.grad.shape == grad.shape:
            with torch.no_grad():
                own.grad.copy_(grad)
        else:
            own.grad = grad.to(device=own.device, dtype=own.dtype)


def update_in_place(target: Any, value: Any) -> bool:
    """Make ``target`` equal ``value`` keeping its identity; False when only rebinding can.

    For what travels whole (a set, an array, a dict of a subclass): a list, a dict or an
    object whose state is its attributes travels as what it holds (:func:`nbtrain.messages.reach.refill`).

    >>> history = [1]; update_in_place(history, [1, 2]), history
    (True, [1, 2])
    """
    if type(target) is not type(value):
        return False
    if isinstance(target, list):
        target[:] = value
    elif isinstance(target, dict):
        target.clear()
        target.update(value)
    elif isinstance(target, (set, bytearray)):
        target.clear()
        target.update(value) if isinstance(target, set) else target.extend(value)
    elif type(target).__name__ == "ndarray" and getattr(target, "shape", None) == getattr(value, "shape", ()):
        target[...] = value
    elif dataclasses.is_dataclass(target) and not hasattr(target, "__dict__"):  # its fields are its state
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(target) if hasattr(value, f.name)}
        for key, held in fields.items():  # past __setattr__, as a frozen dataclass's own __init__ sets them
            object.__setattr__(target, key, held)
    else:
        return False
    return True


def set_attribute(target: Any, key: str, value: Any) -> None:
    """Set ``target.key`` to ``value``, copying into its tensors where they fit (so what shares them still does).

    >>> class Box: pass
    >>> box = Box(); box.items = [1]; same = box.items
    >>> set_attribute(box, "items", [1]); box.items is same
    True
    """
    if not _fill(getattr(target, key, None), value):
        setattr(target, key, value)


def _fill(current: Any, value: Any) -> bool:
    """Copy ``value`` into ``current`` where it fits whole (:func:`_copy_into`); False (nothing copied) where not."""
    return _copy_into(current, value, check=True) and _copy_into(current, value, check=False)


def _copy_into(current: Any, value: Any, *, check: bool) -> bool:
    """Whether ``value`` fits into ``current`` (same-shape tensors, same-length lists); copies it unless ``check``."""
    torch = sys.modules.get("torch")
    if current is value:
        return True
    if torch is not None and isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
        if current.shape != value.shape or current.dtype != value.dtype:
            return False
        if not check:
            with torch.no_grad():
                current.copy_(value)
        return True
    if isinstance(current, list) and isinstance(value, list) and len(current) == len(value):
        return all(_copy_into(c, v, check=check) for c, v in zip(current, value, strict=True))
    return current == value if type(current) is type(value) and isinstance(value, (int, float, str)) else False


def _rebind(user_ns: dict[str, Any], shipped: Mapping[str, Any], held: Any, name: str, value: Any) -> str | None:
    """Put ``value`` where the kernel's object ``name`` was: a global, or the place ``held`` inside one.

    Why it could not (None: done): its holder refuses another object (a tuple, a class that
    refuses the attribute).
    """
    if held is None:
        user_ns[name] = value
        return None
    holder, (how, key) = held.root + reach.steps_as_python(held.steps[:-1]), held.steps[-1]
    try:
        _put(shipped, held, value)
    except Exception as error:  # noqa: BLE001 - one bad object must not stop the rest
        example = f" (for a dataclass: `{holder} = dataclasses.replace({holder}, {key}=...)`)" if how == "attr" else ""
        return (
            f"it cannot be changed in place, and `{holder}` cannot hold a new one ({type(error).__name__}: {error}); "
            f"rebind `{holder}` in the cell to a new object holding it{example}"
        )
    return None


def _put(shipped: Mapping[str, Any], held: Any, value: Any) -> None:
    """:func:`reach.put`; a frozen dataclass's field is set past its ``__setattr__``, as its own
    ``__init__`` sets it (and :func:`reach.refill` its slots)."""
    owner = reach.resolve(shipped, dataclasses.replace(held, steps=held.steps[:-1]))
    how, key = held.steps[-1]
    if how == "attr" and getattr(getattr(type(owner), "__dataclass_params__", None), "frozen", False):
        object.__setattr__(owner, key, value)
    else:
        reach.put(shipped, held, value)
