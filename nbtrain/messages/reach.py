"""What a cell's globals hold inside them: the objects the ranks track by where they are.

Training code often keeps its model in another object: ``trainer.model``,
``models["generator"]``, a dataclass field, a list of models, a trainer of a module beside
the notebook. :func:`find_reached` lists every object a few steps inside the cell's
globals (through dicts, lists, tuples, objects whose state is their attributes, of any
class, and the closures of functions: ``create_supervised_trainer(model, ...)`` keeps its model
in one), each named by the expression that reaches it (``trainer.model``). The ranks send
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
import pickle
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
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not by C code
_STATIC = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


@dataclasses.dataclass(frozen=True)
class Held:
    """One object held inside a global: where it is, and what it is."""

    label: str  # the expression that reaches it: "trainer.model", "models['g']"
    root: str  # the global it is inside
    steps: tuple[tuple[str, Any], ...]  # ("attr", name) | ("key", key) | ("index", i) | ("cell", i), from the global
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

    Numbers, strings, functions, classes and modules are no places' own; what a function's closure
    holds is (``engine._process_function.__closure__[3].cell_contents``). An object reached
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
            if _holds_nothing(child) or id(child) in path or len(found) >= REACHED:
                continue  # no place's own, a cycle, or enough
            here, kind = (*steps, step), kind_of(child)
            again = id(child) in tops or id(child) in seen  # its inside is listed where it was first
            if again and (kind not in TORCH_KINDS or in_model):
                continue
            seen.add(id(child))
            if not isinstance(child, types.FunctionType):  # it travels by value: its closure's objects are places
                found.append((Held(name + steps_as_python(here), name, here, kind, fixed, in_model), child))
            if not again and len(here) < DEPTH:
                visit(name, child, here, path | {id(child)}, in_model or kind == "module")

    for name in sorted(namespace):
        value = namespace[name]
        visit(name, value, (), {id(value)}, torch_kind(value) == "module")
    return found


def _holds_nothing(value: Any) -> bool:
    """No place of its own, nor holding one: a number, a class, a module; a function holds its closure."""
    return isinstance(value, _ATOMIC) or (isinstance(value, _STATIC) and not isinstance(value, types.FunctionType))


def _children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    try:
        return _listed_children(value)
    except Exception:  # noqa: BLE001 - an object that cannot be looked into holds nothing we prepare
        return []


def _listed_children(value: Any) -> list[tuple[tuple[str, Any], Any]]:
    if isinstance(value, types.FunctionType):  # an empty cell (a name bound later) raises: nothing there yet
        cells = itertools.islice(enumerate(value.__closure__ or ()), ITEMS)
        return [(("cell", i), cell.cell_contents) for i, cell in cells if is_filled(cell)]
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


def is_filled(cell: types.CellType) -> bool:
    """Whether a closure's cell holds a value yet (that of a name its function binds later does not)."""
    try:
        cell.cell_contents  # noqa: B018 - reading it is the test
    except ValueError:
        return False
    return True


