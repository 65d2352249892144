"""cloudpickle that keeps each function's source file name, so tracebacks can name it.

cloudpickle 3.1.3 writes every pickled function's ``co_filename`` as ``"<dynamic-code>"``
(for deterministic payloads). A rank's traceback then cannot show the line of a function
defined in a notebook cell or a module (``Cell In[7], line 4`` and the source line under
it): the rank knows the cell's lines by file name. :class:`Pickler` puts the real name
back; with an older cloudpickle, which kept it, it changes nothing.

Example:
    >>> import pickle
    >>> def where(): return 1
    >>> pickle.loads(dumps_keeping_filenames(where)).__code__.co_filename == where.__code__.co_filename
    True
"""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import MutableMapping
from typing import Any, cast

import cloudpickle

from nbtrain.messages import localstate, nestedpickling, processlocal, reach, trackerruns

_ERASED = "<dynamic-code>"
_OBJECT_GETSTATE = getattr(object, "__getstate__", None)
# The module inside cloudpickle that holds its reducers (``_code_reduce`` among them).
_INTERNALS = importlib.import_module("cloudpickle.cloudpickle")


def _code_reduce(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the file name it erased put back."""
    constructor, args = _INTERNALS._code_reduce(code)
    return constructor, tuple(code.co_filename if arg == _ERASED else arg for arg in args)


def _dispatch_table() -> Any:
    # Weak references and locks as their meaning in the loading process (nbtrain.messages.localstate).
    overrides: dict[type, Any] = dict(localstate.REDUCERS)
    if hasattr(_INTERNALS, "_code_reduce"):
        overrides[types.CodeType] = _code_reduce
    # cloudpickle's own table is a ChainMap over copyreg's: later registrations still count.
    return ChainMap(overrides, cast("MutableMapping[Any, Any]", cloudpickle.Pickler.dispatch_table))


class Pickler(cloudpickle.Pickler):
    """``cloudpickle.Pickler`` whose functions keep their ``co_filename``, optimizers their
    attributes, parametrized modules (``weight_norm``, ``spectral_norm``) travel, a
    tracker's run the kernel opened travels as a stand-in (:mod:`nbtrain.messages.trackerruns`),
    weak references and locks as :mod:`nbtrain.messages.localstate` says, an object whose class's
    ``__getstate__`` leaves out what can travel with what it left out (:func:`own_state_reduce`), and a standard
    pickle made inside it sends notebook code by value (:mod:`nbtrain.messages.nestedpickling`)."""

    dispatch_table = _dispatch_table()

    def dump(self, obj: Any) -> None:
        """Pickle ``obj``; a ``pickle.dump`` or ``torch.save`` that its ``__getstate__`` makes
        sends the notebook's classes and functions by value meanwhile."""
        with nestedpickling.by_value(dumps_keeping_filenames):
            super().dump(obj)

    def reducer_override(self, obj: Any) -> Any:
        """Optimizers (:func:`optimizer_reduce`) and parametrized modules (:func:`parametrized_reduce`)
        their own way; everything else as cloudpickle does."""
        # A tracker's run the kernel opened goes as a stand-in that calls it back.
        # A thread is refused (localstate.refuse_thread): its locks travel (localstate.REDUCERS), it does not.
        reducers = (
            optimizer_reduce,
            parametrized_reduce,
            trackerruns.stand_in,
            processlocal.reduce_shared_state,
            own_state_reduce,
        )
        for reduce in (*reducers, localstate.refuse_thread):
            reduced = reduce(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def own_state_reduce(obj: Any) -> Any:
    """A reduction of an object whose class's own ``__getstate__`` leaves out attributes that can
    travel (:func:`nbtrain.messages.reach.state_and_left_out`), with them; None for anything else.

    fastcore's ``Stateful`` leaves out a ``Recorder``'s history (``values``, ``losses``) for
    ``Learner.export``: a ``Learner`` bound in a cell would come back without it, where one the kernel
    refills keeps it (:func:`nbtrain.messages.reach.attributes`). What cannot travel (a lock) stays
    out, and the class's own ``__setstate__`` makes it anew, as it would.
    """
    cls = type(obj)
    if getattr(cls, "__getstate__", _OBJECT_GETSTATE) is _OBJECT_GETSTATE:
        return None  # its pickle holds all its attributes already: the common case, at one look-up
    if hasattr(cls, "__getnewargs_ex__") or hasattr(cls, "__getnewargs__"):
        return None  # made from arguments of its own: pickled its own way
    held = reach.state_and_left_out(obj)
    if held is None:
        return None
    # copyreg.__newobj__ is what pickle itself uses for a class instance (typeshed lacks it).
    return copyreg.__newobj__, (cls,), held, None, None, _set_own_state  # type: ignore[attr-defined]


def _set_own_state(obj: Any, held: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """What pickle would do with the state (the class's ``__setstate__``), then what travelled beside it."""
    state, left_out = held
    setstate = getattr(type(obj), "__setstate__", None)  # the class's: a __getattr__ (fastcore's GetAttr) is not asked
    if setstate is not None:
        setstate(obj, state)
    else:
        obj.__dict__.update(state)
    obj.__dict__.update(left_out)


def parametrized_reduce(obj: Any) -> Any:
    """A reduction of a module with torch parametrizations, or None for anything else.

    ``register_parametrization`` (behind ``parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``) swaps the module's class for a generated subclass
    whose ``__getstate__`` refuses to pickle. Everything the module holds (the originals,
    the parametrization modules) is ordinary: it travels as the module of its own class
    and gets the generated class back on arrival, as ``register_parametrization`` made it.
    The state is set after the object exists, so references back to it (a hook's closure)
    come out as the same object.
    """
    nn = sys.modules.get("torch.nn")
    if nn is None or not isinstance(obj, nn.Module):
        return None
    for cls in type(obj).__mro__[:3]:  # the generated class, under a one-rank run's class of its own
        base = cls.__bases__[0] if cls.__bases__ else object
        if cls.__name__ == f"Parametrized{base.__name__}" and "__getstate__" in vars(cls):
            return _new_module, (base,), dict(vars(obj)), None, None, _set_parametrized_state
    return None


def _new_module(cls: type) -> Any:
    return object.__new__(cls)  # a module's __dict__ comes next, from the state


def _set_parametrized_state(module: Any, state: dict[str, Any]) -> None:
    # deferred: start-up time (torch)
    from torch.nn.utils import parametrize

    module.__dict__.update(state)
    parametrize._inject_new_class(module)
    for name in module.parametrizations:
        parametrize._inject_property(module, name)


# What torch's Optimizer.__setstate__ makes anew, or an LR scheduler sets on the optimizer
# (its step wrapper; nbtrain.rank.cell puts that back): never sent.
_REMADE = frozenset({"step", "_opt_called", "_zero_grad_profile_name", "_warned_capturable_if_run_uncaptured"})


def optimizer_reduce(obj: Any) -> Any:
    """A torch optimizer's reduction that keeps its plain attributes, or None for anything else.

    ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``: an
    optimizer that keeps more (``LBFGS._params``, ``_numel_cache``; third-party optimizers'
    own settings) would arrive without it and fail at its first ``step``. The attributes
    added here are those of plain data (numbers, strings, tensors, optimizers, lists,
    tuples and dicts of them), so nothing that cannot travel is added; the pickle's memo keeps
    ``LBFGS._params`` the very list in ``param_groups[0]``.
    """
    home = sys.modules.get("torch.optim.optimizer")
    if home is None or not isinstance(obj, home.Optimizer):
        return None
    state = obj.__getstate__()
    extra = own_attributes(obj)
    if not extra or not isinstance(state, dict):
        return None
    # copyreg.__newobj__ is what pickle itself uses for a class instance (typeshed lacks it).
    return copyreg.__newobj__, (type(obj),), {**state, **extra}  # type: ignore[attr-defined]


def own_attributes(optimizer: Any, *, optimizers: bool = True) -> dict[str, Any]:
    """The plain attributes ``optimizer`` keeps beside what ``Optimizer.__getstate__`` returns.

    ``optimizers=False`` leaves out those that hold an optimizer (one it wraps).
    """
    state = optimizer.__getstate__()
    own = {key: value for key, value in vars(optimizer).items() if key not in state and key not in _REMADE}
    own = {key: value for key, value in own.items() if not key.startswith("_optimizer_")}
    return {key: value for key, value in own.items() if _plain_data(value, optimizers=optimizers)}


def _plain_data(value: Any, depth: int = 0, *, optimizers: bool = True) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    if torch is not None and isinstance(value, torch.optim.Optimizer):
        return optimizers  # one another wraps (a lookahead's inner optimizer) is reduced the same way
    if depth >= 3:
        return False
    if isinstance(value, dict):  # its keys and values alike
        value = [item for pair in value.items() for item in pair]
    if isinstance(value, (list, tuple)):
        return all(_plain_data(item, depth + 1, optimizers=optimizers) for item in value)
    return False


def dumps_keeping_filenames(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)`` (highest protocol), file names kept."""
    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
