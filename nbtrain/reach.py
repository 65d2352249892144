"""Models, optimizers, schedulers and loaders that a cell's globals hold inside other objects.

Training code often keeps its model in another object: ``trainer.model``,
``models["generator"]``, a dataclass field, a list of models. :func:`find_held` finds
the torch objects one or two steps inside the cell's globals (through dicts, lists,
tuples, dataclasses, ``SimpleNamespace`` and instances of notebook classes), so the
ranks can prepare them like top-level ones and the kernel can load their state back
into the same objects. Each is named by the expression that reaches it
(``trainer.model``), which is how the summary and the result name it.

Pure: it imports neither torch nor anything else; torch's classes are looked up only
when torch is already imported.

Example:
    >>> import types
    >>> box = types.SimpleNamespace(settings={"lr": 0.1})
    >>> find_held({"box": box})   # no torch object inside
    []
    >>> resolve({"box": box}, Held("box.settings['lr']", "box", (("attr", "settings"), ("key", "lr")), "plain"))
    0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

DEPTH = 2  # steps inside a global: trainer.model (1), trainer.models["g"] (2)
ITEMS = 64  # the items of one container looked at: a list of data is not a list of models


@dataclasses.dataclass(frozen=True)
class Held:
    """One torch object held inside a global: where it is, and what it is."""

    label: str  # the expression that reaches it: "trainer.model", "models['g']"
    root: str  # the global it is inside
    steps: tuple[tuple[str, Any], ...]  # ("attr", name) | ("key", key) | ("index", i), from the global
    kind: str  # "module" | "optimizer" | "scheduler" | "loader"
    fixed: str = ""  # why its place cannot hold another object (a tuple), else ""


def torch_kind(obj: Any) -> str | None:
    """The kind of a torch object: "module", "optimizer", "scheduler", "loader"; None for anything else."""
    if "torch" not in sys.modules:
        return None
    nn = sys.modules.get("torch.nn.modules.module")
    optim = sys.modules.get("torch.optim.optimizer")
    schedulers = sys.modules.get("torch.optim.lr_scheduler")
    data = sys.modules.get("torch.utils.data.dataloader")
    if nn is not None and isinstance(obj, nn.Module):
        return "module"
    if optim is not None and isinstance(obj, optim.Optimizer):
        return "optimizer"
    if schedulers is not None and isinstance(obj, (schedulers.LRScheduler, schedulers.ReduceLROnPlateau)):
        return "scheduler"
    if data is not None and isinstance(obj, data.DataLoader):
        return "loader"
    return None


def find_held(namespace: Mapping[str, Any]) -> list[tuple[Held, Any]]:
    """Each torch object held inside ``namespace``'s values (not the values themselves), with its label.

    An object reached along several paths, or also a global itself, is listed once (its
    first place); globals are visited in sorted order, so both sides of a run agree.
    """
    if "torch" not in sys.modules:
        return []  # no torch object can exist
    tops = {id(value) for value in namespace.values()}
    seen: set[int] = set()
    found: list[tuple[Held, Any]] = []
    for name in sorted(namespace):
        value = namespace[name]
        if torch_kind(value) is not None:
            continue
        for steps, obj, fixed in _inside(value, (), {id(value)}):
            kind = torch_kind(obj)
            if kind is None or id(obj) in tops or id(obj) in seen:
                continue
            seen.add(id(obj))
            found.append((Held(name + steps_as_python(steps), name, steps, kind, fixed), obj))
    return found


def _inside(
    value: Any, steps: tuple[tuple[str, Any], ...], path: set[int]
) -> Iterator[tuple[tuple[tuple[str, Any], ...], Any, str]]:
    """(steps, object, why its place is fixed) for what ``value`` holds, up to DEPTH steps."""
    if len(steps) >= DEPTH:
        return
    for step, child in _children(value):
        if id(child) in path:
            continue  # a cycle
        here = (*steps, step)
        yield here, child, "a tuple cannot hold another object" if isinstance(value, tuple) else ""
        if torch_kind(child) is None:
            yield from _inside(child, here, path | {id(child)})


def _children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    try:
        return _listed_children(value)
    except Exception:  # noqa: BLE001 - an object that cannot be looked into holds nothing we prepare
        return []


def _listed_children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    if isinstance(value, dict):
        items = [(k, v) for k, v in itertools.islice(value.items(), ITEMS) if isinstance(k, (str, int))]
        return [(("key", k), v) for k, v in items]
    if isinstance(value, (list, tuple)):
        return [(("index", i), v) for i, v in enumerate(itertools.islice(value, ITEMS))]
    if _is_holder(value):
        return [(("attr", k), v) for k, v in itertools.islice(vars(value).items(), ITEMS) if not k.startswith("__")]
    return []


def _is_holder(value: Any) -> bool:
    return torch_kind(value) is None and is_users_object(value)


def is_users_object(value: Any) -> bool:
    """An object whose attributes are the user's: a notebook class's instance, a dataclass, a
    ``SimpleNamespace`` or argparse ``Namespace`` (not a class, not a module).

    >>> is_users_object(types.SimpleNamespace(lr=0.1)), is_users_object(types)
    (True, False)
    """
    if isinstance(value, (type, types.ModuleType)) or not hasattr(value, "__dict__"):
        return False
    cls = type(value)
    plain = cls.__module__ == "__main__" or dataclasses.is_dataclass(cls)
    return plain or isinstance(value, (types.SimpleNamespace, argparse.Namespace))


def steps_as_python(steps: tuple[tuple[str, Any], ...]) -> str:
    """The steps as Python: ``.model``, ``['g']``, ``[0]``."""
    return "".join(f".{key}" if how == "attr" else f"[{key!r}]" for how, key in steps)


def resolve(namespace: Mapping[str, Any], held: Held) -> Any:
    """The object at ``held``'s place in ``namespace`` (KeyError, IndexError, AttributeError if gone)."""
    obj = namespace[held.root]
    for how, key in held.steps:
        obj = getattr(obj, key) if how == "attr" else obj[key]
    return obj


def put(namespace: Mapping[str, Any], held: Held, value: Any) -> None:
    """Set ``held``'s place to ``value`` (what the holder raises, if it refuses)."""
    holder = namespace[held.root]
    for how, key in held.steps[:-1]:
        holder = getattr(holder, key) if how == "attr" else holder[key]
    how, key = held.steps[-1]
    if how == "attr":
        setattr(holder, key, value)
    else:
        holder[key] = value
