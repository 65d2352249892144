"""Numbers the notebook derived from ``len(loader)`` before a ``%%distributed`` cell.

Single-device code sizes things from its loader's length in an earlier cell: a
OneCycleLR's ``total_steps``, a warmup schedule's ``num_training_steps`` (a LambdaLR whose
function is a ``functools.partial`` or a closure that holds it, as schedule builders make
them), a progress bar's ``total``. Once auto mode shards the loader, each rank runs fewer
steps than that number, and the schedule never reaches its end. :func:`derived_lengths`
finds those numbers among the objects a cell uses, before it runs, and says for each what
is left and the fix; the summary prints it. Sizes taken of a sharded loader's dataset are
named too: a number equal to one (:func:`_dataset_sizes`), and ``len(loader.dataset)`` in
the cell or in a notebook function the cell passes the loader to (:func:`dataset_lengths`).

Example:
    >>> import functools, torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> train = DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=8, shuffle=True)
    >>> def warmup(step, num_training_steps): return 1 - step / num_training_steps
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup, num_training_steps=3 * len(train)))
    >>> print(derived_lengths({"sched": sched, "train": train}, 2, "ddp")[0])  # doctest: +NORMALIZE_WHITESPACE
    sched expects 24 steps; each rank runs 12 (3 x len(train): 8 batches in the kernel, 4 on each rank):
    create sched inside the %%distributed cell, where len(train) is each rank's
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import symtable
import textwrap
from collections.abc import Mapping
from typing import Any

from nbtrain.kernel import shell as kernel_shell
from nbtrain.messages import reach

# The names schedule builders give the length they were sized with.
_LENGTH_NAMES = ("num_training_steps", "total_steps", "num_steps", "max_steps")


def rebound_names(code: str) -> set[str]:
    """The names ``code`` binds at its top level: what it builds itself, not what it was sized with before.

    >>> sorted(rebound_names("sched = make(opt, 2 * len(train))\\nfor x in train: sched.step()"))
    ['sched', 'x']
    """
    table = symtable.symtable(code, "<cell>", "exec")
    return {symbol.get_name() for symbol in table.get_symbols() if symbol.is_assigned() or symbol.is_imported()}


def derived_lengths(
    objects: Mapping[str, Any], world_size: int, wrapper: str, rebound: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """One sentence per object among ``objects`` whose step count was sized from a loader auto mode shards.

    ``rebound``: names the cell binds itself (:func:`rebound_names`); objects under them are left out.
    """
    from nbtrain.rank import cell as rank_cell  # the ranks' own rule, through their entry point

    sharded: list[tuple[str, int, int]] = []  # (loader's name, its length, each rank's)
    for name, obj in objects.items():
        if reach.torch_kind(obj) == "loader":
            share = rank_cell.batches_per_rank(obj, world_size, wrapper)
            whole = rank_cell.batches_per_rank(obj, world_size, "none")
            if share is not None and whole and share != whole:
                sharded.append((name, whole, share))
    if not sharded:
        return []
    found = []
    for name in sorted(objects):
        if re.split(r"[.\[]", name, maxsplit=1)[0] in rebound:
            continue
        found += _dataset_sizes(name, objects[name], objects, world_size, wrapper)
        value = objects[name]
        counted = type(value) is int and (name in _LENGTH_NAMES or name.endswith("_steps"))
        expected = value if counted else expected_steps(value)
        match = next(((loader, n, s) for loader, n, s in sharded if expected and expected % n == 0), None)
        if expected and match is not None:
            found.append(_sentence(name, expected, *match, number=counted))
    return found


def _dataset_sizes(name: str, value: Any, objects: Mapping[str, Any], world_size: int, wrapper: str) -> list[str]:
    """Sentences for the numbers in ``value`` (an int, or a dict of them) that are the size of
    a sharded loader's dataset: a total over a training pass divided by one is a rank's part."""
    from nbtrain.rank import cell as rank_cell  # the ranks' own rule, through their entry point

    if type(value) is int:
        numbers = [(name, value)]
    elif isinstance(value, dict) and len(value) <= 16:
        numbers = [(f"{name}[{k!r}]", v) for k, v in value.items() if isinstance(k, (str, int)) and type(v) is int]
    else:
        return []
    found = []
    for label, number in numbers:
        for loader_name, loader in objects.items():
            read = rank_cell.samples_per_rank(loader, world_size, wrapper)
            if read is not None and number == len(loader.dataset) != read:
                found.append(
                    f"{label} is {number}, the size of {loader_name}{_DATASET_SIZE} {read}: a total over that "
                    f"pass divided by {label} is the rank's part, not the whole; divide by the samples the pass "
                    "read (count them in the loop) instead"
                )
                break
    return found


_DATASET_SIZE = "'s dataset, of which each rank's training pass reads"


def dataset_lengths(code: str, objects: Mapping[str, Any], world_size: int, wrapper: str) -> list[str]:
    """Sentences for each ``len(loader.dataset)`` the cell takes of a loader auto mode shards,
    itself or in a notebook function it calls with the loader (PyTorch's quickstart ``train()``).

    A training pass reads the rank's share of that loader, while ``len(loader.dataset)`` counts
    the whole dataset: a total over the pass divided by it is the rank's part, and a progress
    line ``[current/size]`` ends at the share.

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> train_dl = DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=8, shuffle=True)
    >>> print(dataset_lengths("size = len(train_dl.dataset)", {"train_dl": train_dl}, 2, "ddp")[0].split(":")[0])
    len(train_dl.dataset) is 64, the size of train_dl's dataset, of which each rank's training pass reads 32
    """
    from nbtrain.rank import cell as rank_cell  # the ranks' own rule, through their entry point

    found = []
    for loader_name, taken in _dataset_lengths_taken(code, objects):
        loader: Any = objects.get(loader_name)
        if reach.torch_kind(loader) != "loader":
            continue
        read, whole = rank_cell.samples_per_rank(loader, world_size, wrapper), len(loader.dataset)
        if read is not None and read != whole:
            found.append(
                f"{taken} is {whole}, the size of {loader_name}{_DATASET_SIZE} {read}: a total over that pass "
                f"divided by it is the rank's part, not the whole (and a count of samples seen ends at {read}); "
                "divide by the samples the pass read (count them in the loop) instead"
            )
    return list(dict.fromkeys(found))


def _dataset_lengths_taken(code: str, objects: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(loader's name, how the code takes its dataset's length) for each ``len(x.dataset)``, in the
    cell and in the notebook functions the cell calls with ``x`` as an argument."""
    try:
        cell = ast.parse(code)
    except SyntaxError:
        return []
    taken = [(name, f"len({name}.dataset)") for name in _lengths_of_datasets(cell)]
    for call in ast.walk(cell):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            continue
        name, function = call.func.id, objects.get(call.func.id)
        if getattr(function, "__module__", None) != "__main__" or not inspect.isfunction(function):
            continue  # only the notebook's own functions: their source is the notebook's
        try:
            inner = ast.parse(textwrap.dedent(inspect.getsource(function)))
            keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
            passed = inspect.signature(function).bind_partial(*call.args, **keywords)
        except (OSError, TypeError, ValueError, SyntaxError):
            continue
        arguments = {p: v.id for p, v in passed.arguments.items() if isinstance(v, ast.Name)}
        found = [p for p in _lengths_of_datasets(inner) if p in arguments]
        taken += [(arguments[p], f"len({p}.dataset) in {name}()") for p in found]
    return taken