def is_users_object(value: Any) -> bool:
    """An object whose state is its attributes, of any class: it pickles as them, or as some of them
    through its class's own ``__getstate__``/``__setstate__`` (:func:`_own_state`): a notebook class's
    or a module's instance, a dataclass, a ``SimpleNamespace``, fastai's ``Learner``; not a class, a
    module, a container, a tensor, nor an object whose pickled state is something else.

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
    if cls.__reduce_ex__ is not _OBJECT_REDUCE_EX or cls.__reduce__ is not _OBJECT_REDUCE:
        return False
    if getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None) and not hasattr(cls, "__setstate__"):
        return True
    return _own_state(value) is not None


def _own_state(value: Any) -> dict[str, Any] | None:
    """What ``value``'s class's own ``__getstate__`` keeps, where that is its attributes: some of them as
    they are (fastai's ``Learner`` leaves out its lock, fastcore's ``Stateful`` its history), beside
    entries of its own that are none of them (skorch's ``NeuralNet`` pickles ``module_``, ``optimizer_``
    and ``criterion_`` into one bytes entry: :func:`_encodes`); None where its state is something else
    (then it travels whole, rebuilt by its class). The state of an object without a ``__getstate__`` of
    its class's own is all of its attributes.

    >>> class Net:
    ...     def __init__(self): self.lr, self.module_ = 0.1, [1.0]
    ...     def __getstate__(self): return {"lr": self.lr, "__encoded__": repr(self.module_)}
    >>> sorted(_own_state(Net())), is_users_object(Net()), sorted(contents(Net()))
    (['__encoded__', 'lr'], True, ['lr', 'module_'])
    """
    own = getattr(value, "__dict__", None)
    if not isinstance(own, dict) or _slots(type(value)):
        return None
    if getattr(type(value), "__getstate__", None) is getattr(object, "__getstate__", None):
        return own
    try:
        state = _read_state(value)
    except Exception:  # noqa: BLE001 - a state it cannot say is none we can refill
        return None
    if state is None:
        state = {}
    # An attribute pickled as something else under its own name: its state is not its attributes.
    if not isinstance(state, dict) or any(k in own and own[k] is not v for k, v in state.items()):
        return None
    if _encodes(value, state) and not _python_made(type(value)):
        return None  # a C base's state may be in the encoded entries: no attributes hold it
    return state


def _read_state(value: Any) -> Any:
    """``value.__getstate__()``, made as nbtrain's picklers make it where they are imported: a standard
    pickle inside it (skorch's) sends a notebook's class by value, which a rank's ``__main__`` lacks."""
    codepickle = sys.modules.get("nbtrain.messages.codepickle")
    if codepickle is None:
        return value.__getstate__()
    with codepickle.nestedpickling.by_value(codepickle.dumps_keeping_filenames):
        return value.__getstate__()


def _encodes(value: Any, state: dict[str, Any]) -> bool:
    """Whether ``state`` has entries that are none of ``value``'s attributes: what it leaves out may be
    in them, encoded (skorch's ``__cuda_dependent_attributes__``). In memory, the attributes are what
    it holds: they are what travels back and refills the receiver's object, never the encoding.
    """
    own = getattr(value, "__dict__", {})
    return any(k not in own for k in state)


def _python_made(cls: type) -> bool:
    """Whether every class ``cls`` is made of is Python's, but ``object``: no C base keeps state of its own.

    >>> _python_made(argparse.Namespace), _python_made(dict)
    (True, False)
    """
    return all(klass is object or klass.__flags__ & _HEAPTYPE for klass in cls.__mro__)


def _left_out(value: Any) -> set[str]:
    """The attributes of a users object that its own pickling leaves out (:func:`_own_state`)."""
    state = _own_state(value) if is_users_object(value) else None
    own = getattr(value, "__dict__", None)
    return set() if state is None or not isinstance(own, dict) else {k for k in own if k not in state}


def state_and_left_out(value: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """For a users object whose class's own pickling leaves out attributes that can travel anyway
    (:func:`_travels`: fastcore's ``Stateful`` its history): (the state it keeps, those attributes);
    None for any other object, so that it pickles as its class says."""
    if not is_users_object(value):
        return None
    state, own = _own_state(value), getattr(value, "__dict__", None)
    if state is None or state is own or not isinstance(own, dict) or _encodes(value, state):
        return None  # encoded: it goes out as its class pickles it, and the receiver's class decodes it
    travelling = {k: v for k, v in own.items() if k not in state and _travels(v)}
    return (state, travelling) if travelling else None


def _travels(value: Any) -> bool:
    """Whether an attribute a class's pickling leaves out can go to another process anyway: a history
    (fastai's ``Recorder.values``) does, a lock or an open file does not (it stays the receiver's own),
    nor does code (a method an LR scheduler set on its optimizer: the receiver's own wraps its own).
    A torch object does: nbtrain sends it its own way (the receiver's own as a reference to it), whatever
    the standard pickler says of it (a notebook's module class is not in a rank's ``__main__``)."""
    if kind_of(value) in (*TORCH_KINDS, "tensor"):
        return True
    if callable(value):
        return False
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - whatever stops it, it stays where it is
        return False
    return True


def _slots(cls: type) -> list[str]:
    names = (getattr(klass, "__slots__", ()) for klass in cls.__mro__)
    return [s for group in names for s in ([group] if isinstance(group, str) else group) if not s.startswith("__")]


def attributes(value: Any) -> dict[str, Any]:
    """A users object's attributes, in ``__dict__`` and ``__slots__`` (see :func:`is_users_object`);
    a model's own public ones (``model.epoch``, ``model.config``: torch's registries are its state dict's)."""
    if torch_kind(value) == "module":
        return {k: v for k, v in vars(value).items() if not k.startswith("_") and k != "training"}
    found = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("__")}
    # What its own pickling leaves out is the object's too, here in memory: kept where it can travel.
    for name in _left_out(value) & found.keys():
        if not _travels(found[name]):
            del found[name]
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

    An object whose class's pickling leaves out a lock and a history (as fastai's ``Learner`` and
    ``Recorder`` do): the history travels, the lock it cannot send stays the receiver's own.

    >>> import threading
    >>> class Fit:
    ...     def __init__(self): self.lock, self.losses, self.lr = threading.Lock(), [], 0.1
    ...     def __getstate__(self): return {"lr": self.lr}
    ...     def __setstate__(self, state): self.__dict__.update(state, lock=threading.Lock(), losses=[])
    >>> rank, kernel = Fit(), Fit(); rank.losses.append(0.5); rank.lr = 0.2; lock = kernel.lock
    >>> sorted(contents(rank)); refill(kernel, contents(rank))
    ['losses', 'lr']
    >>> kernel.losses, kernel.lr, kernel.lock is lock
    ([0.5], 0.2, True)
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
        if own is not None:  # Python's own entries (``__orig_class__``) are not the state that travelled,
            # nor what its pickling leaves out and did not come (a lock: the receiver's own stays)
            left_out = _left_out(target) - held.keys()
            kept = {k: v for k, v in own.items() if k.startswith("__") or k in left_out}
            own.clear()
            own.update(kept)
            own.update({k: v for k, v in held.items() if k not in slots})
        for name in slots:  # object's own setattr: a frozen dataclass refuses its own
            if name in held:
                object.__setattr__(target, name, held[name])
            elif hasattr(target, name):
                object.__delattr__(target, name)


