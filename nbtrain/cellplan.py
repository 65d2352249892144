"""How many steps a ``%%distributed`` cell will take, read from its code before it runs.

The live view's progress bar needs a total. A data scientist writes::

    for epoch in range(3):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()

and the run's step number goes up once per ``loss.backward()`` (auto mode logs that loss)
or once per ``nbtrain.log(...)`` call. When the one statement that advances the step runs
exactly once per iteration of loops whose lengths are known, the total is their product:
here 3 x the batches of ``loader`` per rank.

A wrong total is worse than none, so every rule is strict and anything else gives None:

- exactly one call site advances the step (one ``.backward()`` in auto mode, one
  ``nbtrain.log(...)`` otherwise), as a statement of its own, with no explicit ``step=``;
- between it and the top of the cell there are only ``for`` loops (their bodies, not
  their ``else``) and ``with`` blocks: no ``if``, ``while``, ``try``, function or
  comprehension, and no ``break`` or ``continue`` of any of those loops;
- each loop iterates ``range(...)``, ``enumerate(<known>)`` or a kernel name whose length
  per rank is known (a DataLoader); ``range`` arguments are int literals, simple
  arithmetic, ``len(<known>)``, or names holding an int: a kernel global the cell never
  rebinds, or one top-level ``name = <int expression>`` of the cell before the loops.

Pure: it reads source text and the values the kernel hands it; no torch, no processes.

Example:
    >>> cell = '''
    ... for epoch in range(epochs):
    ...     for x, y in loader:
    ...         loss = loss_fn(model(x), y)
    ...         opt.zero_grad(); loss.backward(); opt.step()
    ... '''
    >>> total_steps(cell, StepCounter("backward"), ints={"epochs": 3}, lengths={"loader": 7})
    21
    >>> uncertain = cell.replace("for x, y in loader", "while True")  # how long does it loop?
    >>> total_steps(uncertain, StepCounter("backward"), ints={"epochs": 3}) is None
    True
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Callable, Container, Mapping

BACKWARD = "backward"  # the step is the number of loss.backward() calls (auto mode logs that loss)
LOG = "log"  # the step is the number of nbtrain.log(...) calls
LOG_MODULES = ("nbtrain", "nbtrain.rank.api")  # where ``log`` can be imported from

_ARITHMETIC: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


@dataclass(frozen=True)
class StepCounter:
    """What advances a rank's step number while the cell runs.

    ``kind`` is :data:`BACKWARD` (auto mode's loss logging) or :data:`LOG` (the cell calls
    ``nbtrain.log`` itself). For :data:`LOG`, ``log_modules`` are the kernel's names for the
    nbtrain module and ``log_functions`` its names for ``nbtrain.log``; imports in the cell
    itself are read from the cell.
    """

    kind: str
    log_modules: frozenset[str] = frozenset({"nbtrain"})
    log_functions: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in (BACKWARD, LOG):
            raise ValueError(f"a step counter is {BACKWARD!r} or {LOG!r}, not {self.kind!r}")


class _Unknown(Exception):
    """The cell's total cannot be known for sure."""


