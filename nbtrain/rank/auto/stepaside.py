"""Auto mode steps aside for a framework that distributes the cell itself (:mod:`nbtrain.frameworks`).

A framework's trainer wraps its model in DDP and shards its loaders once it sees the rank's
world; a model auto mode wrapped first reaches it as a DDP wrapper, which it refuses or reads
wrongly (a Lightning Trainer wants its LightningModule, transformers' Trainer reads the
wrapper's ``forward(*inputs, **kwargs)`` and drops every column). So a cell that refers to a
framework's distributing class or function, directly, through a notebook function it calls,
or as an object held in a global, is left to that framework: :func:`frameworks_in` says which.

What the cell refers to is read before it runs: the globals it and its notebook functions use
(the kernel's analysis, ``names``), the objects held inside them, and the dotted names in the
cell's code (``L.Trainer``, ``accelerator.prepare``), looked up without running a property.

Example:
    >>> import types
    >>> fake = types.ModuleType("fake")
    >>> class Trainer: ...
    >>> Trainer.__module__ = "transformers.trainer"
    >>> fake.Trainer = Trainer
    >>> [f.name for f in frameworks_in("t = fake.Trainer()", {"fake": fake}, ["fake"], [])]
    ["transformers' Trainer"]
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nbtrain import frameworks
from nbtrain.rank import api
from nbtrain.rank.auto import ledger


def frameworks_in(
    code: str, cell_globals: Mapping[str, Any], names: Iterable[str], held: Iterable[Any]
) -> list[frameworks.Framework]:
    """The frameworks that distribute this cell: those one of its referenced objects belongs to."""
    objects = [cell_globals[name] for name in names if name in cell_globals]
    objects += list(held)
    referred: set[str] = set()
    try:
        tree = ast.parse(code)
    except SyntaxError:  # the cell's to raise, where the user sees it
        tree = ast.Module(body=[], type_ignores=[])
    imported, named = _imports(tree)
    objects += list(_dotted_objects(tree, {**cell_globals, **imported}))
    for obj in [*objects, *imported.values()]:
        try:
            referred |= frameworks.names_of(obj)
        except Exception:  # noqa: BLE001, S112 - an object whose class lies about itself names nothing
            continue
    return frameworks.distributing(referred | frameworks.by_name(named | _named_through(tree, imported, named)))


def _dotted_objects(tree: ast.AST, scope: Mapping[str, Any]) -> Iterator[Any]:
    """What each dotted name of the cell (``L.Trainer``, ``accelerator.prepare``) is now, where it resolves."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            path = _path(node)
            if path and path[0] in scope:
                found = _resolve(scope[path[0]], path[1:])
                if found is not None:
                    yield found


def _imports(tree: ast.AST) -> tuple[dict[str, Any], set[str]]:
    """What the cell's own absolute imports bind, where the module is imported already (name -> object);
    and, for a module not imported yet, "package:Name" for each name it imports from it.

    Nothing is imported here: a patch that waits for a module's import (a tracker's) must see the cell's own.
    """
    bound: dict[str, Any] = {}
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.partition(".")[0]
                if alias.name in sys.modules:
                    bound[alias.asname or root] = sys.modules[alias.name if alias.asname else root]
                else:
                    named.add(f"{root}:")  # its attributes, through the alias (_named_through)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = sys.modules.get(node.module)
            for alias in node.names:
                found = None if module is None else _resolve(module, [alias.name])
                if found is not None:
                    bound[alias.asname or alias.name] = found
                else:
                    named.add(f"{node.module.partition('.')[0]}:{alias.name}")
    return bound, named


