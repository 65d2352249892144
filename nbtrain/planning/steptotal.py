"""How many steps a ``%%distributed`` cell will take, read from its code before it runs.

The live view's progress bar needs a total. A data scientist writes::

    for epoch in range(3):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()

and the run's step number goes up once per ``loss.backward()`` (auto mode logs that loss)
or once per ``nbtrain.log(...)`` call. When each statement that advances the step runs
exactly once per iteration of loops whose lengths are known, the total is the sum, over
those statements, of the product of their loops: here 3 x the batches of ``loader`` per
rank. A loop that advances nothing (an evaluation loop without ``.backward()``) adds
nothing.

A loop over a DataLoader reads this rank's share when it runs with gradients enabled (a
training pass) and the whole loader under ``torch.no_grad()`` / ``torch.inference_mode()``
(an evaluation pass; see :mod:`nbtrain.rank.auto.preparedloaders`). The kernel hands both lengths
(``lengths`` and ``eval_lengths``); the ``with`` blocks around a loop say which applies.

A wrong total is worse than none, so every rule is strict and anything else gives None:

- each call site that advances the step (``.backward()`` in auto mode, ``nbtrain.log(...)``
  otherwise) is a statement of its own, with no explicit ``step=``;
- between it and the top of the cell there are only ``for`` loops (their bodies, not
  their ``else``) and ``with`` blocks: no ``if``, ``while``, ``try``, function or
  comprehension, and no ``break`` or ``continue`` of any of those loops;
- each loop iterates ``range(...)``, ``enumerate(<known>)`` or a kernel name whose length
  per rank is known (a DataLoader); ``range`` arguments are int literals, simple
  arithmetic, ``len(<known>)``, or names holding an int: a kernel global the cell never
  rebinds, or one top-level ``name = <int expression>`` of the cell before the loops;
- where a loader's two lengths differ, its loop's grad mode must be certain: set only by
  ``with torch.no_grad()``, ``torch.inference_mode()``, ``torch.enable_grad()`` or
  ``torch.set_grad_enabled(<True or False>)``, never by a call outside a ``with``.

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
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

BACKWARD = "backward"  # the step is the number of loss.backward() calls (auto mode logs that loss)
LOG = "log"  # the step is the number of nbtrain.log(...) calls
LOG_MODULES = ("nbtrain", "nbtrain.rank.api")  # where ``log`` can be imported from

# The context managers that switch gradients on or off, by their last name
# (``torch.no_grad``, ``torch.autograd.no_grad``, ``no_grad`` imported from torch).
GRAD_SWITCHES = frozenset({"no_grad", "enable_grad", "inference_mode", "set_grad_enabled"})

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
    code: str, counter: StepCounter, *, ints: Mapping[str, int] | None = None, lengths: Mapping[str, int] | None = None,
    eval_lengths: Mapping[str, int] | None = None, kernel_globals: Container[str] = (),
) -> int | None:
    """The number of steps the cell's code will log on a rank, or None when unsure.

    ``ints``: kernel globals holding ints (name -> value); ``lengths``: kernel globals the
    cell may loop over (name -> items per rank in a pass with gradients, e.g. a
    DataLoader's batches after prepare); ``eval_lengths``: the same for a pass without
    gradients (a loader evaluated whole: all its batches). ``kernel_globals``: every
    kernel global name, so that a kernel's own ``range`` or ``enumerate`` is not taken
    for the builtin.

    >>> total_steps("for i in range(2, 10, 3):\\n    nbtrain.log(loss=i)\\n", StepCounter(LOG))
    3
    >>> total_steps("for i in range(10):\\n    if i % 2:\\n        nbtrain.log(loss=i)\\n", StepCounter(LOG)) is None
    True
    >>> mixed = ("for x in loader:\\n    nbtrain.log(loss=x)\\n"
    ...          "with torch.no_grad():\\n    for x in loader:\\n        nbtrain.log(val=x)\\n")
    >>> total_steps(mixed, StepCounter(LOG), lengths={"loader": 4}, eval_lengths={"loader": 8})
    12
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    try:
        total = _Plan(tree, counter, ints or {}, lengths or {}, eval_lengths or {}, kernel_globals).total()
    except _Unknown:
        return None
    return total if total > 0 else None


class _Plan:
    def __init__(
        self, tree: ast.Module, counter: StepCounter, ints: Mapping[str, int], lengths: Mapping[str, int],
        eval_lengths: Mapping[str, int], kernel_globals: Container[str],
    ) -> None:
        self.tree, self.counter, self.kernel_globals = tree, counter, kernel_globals
        self.ints, self.lengths, self.eval_lengths = ints, lengths, eval_lengths
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.bindings = _bindings(tree)
        # Grad mode at the top of the cell: enabled, unless a call outside a ``with``
        # switches it somewhere (then no loop's mode is certain).
        self.top_without_grad: bool | None = None if _stray_grad_switch(tree, self.parents) else False
        self.log_modules = set(counter.log_modules)
        self.log_functions = set(counter.log_functions)
        for node in ast.walk(tree):  # the cell's own imports of nbtrain / nbtrain.log
            if isinstance(node, ast.Import):
                self.log_modules |= {alias.asname or "nbtrain" for alias in node.names if alias.name == "nbtrain"}
            elif isinstance(node, ast.ImportFrom) and node.module in LOG_MODULES:
                self.log_functions |= {alias.asname or "log" for alias in node.names if alias.name == "log"}

    # -- the call sites that advance the step ---------------------------------------------
    def total(self) -> int:
        if self.counter.kind == LOG:
            for name in self.log_modules | self.log_functions:
                if any(not _imports_nbtrain(statement, name) for statement in self.bindings.get(name, ())):
                    raise _Unknown(f"{name} is rebound in the cell: its calls may not be nbtrain.log")
        return sum(self._site_total(site) for site in self._counting_calls())

    def _site_total(self, site: ast.Call) -> int:
        """How often ``site`` runs: the product of the loops around it."""
        statement = self.parents.get(site)
        if not isinstance(statement, ast.Expr):
            raise _Unknown("the counting call is part of a larger expression")
        blocks: list[ast.For | ast.With] = []  # from the innermost out
        child: ast.stmt = statement
        parent = self.parents[child]
        while not isinstance(parent, ast.Module):
            if not (isinstance(parent, (ast.For, ast.With)) and any(s is child for s in parent.body)):
                raise _Unknown(f"the counting call is inside {type(parent).__name__}")
            blocks.append(parent)
            child, parent = parent, self.parents[parent]
        top_index = self.tree.body.index(child)
        total = 1
        for i, loop in enumerate(blocks):
            if not isinstance(loop, ast.For):
                continue
            if _jumps(loop):
                raise _Unknown("a loop around the counting call has break or continue")
            total *= self._iterations(loop.iter, top_index, self._without_grad(blocks[i + 1 :]))
        return total

    def _without_grad(self, outer: list[ast.For | ast.With]) -> bool | None:
        """Whether code inside ``outer`` (innermost first) runs with gradients off; None: unsure."""
        if self.top_without_grad is None:
            return None
        for block in outer:
            if isinstance(block, ast.With):
                enabled = _with_grad_mode(block)
                if enabled is not None:
                    return None if enabled is _UNSURE else not enabled
        return self.top_without_grad

    def _counting_calls(self) -> list[ast.Call]:
        sites: list[ast.Call] = []
        for node in ast.walk(self.tree):
            if not self._is_counter(node):
                continue
            call = self.parents.get(node)
            if not (isinstance(call, ast.Call) and call.func is node):
                raise _Unknown("the step counter is referred to without being called (an alias?)")
            if self._counts(call):
                sites.append(call)
        if not sites:
            raise _Unknown("nothing in the cell advances the step")
        return sites

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
            if not isinstance(call.func, ast.Attribute):  # _is_counter: always <owner>.backward
                raise _Unknown("backward called by another name")
            owner = call.func.value
            if _dotted(owner).rsplit(".", 1)[-1] == "autograd":
                raise _Unknown("torch.autograd.backward logs nothing")
            if call.args or "gradient" in keywords:
                raise _Unknown("backward with a gradient logs nothing")
            return True
        if call.args or "step" in keywords:
            raise _Unknown("an explicit step: the cell numbers its steps itself")
        return bool(keywords)  # log() with no scalars does nothing

    # -- how often a loop runs ------------------------------------------------------------
    def _iterations(self, iterable: ast.expr, top_index: int, without_grad: bool | None) -> int:
        if isinstance(iterable, ast.Name):
            if iterable.id in self.bindings:
                raise _Unknown(f"{iterable.id} is rebound in the cell")
            return self._length(iterable.id, without_grad)
        if isinstance(iterable, ast.Call) and self._is_builtin(iterable.func, "range") and not iterable.keywords:
            if not 1 <= len(iterable.args) <= 3:
                raise _Unknown("range() with a strange number of arguments")
            bounds = [self._int(arg, top_index, without_grad) for arg in iterable.args]
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
            return self._iterations(iterable.args[0], top_index, without_grad)
        raise _Unknown(f"cannot tell how often a loop over {ast.dump(iterable)[:60]} runs")

    def _length(self, name: str, without_grad: bool | None) -> int:
        """Items of the kernel's ``name`` per rank in a pass with (or without) gradients."""
        with_grad, evaluated = self.lengths.get(name), self.eval_lengths.get(name)
        if without_grad is None:  # the grad mode is unsure: fine only if both lengths agree
            if with_grad is None or with_grad != evaluated:
                raise _Unknown(f"the length of {name} depends on a grad mode that is not certain")
            return int(with_grad)
        length = evaluated if without_grad else with_grad
        if length is None:
            raise _Unknown(f"the length of {name} is not known")
        return int(length)

    def _int(self, node: ast.expr, before: int, without_grad: bool | None) -> int:
        """The int ``node`` evaluates to when the top-level statement ``before`` runs."""
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._int(node.operand, before, without_grad)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left = self._int(node.left, before, without_grad)
            right = self._int(node.right, before, without_grad)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise _Unknown("division by zero")
            return _ARITHMETIC[type(node.op)](left, right)
        if (isinstance(node, ast.Call) and self._is_builtin(node.func, "len") and not node.keywords
                and len(node.args) == 1 and isinstance(node.args[0], ast.Name)):
            return self._iterations(node.args[0], before, without_grad)  # len(loader) on a rank: its batches there
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
            target, expression = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, expression = statement.target, statement.value
        else:
            raise _Unknown(f"{name} is not bound by a plain assignment")
        if not (isinstance(target, ast.Name) and target.id == name):
            raise _Unknown(f"{name} is bound by unpacking")
        return self._int(expression, index, self.top_without_grad)  # a top-level statement

    def _is_builtin(self, func: ast.expr, name: str) -> bool:
        unbound = name not in self.bindings and name not in self.kernel_globals
        return isinstance(func, ast.Name) and func.id == name and unbound


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


class _Unsure:
    """A grad switch whose argument is not a literal: the mode it sets is not known."""


_UNSURE = _Unsure()


def _grad_switch(call: ast.Call) -> bool | _Unsure | None:
    """What ``call`` as a ``with`` item sets gradients to: True, False, _UNSURE, or None (not a switch)."""
    name = _dotted(call.func).rsplit(".", 1)[-1]
    if name not in GRAD_SWITCHES:
        return None
    if name in ("no_grad", "enable_grad"):
        return name == "enable_grad"
    arguments = [*call.args, *(k.value for k in call.keywords if k.arg in ("mode", None))]
    if not arguments and name == "inference_mode":
        return False
    if len(arguments) != 1 or not isinstance(arguments[0], ast.Constant) or type(arguments[0].value) is not bool:
        return _UNSURE
    if name == "inference_mode":  # inference_mode(False) leaves the mode as it was
        return False if arguments[0].value else None
    return arguments[0].value


def _with_grad_mode(block: ast.With) -> bool | _Unsure | None:
    """The grad mode inside ``block`` if its items set one (the last one wins), else None."""
    mode: bool | _Unsure | None = None
    for item in block.items:
        if isinstance(item.context_expr, ast.Call):
            switch = _grad_switch(item.context_expr)
            mode = switch if switch is not None else mode
    return mode


def _stray_grad_switch(tree: ast.Module, parents: Mapping[ast.AST, ast.AST]) -> bool:
    """Does the cell switch gradients by a call that is not a ``with`` item or a decorator?"""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or _grad_switch(node) is None:
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.withitem) and parent.context_expr is node:
            continue
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in parent.decorator_list:
            continue  # it switches inside that function only
        return True
    return False


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
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
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