def _lengths_of_datasets(tree: ast.AST) -> list[str]:
    """The names ``x`` of each ``len(x.dataset)`` in ``tree``."""
    names = []
    for node in ast.walk(tree):
        is_len = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
        taken = node.args[0] if is_len and len(node.args) == 1 else None  # type: ignore[attr-defined]
        if isinstance(taken, ast.Attribute) and taken.attr == "dataset" and isinstance(taken.value, ast.Name):
            names.append(taken.value.id)
    return names


def read_in_training(sentences: list[str], loader_report: list[tuple[str, str]]) -> list[str]:
    """``sentences`` without those on a dataset's size whose loader no training pass read (after the run).

    >>> said = ["n is 8, the size of val's dataset, of which each rank's training pass reads 4: ..."]
    >>> read_in_training(said, [("val", "evaluated whole on every rank (iterated without gradients)")])
    []
    """
    sharded = {name for name, how in loader_report if how.startswith("sharded")}
    parts = [(sentence, *sentence.partition(_DATASET_SIZE)[:2]) for sentence in sentences]
    return [sentence for sentence, head, sep in parts if not sep or head.rsplit(", the size of ", 1)[-1] in sharded]


def _sentence(name: str, expected: int, loader: str, whole: int, share: int, *, number: bool = False) -> str:
    epochs = expected // whole
    times = f"{epochs} x " if epochs > 1 else ""
    verb, act = ("is", "compute") if number else ("expects", "create")
    return (
        f"{name} {verb} {expected} steps; each rank runs {epochs * share} ({times}len({loader}): {whole} batches "
        f"in the kernel, {share} on each rank): {act} {name} inside the {kernel_shell.magic_name()} cell, "
        f"where len({loader}) is each rank's"
    )


def expected_steps(obj: Any) -> int | None:
    """The step count ``obj`` was built for: a OneCycleLR's, a schedule function's, a progress bar's total."""
    if reach.torch_kind(obj) == "scheduler":
        total = getattr(obj, "total_steps", None)  # OneCycleLR
        if isinstance(total, int):
            return total
        # LambdaLR, MultiplicativeLR: the first of its functions that holds a length
        return _first_int(_function_length(function) for function in getattr(obj, "lr_lambdas", ()) or ())
    if type(obj).__module__.split(".")[0] == "tqdm":  # a progress bar: tqdm(total=...) or tqdm(range(n))
        total = getattr(obj, "total", None)
        return total if isinstance(total, int) else None
    return None


def _function_length(function: Any) -> int | None:
    """``num_training_steps`` (or a like name) that a schedule function holds: partial, closure or default."""
    if isinstance(function, functools.partial):
        held = {k: v for k, v in function.keywords.items() if k in _LENGTH_NAMES}
        return _first_int(held.values()) if held else _function_length(function.func)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    cells = dict(zip(code.co_freevars, function.__closure__ or (), strict=False))
    values = []
    for name in _LENGTH_NAMES:
        if name in cells:
            with contextlib.suppress(ValueError):  # an empty cell
                values.append(cells[name].cell_contents)
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]  # no signature: only the closure tells
    values += [p.default for n, p in parameters.items() if n in _LENGTH_NAMES and p.default is not p.empty]
    return _first_int(values)


def _first_int(values: Any) -> int | None:
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
