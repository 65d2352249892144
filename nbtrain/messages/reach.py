"""What a cell's globals hold inside them: the objects the ranks track by where they are.

Training code often keeps its model in another object: ``trainer.model``,
``models["generator"]``, a dataclass field, a list of models, a trainer of a module beside
the notebook. :func:`find_reached` lists every object a few steps inside the cell's
globals (through dicts, lists, tuples and objects whose state is their attributes, of any
class), each named by the expression that reaches it (``trainer.model``). The ranks send
back each of those objects as a reference to where it was, and what changed in it: so the
kernel's objects stay the objects they were, shared where they were shared (``trainer.model
is model``), and only their contents change, as if the cell had run in the kernel.
The torch objects among them (:attr:`Held.preparable`) the ranks prepare in their places.

Pure: it imports neither torch nor anything else; torch's classes are looked up only
when torch is already imported.

Example:
    >>> import types
    >>> box = types.SimpleNamespace(settings={"lr": 0.1})
    >>> [h.label for h, _ in find_reached({"box": box}) if h.preparable]   # no torch object inside
    []
    >>> [h.label for h, _ in find_reached({"box": box})]
    ['box.settings']
    >>> resolve({"box": box}, Held("box.settings['lr']", "box", (("attr", "settings"), ("key", "lr")), "plain"))
    0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import types
from collections.abc import Mapping
from typing import Any

DEPTH = 4  # steps inside a global: trainer.model (1), trainer.models["g"] (2), trainer.cfg.opt.betas (3)...
ITEMS = 64  # the items of one container looked at: a list of data is not a list of models
REACHED = 1024  # objects listed at most: what lies further travels by value, as a copy
TORCH_KINDS = ("module", "optimizer", "scheduler", "loader")
_ATOMIC = (int, float, complex, str, bytes, bool, type(None), range)
# Typed Any: mypy reads a class's and object's reductions as different callables, always unequal.
_OBJECT_REDUCE_EX: Any = object.__reduce_ex__
_OBJECT_REDUCE: Any = object.__reduce__
_STATIC = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


@dataclasses.dataclass(frozen=True)
class Held:
    """One object held inside a global: where it is, and what it is."""

    label: str  # the expression that reaches it: "trainer.model", "models['g']"
    root: str  # the global it is inside
    steps: tuple[tuple[str, Any], ...]  # ("attr", name) | ("key", key) | ("index", i), from the global
    kind: str  # "module" | "optimizer" | "scheduler" | "loader" | "tensor" | the class's name (kind_of)
    fixed: str = ""  # why its place cannot hold another object (a tuple), else ""
    in_model: bool = False  # a model's attribute, or inside one: the model's, never prepared on its own

    @property
    def preparable(self) -> bool:
        """A model, optimizer, scheduler or loader of its own: the ranks prepare it in its place."""
        return self.kind in TORCH_KINDS and not self.in_model


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


def kind_of(obj: Any) -> str:
    """What a place must still hold on a rank to be the kernel's object: its torch kind, or its class.

    >>> kind_of([1]), kind_of(types.SimpleNamespace())
    ('builtins.list', 'types.SimpleNamespace')
    """
    kind = torch_kind(obj)
    if kind is not None:
        return kind
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return "tensor"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def find_reached(namespace: Mapping[str, Any]) -> list[tuple[Held, Any]]:
    """Each object inside ``namespace``'s values (not the values themselves), with its label.

    Numbers, strings, functions, classes and modules are no places' own. An object reached
    along several paths, or also a global itself, is listed once (its first place), but a
    model, optimizer or loader at each place, since each place must hold the prepared one;
    globals are visited in sorted order, so both sides of a run agree.
    """
    tops = {id(value) for value in namespace.values()}
    seen: set[int] = set()
    found: list[tuple[Held, Any]] = []

    def visit(name: str, value: Any, steps: tuple[tuple[str, Any], ...], path: set[int], in_model: bool) -> None:
        fixed = "a tuple cannot hold another object" if isinstance(value, tuple) else ""
        for step, child in _children(value):
            if isinstance(child, (_ATOMIC, _STATIC)) or id(child) in path or len(found) >= REACHED:
                continue  # no place's own, a cycle, or enough
            here, kind = (*steps, step), kind_of(child)
            again = id(child) in tops or id(child) in seen  # its inside is listed where it was first
            if again and (kind not in TORCH_KINDS or in_model):
                continue
            seen.add(id(child))
            found.append((Held(name + steps_as_python(here), name, here, kind, fixed, in_model), child))
            if not again and len(here) < DEPTH:
                visit(name, child, here, path | {id(child)}, in_model or kind == "module")

    for name in sorted(namespace):
        value = namespace[name]
        visit(name, value, (), {id(value)}, torch_kind(value) == "module")
    return found


def _children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    try:
        return _listed_children(value)
    except Exception:  # noqa: BLE001 - an object that cannot be looked into holds nothing we prepare
        return []


def _listed_children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    if isinstance(value, (_ATOMIC, _STATIC)):
        return []
    kind = torch_kind(value)
    if kind == "loader":  # the data set it reads: the cell's own code may hold it too
        return [(("attr", "dataset"), value.dataset)]
    if kind == "module":  # its own attributes, and its submodules (whose weights are its state dict's)
        found = [(("attr", k), v) for k, v in attributes(value).items()]
        return found + [(("attr", k), v) for k, v in vars(value).get("_modules", {}).items() if v is not None]
    if kind is not None:  # an optimizer's state and a scheduler's are loaded whole
        return []
    if isinstance(value, dict) and type(value).__module__ in ("builtins", "collections"):
        items = [(k, v) for k, v in itertools.islice(value.items(), ITEMS) if isinstance(k, (str, int))]
        return [(("key", k), v) for k, v in items]
    if type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return [(("index", i), v) for i, v in enumerate(itertools.islice(value, ITEMS))]
    if is_users_object(value):
        return [(("attr", k), v) for k, v in itertools.islice(attributes(value).items(), ITEMS)]
    return []


def is_users_object(value: Any) -> bool:
    """An object whose state is its attributes, of any class: it pickles as them, nothing of its own
    (a notebook class's or a module's instance, a dataclass, a ``SimpleNamespace``; not a class,
    a module, a container or a tensor).

    >>> is_users_object(types.SimpleNamespace(lr=0.1)), is_users_object(types), is_users_object([1])
    (True, False, False)
    """
    if isinstance(value, (types.SimpleNamespace, argparse.Namespace)):
        return True
    cls = type(value)
    if isinstance(value, (_STATIC, dict, list, tuple, set, frozenset, bytearray)) or not (
        hasattr(value, "__dict__") or _slots(cls)
    ):
        return False
    return (
        cls.__reduce_ex__ is _OBJECT_REDUCE_EX
        and cls.__reduce__ is _OBJECT_REDUCE
        and getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None)
        and not hasattr(cls, "__setstate__")
    )


def _slots(cls: type) -> list[str]:
    names = (getattr(klass, "__slots__", ()) for klass in cls.__mro__)
    return [s for group in names for s in ([group] if isinstance(group, str) else group) if not s.startswith("__")]


def attributes(value: Any) -> dict[str, Any]:
    """A users object's attributes, in ``__dict__`` and ``__slots__`` (see :func:`is_users_object`);
    a model's own public ones (``model.epoch``, ``model.config``: torch's registries are its state dict's)."""
    if torch_kind(value) == "module":
        return {k: v for k, v in vars(value).items() if not k.startswith("_") and k != "training"}
    found = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("__")}
    for name in _slots(type(value)):
        if hasattr(value, name):
            found[name] = getattr(value, name)
    return found