def _named_through(tree: ast.AST, imported: Mapping[str, Any], named: set[str]) -> set[str]:
    """ "package:Name" for ``alias.Name`` where ``import package as alias`` is not imported yet."""
    aliases = {
        alias.asname or alias.name.partition(".")[0]: alias.name.partition(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if f"{alias.name.partition('.')[0]}:" in named
    }
    return {
        f"{aliases[path[0]]}:{path[1]}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and len(path := _path(node)) >= 2
        and path[0] in aliases
        and path[0] not in imported
    }


def _path(node: ast.expr) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _resolve(obj: Any, attributes: list[str]) -> Any:
    """``obj.a.b`` without running a property or a ``__getattr__`` of the user's (a module's lazy ones run)."""
    for attribute in attributes:
        try:
            if isinstance(obj, types.ModuleType):
                obj = getattr(obj, attribute)  # transformers' lazy module imports the class the cell will use
            else:
                obj = inspect.getattr_static(obj, attribute)
                if isinstance(obj, (staticmethod, classmethod)):
                    obj = obj.__func__
        except Exception:  # noqa: BLE001 - a name the cell makes itself, or one that raises: not ours to judge
            return None
    return obj


def note(found: Iterable[frameworks.Framework]) -> str:
    """The summary's sentence for the frameworks that distributed the cell.

    >>> note(frameworks.TABLE[:1])
    "transformers' Trainer distributed the training over the ranks: auto mode wrapped no model and sharded no loader"
    """
    names = " and ".join(framework.name for framework in found)
    return f"{names} distributed the training over the ranks: auto mode wrapped no model and sharded no loader"


_ONE_DEVICE = (1, "1", "auto", None)


def one_device_gets_the_world(original: Any) -> Any:
    """A Lightning ``Trainer``'s or ``Fabric``'s ``__init__`` (the patch table's, under auto mode): one built
    for one device (``devices=1`` or ``"auto"``, one node, strategy ``"auto"``) gets the cell's world.

    Lightning takes the world from torchrun's variables and checks it against ``devices`` x ``num_nodes``:
    a notebook's ``Trainer(devices=1)`` would train alone on each rank (or fail that check), where the
    cell asked for its ranks. ``--no-auto`` runs it as written.
    """
    if original is None:
        return original

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        world = _world_for_one_device(kwargs)
        if world:
            given = ", ".join(f"{key}={value!r}" for key, value in world.items())
            ledger.cell_registry().notes.append(
                f"{type(self).__name__}(devices={kwargs.get('devices', 'auto')!r}) was built for one device: "
                f"it trained on the cell's {api.world_size()} ranks ({given}); --no-auto runs it as written"
            )
            kwargs.update(world)
        original(self, *args, **kwargs)
        if world and getattr(self, "_launched", None) is False:
            # A Fabric for one device needs no launch(), the world it got does (a later launch() does nothing).
            self.launch()

    return __init__


def _world_for_one_device(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords that give a one-device Trainer or Fabric the run's world; {} where it asked for more."""
    if kwargs.get("devices", "auto") not in _ONE_DEVICE or kwargs.get("num_nodes", 1) != 1:
        return {}
    if kwargs.get("strategy", "auto") not in ("auto", None):
        return {}
    devices, num_nodes = _world()
    return {"devices": devices, "num_nodes": num_nodes, "strategy": "ddp"}


def _world() -> tuple[int, int]:
    """(devices per node, nodes) of this run, as torchrun's variables say."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or api.world_size())
    return local, max(1, api.world_size() // local)


def given_the_world(objects: Iterable[Any]) -> None:
    """Give the Lightning Trainers among ``objects`` (built in the kernel, for its one process) this run's world;
    and every fastai Learner of the cell fastai's distributed callback (:func:`nbtrain.frameworks.fastai_world`)."""
    objects = list(objects)
    if "fastai.learner" in sys.modules:  # fastai's optimizer and loaders are none of auto mode's: its callback's
        try:
            frameworks.fastai_world(objects, ledger.cell_registry().patches)
        except ImportError as error:  # fastai's DistributedTrainer is built on accelerate
            ledger.cell_registry().notes.append(
                f"a fastai Learner trains alone on each rank: fastai's DistributedTrainer needs accelerate ({error}); "
                "`pip install accelerate` to train it over the ranks"
            )
    if "lightning" not in sys.modules and "pytorch_lightning" not in sys.modules:
        return
    devices, num_nodes = _world()
    for name in frameworks.with_world(objects, devices, num_nodes):
        ledger.cell_registry().notes.append(
            f"a {name} built in the kernel for one device trained on the cell's {api.world_size()} ranks; "
            "back in the kernel it is one process's again"
        )
