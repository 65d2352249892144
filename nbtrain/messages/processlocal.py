"""Per-process singletons travel as the receiving process's own.

Some frameworks keep what a process is (its rank, the world's size, its device) in a
singleton whose instances all share one class-level dict: accelerate's ``PartialState``,
``AcceleratorState`` and ``GradientState`` (the "Borg" pattern). Pickled the ordinary way,
an instance carries a private copy of the sender's dict: an ``Accelerator`` built in a
one-process kernel would arrive in a rank still saying one process, and one built on a rank
would come back to the kernel saying two. :func:`reduce_shared_state` sends such an instance
as a reference to the receiver's own state instead: on a rank it reads the rank's world,
in the kernel one process.

The receiver's state may not exist yet (a rank unpickles before it joins its process group;
a kernel that never built an ``Accelerator``): the object is attached to the empty shared
dict at once, and :func:`initialize` builds the state afterwards from the sender's fields,
less the world's (rank, size, device), which the receiver's environment decides.

Standard library only; nothing here imports a framework. Which singletons hold a world is the
frameworks' table's (:class:`nbtrain.frameworks.Singleton`).

Example (a Borg singleton of our own):
    >>> import pickle
    >>> class State:
    ...     _shared_state: dict = {}
    ...     def __init__(self, size=1):
    ...         self.__dict__ = self._shared_state
    ...         self.__dict__.setdefault("size", size)
    >>> state = State(size=2)
    >>> reduce_shared_state(state)[0] is attached_state
    True
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from nbtrain import frameworks

# From the frameworks' table: "module:Class" of each singleton that IS a process's world, with the keywords that
# rebuild it from the sender's fields (its choices, never its world); and of each that holds a world's fields
# beside its own (AcceleratorState copies PartialState's and adds mixed precision, dynamo, plugins).
_WORLDS: dict[str, dict[str, str]] = {
    s.cls: dict(s.rebuilt_with) for framework in frameworks.TABLE for s in framework.singletons if not s.world
}
_IN_WORLD: dict[str, str] = {s.cls: s.world for framework in frameworks.TABLE for s in framework.singletons if s.world}

_pending: list[tuple[type, dict[str, Any]]] = []  # attached states not built yet, in the order they arrived


def is_shared_state(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a per-process singleton: its dict is its class's shared one.

    Such an object is never "changed by the cell": what it holds is its process's, not the cell's.
    """
    shared = getattr(type(obj), "_shared_state", None)
    try:
        return isinstance(shared, dict) and vars(obj) is shared
    except TypeError:  # no __dict__
        return False


def reduce_shared_state(obj: Any) -> Any:
    """How a per-process singleton pickles (a reducer for ``reducer_override``); None for anything else."""
    if not is_shared_state(obj):
        return None
    return attached_state, (type(obj), dict(type(obj)._shared_state))


def attached_state(cls: type[Any], fields: dict[str, Any]) -> Any:
    """This process's instance of the singleton ``cls`` (its shared dict, built or not); the sender's
    ``fields`` build it if this process has not (:func:`initialize`)."""
    obj: Any = object.__new__(cls)  # no __init__: that would build this process's state now
    obj.__dict__ = cls._shared_state  # the Borg's dict, by construction
    _pending.append((cls, fields))
    return obj


def initialize() -> list[str]:
    """Build each attached singleton that this process has not built yet; the ones that failed, worded.

    Called by a rank once its process group exists (so the state reads the rank's world) and by
    the kernel once it has read a cell's result. A world this process has already stands; a
    singleton without a world is the sender's. One that fails is left unbuilt, never half-built.
    """
    failed: list[str] = []
    while _pending:
        cls, fields = _pending.pop(0)
        shared: dict[str, Any] = cls._shared_state  # type: ignore[attr-defined]
        if shared and (_name(cls) in _WORLDS or _name(cls) in _IN_WORLD):
            continue  # this process's world stands
        try:
            _build(cls, fields, shared)
        except Exception as error:  # noqa: BLE001 - the cell goes on; the summary says what is missing
            shared.clear()
            failed.append(f"{cls.__name__} could not be rebuilt for this process ({type(error).__name__}: {error})")
    return failed


def _build(cls: type, fields: Mapping[str, Any], shared: dict[str, Any]) -> None:
    name = _name(cls)
    if name in _WORLDS:
        cls(**{keyword: fields[field] for keyword, field in _WORLDS[name].items() if field in fields})
        return
    if name in _IN_WORLD:
        module, _, world_name = _IN_WORLD[name].partition(":")
        world: Any = getattr(sys.modules[module], world_name)
        if not world._shared_state:
            _build(world, fields, world._shared_state)
        shared.update({key: value for key, value in fields.items() if key not in world._shared_state})
        shared.update(world._shared_state)
        return
    # No world in it (GradientState: where a loop is in its accumulation): the sender's fields are the state,
    # also where this process made a default one meanwhile (unpickling accelerate's loader builds one).
    shared.clear()
    shared.update(fields)


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