def contents(value: Any) -> Any:
    """What ``value`` holds, one step deep, to refill the kernel's object with (:func:`refill`); None: it
    holds its state otherwise, and travels whole.

    >>> contents([1, [2]]), contents(types.SimpleNamespace(a=1)), contents(types)
    ([1, [2]], {'a': 1}, None)
    """
    if type(value) is list:
        return list(value)
    if type(value) is dict:
        return dict(value)
    kind = torch_kind(value)
    if kind == "module" or (kind is None and is_users_object(value)):
        return attributes(value)
    return None


def refill(target: Any, held: Any) -> None:
    """Make ``target`` hold ``held`` (what :func:`contents` read from its copy), keeping its identity.

    >>> box = types.SimpleNamespace(a=1, gone=2); refill(box, {"a": [3]}); box
    namespace(a=[3])
    """
    if type(target) is list:
        target[:] = held
    elif type(target) is dict:
        target.clear()
        target.update(held)
    elif torch_kind(target) == "module":  # through its setattr: a name it registered stops being one
        for name in [k for k in attributes(target) if k not in held]:
            delattr(target, name)
        for name, value in held.items():
            setattr(target, name, value)
    else:
        slots = set(_slots(type(target)))
        own = getattr(target, "__dict__", None)
        if own is not None:  # Python's own entries (``__orig_class__``) are not the state that travelled
            kept = {k: v for k, v in own.items() if k.startswith("__")}
            own.clear()
            own.update(kept)
            own.update({k: v for k, v in held.items() if k not in slots})
        for name in slots:  # object's own setattr: a frozen dataclass refuses its own
            if name in held:
                object.__setattr__(target, name, held[name])
            elif hasattr(target, name):
                object.__delattr__(target, name)


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