def total_steps(
    code: str,
    counter: StepCounter,
    *,
    ints: Mapping[str, int] | None = None,
    lengths: Mapping[str, int] | None = None,
    kernel_globals: Container[str] = (),
) -> int | None:
    """The number of steps the cell's code will log on a rank, or None when unsure.

    ``ints``: kernel globals holding ints (name -> value); ``lengths``: kernel globals the
    cell may loop over (name -> items per rank, e.g. a DataLoader's batches after
    prepare). ``kernel_globals``: every kernel global name, so that a kernel's own
    ``range`` or ``enumerate`` is not taken for the builtin.

    >>> total_steps("for i in range(2, 10, 3):\\n    nbtrain.log(loss=i)\\n", StepCounter(LOG))
    3
    >>> total_steps("for i in range(10):\\n    if i % 2:\\n        nbtrain.log(loss=i)\\n", StepCounter(LOG)) is None
    True
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    try:
        total = _Plan(tree, counter, ints or {}, lengths or {}, kernel_globals).total()
    except _Unknown:
        return None
    return total if total > 0 else None


class _Plan:
    def __init__(
        self,
        tree: ast.Module,
        counter: StepCounter,
        ints: Mapping[str, int],
        lengths: Mapping[str, int],
        kernel_globals: Container[str],
    ) -> None:
        self.tree = tree
        self.counter = counter
        self.ints = ints
        self.lengths = lengths
        self.kernel_globals = kernel_globals
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.bindings = _bindings(tree)
        self.log_modules = set(counter.log_modules)
        self.log_functions = set(counter.log_functions)
        for node in ast.walk(tree):  # the cell's own imports of nbtrain / nbtrain.log
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "nbtrain":
                        self.log_modules.add(alias.asname or "nbtrain")
            elif isinstance(node, ast.ImportFrom) and node.module in LOG_MODULES:
                for alias in node.names:
                    if alias.name == "log":
                        self.log_functions.add(alias.asname or "log")

    # -- the step's one call site ---------------------------------------------------------
    def total(self) -> int:
        if self.counter.kind == LOG:
            for name in self.log_modules | self.log_functions:
                if any(not _imports_nbtrain(statement, name) for statement in self.bindings.get(name, ())):
                    raise _Unknown(f"{name} is rebound in the cell: its calls may not be nbtrain.log")
        site = self._the_counting_call()
        statement = self.parents.get(site)
        if not isinstance(statement, ast.Expr):
            raise _Unknown("the counting call is part of a larger expression")
        loops: list[ast.For] = []
        child: ast.AST = statement
        parent = self.parents[child]
        while not isinstance(parent, ast.Module):
            if isinstance(parent, ast.For) and _in_body(parent, child):
                loops.append(parent)
            elif not (isinstance(parent, ast.With) and _in_body(parent, child)):
                raise _Unknown(f"the counting call is inside {type(parent).__name__}")
            child, parent = parent, self.parents[parent]
        top_index = self.tree.body.index(child)  # type: ignore[arg-type]
        total = 1
        for loop in loops:
            if _jumps(loop):
                raise _Unknown("a loop around the counting call has break or continue")
            total *= self._iterations(loop.iter, top_index)
        return total

    def _the_counting_call(self) -> ast.Call:
        sites = []
        for node in ast.walk(self.tree):
            called_here = isinstance(self.parents.get(node), ast.Call) and self.parents[node].func is node
            if self._is_counter(node):
                if not called_here:
                    raise _Unknown("the step counter is referred to without being called (an alias?)")
                call = self.parents[node]
                if self._counts(call):  # type: ignore[arg-type]
                    sites.append(call)
        if len(sites) != 1:
            raise _Unknown(f"{len(sites)} places advance the step")
        return sites[0]

    def _is_counter(self, node: ast.AST) -> bool:
        if self.counter.kind == BACKWARD:
            return isinstance(node, ast.Attribute) and node.attr == "backward"
        if isinstance(node, ast.Attribute) and node.attr == "log" and isinstance(node.value, ast.Name):
            return node.value.id in self.log_modules
        return isinstance(node, ast.Name) and node.id in self.log_functions and isinstance(node.ctx, ast.Load)

    def _counts(self, call: ast.Call) -> bool:
        """Whether this call advances the step by one; raises when that depends on values."""
        keywords = {k.arg for k in call.keywords}
        if None in keywords or any(isinstance(a, ast.Starred) for a in call.args):
            raise _Unknown("** or * arguments")
        if self.counter.kind == BACKWARD:
            owner = call.func.value  # type: ignore[attr-defined]
            if _dotted(owner).rsplit(".", 1)[-1] == "autograd":
                raise _Unknown("torch.autograd.backward logs nothing")
            if call.args or "gradient" in keywords:
                raise _Unknown("backward with a gradient logs nothing")
            return True
        if call.args or "step" in keywords:
            raise _Unknown("an explicit step: the cell numbers its steps itself")
        return bool(keywords)  # log() with no scalars does nothing

    # -- how often a loop runs ------------------------------------------------------------
    def _iterations(self, iterable: ast.expr, top_index: int) -> int:
        if isinstance(iterable, ast.Name):
            if iterable.id in self.bindings:
                raise _Unknown(f"{iterable.id} is rebound in the cell")
            if iterable.id not in self.lengths:
                raise _Unknown(f"the length of {iterable.id} is not known")
            return int(self.lengths[iterable.id])
        if isinstance(iterable, ast.Call) and self._is_builtin(iterable.func, "range") and not iterable.keywords:
            if not 1 <= len(iterable.args) <= 3:
                raise _Unknown("range() with a strange number of arguments")
            bounds = [self._int(arg, top_index) for arg in iterable.args]
            if len(bounds) == 3 and bounds[2] == 0:
                raise _Unknown("range() with a step of 0 raises")
            try:
                return len(range(*bounds))
            except OverflowError:  # more steps than a Python int index: no one waits for those
                raise _Unknown("range() too long") from None
        if isinstance(iterable, ast.Call) and self._is_builtin(iterable.func, "enumerate"):
            keywords = [k.arg for k in iterable.keywords]
            if len(iterable.args) + len(keywords) > 2 or keywords not in ([], ["start"]) or not iterable.args:
                raise _Unknown("enumerate() with strange arguments")
            if any(isinstance(a, ast.Starred) for a in iterable.args):
                raise _Unknown("enumerate(*...)")
            return self._iterations(iterable.args[0], top_index)
        raise _Unknown(f"cannot tell how often a loop over {ast.dump(iterable)[:60]} runs")

    def _int(self, node: ast.expr, before: int) -> int:
        """The int ``node`` evaluates to when the top-level statement ``before`` runs."""
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._int(node.operand, before)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = self._int(node.left, before), self._int(node.right, before)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise _Unknown("division by zero")
            return _ARITHMETIC[type(node.op)](left, right)
        if (
            isinstance(node, ast.Call)
            and self._is_builtin(node.func, "len")
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Name)
            and not node.keywords
        ):
            return self._iterations(node.args[0], before)  # len(loader) on a rank: its batches there
        if isinstance(node, ast.Name):
            return self._name_int(node.id, before)
        raise _Unknown(f"not an int the kernel knows: {ast.dump(node)[:60]}")

    def _name_int(self, name: str, before: int) -> int:
        bound = self.bindings.get(name)
        if bound is None:
            value = self.ints.get(name)
            if type(value) is not int:
                raise _Unknown(f"{name} is not an int the kernel knows")
            return value
        # Bound in the cell: only one plain top-level assignment before the loops is certain.
        if len(bound) != 1:
            raise _Unknown(f"{name} is bound {len(bound)} times in the cell")
        statement = bound[0]
        if statement not in self.tree.body:
            raise _Unknown(f"{name} is bound inside a block")
        index = self.tree.body.index(statement)
        if index >= before:
            raise _Unknown(f"{name} is bound after the loop starts")
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            raise _Unknown(f"{name} is not bound by a plain assignment")
        if not (isinstance(target, ast.Name) and target.id == name):
            raise _Unknown(f"{name} is bound by unpacking")
        return self._int(value, index)

    def _is_builtin(self, func: ast.expr, name: str) -> bool:
        return (
            isinstance(func, ast.Name)
            and func.id == name
            and name not in self.bindings
            and name not in self.kernel_globals
        )


def _imports_nbtrain(statement: ast.AST, name: str) -> bool:
    """Does ``statement`` bind ``name`` to nbtrain (``import nbtrain``) or its log (``from nbtrain import log``)?"""
    if isinstance(statement, ast.Import):
        return all(
            alias.name == "nbtrain" or (alias.asname is None and alias.name.startswith("nbtrain."))
            for alias in statement.names
            if (alias.asname or alias.name.split(".", 1)[0]) == name
        )
    if isinstance(statement, ast.ImportFrom) and statement.module in LOG_MODULES:
        return all(alias.name == "log" for alias in statement.names if (alias.asname or alias.name) == name)
    return False


def _in_body(block: ast.For | ast.With, child: ast.AST) -> bool:
    return any(statement is child for statement in block.body)


def _jumps(loop: ast.For) -> bool:
    """Does ``loop`` contain a break or continue of its own (not of a loop inside it)?"""
    pending: list[ast.AST] = list(loop.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Break, ast.Continue)):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            pending.extend(node.orelse)  # the else of an inner loop: a break there is ours
            continue
        pending.extend(ast.iter_child_nodes(node))
    return False


def _bindings(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Every name the cell binds anywhere (nested scopes too, to be safe) -> the statements that do."""
    found: dict[str, list[ast.AST]] = {}
    statement_of: dict[ast.AST, ast.AST] = {}
    for statement in ast.walk(tree):  # outer statements first, so the innermost one wins
        if isinstance(statement, ast.stmt):
            for node in ast.walk(statement):
                statement_of[node] = statement

    def bind(name: str | None, node: ast.AST) -> None:
        if name:
            found.setdefault(name, []).append(statement_of.get(node, node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bind(node.id, node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bind(alias.asname or alias.name.split(".", 1)[0], node)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                bind(name, node)
        elif isinstance(node, ast.ExceptHandler):
            bind(node.name, node)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)):
            bind(node.name, node)
        elif isinstance(node, ast.MatchMapping):
            bind(node.rest, node)
    return found


def _dotted(node: ast.AST) -> str:
    """``torch.autograd`` for that attribute chain; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""