def steps_as_python(steps: tuple[tuple[str, Any], ...]) -> str:
    """The steps as Python: ``.model``, ``['g']``, ``[0]``, ``.__closure__[3].cell_contents``."""
    return "".join(_step_as_python(how, key) for how, key in steps)


def _step_as_python(how: str, key: Any) -> str:
    if how == "cell":
        return f".__closure__[{key}].cell_contents"
    return f".{key}" if how == "attr" else f"[{key!r}]"


def _step(obj: Any, how: str, key: Any) -> Any:
    if how == "cell":
        return obj.__closure__[key].cell_contents
    return getattr(obj, key) if how == "attr" else obj[key]


def resolve(namespace: Mapping[str, Any], held: Held) -> Any:
    """The object at ``held``'s place in ``namespace`` (KeyError, IndexError, AttributeError if gone)."""
    obj = namespace[held.root]
    for how, key in held.steps:
        obj = _step(obj, how, key)
    return obj


def put(namespace: Mapping[str, Any], held: Held, value: Any) -> None:
    """Set ``held``'s place to ``value`` (what the holder raises, if it refuses)."""
    holder = namespace[held.root]
    for how, key in held.steps[:-1]:
        holder = _step(holder, how, key)
    how, key = held.steps[-1]
    if how == "cell":  # the function's own cell: the function (and all that share the cell) sees the new one
        holder.__closure__[key].cell_contents = value
    elif how == "attr":
        setattr(holder, key, value)
    else:
        holder[key] = value
